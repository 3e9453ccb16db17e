#!/bin/bash
# On the GPU machine: time flash_qla and then the peer libraries on the standard matrix, in one
# sequence on one GPU, so every ratio in the report compares numbers from the same card and run.
#
# usage (from the repository root):
#   bash scripts/gpu_bench.sh OUT_DIR [--pass fwd|bwd|both] [--peers "qla fla fi"|none] [--no-ours]
#                             [--rows SUBSTRING] [--backend auto|kernels|reference]
#                             [--warmup N] [--iters N] [--peers-dir .peers] [--runs N] [--report]
#
# Writes under OUT_DIR, a card's result folder (python -m benchmarks.report reads it as it is):
#   ours.jsonl         python -m flash_qla.bench rows (appended per pass)
#   <peer>.jsonl       the peer's rows (qla = FlashQLA, fla = FLA, fi = FlashInfer, forward only)
#   gpu_bench.log      GPU, driver, versions, and every step's output
#   BENCHMARKS.md      with --report: the report of this folder alone (tables, no figures)
# --runs N (N > 1): N runs, ours then each peer in turn, into OUT_DIR/run1 ... runN; ours.jsonl and <peer>.jsonl are
# then each row's median over the runs (python -m benchmarks.merge_runs; a 32k backward row's graph median moves
# by a few percent between captures on one card, more than some rows' distance to a peer).
#
# Peers run from a staged folder (--peers-dir, default .peers) holding run_peers.sh, matrix.json, the peers' site
# bundles and their compile caches; scripts/README.md says how to stage it. Without their caches the peers spend
# minutes compiling. Split long work across calls with --pass, --peers and --no-ours.
set -uo pipefail

OUT=${1:?usage: bash scripts/gpu_bench.sh OUT_DIR [options]}; shift
PASS=both; PEERS="qla fla fi"; RUN_OURS=1; ROWS=""; BACKEND=auto; WARMUP=""; ITERS=""
PEERS_DIR=.peers; REPORT=0; RUNS=1; PYTHON=${PYTHON:-python3}
while [ $# -gt 0 ]; do
  case "$1" in
    --pass) PASS=$2; shift 2 ;;
    --peers) PEERS=$2; shift 2 ;;
    --no-ours) RUN_OURS=0; shift ;;
    --rows) ROWS=$2; shift 2 ;;
    --backend) BACKEND=$2; shift 2 ;;
    --warmup) WARMUP=$2; shift 2 ;;
    --iters) ITERS=$2; shift 2 ;;
    --peers-dir) PEERS_DIR=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    --report) REPORT=1; shift ;;
    *) echo "gpu_bench.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
[ "$PEERS" = none ] && PEERS=""
case "$PASS" in fwd|bwd|both) ;; *) echo "gpu_bench.sh: --pass must be fwd, bwd or both" >&2; exit 2 ;; esac
case "$RUNS" in ''|*[!0-9]*|0) echo "gpu_bench.sh: --runs must be a positive integer" >&2; exit 2 ;; esac

# Files are appended to (a later call adds the other pass), so a pass already timed into them would leave two runs'
# rows mixed in one file: refuse that, naming the file (a warm machine keeps an earlier call's OUT_DIR).
case "$PASS" in both) TIMED="fwd bwd" ;; *) TIMED=$PASS ;; esac
for name in ours $PEERS; do
  [ "$name" = ours ] && [ "$RUN_OURS" = 0 ] && continue
  for f in "$OUT/$name.jsonl" "$OUT"/run*/"$name.jsonl"; do
    for p in $TIMED; do
      if [ -s "$f" ] && grep -q "\"pass_\": \"$p\"" "$f"; then
        echo "gpu_bench.sh: $f already holds $p rows: pick an empty OUT_DIR or remove them" >&2; exit 2
      fi
    done
  done
done

