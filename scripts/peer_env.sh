#!/bin/bash
# On the GPU machine: unpack the staged peers bundle and its compile caches (as run_peers.sh does) and run
# a command in that environment.  usage: bash scripts/peer_env.sh PEERS_DIR {qla|fla} CMD...
set -uo pipefail
B=$1; LIB=$2; shift 2
mkdir -p /tmp/peersite /tmp/peercache
[ -f /tmp/peersite/.ok ] || { tar -xJf "$B/peers-site.tar.xz" -C /tmp/peersite && touch /tmp/peersite/.ok; }
if ls "$B"/cache-$LIB.tar.xz.* >/dev/null 2>&1; then cat "$B"/cache-$LIB.tar.xz.* | tar -xJf - -C /tmp/peercache; fi
export PYTHONPATH=/tmp/peersite${PYTHONPATH:+:$PYTHONPATH}
export TILELANG_CACHE_DIR=/tmp/peercache/tilelang TRITON_CACHE_DIR=/tmp/peercache/triton
[ -d /usr/local/cuda ] && export CUDA_HOME=/usr/local/cuda
"$@"
