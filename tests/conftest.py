"""Shared fixtures: GPU-marked tests skip themselves unless an sm_90 GPU is present."""
from pathlib import Path

import pytest
import torch


def _has_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0) == (9, 0)


def pytest_collection_modifyitems(config, items):
    if _has_sm90():
        return
    skip = pytest.mark.skip(reason="needs an sm_90 GPU (runs on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def launches(monkeypatch):
    """Every launch of the forward / backward on CPU tensors, as (name, variant, sizes, pointers), its arguments
    built by the manifest's rules (a KeyError names a size or pointer the launch left out)."""
    from flash_qla import backward as bwd
    from flash_qla import forward as fwd
    from flash_qla import loader, manifest
    from flash_qla.tuning import settings
    seen = []
    builders = {}

    def record(name, variant, device, sizes, pointers, stream=None):
        kernel = loader.library().kernel(name, **variant)
        if kernel.key not in builders:
            builders[kernel.key] = manifest.compile_arg_builder(kernel.entry)
        builders[kernel.key](sizes, pointers)
        seen.append((name, dict(variant), dict(sizes), dict(pointers)))

    for mod in (fwd, bwd):
        monkeypatch.setattr(mod, "launch", record)
        monkeypatch.setattr(mod, "current_stream", lambda device: 0)
        monkeypatch.setattr(mod, "num_sms", lambda device: 132)
        monkeypatch.setattr(mod, "join", lambda a, b: None)
    monkeypatch.setattr(settings, "save_chain_beside_dh", False)  # no side stream
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    return seen


REPO = Path(__file__).resolve().parent.parent


def repo_text(*parts: str) -> str:
    """A file of the repository (kernel sources, committed benchmark results), or a skip where the installed wheel is
    tested from a copy of tests/ alone (ci/test_installed.sh)."""
    path = REPO.joinpath(*parts)
    if not path.is_file():
        pytest.skip(f"{'/'.join(parts)}: a repository file, absent beside the installed wheel's tests")
    return path.read_text()