mkdir -p "$OUT"
LOG="$OUT/gpu_bench.log"
export PYTHONUNBUFFERED=1
status=0
say() { echo "== $*" | tee -a "$LOG"; }

say "gpu_bench.sh pass=$PASS peers='${PEERS}' ours=$RUN_OURS backend=$BACKEND rows='${ROWS}'"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,temperature.gpu \
  --format=csv 2>&1 | tee -a "$LOG"
"$PYTHON" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
  "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "NO GPU")' \
  2>&1 | tee -a "$LOG"

run_once() {  # ours, then each peer, into directory $1
  local dir=$1 lib rc only args
  # Ours first: the process's first row then records the cold start (kernel loading) of a fresh machine.
  if [ "$RUN_OURS" = 1 ]; then
    say "flash_qla ($PASS)"
    # eager call counts: peer_bench.py's do_bench time budgets unless --warmup / --iters pin them
    args=(--pass "$PASS" --backend "$BACKEND" --out "$dir/ours.jsonl" --append)
    [ -n "$WARMUP" ] && args+=(--warmup "$WARMUP")
    [ -n "$ITERS" ] && args+=(--iters "$ITERS")
    [ -n "$ROWS" ] && args+=(--rows "$ROWS")
    # -m from the repository root runs this checkout's flash_qla; no PYTHONPATH here on purpose, since
    # the peers' bundle holds FlashQLA under the same import name.
    "$PYTHON" -m flash_qla.bench "${args[@]}" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { say "flash_qla.bench exited $rc"; status=1; }
  fi

  for lib in $PEERS; do
    say "peer $lib ($PASS)"
    case "$lib" in qla|fla|fi) ;; *) say "unknown peer $lib (qla, fla or fi)"; status=1; continue ;; esac
    if [ ! -f "$PEERS_DIR/run_peers.sh" ]; then
      say "no $PEERS_DIR/run_peers.sh: stage the peers first (scripts/README.md)"; status=1; continue
    fi
    if [ "$lib" = fi ]; then
      [ -f "$PEERS_DIR/fi-site.tar.xz" ] || say "warning: no fi-site.tar.xz in $PEERS_DIR"
      [ "$PASS" = bwd ] && { say "fi has no backward: skipped"; continue; }
    else
      ls "$PEERS_DIR"/cache-$lib.tar.xz.* >/dev/null 2>&1 \
        || say "warning: no compile cache for $lib in $PEERS_DIR, expect minutes of JIT"
    fi
    only=(); [ "$PASS" != both ] && only=(--only "$PASS")
    bash "$PEERS_DIR/run_peers.sh" "$PEERS_DIR" "$lib" "$PEERS_DIR/matrix.json" "$dir/$lib.jsonl" "${only[@]}" \
      2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || { say "peer $lib exited $rc"; status=1; }
  done
}

if [ "$RUNS" = 1 ]; then
  run_once "$OUT"
else
  for i in $(seq 1 "$RUNS"); do
    mkdir -p "$OUT/run$i"; say "run $i of $RUNS"; run_once "$OUT/run$i"
  done
  say "each row's median over the $RUNS runs"
  for name in ours $PEERS; do
    files=(); for i in $(seq 1 "$RUNS"); do [ -s "$OUT/run$i/$name.jsonl" ] && files+=("$OUT/run$i/$name.jsonl"); done
    [ ${#files[@]} -gt 0 ] && "$PYTHON" -m benchmarks.merge_runs "$OUT/$name.jsonl" "${files[@]}" 2>&1 | tee -a "$LOG"
  done
fi

if [ "$REPORT" = 1 ] && [ -s "$OUT/ours.jsonl" ]; then
  say "report"
  "$PYTHON" -m benchmarks.report "$OUT" --out "$OUT/BENCHMARKS.md" --no-plots 2>&1 | tee -a "$LOG"
  grep -E '^- (graph|eager):' "$OUT/BENCHMARKS.md" 2>/dev/null
fi
say "done, status $status"
exit $status
