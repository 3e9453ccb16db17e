"""The runtime package never pulls in the build-time toolchain."""
import subprocess
import sys


def test_import_flash_qla_imports_no_build_tools():
    code = ("import sys, flash_qla, flash_qla.api, flash_qla.reference; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('tilelang', 'tvm', 'tvm_ffi', 'aot', 'build_matrix')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_no_module_shares_a_name_with_flashqlas_packages():
    """FlashQLA's flash-qla installs flash_qla/ops/ and flash_qla/utils/ under the same import name: a module of
    ours with either name would be shadowed by its package when both are installed into one folder."""
    from pathlib import Path
    import flash_qla
    here = Path(flash_qla.__file__).parent
    assert not [n for n in ("ops", "utils") if (here / f"{n}.py").exists() or (here / n).is_dir()]
