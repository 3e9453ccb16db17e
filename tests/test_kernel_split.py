"""scripts/kernel_split.py on the CPU: a peer's rows come from the staged matrix even where the name `flash_qla`
is another package (a peer's environment puts FlashQLA's first on the path)."""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import importlib.util, json, sys
# the name flash_qla bound to another package first, as a peer's site folder does
spec = importlib.util.spec_from_file_location("flash_qla", sys.argv[1] + "/flash_qla/__init__.py",
                                              submodule_search_locations=[sys.argv[1] + "/flash_qla"])
sys.modules["flash_qla"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sys.modules["flash_qla"])
sys.path.insert(0, sys.argv[2])   # scripts/
import kernel_split
m = kernel_split.matrix_module()
rows = [r.key for r in m.iter_rows(m.load_matrix(sys.argv[3]), ("fwd",))]
print(json.dumps(rows))
"""


def test_peer_rows_load_beside_a_shadowing_flash_qla(tmp_path):
    shadow = tmp_path / "site" / "flash_qla"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("SHADOW = True\n")   # FlashQLA's package has no bench subpackage
    matrix = tmp_path / "matrix.json"
    matrix.write_text(json.dumps({"head_dim": 128, "fwd": {"models": [["TP8", 2, 8]],
                                                           "seqs": [["1x64", [64]], ["2x8", [8, 8]]]}}))
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "site"), str(ROOT / "scripts"), str(matrix)],
                         capture_output=True, text=True, check=True, cwd=tmp_path)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["fwd|TP8|1x64", "fwd|TP8|2x8"]
