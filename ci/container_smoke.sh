#!/usr/bin/env bash
# Build the project's Dockerfile for real and run the service from the image, with no container daemon:
#
#   bash ci/container_smoke.sh                 # needs root, buildah and debootstrap (apt-get install buildah debootstrap)
#
# 1. base:    debootstrap a minimal Debian bookworm with python3 + pip (the local stand-in for python:3.12-slim,
#             which cannot be pulled here), imported as an image with `buildah from scratch` + `buildah add`.
# 2. build:   `buildah bud --isolation chroot --build-arg PYTHON_IMAGE=<that base>` of ./Dockerfile from a clean
#             clone of HEAD: the builder stage makes the wheel, the runtime stage installs torch and the wheel.
#             Torch is the CPU build from $TORCH_WHEEL_DIR when it holds one (bind-mounted into the build with
#             --volume and named by TORCH_FIND_LINKS), which keeps the image small; the release image takes the
#             CUDA build (ci/workflows/release.yml).
# 3. facts:   image size per stage (uncompressed; gzip-compressed as pushed to an OCI layout) and per layer, what
#             the runtime image holds (no compiler, no nvcc, no TileLang, no tests / bytecode / pip cache), its
#             user, entrypoint, command and healthcheck.
# 4. run:     `buildah run --isolation chroot` (host network: loopback) of the image's ENTRYPOINT with
#             `--backend reference --host 127.0.0.1 --port <free>`; ci/container_smoke_client.py checks /health,
#             /ready, a JSON and a safetensors prefill against a direct flash_qla call made on this host, and
#             /metrics; the image's own HEALTHCHECK command runs inside the container; the server's uid must be
#             the image's non-root user. Then the kernels backend (the image's default CMD, on a free port) must
#             start and answer /ready 503 no_gpu on a host without a GPU.
# Everything it makes lives under $WORK (its own buildah storage root) and is removed on exit, unless
# KEEP_WORK=1. EXPORT_DIR=<dir> first copies there the runtime image's wheel layer (the layer of the step that
# installs the project wheel: flash_qla, server and the service's Python dependencies, no torch) as a gzip tar,
# for starting the service on a GPU machine whose own torch is used. Prints a summary; exit status 0 only if
# every check passed.
set -euo pipefail
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${WORK:-/tmp/flash_qla_container}"
SUITE="${DEBIAN_SUITE:-bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
TORCH_WHEEL_DIR="${TORCH_WHEEL_DIR:-/opt/wheels}"
HOST_PY="${PYTHON:-python3}"
BASE_IMAGE="localhost/flash-qla-base:$SUITE"
BUILDER_IMAGE="localhost/flash-qla-serve:builder"
RUNTIME_IMAGE="localhost/flash-qla-serve:local"
T0=$SECONDS
SUMMARY=()
CTR=""
SERVER_PIDS=()

step() { printf '\n== [%4ss] %s\n' "$((SECONDS - T0))" "$*"; }
note() { SUMMARY+=("$*"); echo "$*"; }
fail() { echo "CONTAINER SMOKE FAILED: $*" >&2; exit 1; }
B() { buildah --root "$WORK/storage" --runroot "$WORK/run" --storage-driver overlay "$@"; }

case "$WORK" in /tmp/?*) ;; *) fail "WORK must be a folder under /tmp (it is deleted): $WORK";; esac
[ "$(id -u)" -eq 0 ] || fail "run as root (debootstrap and buildah's chroot isolation need it)"
for tool in buildah debootstrap git; do command -v "$tool" >/dev/null || fail "$tool is not installed"; done

# The python process serving on a port, found by its command line (buildah run's child chroots, then execs it).
server_pid_on() {
  local port="$1" pid cmd
  for pid in $(ls /proc | grep -E '^[0-9]+$'); do
    cmd="$(tr '\0' ' ' 2>/dev/null < "/proc/$pid/cmdline")" || continue
    case "${cmd%% *}" in python*|*/python*) ;; *) continue;; esac   # argv[0] (not buildah-chroot-exec's)
    case "$cmd" in *" -m server "*"--port $port "*) echo "$pid"; return 0;; esac
  done
  return 1
}

stop_server() {  # $1 = buildah run's pid, $2 = port
  local runner="$1" port="$2" pid
  pid="$(server_pid_on "$port" || true)"
  if [ -n "$pid" ]; then kill -TERM "$pid" 2>/dev/null || true; fi
  for _ in $(seq 1 40); do kill -0 "$runner" 2>/dev/null || break; sleep 0.5; done
  if kill -0 "$runner" 2>/dev/null; then
    echo "server did not stop within 20 s of SIGTERM: SIGKILL"
    pid="$(server_pid_on "$port" || true)"
    [ -z "$pid" ] || kill -KILL "$pid" 2>/dev/null || true
    kill -KILL "$runner" 2>/dev/null || true
  fi
  wait "$runner" 2>/dev/null || true
}

