#!/usr/bin/env bash
# GPU-machine validation in one call: proves the cubins run with TileLang absent, runs the gpu-marked
# tests, compute-sanitizer memcheck + racecheck on a small varlen case (scripts/sanitize_case.py), graph
# replays of every backward row under a watchdog (scripts/stress_backward.py), and the host cost of a call.
# usage: bash scripts/gpu_validate.sh OUT_DIR   (expects flash_qla/_launcher*.so built or carried)
# OUT_DIR gets gpu_validate.log (the summary), gpu_tests.log, memcheck.log, racecheck.log (and *_plan.log, *_window.log:
# sanitize_case.py's plan and window cases), stress_backward.log and host_overhead.json: the files a card's folder
# under bench/results keeps.
set -uo pipefail
OUT=${1:?output dir}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG="$OUT/gpu_validate.log"
{
  echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
  python3 -c "import tilelang" 2>/dev/null && { echo "FAIL: tilelang is importable here"; exit 1; } || echo "tilelang: not importable (as intended)"
  python3 -m flash_qla info
  echo "== gpu tests"
  # full output (the backward tests print each gradient's relative L2) in its own file, the summary here
  timeout "${GPU_TEST_TIMEOUT:-480}" python3 -m pytest -q -s -m gpu tests/test_*gpu*.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  echo "pytest exit $?"; grep -E "passed|failed|Error" "$OUT/gpu_tests.log" | tail -15
  echo "== compute-sanitizer memcheck"
  compute-sanitizer --tool memcheck --error-exitcode 3 python3 scripts/sanitize_case.py > "$OUT/memcheck.log" 2>&1
  grep -E "=========" "$OUT/memcheck.log" | head -30
  echo "== compute-sanitizer racecheck"
  compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 3 python3 scripts/sanitize_case.py > "$OUT/racecheck.log" 2>&1
  grep -E "RACECHECK SUMMARY|sanitize case" "$OUT/racecheck.log"
  # the CP tables' kernel over several CTAs (plan), multi-GPU CP's head window build (window) and linked forward
  for case in plan window linked; do
    echo "== compute-sanitizer: sanitize_case.py $case"
    compute-sanitizer --tool memcheck --error-exitcode 3 python3 scripts/sanitize_case.py "$case" \
      > "$OUT/memcheck_$case.log" 2>&1
    grep -E "ERROR SUMMARY" "$OUT/memcheck_$case.log"
    compute-sanitizer --tool racecheck --racecheck-report all --error-exitcode 3 \
      python3 scripts/sanitize_case.py "$case" > "$OUT/racecheck_$case.log" 2>&1
    grep -E "RACECHECK SUMMARY" "$OUT/racecheck_$case.log"
  done
  echo "== backward graph replays under a watchdog"
  timeout 300 python3 scripts/stress_backward.py "hk" 1000 60 > "$OUT/stress_backward.log" 2>&1
  echo "stress exit $?"; cat "$OUT/stress_backward.log" | tail -8
  echo "== host cost"
  if [ -f scripts/host_cost.py ]; then python3 scripts/host_cost.py --out "$OUT/host_overhead.json" 2>&1 | tail -20; fi
} 2>&1 | tee "$LOG"
