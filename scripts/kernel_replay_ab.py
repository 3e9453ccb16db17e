"""A/B timing of one kernel's builds inside the bench's backward (GPU machine; an experiment, not a test).

Per row: the bench's low-level backward call (as peer_bench times FlashQLA's) once with each build, whose gradients
must match the manifest build's bit for bit; then one call in which every launch of KERNEL is first timed alone
(the device drained, each build in turns, CUDA-event medians) on that call's own buffers.
usage: python scripts/kernel_replay_ab.py KERNEL KEY NAME=CUBIN:SMEM [NAME=CUBIN:SMEM ...] [--rows SUB[,SUB...]]
(KEY: the variant the cubins replace, whose manifest entry's launch rules every build shares; NAME=manifest times
the built kernel, NAME=dir:PATH the build in another kernel directory; cubins from scripts/compile_variant.py, which
prints each build's SMEM). JSON lines on stdout.
"""
import json
import statistics
import sys

import torch

from flash_qla import loader, ops
from flash_qla.bench.workloads import backward_rows

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from chunk_kernel_ab import kernels, rows_option, use  # noqa: E402


def main():
    args = sys.argv[1:]
    rows = rows_option(args, ["hk16_hv32|32k_1seq", "hk16_hv32|8k_8seq"])
    kernel, key, specs = args[0], args[1], args[2:]
    builds = kernels(key, specs)
    base = loader.library().kernel_by_key(key)
    device = torch.device("cuda", torch.cuda.current_device())
    real_launch = ops._launch
    for row, _, call in backward_rows(rows):
        want = [t.clone() for t in call() if t is not None]
        for name, kern in builds.items():  # each build's whole backward: the same gradients, bit for bit
            use(kern)
            got = [t for t in call() if t is not None]
            print(json.dumps({"row": row.key, "build": name,
                              "same_gradients": all(torch.equal(a, b) for a, b in zip(got, want))}), flush=True)
        use(base)
        times = {n: [] for n in builds}

        def timed(name, variant, dev, sizes, pointers, stream=None):
            # every launch of KERNEL timed alone (the device drained first), each build in turns, on the buffers
            # of this very call; then the real launch
            if name == kernel:
                torch.cuda.synchronize()
                handle = ops.current_stream(device)
                for _ in range(12):
                    for n, kern in builds.items():
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record()
                        kern.launch(device.index, handle, sizes, pointers)
                        b.record()
                        torch.cuda.synchronize()
                        times[n].append(a.elapsed_time(b))
            return real_launch(name, variant, dev, sizes, pointers, stream)
        ops._launch = timed
        try:
            call()
        finally:
            ops._launch = real_launch
        torch.cuda.synchronize()
        launches = len(times[next(iter(builds))]) // 12  # each launch was timed 12 times per build
        if not launches:  # this row's backward never launches KERNEL (e.g. no CP)
            print(json.dumps({"row": row.key, "kernel": kernel, "launches": 0}), flush=True)
            continue
        print(json.dumps({"row": row.key, "kernel": kernel, "launches": launches,
                          **{n: round(statistics.median(v), 4) for n, v in times.items()}}), flush=True)

if __name__ == "__main__":
    main()
