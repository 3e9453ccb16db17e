"""gdn_bwd_chunk's V-loop products issued by hand: the five wgmmas of a V block (dO S^T, dW S^T, Vnew dS'^T into the
C x K accumulators, dO Vnew^T and X W^T into the C x C ones) from shared-memory descriptors made once a call.

TileLang's T.wgmma_gemm builds each operand's descriptor from the tile's address at every product and adds the
warpgroup's offset into B from threadIdx.x, which ptxas cannot prove uniform: ~12 instructions an HGMMA (4 of them
R2UR), ~500 of the ~3200 a warp issues a v-head. Here the warpgroup index comes through a shuffle from lane 0 (uniform
for ptxas), and a block's eight descriptors are made once.

Operands, as TileLang lays them out for these tiles (make_swizzled_layout on the [2, 64, BV] buffers, BV = 32): K-major
rows of 64 bytes under the 64-byte swizzle, a descriptor's fields start address >> 4, leading byte offset 1, stride
byte offset 32 (512 bytes, eight rows), layout type 2 (TileLang's initialize_wgmma_descriptor<2, 1, 32>). A k16 step is
32 bytes (descriptor + 2). Each warpgroup computes its N / 2 columns of every product: B's rows from g N / 2 on, an
offset of g N / 2 x 64 bytes.
  fqla_vloop_mma_<dt>_n<NQ>(do, dw, vn, x, h, dh, w, dq, dk, ds, dp, da)   (NQ = K / 2, the C x K products' N a
      warpgroup; the C x C products' is 32): the tiles at buffer b (each tile's first element), the accumulators in
      TileLang's fragment order (operand i = element i). One wgmma.fence, the ten wgmmas in the order T.wgmma_gemm
      issued them (product by product, k steps in order: the sums are the same), one commit group; the caller waits.
"""

TYPES = {"bf16": "bf16", "fp16": "f16"}


def _wgmma(dt: str, n: int) -> str:
    """fqla_wgmma_<dt>_n<n>(d, a, b): d (n / 2 floats a thread) += A B for descriptors a, b (m64 n k16, accumulate)."""
    acc = n // 2
    regs = ", ".join(f"%{i}" for i in range(acc))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(acc))
    ty = TYPES[dt]
    return (f"__device__ __forceinline__ void fqla_wgmma_{dt}_n{n}(float* d, unsigned long long a, "
            f"unsigned long long b) {{\n"
            f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, 1, 0;\\n"\n'
            f'               "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ty}.{ty} {{{regs}}}, %{acc}, '
            f'%{acc + 1}, p, 1, 1, 0, 0;\\n}}\\n"\n'
            f'               : {outs} : "l"(a), "l"(b));\n'
            f"}}\n")


def _products(dt: str, nq: int) -> str:
    return f"""__device__ __forceinline__ void fqla_vloop_mma_{dt}_n{nq}(const void* do_t, const void* dw_t,
    const void* vn_t, const void* x_t, const void* h_t, const void* dh_t, const void* w_t, float* dq, float* dk,
    float* ds, float* dp, float* da) {{
  const unsigned g = __shfl_sync(0xffffffffu, threadIdx.x >> 7, 0);
  const unsigned long long a_do = fqla_desc64(do_t), a_dw = fqla_desc64(dw_t), a_vn = fqla_desc64(vn_t),
                           a_x = fqla_desc64(x_t);
  const unsigned long long b_h = fqla_desc64(h_t) + g * {nq * 64 // 16}, b_dh = fqla_desc64(dh_t) + g * {nq * 64 // 16},
                           b_vn = fqla_desc64(vn_t) + g * {32 * 64 // 16}, b_w = fqla_desc64(w_t) + g * {32 * 64 // 16};
  asm volatile("wgmma.fence.sync.aligned;\\n" ::: "memory");
#pragma unroll
  for (int k = 0; k < 2; ++k) fqla_wgmma_{dt}_n{nq}(dq, a_do + 2 * k, b_h + 2 * k);
#pragma unroll
  for (int k = 0; k < 2; ++k) fqla_wgmma_{dt}_n{nq}(dk, a_dw + 2 * k, b_h + 2 * k);
#pragma unroll
  for (int k = 0; k < 2; ++k) fqla_wgmma_{dt}_n{nq}(ds, a_vn + 2 * k, b_dh + 2 * k);
#pragma unroll
  for (int k = 0; k < 2; ++k) fqla_wgmma_{dt}_n32(dp, a_do + 2 * k, b_vn + 2 * k);
#pragma unroll
  for (int k = 0; k < 2; ++k) fqla_wgmma_{dt}_n32(da, a_x + 2 * k, b_w + 2 * k);
  asm volatile("wgmma.commit_group.sync.aligned;\\n" ::: "memory");
}}
"""


PRELUDE = r"""
// a K-major tile of 64-byte rows under the 64-byte swizzle: TileLang's initialize_wgmma_descriptor<2, 1, 32>
__device__ __forceinline__ unsigned long long fqla_desc64(const void* p) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  return static_cast<unsigned long long>(((s >> 4) & 0x3FFFu) | (1u << 16)) | (32ull << 32) | (2ull << 62);
}
""" + "".join(_wgmma(dt, n) for dt in TYPES for n in (32, 64)) + "".join(
    _products(dt, nq) for dt in TYPES for nq in (32, 64))
