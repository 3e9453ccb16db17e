#!/usr/bin/env bash
# Replay the Dockerfile's runtime stage without a Docker engine (none on these machines):
#   bash ci/replay_runtime_stage.sh        # log: bash ci/replay_runtime_stage.sh 2>&1 | tee ci/logs/replay_runtime_stage.log
# What it mirrors, step by step (Dockerfile stage `runtime`):
#   FROM python:3.12-slim        -> a CLEAN venv (no system site-packages); PATH reduced to it, so no compiler
#   pip install torch            -> $TORCH_SPEC (here the local CPU wheel; the image takes PyPI's CUDA build)
#   pip install wheel[server]    -> the wheel the builder stage makes (built here from a clean clone of HEAD,
#                                   or $REPLAY_WHEEL), --only-binary=:all:, CC/CXX=false
#   WORKDIR /app + COPY server   -> a scratch app dir holding only server/ from the clean clone
#   USER 10001                   -> the server runs as an unprivileged uid (65534 via setpriv when run as root)
#   ENTRYPOINT/CMD               -> python -m server, but --backend reference --host 127.0.0.1 on a free port
#                                   (no GPU here; the kernels backend would start and report not-ready)
#   HEALTHCHECK                  -> the exact command from the Dockerfile (port substituted), must exit 0
# then /health must answer 200 within a bounded time, /ready and one tiny JSON prefill are checked, and the
# server is stopped (SIGTERM, then SIGKILL after 15 s). Idempotent, bounded, non-zero exit on any failure.
set -euo pipefail
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${REPLAY_WORK:-/tmp/flash_qla_replay_runtime}"
PY="${PYTHON:-python3}"
# The runtime venv's interpreter must be readable by the unprivileged uid the server drops to (the image's
# /usr/local/bin/python3.12 is); a pyenv interpreter under /root is not, so prefer the system one when root.
if [ -z "${RUNTIME_PYTHON:-}" ] && [ "$(id -u)" -eq 0 ] && /usr/bin/python3 -c "import venv, ensurepip" 2>/dev/null; then
  RUNTIME_PYTHON=/usr/bin/python3
fi
RPY="${RUNTIME_PYTHON:-$PY}"
TORCH_SPEC="${REPLAY_TORCH:-torch==2.13.0}"
HEALTH_TIMEOUT_S="${HEALTH_TIMEOUT_S:-60}"
T0=$SECONDS
SERVER_PID=""

step() { printf '\n== [%4ss] %s\n' "$((SECONDS - T0))" "$*"; }
fail() { echo "REPLAY FAILED: $*" >&2; [ -f "$WORK/server.log" ] && tail -n 40 "$WORK/server.log" >&2; exit 1; }
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$SERVER_PID" 2>/dev/null && { echo "server ignored SIGTERM: SIGKILL"; kill -KILL "$SERVER_PID" || true; }
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=""
}
trap stop_server EXIT

