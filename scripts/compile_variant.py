"""Compile one kernel variant from the working tree to a cubin, outside the build matrix (for experiments).

usage: python scripts/compile_variant.py KERNEL "{'dtype': 'bf16', 'K': 128, 'V': 128}" OUT.cubin [OUT.cu]
Prints registers, spills and dynamic shared memory (the SMEM that scripts/chunk_kernel_ab.py and
scripts/chunk_phase_timing.py take with the cubin). Build machine only (imports TileLang).
"""
import ast
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from aot.compile import compile_kernel  # noqa: E402
from build_matrix.variants import Variant, build_prim_func, pass_configs  # noqa: E402


def main():
    kernel, params, out = sys.argv[1], ast.literal_eval(sys.argv[2]), sys.argv[3]
    v = Variant(kernel, tuple(params.items()))
    ck = compile_kernel(build_prim_func(v), pass_configs(v))
    pathlib.Path(out).write_bytes(ck.cubin)
    if len(sys.argv) > 4:
        pathlib.Path(sys.argv[4]).write_text(ck.source)
    print(f"{v.key}: registers {ck.registers}, spills {ck.spills}, smem {ck.smem}, grid {ck.grid}")


if __name__ == "__main__":
    main()
