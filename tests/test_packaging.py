"""Release packaging: the Dockerfile's required shape, the cibuildwheel config, the release workflow, and
ci/compare_manifests.py (the rebuilt-vs-committed cubin gate). CPU only, no network, a few seconds."""
import hashlib
import importlib.util
import json
import lzma
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CI = REPO / "ci"

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")


# ---------------------------------------------------------------------------------------------------------------
# Dockerfile

def _stages():
    """[(from_line, [instruction lines])] with backslash continuations joined and comments dropped."""
    text = (REPO / "Dockerfile").read_text()
    joined = re.sub(r"\\\n", " ", text)
    stages = []
    in_heredoc = None
    for line in joined.splitlines():
        s = line.strip()
        if in_heredoc:
            if s == in_heredoc:
                in_heredoc = None
            continue
        if not s or s.startswith("#"):
            continue
        m = re.search(r"<<-?'?(\w+)'?", s)
        if m and s.split()[0].upper() == "RUN":
            in_heredoc = m.group(1)
        if s.upper().startswith("FROM "):
            stages.append((s, []))
        elif stages:
            stages[-1][1].append(s)
    return stages


def _instr(lines, name):
    return [ln for ln in lines if ln.split()[0].upper() == name]


def test_dockerfile_is_multi_stage_builder_then_slim_runtime():
    stages = _stages()
    assert len(stages) >= 2
    names = [re.search(r"\bAS\s+(\S+)", f, re.I).group(1).lower() for f, _ in stages]
    assert names[0] == "builder" and names[-1] == "runtime", names
    text = (REPO / "Dockerfile").read_text()
    assert re.search(r"ARG PYTHON_IMAGE=python:3\.12-slim", text)
    runtime = stages[-1][1]
    assert any("--from=builder" in ln for ln in _instr(runtime, "COPY")), "runtime must take the wheel from builder"
    # the builder makes the wheel from the committed cubins (no nvcc); the runtime installs it with the server extra
    assert any("pip wheel" in ln for ln in _instr(stages[0][1], "RUN"))
    assert any("[server]" in ln for ln in _instr(runtime, "RUN"))
    run = " ".join(_instr(runtime, "RUN"))
    assert "apt-get install" not in run and "nvcc" not in run.replace("command -v nvcc", ""), \
        "runtime stage must not install a compiler or the CUDA toolkit"


def test_dockerfile_runtime_runs_as_non_root_user():
    runtime = _stages()[-1][1]
    users = _instr(runtime, "USER")
    assert users, "runtime stage needs a USER"
    user = users[-1].split()[1].split(":")[0]
    assert user not in ("root", "0"), users[-1]
    # the USER comes before the command that starts the service
    idx = {ln: i for i, ln in enumerate(runtime)}
    assert idx[users[-1]] < idx[_instr(runtime, "ENTRYPOINT")[-1]]


def test_dockerfile_healthcheck_expose_and_command():
    runtime = _stages()[-1][1]
    hc = _instr(runtime, "HEALTHCHECK")
    assert len(hc) == 1 and "/health" in hc[0] and "CMD" in hc[0]
    assert re.search(r"--timeout=\d+s", hc[0]) and re.search(r"--interval=\d+s", hc[0])
    assert [ln.split()[1:] for ln in _instr(runtime, "EXPOSE")] == [["8000"]]
    entry = json.loads(_instr(runtime, "ENTRYPOINT")[-1].split(None, 1)[1])
    cmd = json.loads(_instr(runtime, "CMD")[-1].split(None, 1)[1])
    assert entry == ["python", "-m", "server"]
    assert cmd == ["--backend", "kernels", "--host", "0.0.0.0", "--port", "8000"]
    # the healthcheck probes the port the service binds
    assert ":8000/health" in hc[0]


def test_dockerignore_keeps_context_small():
    lines = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", "allow-list: ignore everything, then re-include what the Dockerfile copies"
    for needed in ("!pyproject.toml", "!CMakeLists.txt", "!README.md", "!flash_qla/", "!server/"):
        assert needed in lines
    assert "**/*.so" in lines, "a locally built launcher must not leak into the image build"


# ---------------------------------------------------------------------------------------------------------------
# cibuildwheel + workflow

def _cibw():
    return tomllib.loads((CI / "cibuildwheel.toml").read_text())["tool"]["cibuildwheel"]