case "$WORK" in /tmp/*) ;; *) fail "REPLAY_WORK must live under /tmp (it is deleted): $WORK";; esac
rm -rf "$WORK"
mkdir -p "$WORK"
chmod 755 "$WORK"

step "builder stage: clean clone of HEAD and the wheel"
git clone --quiet --no-hardlinks "$REPO" "$WORK/src"
git -C "$WORK/src" log -1 --format='commit %H%n%s'
if [ -n "${REPLAY_WHEEL:-}" ]; then
  mkdir -p "$WORK/dist"; cp "$REPLAY_WHEEL" "$WORK/dist/"
else
  (cd "$WORK/src" && timeout 900 "$PY" -m pip wheel --no-deps --no-cache-dir -w "$WORK/dist" . 2>&1 | tail -n 2)
fi
shopt -s nullglob
wheels=("$WORK"/dist/flash_qla_aot-*.whl)
[ "${#wheels[@]}" -eq 1 ] || fail "expected one wheel, found ${#wheels[@]}"
WHEEL="${wheels[0]}"
echo "wheel: $(basename "$WHEEL")  $(stat -c %s "$WHEEL") bytes"

step "runtime stage: clean venv ($("$RPY" -c 'import sys; print(sys.executable, sys.version.split()[0])')) + $TORCH_SPEC"
"$RPY" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
grep -q '^include-system-site-packages = false' "$WORK/venv/pyvenv.cfg" || fail "venv sees system site-packages"
timeout 900 "$VPY" -m pip install -q --only-binary=:all: "$TORCH_SPEC" 2>&1 | { grep -v 'is ignored: it is neither' || true; }

step "runtime stage: pip install wheel[server] with no compiler reachable"
timeout 600 env -i HOME="$HOME" PATH="$WORK/venv/bin" CC=false CXX=false PIP_DISABLE_PIP_VERSION_CHECK=1 \
  ${PIP_FIND_LINKS:+PIP_FIND_LINKS="$PIP_FIND_LINKS"} ${PIP_CERT:+PIP_CERT="$PIP_CERT"} \
  "$VPY" -m pip install -q --only-binary=:all: "$WHEEL[server]" 2>&1 | { grep -v 'is ignored: it is neither' || true; }
"$VPY" -m pip list 2>/dev/null | grep -i -E '^(flash-qla-aot|torch|fastapi|uvicorn|tilelang) '
if env PATH="$WORK/venv/bin" /bin/bash -c 'command -v gcc || command -v cc || command -v nvcc'; then
  fail "a compiler is reachable on the runtime PATH"
fi
"$VPY" -c "import tilelang" 2>/dev/null && fail "tilelang importable in the runtime venv"
echo "no gcc/cc/nvcc on the runtime PATH; tilelang not importable"

step "WORKDIR /app + COPY server (from the clean clone)"
mkdir -p "$WORK/app"
cp -r "$WORK/src/server" "$WORK/app/server"
find "$WORK/app" -name __pycache__ -prune -exec rm -rf {} +
chmod -R a+rX "$WORK"

# USER 10001: drop root if we are root (setpriv), else run as whoever runs this script.
RUNAS=()
if [ "$(id -u)" -eq 0 ] && command -v setpriv >/dev/null && [ "$RPY" != "$PY" ]; then
  RUNAS=("$(command -v setpriv)" --reuid=65534 --regid=65534 --clear-groups --)
  echo "server runs as uid 65534 (non-root), like the image's USER 10001"
fi

PORT="$("$VPY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')"
step "start: python -m server --backend reference --host 127.0.0.1 --port $PORT"
(cd "$WORK/app" && exec "${RUNAS[@]}" /usr/bin/env -i HOME=/tmp PATH="$WORK/venv/bin" PYTHONUNBUFFERED=1 \
   PYTHONDONTWRITEBYTECODE=1 "$VPY" -m server --backend reference --host 127.0.0.1 --port "$PORT" --log-level info) \
   > "$WORK/server.log" 2>&1 &
SERVER_PID=$!
echo "server pid $SERVER_PID"

step "wait for /health == 200 (at most ${HEALTH_TIMEOUT_S} s)"
"$VPY" - "$PORT" "$HEALTH_TIMEOUT_S" "$SERVER_PID" <<'EOF'
import os, sys, time, urllib.error, urllib.request
port, limit, pid = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
deadline, t0 = time.monotonic() + limit, time.monotonic()
while True:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            if r.status == 200:
                print(f"/health -> 200 {r.read().decode()} after {time.monotonic() - t0:.1f} s")
                break
    except (urllib.error.URLError, ConnectionError, OSError):
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("FAIL: the server exited before /health answered")
    if time.monotonic() > deadline:
        sys.exit(f"FAIL: /health did not return 200 within {limit} s")
    time.sleep(0.25)
EOF

uid="$(ps -o uid= -p "$SERVER_PID" | tr -d ' ')"
echo "server process uid: $uid"
[ "${#RUNAS[@]}" -eq 0 ] || [ "$uid" != 0 ] || fail "server runs as root"

step "the Dockerfile's HEALTHCHECK command, verbatim but for the port"
"$VPY" - "$REPO/Dockerfile" "$PORT" "$VPY" <<'EOF'
import json, re, subprocess, sys
text, port, py = open(sys.argv[1]).read(), sys.argv[2], sys.argv[3]
m = re.search(r"^HEALTHCHECK[^\n]*\\\n\s*CMD (\[.*\])\s*$", text, re.M)
if not m:
    sys.exit("FAIL: no exec-form HEALTHCHECK CMD in the Dockerfile")
cmd = [a.replace(":8000/", f":{port}/") for a in json.loads(m.group(1))]
cmd[0] = py if cmd[0] == "python" else cmd[0]
r = subprocess.run(cmd, timeout=10)
print(f"HEALTHCHECK exit status {r.returncode}")
sys.exit(r.returncode)
EOF

step "/ready (reference backend) and one tiny JSON prefill"
"$VPY" - "$PORT" <<'EOF'
import json, sys, time, urllib.error, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
deadline = time.monotonic() + 60
while True:
    try:
        with urllib.request.urlopen(base + "/ready", timeout=5) as r:
            print(f"/ready -> {r.status} {r.read().decode()}")
            break
    except urllib.error.HTTPError as e:
        body = e.read().decode()
        if time.monotonic() > deadline:
            sys.exit(f"FAIL: /ready still {e.code} {body}")
        time.sleep(0.5)
T, H, K, V = 3, 1, 4, 4
req = {"q": [[[0.5] * K] * H] * T, "k": [[[0.5] * K] * H] * T, "v": [[[1.0] * V] * H] * T,
       "g": [[-0.1] * H] * T, "beta": [[0.5] * H] * T, "cu_seqlens": [0, T]}
r = urllib.request.urlopen(urllib.request.Request(base + "/v1/prefill", data=json.dumps(req).encode(),
                           headers={"Content-Type": "application/json"}), timeout=30)
out = json.loads(r.read())
o = out["o"]
assert r.status == 200 and len(o) == T and len(o[0][0]) == V, out
print(f"/v1/prefill -> {r.status}, o[{len(o)}][{len(o[0])}][{len(o[0][0])}], o[-1][0][:2] = {o[-1][0][:2]}")
EOF

step "stop the server"
stop_server
echo "server stopped"
echo "--- server log ---"; cat "$WORK/server.log"
step "OK: runtime stage replayed ($((SECONDS - T0)) s)"
