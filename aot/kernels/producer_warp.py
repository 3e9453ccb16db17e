"""Warp-specialised chain kernels: only the producer warpgroup's first warp may run the producer loop.

TileLang's warp specialisation (T.Pipelined) gives the producer a whole warpgroup: all four warps walk the loop and
wait on every stage's "empty" mbarrier by phase parity, but only the elected lane of warp 0 issues the TMA loads.
Warps 1-3 take no part in any barrier's progress, so nothing keeps them in step: once one of them falls two phases
behind on a barrier, the parity it waits for is the barrier's current one again, and when the consumers and warp 0
have finished, it waits forever and its CTA never exits. This is the backward's hang (H200, cuda-gdb on a held
stall: only threads 32-127 of one gdn_bwd_recompute save-build CTA alive, all in the try-wait loop on the k stage's empty
barrier). It needs those warps to be starved for two phases,
which happened when another CTA shared the SM.

The fix: the producer branch returns at once for warps 1-3. It is applied to TileLang's generated CUDA through its
post-processing hook, only for the kernels that register here, and only when the branch has exactly the expected
shape (the producer branch is `threadIdx.x < 128`, its loads are TMA issued by the elected lane, and it has no CTA
barrier or per-thread copy that would need warps 1-3): anything else fails the build. A register release
(setmaxnreg, `.sync.aligned`: the whole warpgroup must execute it) may open the branch; the return goes after it.
"""
import re

PRODUCER_BRANCH = "  if (((int)threadIdx.x) < 128) {\n"
REGISTER_RELEASE = re.compile(r"    tl::warpgroup_reg_dealloc<\d+>\(\);\n")
EARLY_RETURN = ("    if ((((int)threadIdx.x) >> 5) != 0) return;  // producer warps 1-3: no part in the loads, and a "
                "lagging parity wait could hang (aot/kernels/producer_warp.py)\n")
# statements warps 1-3 would have to take part in: they must not occur in the producer branch
NEEDS_ALL_WARPS = ("__syncthreads", "__sync_thread_partial", "bar.sync", "setmaxnreg", "warpgroup_reg", "cp_async",
                   "cp.async.ca", "cp.async.cg", "tl::copy")
_SYMBOLS = set()


def _producer_branch(code: str, start: int) -> str:
    """The text of the branch that opens at `start` (the line after PRODUCER_BRANCH), up to its closing brace."""
    depth, i = 1, start
    while depth:
        nxt = re.search(r"[{}]", code[i:])
        if nxt is None:
            raise RuntimeError("producer branch: unbalanced braces")
        i += nxt.end()
        depth += 1 if nxt.group() == "{" else -1
    return code[start:i]


def single_warp_producer(code: str, symbol: str) -> str:
    """`code` with kernel `symbol`'s producer branch returning for warps 1-3 (unchanged if `symbol` is absent)."""
    if f" {symbol}(" not in code:
        return code
    if code.count(PRODUCER_BRANCH) != 1:
        raise RuntimeError(f"{symbol}: expected one producer branch `threadIdx.x < 128`, found "
                           f"{code.count(PRODUCER_BRANCH)}")
    start = code.index(PRODUCER_BRANCH) + len(PRODUCER_BRANCH)
    release = REGISTER_RELEASE.match(code, start)
    if release:
        start = release.end()
    body = _producer_branch(code, start)
    bad = [s for s in NEEDS_ALL_WARPS if s in body]
    if bad or "tl::tl_shuffle_elect<128>()" not in body or "tma_load" not in body:
        raise RuntimeError(f"{symbol}: the producer branch is not loads by the elected lane only ({bad or 'no TMA'})")
    return code[:start] + EARLY_RETURN + code[start:]


def _postproc(code: str, target) -> str:
    for symbol in sorted(_SYMBOLS):
        code = single_warp_producer(code, symbol)
    return code


def register(symbol: str) -> None:
    """Apply single_warp_producer to kernel `symbol` whenever TileLang generates CUDA in this process."""
    from tilelang.engine.callback import register_cuda_postproc  # here: the rewrite itself needs no TileLang

    _SYMBOLS.add(symbol)
    register_cuda_postproc(_postproc)
