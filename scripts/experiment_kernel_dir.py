"""A kernel directory for an experiment: the shipped one with some variants built from another kernel module.

usage: python scripts/experiment_kernel_dir.py OUT_DIR MODULE KERNEL "{'dtype': 'bf16', ...}" [more variant dicts]
Copies flash_qla/_kernels/sm90a to OUT_DIR and replaces the entry KERNEL.<tag> of each variant given by a build of
MODULE (a dotted path, e.g. aot.experimental.gdn_bwd_chunk_ws, whose build() takes the variant's axes; the kernel
keeps KERNEL's name and parameters). Point the library at it with FLASH_QLA_KERNELS_DIR=OUT_DIR, or
scripts/chunk_kernel_ab.py NAME=dir:OUT_DIR. Build machine only (imports TileLang).
"""
import ast
import importlib
import pathlib
import shutil
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from aot.compile import compile_kernel  # noqa: E402
from build_matrix.hashing import sha256_bytes  # noqa: E402
from build_matrix.manifest_io import KERNEL_DIR, load_manifest, write_cubin, write_manifest  # noqa: E402
from build_matrix.variants import Variant  # noqa: E402


def main():
    out, module_name, kernel = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(KERNEL_DIR, out)
    module = importlib.import_module(module_name)
    manifest = load_manifest(out / "manifest.json")
    entries = {e["key"]: e for e in manifest["kernels"]}
    for spec in sys.argv[4:]:
        v = Variant(kernel, tuple(ast.literal_eval(spec).items()))
        ck = compile_kernel(module.build(**v.params), dict(getattr(module, "PASS_CONFIGS", {})))
        e = entries[v.key]
        e.update(symbol=ck.symbol, block=ck.block, grid=ck.grid, smem=ck.smem, params=ck.params,
                 registers=ck.registers, spills=ck.spills, sha256=sha256_bytes(ck.cubin),
                 source_hash=f"experiment:{module_name}", cubin_bytes=len(ck.cubin),
                 xz_bytes=write_cubin(e["file"], ck.cubin, out))
        print(f"{v.key} <- {module_name}: registers {ck.registers}, spills {ck.spills}, smem {ck.smem}")
    write_manifest(manifest, out / "manifest.json")


if __name__ == "__main__":
    main()