def test_cibuildwheel_targets_manylinux_2_28_x86_64_and_aarch64_one_abi3_wheel():
    cfg = _cibw()
    assert cfg["manylinux-x86_64-image"] == "manylinux_2_28"
    assert cfg["manylinux-aarch64-image"] == "manylinux_2_28"
    assert set(cfg["archs"]) == {"x86_64", "aarch64"}
    builds = cfg["build"].split()
    assert builds and all(b.startswith("cp310-manylinux_") for b in builds), builds
    assert {b.split("manylinux_", 1)[1] for b in builds} == {"x86_64", "aarch64"}
    assert "musllinux" in cfg["skip"]
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert pyproject["tool"]["scikit-build"]["wheel"]["py-api"] == "cp310", "one abi3 wheel needs py-api cp310"


def test_cibuildwheel_repair_excludes_libcuda_everywhere():
    cfg = _cibw()
    commands = [cfg["repair-wheel-command"]] + [o["repair-wheel-command"] for o in cfg.get("overrides", [])
                                               if "repair-wheel-command" in o]
    assert len(commands) >= 3
    for c in commands:
        assert c.startswith("auditwheel repair") and "--exclude libcuda.so.1" in c, c
    plats = {re.search(r"--plat (\S+)", c).group(1) for c in commands if "--plat" in c}
    assert plats == {"manylinux_2_28_x86_64", "manylinux_2_28_aarch64"}


def test_cibuildwheel_tests_the_installed_wheel():
    cfg = _cibw()
    assert "ci/test_installed.sh" in cfg["test-command"]
    script = (CI / "test_installed.sh").read_text()
    assert "import flash_qla" in script and "python -m flash_qla info" in script
    assert '-m "not gpu"' in script
    assert "pytest" in " ".join(cfg["test-requires"])


def test_release_workflow_jobs():
    text = (CI / "workflows" / "release.yml").read_text()
    assert "python -m build_matrix build --force --jobs" in text
    assert "pip install .[build]" in text or 'pip install ".[build]"' in text
    assert "ci/compare_manifests.py" in text
    assert "cibuildwheel" in text and "--config-file ci/cibuildwheel.toml" in text
    assert "ubuntu-24.04-arm" in text, "aarch64 wheels build natively on an arm runner"
    yaml = pytest.importorskip("yaml")
    wf = yaml.safe_load(text)
    jobs = wf["jobs"]
    assert list(jobs) == ["kernels", "wheels", "publish"]
    assert jobs["wheels"]["needs"] == "kernels" and "wheels" in str(jobs["publish"]["needs"])


