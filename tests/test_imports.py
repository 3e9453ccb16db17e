"""The runtime package never pulls in the build-time toolchain."""
import subprocess
import sys


def test_import_flash_qla_imports_no_build_tools():
    code = ("import sys, flash_qla, flash_qla.api, flash_qla.reference; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('tilelang', 'tvm', 'tvm_ffi', 'aot', 'build_matrix')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
