#!/bin/bash
# DRAM bytes and time of each kernel of one backward call, ours and FlashQLA's, from ncu (GPU machine): where a
# row's backward sits against the card's memory bandwidth. Raw ncu CSVs into OUT_DIR, then
# `python scripts/dram_bytes_table.py OUT_DIR/*.csv` (here or there) makes the per-kernel table / JSON lines.
# usage (repository root; carry .peers from ../shared/peers/stage.sh qla and flash_qla/_launcher.abi3.so):
#   bash scripts/dram_bytes.sh OUT_DIR MODEL:SEQS [MODEL:SEQS ...]   e.g. hk16_hv32:32k_8seq
set -uo pipefail
OUT=${1:?usage: bash scripts/dram_bytes.sh OUT_DIR MODEL:SEQS ...}; shift
mkdir -p "$OUT"
M=dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum
NCU=(ncu --profile-from-start off --clock-control none --metrics "$M" --csv)
for row in "$@"; do
  model=${row%%:*}; seqs=${row##*:}
  PYTHONPATH=$PWD "${NCU[@]}" python3 scripts/dram_bytes_driver.py .peers "$model" "$seqs" \
    > "$OUT/ours_${model}_${seqs}.csv" 2>> "$OUT/ncu_err.txt"
  bash scripts/peer_env.sh .peers qla "${NCU[@]}" python3 scripts/dram_bytes_driver.py .peers "$model" "$seqs" \
    > "$OUT/qla_${model}_${seqs}.csv" 2>> "$OUT/ncu_err.txt"
done
