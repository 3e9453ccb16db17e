#!/bin/bash
# Issue 5's closing evidence, on the GPU machine, in one call (~6 minutes): only on an H200, validate this build
# (scripts/gpu_validate.sh) and time the backward rows, ours and FlashQLA's in turns, three times
# (scripts/gpu_bench.sh --runs 3: each row's median over the runs). On any other card it runs nothing.
# usage (repository root; carry .peers from ../shared/peers/stage.sh and flash_qla/_launcher.abi3.so):
#   bash scripts/h200_backward_evidence.sh OUT_DIR
# then, here: python ../shared/bench/compare.py OUT_DIR/b/ours.jsonl --pass bwd --vs qla --min-ratio 1.0
# Keeps at most eight files under OUT_DIR (what one device call brings back).
set -uo pipefail
OUT=${1:?usage: bash scripts/h200_backward_evidence.sh OUT_DIR}
name=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "card: $name"
case "$name" in
  *H200*) ;;
  *) echo "not an H200: nothing run"; exit 0 ;;
esac
PYTHONPATH=$PWD bash scripts/gpu_validate.sh "$OUT/val" > /dev/null 2>&1
grep -E "pytest exit|passed|failed|ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/val/gpu_validate.log"
rm -f "$OUT/val/memcheck.log" "$OUT/val/racecheck.log" "$OUT/val/launch_overhead.json"
bash scripts/gpu_bench.sh "$OUT/b" --pass bwd --peers qla --runs 3 > /dev/null 2>&1
tail -2 "$OUT/b/gpu_bench.log"
rm -rf "$OUT"/b/run?
