"""The service's third-party packages come with the ``server`` extra; say so instead of a bare ImportError."""
from __future__ import annotations

import importlib
from typing import List

# import name -> distribution name
SERVER_PACKAGES = {"fastapi": "fastapi", "fastapi_offline": "fastapi-offline", "uvicorn": "uvicorn",
                   "pydantic": "pydantic", "safetensors": "safetensors", "prometheus_client": "prometheus-client",
                   "httpx": "httpx"}
INSTALL_HINT = "pip install 'flash-qla-aot[server]'"


def missing_server_packages() -> List[str]:
    missing = []
    for module, distribution in SERVER_PACKAGES.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(distribution)
    return missing


def require_server_extra() -> None:
    """Raise SystemExit with the install command when a package of the ``server`` extra is missing."""
    missing = missing_server_packages()
    if missing:
        raise SystemExit(f"flash-qla-serve needs the [server] extra (missing: {', '.join(missing)}); "
                         f"install it with: {INSTALL_HINT}")
