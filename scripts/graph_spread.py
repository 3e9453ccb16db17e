"""How much a backward row's graph median moves between captures of the same call (GPU machine): JSON lines.

For each row, TRIALS times: capture the bench's backward call into a fresh graph and take the bench's graph median
(flash_qla.bench.timing.graph_median_ms), then profile a few replays of that graph for each kernel's start and end
relative to the first kernel (medians). A row whose medians spread between captures while its kernels' own times
do not is set by how the captures arrange the concurrent branches, not by the kernels.
usage: python scripts/graph_spread.py OUT.jsonl TRIALS ROW_SUBSTRING [ROW_SUBSTRING ...]
       (FLASH_QLA_SAVE_BESIDE=0 runs the save chain before the dh chain instead of beside it)
"""
import json
import os
import statistics
import sys

import torch

from flash_qla import backward
from flash_qla.bench.timing import graph_median_ms
from flash_qla.bench.workloads import backward_rows

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from graph_gaps import profiled_replays  # noqa: E402

PROFILED_REPLAYS = 5


def timeline(call, device):
    """{kernel name: [start_us, end_us]} of one replay (medians over PROFILED_REPLAYS), relative to its first kernel."""
    spans = {}
    for one in profiled_replays(call, device, PROFILED_REPLAYS):
        for i, (start, end, name) in enumerate(one):
            spans.setdefault(f"{i}:{name}", []).append((start - one[0][0], end - one[0][0]))
    return {k: [round(statistics.median(s for s, _ in v), 1), round(statistics.median(e for _, e in v), 1)]
            for k, v in spans.items()}


def main():
    out_path, trials, wants = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    backward.SAVE_CHAIN_BESIDE_DH = os.environ.get("FLASH_QLA_SAVE_BESIDE", "1") != "0"
    device = torch.device("cuda", torch.cuda.current_device())
    with open(out_path, "a") as out:
        for row, _, call in backward_rows(wants):
            for trial in range(trials):
                ms, why = graph_median_ms(call, device)
                rec = {"row": row.key, "trial": trial, "save_beside": backward.SAVE_CHAIN_BESIDE_DH, "graph_ms": ms,
                       "why": why, "timeline_us": timeline(call, device), "device": torch.cuda.get_device_name()}
                print(json.dumps({k: v for k, v in rec.items() if k != "timeline_us"}), flush=True)
                out.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
