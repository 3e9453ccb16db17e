"""The producer-warp rewrite of TileLang's generated CUDA (aot/kernels/producer_warp.py), on CUDA text in the shape
TileLang 0.1.15 generates (CPU only: no TileLang needed)."""
import pytest

from aot.kernels.producer_warp import EARLY_RETURN, single_warp_producer

HEAD = """extern "C" __global__ void __launch_bounds__(384, 1) demo_kernel(int n) {
  tl::fence_barrier_init();
  __syncthreads();
  if (((int)threadIdx.x) < 128) {
"""
LOADS = """    for (int c = 0; c < n; ++c) {
      mbarrier[((c & 1) + 2)].wait((((c & 3) >> 1) ^ 1));
      if (tl::tl_shuffle_elect<128>()) {
        mbarrier[(c & 1)].arrive_and_expect_tx(16384);
        tl::tma_load(k_desc, mbarrier[(c & 1)], k_s, 0, c, 0);
      }
    }
"""
TAIL = """  } else {
    consume();
    tl::__sync_thread_partial(3, 256);
  }
}
"""


def test_warps_1_to_3_return_at_the_top_of_the_producer_branch():
    out = single_warp_producer(HEAD + LOADS + TAIL, "demo_kernel")
    assert out == HEAD + EARLY_RETURN + LOADS + TAIL


def test_the_return_follows_a_register_release():
    release = "    tl::warpgroup_reg_dealloc<24>();\n"
    out = single_warp_producer(HEAD + release + LOADS + TAIL, "demo_kernel")
    assert out == HEAD + release + EARLY_RETURN + LOADS + TAIL  # setmaxnreg needs the whole warpgroup


def test_other_kernels_are_left_alone():
    code = HEAD + LOADS + TAIL
    assert single_warp_producer(code, "other_kernel") is code


@pytest.mark.parametrize("needs_all_warps", ["    __syncthreads();\n", "    tl::cp_async_gs<16>(a, b);\n",
                                             "    tl::__sync_thread_partial(1, 128);\n"])
def test_a_producer_that_needs_all_its_warps_fails_the_build(needs_all_warps):
    body = LOADS + needs_all_warps
    with pytest.raises(RuntimeError, match="demo_kernel"):
        single_warp_producer(HEAD + body + TAIL, "demo_kernel")


def test_a_producer_without_elected_tma_loads_fails_the_build():
    with pytest.raises(RuntimeError, match="no TMA"):
        single_warp_producer(HEAD + "    x = 1;\n" + TAIL, "demo_kernel")
