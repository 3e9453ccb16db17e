#!/usr/bin/env bash
# The image's GPU path on a machine with an sm_90 GPU and no container engine: start the service from the
# files of the runtime image's wheel layer (flash_qla, server and their Python dependencies, exactly as the
# image installed them), with the machine's own driver and torch, on the kernels backend, and check it like an
# edge box would (ci/container_smoke_client.py: /ready 200, JSON + safetensors prefill against the reference,
# /metrics).
#
#   bash ci/gpu_layer_smoke.sh LAYER.tar.gz [WHEEL_DIR]
#
# LAYER.tar.gz: the layer ci/container_smoke.sh exports (EXPORT_DIR=...). Its compiled modules were built for
# the image's Python; where this machine's Python differs, each cp3XX extension package is either dropped in
# favour of this machine's own copy (numpy) or replaced by the same version's wheel for this Python from
# WHEEL_DIR (pydantic_core). torch is never taken from the layer (it is not in it): this machine's is used.
# The server runs as uid 10001 (the image's user) when that user can see the GPU, else as the caller.
set -euo pipefail
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1

LAYER="$(realpath "${1:?usage: gpu_layer_smoke.sh LAYER.tar.gz [WHEEL_DIR]}")"
WHEELS="$(realpath "${2:-.}")"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${WORK:-/tmp/flash_qla_gpu_layer}"
PY="${PYTHON:-python3}"
PORT="${PORT:-18000}"
SERVER_PID=""
stop() { [ -z "$SERVER_PID" ] || { kill -TERM "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; }; }
trap stop EXIT

rm -rf "$WORK"; mkdir -p "$WORK/layer" "$WORK/app" "$WORK/swap"
# Every Python below starts in the app folder (the image's WORKDIR): started from a checkout, `python -c` and
# `-m` would import the checkout's flash_qla / server instead of the layer's.
cd "$WORK/app"
tar -xzf "$LAYER" -C "$WORK/layer"
SITE="$(ls -d "$WORK"/layer/usr/local/lib/python3*/*-packages | head -n 1)"
layer_py="$(basename "$(dirname "$SITE")")"
here_tag="$("$PY" -c 'import sys; print(f"cpython-{sys.version_info[0]}{sys.version_info[1]}")')"
echo "layer: $(du -sh "$WORK/layer" | cut -f1) unpacked, site-packages of $layer_py: $(ls "$SITE" | grep -vc -E 'dist-info$') packages"
echo "this machine: $("$PY" --version), torch $("$PY" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "(no GPU)")')"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true

# Extension packages built for another Python than this one.
mapfile -t foreign < <(find "$SITE" -name '*.cpython-3*.so' ! -name "*.$here_tag-*" -printf '%P\n' | cut -d/ -f1 | sort -u)
echo "extension packages for $layer_py, not $here_tag: ${foreign[*]:-none}"
for pkg in "${foreign[@]}"; do
  whl="$(ls "$WHEELS"/"$pkg"-*.whl 2>/dev/null | head -n 1 || true)"
  if [ -n "$whl" ]; then
    "$PY" -m pip install -q --no-index --no-deps --target "$WORK/swap" "$whl"
    echo "  $pkg: replaced by $(basename "$whl")"
  elif "$PY" -c "import $pkg" 2>/dev/null; then
    echo "  $pkg: this machine's own ($("$PY" -c "import $pkg; print($pkg.__version__)"))"
  else
    echo "  $pkg: no copy for $here_tag"; exit 1
  fi
  rm -rf "${SITE:?}/$pkg" "$SITE/$pkg".libs "$SITE/${pkg}"-*.dist-info
done
export PYTHONPATH="$WORK/swap:$SITE"
chmod -R a+rX "$WORK"

"$PY" -c "import flash_qla, server, fastapi; assert flash_qla.__file__.startswith('$SITE'), flash_qla.__file__; print('flash_qla from', flash_qla.__file__); print('fastapi', fastapi.__version__)"
if "$PY" -c "import tilelang" 2>/dev/null; then echo "note: tilelang is importable on this machine (the image has none)"; fi
"$PY" -m flash_qla info 2>&1 | tail -n 12

RUNAS=()
if [ "$(id -u)" -eq 0 ] && command -v setpriv >/dev/null \
   && setpriv --reuid=10001 --regid=10001 --clear-groups env HOME="$WORK/app" PYTHONPATH="$PYTHONPATH" \
        "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  RUNAS=(setpriv --reuid=10001 --regid=10001 --clear-groups)
fi
echo "server runs as uid $([ ${#RUNAS[@]} -gt 0 ] && echo 10001 || id -u)"
"${RUNAS[@]}" env HOME="$WORK/app" PYTHONPATH="$PYTHONPATH" \
  "$PY" -m server --backend kernels --host 127.0.0.1 --port "$PORT" > "$WORK/server.log" 2>&1 &
SERVER_PID=$!
status=0
"$PY" "$REPO/ci/container_smoke_client.py" --url "http://127.0.0.1:$PORT" --expect-ready \
  --expect-backend kernels --tol 1e-2 --pid "$SERVER_PID" || status=$?
stop; SERVER_PID=""
echo "--- server log (tail) ---"; tail -n 15 "$WORK/server.log"
exit "$status"