@pytest.mark.parametrize("script", ["verify_wheel.sh", "replay_runtime_stage.sh", "test_installed.sh"])
def test_ci_scripts_parse(script):
    r = subprocess.run(["bash", "-n", str(CI / script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "set -euo pipefail" in (CI / script).read_text()


# ---------------------------------------------------------------------------------------------------------------
# compare_manifests

def _load_compare():
    spec = importlib.util.spec_from_file_location("compare_manifests", CI / "compare_manifests.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


cm = _load_compare()


def _entry(key, payload):
    return {"key": key, "kernel": key.split(".")[0], "variant": {"dtype": "bf16"}, "file": f"{key}.cubin.xz",
            "sha256": hashlib.sha256(payload).hexdigest(), "source_hash": "0" * 64, "symbol": "main_kernel",
            "block": [384, 1, 1], "grid": ["ceil_div(T, 64)", "H", "1"], "smem": 98304, "params": [],
            "registers": 168, "spills": 0, "compile_seconds": 12.5, "cubin_bytes": len(payload)}


def _manifest(entries, date="2026-11-21T23:03:21Z", nvcc="13.0.88"):
    return {"format_version": 1, "arch": "sm_90a", "build_date": date,
            "toolchain": {"tilelang": "0.1.15", "nvcc": nvcc, "min_driver_api": 13000, "min_driver": "580"},
            "kernels": entries}


def _write(tmp_path, name, obj):
    p = tmp_path / name
    p.write_text(json.dumps(obj))
    return str(p)


def _run(tmp_path, a, b, *extra, capsys):
    rc = cm.main([_write(tmp_path, "a.json", a), _write(tmp_path, "b.json", b), *extra])
    return rc, capsys.readouterr()


BASE = [_entry("gdn_bwd_recompute.bf16.K128.V128", b"cubin-1"), _entry("gdn_prepare.bf16.K64", b"cubin-2")]


def test_compare_identical_passes(tmp_path, capsys):
    rc, out = _run(tmp_path, _manifest(BASE), _manifest(json.loads(json.dumps(BASE))), capsys=capsys)
    assert rc == 0, out.out
    assert "OK: 2 kernels identical" in out.out


def test_compare_changed_sha_fails_naming_the_key(tmp_path, capsys):
    rebuilt = json.loads(json.dumps(BASE))
    rebuilt[1]["sha256"] = hashlib.sha256(b"different").hexdigest()
    rc, out = _run(tmp_path, _manifest(BASE), _manifest(rebuilt), capsys=capsys)
    assert rc == 1
    assert "gdn_prepare.bf16.K64: sha256 differs" in out.out
    assert "gdn_bwd_recompute.bf16.K128.V128" not in out.out.replace("FAILED", "")
    assert "FAILED: 1 difference" in out.out


def test_compare_ignores_build_date_and_compile_seconds(tmp_path, capsys):
    rebuilt = json.loads(json.dumps(BASE))
    rebuilt[0]["compile_seconds"] = 99.0
    rc, out = _run(tmp_path, _manifest(BASE), _manifest(rebuilt, date="2027-01-01T00:00:00Z"), capsys=capsys)
    assert rc == 0, out.out


def test_compare_missing_or_extra_key_and_metadata_fail(tmp_path, capsys):
    extra = BASE + [_entry("gdn_bwd_recompute.fp16.K64.V64", b"cubin-3")]
    rc, out = _run(tmp_path, _manifest(BASE), _manifest(extra), capsys=capsys)
    assert rc == 1 and "gdn_bwd_recompute.fp16.K64.V64: rebuilt but not in the committed manifest" in out.out
    rc, out = _run(tmp_path, _manifest(extra), _manifest(BASE), capsys=capsys)
    assert rc == 1 and "gdn_bwd_recompute.fp16.K64.V64: in the committed manifest but not rebuilt" in out.out
    changed = json.loads(json.dumps(BASE))
    changed[0]["smem"] = 1024
    rc, out = _run(tmp_path, _manifest(BASE), _manifest(changed), capsys=capsys)
    assert rc == 1 and "gdn_bwd_recompute.bf16.K128.V128: smem differs" in out.out


def test_compare_subset_skips_keys_not_rebuilt_but_checks_the_rest(tmp_path, capsys):
    rc, out = _run(tmp_path, _manifest(BASE), _manifest(BASE[:1]), "--subset", capsys=capsys)
    assert rc == 0 and "OK: 1 kernels identical" in out.out
    changed = json.loads(json.dumps(BASE[:1]))
    changed[0]["sha256"] = "f" * 64
    rc, out = _run(tmp_path, _manifest(BASE), _manifest(changed), "--subset", capsys=capsys)
    assert rc == 1 and "gdn_bwd_recompute.bf16.K128.V128: sha256 differs" in out.out


def test_compare_toolchain_mismatch_fails(tmp_path, capsys):
    rc, out = _run(tmp_path, _manifest(BASE), _manifest(BASE, nvcc="12.9.86"), capsys=capsys)
    assert rc == 1 and "toolchain.nvcc" in out.out


def test_compare_kernel_dir_checks_rebuilt_files(tmp_path, capsys):
    kdir = tmp_path / "k"
    kdir.mkdir()
    (kdir / "gdn_bwd_recompute.bf16.K128.V128.cubin.xz").write_bytes(lzma.compress(b"cubin-1"))
    (kdir / "gdn_prepare.bf16.K64.cubin.xz").write_bytes(lzma.compress(b"tampered"))
    rc, out = _run(tmp_path, _manifest(BASE), _manifest(BASE), "--kernel-dir", str(kdir), capsys=capsys)
    assert rc == 1 and "gdn_prepare.bf16.K64: gdn_prepare.bf16.K64.cubin.xz hashes to" in out.out
    (kdir / "gdn_prepare.bf16.K64.cubin.xz").write_bytes(lzma.compress(b"cubin-2"))
    rc, out = _run(tmp_path, _manifest(BASE), _manifest(BASE), "--kernel-dir", str(kdir), capsys=capsys)
    assert rc == 0, out.out


def test_compare_cli_exit_codes(tmp_path):
    a = _write(tmp_path, "a.json", _manifest(BASE))
    r = subprocess.run([sys.executable, str(CI / "compare_manifests.py"), a, a], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "OK" in r.stdout
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = subprocess.run([sys.executable, str(CI / "compare_manifests.py"), a, str(bad)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "not valid JSON" in r.stderr


def test_committed_manifest_compares_equal_to_itself():
    m = REPO / "flash_qla" / "_kernels" / "sm90a" / "manifest.json"
    if not m.exists():
        pytest.skip("no committed manifest yet")
    # the real manifest has the shape compare_manifests expects (file hashes are build_matrix check's job)
    assert cm.compare(cm.load(str(m)), cm.load(str(m))) == []