cleanup() {
  local status=$?
  set +e  # every step of the clean-up runs, whatever failed before
  for entry in "${SERVER_PIDS[@]}"; do stop_server "${entry%%:*}" "${entry##*:}"; done
  if [ "${KEEP_WORK:-0}" = 1 ]; then echo "KEEP_WORK=1: $WORK kept"; return; fi
  if [ -d "$WORK/storage" ]; then
    B rm --all >/dev/null 2>&1 || true
    B rmi --all --force >/dev/null 2>&1 || true
  fi
  # Anything still mounted under $WORK (an interrupted build) goes before the tree is removed.
  findmnt -rn -o TARGET | grep -E "^$WORK(/|$)" | sort -r | while read -r m; do umount -l "$m" || true; done
  rm -rf --one-file-system "$WORK"
  [ ! -e "$WORK" ] && echo "cleaned up: $WORK removed" || echo "WARNING: $WORK could not be removed fully"
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

rm -rf --one-file-system "$WORK"
mkdir -p "$WORK"
note "host: $(uname -m), $(nproc) cores, buildah $(buildah --version | awk '{print $3}'), debootstrap $(debootstrap --version | awk '{print $2}')"

# ---------------------------------------------------------------------------------------------------------------
step "base: debootstrap $SUITE (minbase) + python3, pip"
t=$SECONDS
ROOTFS="$WORK/rootfs"
debootstrap --variant=minbase --include=python3,python3-pip,python-is-python3,ca-certificates \
  "$SUITE" "$ROOTFS" "$MIRROR" > "$WORK/debootstrap.log" 2>&1 || { tail -n 20 "$WORK/debootstrap.log"; fail "debootstrap"; }
# What python:*-slim gives: apt sources with updates and security, pip allowed to install system-wide (the
# image is the environment), no apt lists / caches, no docs or man pages (also for packages installed later).
cat > "$ROOTFS/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb http://deb.debian.org/debian-security $SUITE-security main
EOF
cat > "$ROOTFS/etc/dpkg/dpkg.cfg.d/excludes" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
EOF
rm -f "$ROOTFS"/usr/lib/python3*/EXTERNALLY-MANAGED
# Like python:*-slim, no bytecode in the base (Debian byte-compiles its Python packages on install).
find "$ROOTFS/usr" -depth -type d -name __pycache__ -exec rm -rf {} +
# This host's own CAs (e.g. of an HTTPS proxy between it and PyPI): the build's pip must trust what it trusts.
# They are part of this local base only; the official python:*-slim base has Debian's CAs alone.
host_cas=(/usr/local/share/ca-certificates/*.crt)
if [ -e "${host_cas[0]}" ]; then
  cp "${host_cas[@]}" "$ROOTFS/usr/local/share/ca-certificates/"
  chroot "$ROOTFS" update-ca-certificates > /dev/null 2>&1
  note "base trusts this host's ${#host_cas[@]} local CA(s) from /usr/local/share/ca-certificates"
fi
find "$ROOTFS/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
rm -rf "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* "$ROOTFS"/var/lib/apt/lists/* \
       "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/log/*.log \
       "$ROOTFS"/var/log/apt/* "$ROOTFS"/dev/* "$ROOTFS"/proc/* "$ROOTFS"/sys/*
base_py="$(chroot "$ROOTFS" python --version 2>&1)"; base_pip="$(chroot "$ROOTFS" python -m pip --version | awk '{print $2}')"
tar -C "$ROOTFS" --numeric-owner -cf "$WORK/base.tar" .
rm -rf --one-file-system "$ROOTFS"
ctr="$(B from scratch)"
B add --quiet "$ctr" "$WORK/base.tar" / >/dev/null
B config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --env LANG=C.UTF-8 \
  --cmd python --os linux --arch "$(B info --format '{{.host.arch}}')" "$ctr"
B commit --quiet --format docker --rm "$ctr" "$BASE_IMAGE" >/dev/null
rm -f "$WORK/base.tar"
note "base image $BASE_IMAGE: debootstrap $SUITE minbase, $base_py, pip $base_pip ($((SECONDS - t)) s)"

# ---------------------------------------------------------------------------------------------------------------
step "build context: a clean clone of HEAD (only committed files; .dockerignore applies on top)"
git clone --quiet --no-hardlinks "$REPO" "$WORK/src"
commit="$(git -C "$WORK/src" log -1 --format=%h)"
note "source: commit $commit"

BUILD_ARGS=(--build-arg "PYTHON_IMAGE=$BASE_IMAGE")
torch_wheel="$(ls "$TORCH_WHEEL_DIR"/torch-*+cpu-*.whl 2>/dev/null | head -n 1 || true)"
if [ -n "$torch_wheel" ]; then
  torch_version="$(basename "$torch_wheel" | cut -d- -f2)"
  BUILD_ARGS+=(--build-arg "TORCH_SPEC=torch==$torch_version" --build-arg "TORCH_FIND_LINKS=/wheels"
               --volume "$TORCH_WHEEL_DIR:/wheels:ro")
  note "torch: $(basename "$torch_wheel") from $TORCH_WHEEL_DIR (CPU build; mounted into the build, not copied)"
else
  note "torch: the Dockerfile's default TORCH_SPEC from PyPI"
fi
BUD=(B bud --isolation chroot --format docker --layers --pull=never "${BUILD_ARGS[@]}" -f "$WORK/src/Dockerfile")

step "buildah bud --target builder"
t=$SECONDS
"${BUD[@]}" --target builder -t "$BUILDER_IMAGE" "$WORK/src" > "$WORK/build_builder.log" 2>&1 \
  || { tail -n 30 "$WORK/build_builder.log"; fail "builder stage"; }
grep -E '^(\[[0-9]+/[0-9]+\] )?(STEP|COMMIT)' "$WORK/build_builder.log" | cut -c1-160 || true
note "builder stage built in $((SECONDS - t)) s: $(grep -E '^/dist/flash_qla_aot' "$WORK/build_builder.log" | sed 's#^/dist/##')"

step "buildah bud (runtime, the default target)"
t=$SECONDS
"${BUD[@]}" -t "$RUNTIME_IMAGE" "$WORK/src" > "$WORK/build_runtime.log" 2>&1 \
  || { tail -n 30 "$WORK/build_runtime.log"; fail "runtime stage"; }
grep -E '^(\[[0-9]+/[0-9]+\] )?(STEP|COMMIT)' "$WORK/build_runtime.log" | cut -c1-160 || true
note "runtime stage built in $((SECONDS - t)) s (builder layers reused from the cache)"

# ---------------------------------------------------------------------------------------------------------------
step "image facts"
mkdir -p "$WORK/oci"
for tag in base builder runtime; do
  case "$tag" in base) img="$BASE_IMAGE";; builder) img="$BUILDER_IMAGE";; runtime) img="$RUNTIME_IMAGE";; esac
  B push --quiet --compression-format gzip "$img" "oci:$WORK/oci:$tag" >/dev/null
done
B inspect --type image "$RUNTIME_IMAGE" \
  | "$HOST_PY" -c 'import json, sys; json.dump(json.load(sys.stdin)["Docker"]["config"], sys.stdout)' > "$WORK/runtime_config.json"
"$HOST_PY" "$REPO/ci/image_facts.py" "$WORK/oci" "$WORK/runtime_config.json" --tags base builder runtime \
  ${EXPORT_DIR:+--export-wheel-layer "$EXPORT_DIR/runtime_wheel_layer.tar.gz"} | tee "$WORK/facts.txt"
while IFS= read -r line; do SUMMARY+=("$line"); done < "$WORK/facts.txt"
rm -rf "$WORK/oci"

CTR="$(B from --quiet --pull=never --name flash-qla-smoke "$RUNTIME_IMAGE")"
RUN=(B run --isolation chroot "$CTR" --)
step "what the runtime image holds"
"${RUN[@]}" sh -c '
  set -eu
  site="$(python -c "import sysconfig; print(sysconfig.get_paths()[\"purelib\"])")"
  found=""; for t in gcc cc c++ g++ clang nvcc ptxas ld as make cmake; do command -v "$t" >/dev/null && found="$found $t"; done
  echo "compilers/toolchain on PATH: ${found:-none} (checked gcc cc c++ g++ clang nvcc ptxas ld as make cmake)"
  python -c "import tilelang" 2>/dev/null && echo "tilelang: IMPORTABLE" || echo "tilelang: not importable"
  echo "user: $(id -un) uid=$(id -u) gid=$(id -g); python: $(python --version 2>&1); site-packages: $site"
  echo "torch/include: $([ -e "$site/torch/include" ] && echo present || echo absent); tests dirs: $(find "$site" -type d -name tests | wc -l); __pycache__ dirs: $(find / -xdev -type d -name __pycache__ 2>/dev/null | wc -l); pip cache: $(du -sh /root/.cache/pip 2>/dev/null | cut -f1 || true)$([ -e /root/.cache/pip ] || echo none)"
  python -c "import torch, flash_qla, server; print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"| flash_qla\", flash_qla.__version__, \"| kernels in the manifest:\", len(__import__(\"json\").load(open(flash_qla.__path__[0] + \"/_kernels/sm90a/manifest.json\"))[\"kernels\"]))"
  echo "largest in site-packages: $(du -sm "$site"/* | sort -rn | head -n 6 | awk "{printf \"%s %s MB; \", \$2, \$1}" | sed -e "s#$site/##g" -e "s/; \$//")"
' 2>&1 | tee "$WORK/contents.txt"
grep -q '^compilers/toolchain on PATH: none' "$WORK/contents.txt" || fail "a compiler or toolchain is in the runtime image"
grep -q '^tilelang: not importable' "$WORK/contents.txt" || fail "TileLang is importable in the runtime image"
while IFS= read -r line; do SUMMARY+=("runtime image: $line"); done < "$WORK/contents.txt"

free_port() { "$HOST_PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'; }
mapfile -t ENTRYPOINT < <("$HOST_PY" -c 'import json, sys; [print(a) for a in json.load(open(sys.argv[1]))["Entrypoint"]]' "$WORK/runtime_config.json")

# ---------------------------------------------------------------------------------------------------------------
PORT="$(free_port)"
step "run: ${ENTRYPOINT[*]} --backend reference --host 127.0.0.1 --port $PORT (buildah run --isolation chroot)"
"${RUN[@]}" "${ENTRYPOINT[@]}" --backend reference --host 127.0.0.1 --port "$PORT" > "$WORK/server_reference.log" 2>&1 &
RUNNER=$!
SERVER_PIDS+=("$RUNNER:$PORT")
"$HOST_PY" "$REPO/ci/container_smoke_client.py" --url "http://127.0.0.1:$PORT" --expect-ready \
  --expect-backend reference --tol 1e-5 --pid "$RUNNER" | tee "$WORK/client_reference.txt" \
  || { tail -n 30 "$WORK/server_reference.log"; fail "the reference-backend checks"; }
spid="$(server_pid_on "$PORT")" || fail "no server process found for port $PORT"
suid="$(awk '/^Uid:/ {print $2}' "/proc/$spid/status")"
note "server process $spid runs as uid $suid (image USER $("$HOST_PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["User"])' "$WORK/runtime_config.json"))"
[ "$suid" != 0 ] || fail "the server runs as root"
hc="$("$HOST_PY" -c 'import json, sys; print(json.dumps(json.load(open(sys.argv[1]))["Healthcheck"]["Test"]))' "$WORK/runtime_config.json")"
mapfile -t HC < <("$HOST_PY" -c 'import json, sys; t = json.loads(sys.argv[1]); assert t[0] == "CMD", t; [print(a.replace(":8000/", ":" + sys.argv[2] + "/")) for a in t[1:]]' "$hc" "$PORT")
if "${RUN[@]}" "${HC[@]}"; then note "the image's HEALTHCHECK command, run in the container (port $PORT): exit 0"; else fail "HEALTHCHECK exited non-zero"; fi
grep -v '^SUMMARY' "$WORK/client_reference.txt" | sed 's/^/reference backend: /' > "$WORK/client_lines.txt"
while IFS= read -r line; do SUMMARY+=("$line"); done < "$WORK/client_lines.txt"
stop_server "$RUNNER" "$PORT"; SERVER_PIDS=()
note "reference server stopped by SIGTERM: $(grep -c 'Finished server process' "$WORK/server_reference.log" || true) clean uvicorn shutdown"

PORT="$(free_port)"
step "run: the default backend (kernels) without a GPU must answer /ready 503 no_gpu (port $PORT)"
"${RUN[@]}" "${ENTRYPOINT[@]}" --backend kernels --host 127.0.0.1 --port "$PORT" > "$WORK/server_kernels.log" 2>&1 &
RUNNER=$!
SERVER_PIDS+=("$RUNNER:$PORT")
"$HOST_PY" "$REPO/ci/container_smoke_client.py" --url "http://127.0.0.1:$PORT" --expect-reason no_gpu \
  --expect-backend kernels --pid "$RUNNER" | tee "$WORK/client_kernels.txt" \
  || { tail -n 30 "$WORK/server_kernels.log"; fail "the kernels-backend start without a GPU"; }
SUMMARY+=("kernels backend, no GPU: $(grep '^/ready' "$WORK/client_kernels.txt")")
stop_server "$RUNNER" "$PORT"; SERVER_PIDS=()

B rm "$CTR" >/dev/null; CTR=""
step "OK"
echo
echo "==================== container smoke summary ($((SECONDS - T0)) s) ===================="
printf '%s\n' "${SUMMARY[@]}"
echo "total: $((SECONDS - T0)) s"
