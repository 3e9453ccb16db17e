"""`python -m flash_qla info` says when FlashQLA's `flash-qla` distribution (same import name) is installed too."""
import base64
import hashlib

import pytest

from flash_qla import identity, info


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _dist(site, name, version, files):
    """A minimal installed distribution: METADATA and a RECORD of (path, bytes) with their hashes."""
    info_dir = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info_dir.mkdir()
    (info_dir / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    rows = [f"{p},{_hash(b)},{len(b)}" for p, b in files] + [f"{info_dir.name}/RECORD,,"]
    (info_dir / "RECORD").write_text("\n".join(rows) + "\n")


def _site(tmp_path, theirs_here=True, last="ours"):
    site = tmp_path / "site"
    pkg = site / "flash_qla"
    (pkg / "ops").mkdir(parents=True)
    ours_init, theirs_init = b"# flash-qla-aot\n", b"# FlashQLA\n"
    ours = [("flash_qla/__init__.py", ours_init), ("flash_qla/ops.py", b"X = 1\n")]
    theirs = [("flash_qla/__init__.py", theirs_init), ("flash_qla/ops/__init__.py", b"")]
    _dist(site, "flash-qla-aot", "0.1.0", ours)
    (pkg / "ops.py").write_bytes(b"X = 1\n")
    if theirs_here:
        _dist(site, "flash-qla", "0.1.3", theirs)
        (pkg / "ops" / "__init__.py").write_bytes(b"")
    (pkg / "__init__.py").write_bytes(ours_init if last == "ours" or not theirs_here else theirs_init)
    return site, pkg


def test_alone(tmp_path):
    site, pkg = _site(tmp_path, theirs_here=False)
    r = identity.package_identity(pkg, [str(site)])
    assert r["state"] == "alone" and r["ok"] and r["init_owner"] == "flash-qla-aot" and r["theirs"] is None
    assert "flash-qla is not installed" in identity.describe(r)[0]


@pytest.mark.parametrize("last", ["ours", "theirs"])
def test_both_in_one_folder(tmp_path, last):
    site, pkg = _site(tmp_path, last=last)
    r = identity.package_identity(pkg, [str(site)])
    assert r["state"] == "mixed" and not r["ok"]
    assert r["theirs"]["version"] == "0.1.3"
    assert r["theirs_files_here"] == ["flash_qla/__init__.py", "flash_qla/ops/__init__.py"]
    assert r["init_owner"] == ("flash-qla-aot" if last == "ours" else "flash-qla")
    assert r["shadowed"] == ["ops"]
    text = "\n".join(identity.describe(r))
    assert "WARNING    FlashQLA's flash-qla 0.1.3 is installed into the same folder" in text
    assert f"runs the __init__.py of {r['init_owner']}" in text
    assert "ops/ of flash-qla shadow this package's ops.py" in text and "pip uninstall -y flash-qla" in text


def test_other_folder_is_hidden_not_mixed(tmp_path):
    site, pkg = _site(tmp_path, theirs_here=False)
    other = tmp_path / "other"
    (other / "flash_qla" / "ops").mkdir(parents=True)
    (other / "flash_qla" / "__init__.py").write_bytes(b"# FlashQLA\n")
    _dist(other, "flash-qla", "0.1.3", [("flash_qla/__init__.py", b"# FlashQLA\n")])
    r = identity.package_identity(pkg, [str(site), str(other)])
    assert r["state"] == "hidden" and r["ok"] and r["theirs_files_here"] == []
    assert "outside this folder" in "\n".join(identity.describe(r))


def test_info_reports_a_mixed_folder_as_broken(tmp_path, monkeypatch):
    site, pkg = _site(tmp_path)
    monkeypatch.setattr(info, "_identity", lambda: identity.package_identity(pkg, [str(site)]))
    r = info.collect(load=False)
    assert r["ok"] is False and r["identity"]["state"] == "mixed"
    text = info.render(r)
    assert "WARNING    FlashQLA's flash-qla" in text and "STATUS     broken installation" in text


def test_this_checkout_reports_itself():
    r = identity.package_identity()
    assert r["package_dir"].endswith("flash_qla") and r["ours"] is not None
    assert r["state"] != "mixed" and r["ok"]  # the tests import this checkout: FlashQLA is not mixed into it
