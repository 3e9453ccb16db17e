#!/usr/bin/env bash
# On the GPU machine: install the built wheel (no compiler, no TileLang, nothing from the
# checkout on sys.path) and run the GPU tests against the installed package.
# usage: bash scripts/gpu_wheel_tests.sh WHEEL_DIR OUT_DIR
set -uo pipefail
WHEELS=${1:?wheel dir}; OUT=${2:?out dir}
site=$(mktemp -d); work=$(mktemp -d)
python3 -m pip install -q --no-deps --no-index --target "$site" "$WHEELS"/flash_qla_aot-*.whl || exit 1
cp -r tests "$work/tests"
cd "$work" && {
  echo "== installed: $(ls "$site")"
  PYTHONPATH="$site" python3 -c "import flash_qla, sys; print('flash_qla from', flash_qla.__file__); assert flash_qla.__file__.startswith('$site')"
  PYTHONPATH="$site" python3 -c "import tilelang" 2>/dev/null && echo "FAIL: tilelang importable" || echo "tilelang: not importable"
  PYTHONPATH="$site" python3 -m flash_qla info | tail -4
  PYTHONPATH="$site" python3 -m pytest -q -m gpu tests/test_gpu_forward.py tests/test_gpu_backward.py tests/test_loader_gpu.py -p no:cacheprovider 2>&1 | tail -3
} 2>&1 | tee "$OUT/gpu_wheel_tests.log"
