# syntax=docker/dockerfile:1
# flash-qla-aot prefill service for edge boxes (Hopper: H100/H200/GH200), two stages:
#   builder: makes the wheel from this repository. The sm_90a cubins are committed under
#            flash_qla/_kernels/sm90a, so the build compiles only the small C launcher: no nvcc, no TileLang.
#   runtime: python:3.12-slim + torch (its CUDA runtime comes as NVIDIA pip wheels) + the project wheel with the
#            `server` extra. No compiler, no CUDA toolkit; libcuda.so.1 comes from the host driver through the
#            NVIDIA Container Toolkit (`docker run --gpus all`). Runs as an unprivileged user.
#
#   docker build -t flash-qla-serve .
#   docker run --rm --gpus all -p 8000:8000 flash-qla-serve
#   docker run --rm -p 8000:8000 flash-qla-serve --backend reference --host 0.0.0.0 --port 8000   # CPU only
#
# ci/replay_runtime_stage.sh replays the runtime stage's install and start steps in a clean venv (no Docker
# engine is available where this file was written); its output is in ci/logs/replay_runtime_stage.log.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

# ---------------------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS builder
# gcc + libc headers for the launcher; cmake and ninja arrive from PyPI in scikit-build-core's isolated build env.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
COPY pyproject.toml CMakeLists.txt README.md ./
COPY flash_qla ./flash_qla
RUN python -m pip wheel --no-deps -w /dist . \
 && python - <<'EOF'
import glob, json, zipfile
whl, = glob.glob("/dist/flash_qla_aot-*.whl")
names = set(zipfile.ZipFile(whl).namelist())
man = json.loads(zipfile.ZipFile(whl).read("flash_qla/_kernels/sm90a/manifest.json"))
missing = [e["file"] for e in man["kernels"] if "flash_qla/_kernels/sm90a/" + e["file"] not in names]
assert not missing, f"cubins missing from the wheel: {missing}"
assert any(n.startswith("flash_qla/_launcher") and n.endswith(".so") for n in names), "no launcher in the wheel"
print(whl, len(man["kernels"]), "kernels")
EOF

# ---------------------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
# torch from PyPI brings its CUDA runtime as nvidia-* wheels; pick another build with TORCH_INDEX_URL
# (e.g. https://download.pytorch.org/whl/cu128 for hosts whose driver is older than the default CUDA needs).
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX_URL=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
RUN python -m pip install --only-binary=:all: ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
COPY --from=builder /dist/ /tmp/wheels/
RUN set -eu; whl="$(ls /tmp/wheels/flash_qla_aot-*.whl)"; \
    python -m pip install --only-binary=:all: "${whl}[server]"; \
    rm -rf /tmp/wheels; \
    if command -v gcc || command -v cc || command -v nvcc; then echo "a compiler is in the runtime image" >&2; exit 1; fi; \
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
