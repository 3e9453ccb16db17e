# syntax=docker/dockerfile:1
# flash-qla-aot prefill service for edge boxes (Hopper: H100/H200/GH200), two stages:
#   builder: makes the wheel from this repository. The sm_90a cubins are committed under
#            flash_qla/_kernels/sm90a, so the build compiles only the small C launcher: no nvcc, no TileLang.
#   runtime: a Python base + torch (the CUDA build brings its CUDA runtime as NVIDIA pip wheels) + the project
#            wheel with the `server` extra. No compiler, no CUDA toolkit, no TileLang; libcuda.so.1 comes from
#            the host driver through the NVIDIA Container Toolkit (`docker run --gpus all`). Runs as uid 10001.
#
#   docker build -t flash-qla-serve .
#   docker run --rm --gpus all -p 8000:8000 flash-qla-serve
#   docker run --rm -p 8000:8000 flash-qla-serve --backend reference --host 0.0.0.0 --port 8000   # CPU only
#
# Build arguments:
#   PYTHON_IMAGE     base of both stages: python:3.12-slim-bookworm, or any Debian-family image whose `python`
#                    has pip (ci/container_smoke.sh uses a debootstrap-made bookworm base with Python 3.11).
#   TORCH_SPEC       the torch requirement of the runtime stage (default torch==2.13.0).
#   TORCH_INDEX_URL  an index to take torch from, e.g. https://download.pytorch.org/whl/cu130 (the release
#                    workflow pins it so amd64 and arm64 get the same CUDA 13 build); empty: PyPI.
#   TORCH_FIND_LINKS a directory of local wheels mounted into the build (buildah bud --volume), e.g. a CPU torch.
# ci/container_smoke.sh builds this file with buildah and runs the service from the image.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

# ---------------------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS builder
# gcc + libc headers for the launcher; cmake and ninja arrive from PyPI in scikit-build-core's isolated build env.
# python:*-slim carries Python.h; Debian's own python3 does not, so its headers come from python3-dev.
RUN set -eu; pkgs="gcc libc6-dev"; \
    python -c "import os, sys, sysconfig; sys.exit(not os.path.exists(sysconfig.get_paths()['include'] + '/Python.h'))" \
      || pkgs="$pkgs python3-dev"; \
    apt-get update; apt-get install -y --no-install-recommends $pkgs; rm -rf /var/lib/apt/lists/*
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml CMakeLists.txt README.md ./
COPY flash_qla ./flash_qla
COPY server ./server
RUN python -m pip wheel --no-deps -w /dist . \
 && python -c "import glob, json, zipfile; \
whl, = glob.glob('/dist/flash_qla_aot-*.whl'); z = zipfile.ZipFile(whl); names = set(z.namelist()); \
man = json.loads(z.read('flash_qla/_kernels/sm90a/manifest.json')); \
missing = [e['file'] for e in man['kernels'] if 'flash_qla/_kernels/sm90a/' + e['file'] not in names]; \
assert not missing, f'cubins missing from the wheel: {missing}'; \
assert any(n.startswith('flash_qla/_launcher') and n.endswith('.so') for n in names), 'no launcher in the wheel'; \
assert 'server/__main__.py' in names, 'no server package in the wheel'; \
print(whl, len(man['kernels']), 'kernels')"

# ---------------------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL=""
ARG TORCH_FIND_LINKS=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
# Not needed to run, dropped in the layer that adds them: torch's C++ headers and C++ test binaries, the test
# suites of pure-Python dependencies. No bytecode is written (--no-compile, PYTHONDONTWRITEBYTECODE).
RUN set -eu; \
    python -m pip install --no-compile --only-binary=:all: \
      ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} ${TORCH_FIND_LINKS:+--find-links "$TORCH_FIND_LINKS"} \
      "$TORCH_SPEC"; \
    site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"; \
    rm -rf "$site/torch/include" "$site/torch/test" "$site"/torch/bin/test_*; \
    find "$site" -depth -type d \( -name tests -o -name __pycache__ \) -exec rm -rf {} +
COPY --from=builder /dist/ /tmp/wheels/
# numpy: safetensors >= 0.8 imports it to write a safetensors answer (torch itself does not require it).
RUN set -eu; whl="$(ls /tmp/wheels/flash_qla_aot-*.whl)"; \
    python -m pip install --no-compile --only-binary=:all: "${whl}[server]" numpy; \
    rm -rf /tmp/wheels; \
    site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"; \
    find "$site" -depth -type d \( -name tests -o -name __pycache__ \) -exec rm -rf {} +; \
    if command -v gcc || command -v cc || command -v c++ || command -v clang || command -v nvcc || command -v ptxas; \
    then echo "a compiler is in the runtime image" >&2; exit 1; fi; \
    if python -c "import tilelang" 2>/dev/null; then echo "TileLang is in the runtime image" >&2; exit 1; fi; \
    python -c "import flash_qla, server"; \
    groupadd --system --gid 10001 flashqla; \
    useradd --system --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin flashqla
# The wheel carries the service package (server/) and the flash-qla-serve console script.
WORKDIR /app
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status == 200 else 1)"]
ENTRYPOINT ["python", "-m", "server"]
CMD ["--backend", "kernels", "--host", "0.0.0.0", "--port", "8000"]
