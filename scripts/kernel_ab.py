"""A/B of one kernel's builds inside the benchmark's own calls (GPU machine; compile on the build machine).

    python scripts/kernel_ab.py compile KERNEL "{'dtype': 'bf16', 'K': 128, 'V': 128, ...}" OUT.cubin [OUT.cu]
        Build one variant from the working tree's aot/kernels (needs TileLang; no GPU). Prints registers,
        spills and the dynamic shared memory the cubin needs (SMEM below).
    python scripts/kernel_ab.py time KERNEL KEY NAME=SPEC [NAME=SPEC ...] [--pass fwd|bwd] [--rows SUB[,SUB...]]
        KEY: the manifest variant the builds replace (its launch rules and tensor maps are shared by every build).
        SPEC: CUBIN:SMEM (a cubin from `compile`), `manifest` (the committed build), or dir:PATH (the build in
        another kernel directory, e.g. a copy of flash_qla/_kernels/sm90a made before a rebuild).

`time` runs, per benchmark row, the benchmark's call (the forward, or the low-level backward) once with each
build: its outputs must equal the first build's bit for bit (same math, same order), else the A/B compares
different arithmetic. Then, inside one more call, every launch of KERNEL is timed alone on that call's own
buffers (device drained, builds in turns, 12 turns, CUDA-event medians). JSON lines on stdout.
"""
import ast
import json
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
TURNS = 12
DEFAULT_ROWS = {"fwd": ["TP1-397B|4096x8", "TP8|1x32768"], "bwd": ["hk16_hv32|32k_1seq", "hk16_hv32|8k_8seq"]}


def compile_variant(kernel: str, params: str, out: str, source: str = None) -> None:
    sys.path.insert(0, str(ROOT))
    from aot.compile import compile_kernel
    from build_matrix.variants import Variant, build_prim_func, pass_configs
    variant = Variant(kernel, tuple(ast.literal_eval(params).items()))
    built = compile_kernel(build_prim_func(variant), pass_configs(variant))
    pathlib.Path(out).write_bytes(built.cubin)
    if source:
        pathlib.Path(source).write_text(built.source)
    print(f"{variant.key}: registers {built.registers}, spills {built.spills}, smem {built.smem}, grid {built.grid}")


def builds(key: str, specs: list) -> dict:
    """name -> a loader.Kernel running that build with the manifest entry's launch rules."""
    from flash_qla import loader

    class BuildKernel(loader.Kernel):
        """A manifest entry's launch rules with another build's cubin and shared-memory size."""
        __slots__ = ("image",)

        def cubin(self) -> bytes:
            return self.image

    lib = loader.library()
    base = lib.kernel_by_key(key)
    out = {}
    for spec in specs:
        name, _, rest = spec.partition("=")
        if not rest:
            raise SystemExit(f"kernel_ab: build spec {spec!r} is not NAME=SPEC")
        if rest == "manifest":
            out[name] = base
        elif rest.startswith("dir:"):
            out[name] = loader.KernelLibrary(rest[4:]).kernel_by_key(key)
        else:
            path, _, smem = rest.rpartition(":")
            if not path or not smem.isdigit():
                raise SystemExit(f"kernel_ab: {spec!r}: a cubin build is NAME=CUBIN:SMEM")
            kern = BuildKernel(lib, base.entry)
            kern.image, kern.smem = pathlib.Path(path).read_bytes(), int(smem)
            out[name] = kern
    return out


def time_builds(kernel: str, key: str, specs: list, pass_: str, rows: list) -> None:
    import torch

    from flash_qla import loader, ops
    from flash_qla.bench.workloads import backward_rows, forward_rows

    kernels = builds(key, specs)
    base = loader.library().kernel_by_key(key)
    device = torch.device("cuda", torch.cuda.current_device())

    def use(kern) -> None:  # the launch cache ops consults before the manifest
        ops._CACHE[(kern.name, tuple(kern.variant.items()))] = kern

    real_launch = ops._launch
    for row, _, call in (forward_rows if pass_ == "fwd" else backward_rows)(rows):
        want = None
        for name, kern in kernels.items():
            use(kern)
            got = [t.clone() for t in call() if t is not None]
            want = want or got
            print(json.dumps({"row": row.key, "build": name,
                              "same_as_first": all(torch.equal(a, b) for a, b in zip(got, want))}), flush=True)
        use(base)
        times = {n: [] for n in kernels}

        def timed(name, variant, dev, sizes, pointers, stream=None):
            if name == kernel:
                torch.cuda.synchronize()
                handle = ops.current_stream(device)
                for _ in range(TURNS):
                    for n, kern in kernels.items():
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        kern.launch(device.index, handle, sizes, pointers)
                        end.record()
                        torch.cuda.synchronize()
                        times[n].append(start.elapsed_time(end))
            return real_launch(name, variant, dev, sizes, pointers, stream)
        ops._launch = timed
        try:
            call()
        finally:
            ops._launch = real_launch
        torch.cuda.synchronize()
        launches = len(times[next(iter(kernels))]) // TURNS
        medians = {n: round(statistics.median(v), 4) for n, v in times.items() if v}
        print(json.dumps({"row": row.key, "kernel": kernel, "launches": launches, **medians}), flush=True)


def main(argv: list) -> None:
    if len(argv) >= 4 and argv[0] == "compile":
        compile_variant(*argv[1:5])
        return
    if len(argv) >= 4 and argv[0] == "time":
        args = argv[1:]
        options = {}
        for flag in ("--pass", "--rows"):
            if flag in args:
                i = args.index(flag)
                options[flag] = args[i + 1]
                del args[i:i + 2]
        pass_ = options.get("--pass", "bwd")
        if pass_ not in DEFAULT_ROWS:
            raise SystemExit("kernel_ab: --pass must be fwd or bwd")
        rows = options["--rows"].split(",") if "--rows" in options else DEFAULT_ROWS[pass_]
        time_builds(args[0], args[1], args[2:], pass_, rows)
        return
    raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
