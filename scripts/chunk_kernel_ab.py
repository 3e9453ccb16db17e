"""A/B timing of gdn_bwd_chunk builds (GPU machine; an experiment, not a test): JSON lines on stdout.

Runs the recompute and the dh chain once per row as the backward does, then times the chunk kernel alone (median of
CUDA-event timings) from each cubin given, in turns, so every build sees the same inputs, clocks and L2 state.
usage: python scripts/chunk_kernel_ab.py KEY NAME=CUBIN:SMEM [NAME=CUBIN:SMEM ...] [--rows SUB[,SUB...]]
(KEY: the variant the cubins replace, e.g. gdn_bwd_chunk.bf16.K128.V128, whose manifest entry's launch rules and
tensor maps every build must share; cubins from scripts/compile_variant.py, which prints each build's SMEM;
NAME=manifest times the built kernel; NAME=dir:PATH the build in another kernel directory, e.g. a copy of the
committed flash_qla/_kernels/sm90a, whose manifest entry may differ in parameters and tensor maps)
"""
import json
import statistics
import sys

import torch

from flash_qla import backward, loader, ops
from flash_qla.bench.inputs import draw_inputs
from flash_qla.bench.matrix import iter_rows, load_matrix


class BuildKernel(loader.Kernel):
    """A manifest entry's launch rules with another build's cubin and shared-memory size."""
    __slots__ = ("image",)

    def cubin(self) -> bytes:
        return self.image


def kernels(key, specs):
    """name -> a loader.Kernel for that build (its own module, loaded on first launch)."""
    lib = loader.library()
    base = lib.kernel_by_key(key)
    out = {}
    for spec in specs:
        name, _, rest = spec.partition("=")
        if rest == "manifest":
            out[name] = base
            continue
        if rest.startswith("dir:"):  # another kernel directory's build, with its own manifest entry (launch rules)
            out[name] = loader.KernelLibrary(rest[4:]).kernel_by_key(key)
            continue
        path, _, smem = rest.rpartition(":")
        k = BuildKernel(lib, base.entry)
        k.image = open(path, "rb").read()
        k.smem = int(smem)
        out[name] = k
    return out


def use(kern) -> None:
    """Make ops._launch run `kern` for its variant (the launch cache the library consults first)."""
    ops._CACHE[(kern.name, tuple(kern.variant.items()))] = kern


def chunk_stage_inputs(row):
    """(problem, saved, (dO packed, X, dV, dS')) for a bench row: everything gdn_bwd_chunk reads."""
    x = draw_inputs(row, "cuda")
    return backward.chunk_stage_inputs(x.q, x.k, x.v, x.g, x.beta, x.h0, x.cu_seqlens, x.do, x.dht)


def rows_option(args: list, default: list) -> list:
    """The --rows SUB[,SUB...] option's row substrings (default without it), removed from args."""
    if "--rows" not in args:
        return default
    i = args.index("--rows")
    rows = args[i + 1].split(",")
    del args[i:i + 2]
    return rows


def time_in_turns(builds, stage_inputs, each=None, reps=15) -> dict:
    """{build name: median ms} of the chunk kernel from each build in turns on the same inputs (the first three
    calls of each left out); each(rep, name, outputs), if given, sees every call's (dq, dk, dbeta, dg)."""
    p, st, stage = stage_inputs
    times = {n: [] for n in builds}
    for rep in range(reps):
        for name, kern in builds.items():
            use(kern)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = backward._chunk_kernel(p, st, *stage)
            b.record()
            torch.cuda.synchronize()
            times[name].append(a.elapsed_time(b))
            if each is not None:
                each(rep, name, out)
    return {n: round(statistics.median(v[3:]), 4) for n, v in times.items()}


def over_rows(default_rows: list, check) -> None:
    """The command line KEY NAME=SPEC [...] [--rows SUB[,SUB...]]: for each selected backward row, time the builds in
    turns (time_in_turns) and print their medians; check(row, ref, rep, name, outputs) sees every call, with ref a
    list it may fill with the first call's outputs."""
    args = sys.argv[1:]
    rows = rows_option(args, default_rows)
    key, specs = args[0], args[1:]
    builds = kernels(key, specs)
    for row in iter_rows(load_matrix(), ("bwd",), ""):
        if not any(w in row.key for w in rows):
            continue
        ref = []
        medians = time_in_turns(builds, chunk_stage_inputs(row),
                                lambda rep, name, out, row=row, ref=ref: check(row, ref, rep, name, out))
        print(json.dumps({"row": row.key, **medians}), flush=True)


def same_as_first(row, ref, rep, name, out) -> None:
    """Every build must give the first build's gradients bit for bit (same math, same order): checked at the first
    turn."""
    if rep == 0:
        if not ref:
            ref.extend(t.clone() for t in out)
        same = all(torch.equal(u, v) for u, v in zip(ref, out))
        print(json.dumps({"row": row.key, "build": name, "same_as_first": same}), flush=True)


def main():
    over_rows(["hk16_hv32|32k_1seq", "hk4_hv8|32k_1seq"], same_as_first)


if __name__ == "__main__":
    main()
