"""16 x 16 blocks of 16-bit shared-memory tiles as mma.sync m16n8k16 operands: the per-lane ldmatrix / stmatrix
addresses (pure Python, so CPU tests check them) and the C helpers of inverse_mma.py's block products.

Per-lane addresses (lane l of a warp; a 16 x 16 block at row R, column C of a row-major tile):
  block_rows(l, R, C)  (R + 8 (l / 8 % 2) + l % 8, C + 8 (l / 16)): ldmatrix as an A operand, .trans as a B operand
                       ([k, n] storage), stmatrix of an accumulator
  block_cols(l, R, C)  (R + 8 (l / 16) + l % 8, C + 8 (l / 8 % 2)): ldmatrix as a B operand of its transpose ([n, k]
                       storage), .trans as an A operand of its transpose
"""

# after fragment_io.PRELUDE (its fqla_pack_* and fqla_ldsm4* helpers). Accumulators: 8 floats, an m16n8 tile's c0..c3
# then the next tile's (columns + 8)
PRELUDE = r"""
#define FQLA_INV(SUF, TY, PACK) \
__device__ __forceinline__ void fqla_mma16_##SUF(float* d, const unsigned* a, const unsigned* b) { \
  _Pragma("unroll") for (int n = 0; n < 2; ++n) \
    asm("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, " \
        "{%0, %1, %2, %3};" : "+f"(d[4 * n]), "+f"(d[4 * n + 1]), "+f"(d[4 * n + 2]), "+f"(d[4 * n + 3]) \
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[2 * n]), "r"(b[2 * n + 1])); \
} \
/* y += op(block at pa) (block at pb, its block_cols address)^T: op the block itself (its block_rows address) or, ta, \
   its transpose (its block_cols address) */ \
__device__ __forceinline__ void fqla_inv_abt_##SUF(float* y, const void* pa, const void* pb, int ta) { \
  unsigned a[4], b[4]; \
  if (ta) fqla_ldsm4_t(pa, a); else fqla_ldsm4(pa, a); \
  fqla_ldsm4(pb, b); \
  fqla_mma16_##SUF(y, a, b); \
} \
/* y += (block at pa, its block_rows address) X, X given by its transpose's accumulator xt */ \
__device__ __forceinline__ void fqla_inv_y_##SUF(float* y, const void* pa, const float* xt) { \
  unsigned a[4], b[4]; \
  fqla_ldsm4(pa, a); \
  b[0] = PACK(xt[0], xt[1]); b[1] = PACK(xt[4], xt[5]); b[2] = PACK(xt[2], xt[3]); b[3] = PACK(xt[6], xt[7]); \
  fqla_mma16_##SUF(y, a, b); \
} \
/* the block at p (its block_rows address) = -y, rounded */ \
__device__ __forceinline__ void fqla_inv_store_neg_##SUF(void* p, const float* y) { \
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p)); \
  asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};" :: "r"(s), \
               "r"(PACK(-y[0], -y[1])), "r"(PACK(-y[2], -y[3])), "r"(PACK(-y[4], -y[5])), "r"(PACK(-y[6], -y[7])) \
               : "memory"); \
}
FQLA_INV(bf16, "bf16", fqla_pack_bf16)
FQLA_INV(fp16, "f16", fqla_pack_fp16)
// diagonal block w of a wgmma accumulator (its elements 8 w .. 8 w + 7) in fp32 at p = &tile[16 w + l / 4,
// 16 w + 2 (l % 4)], rows of `row` floats (a layout whose 8-row and 8-column steps are plain offsets)
#define FQLA_DIAG_ST(W) { const float* x = a + 8 * (W); \
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" :: "r"(s), "f"(x[0]), "f"(x[1]) : "memory"); \
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" :: "r"(s + 32u * row), "f"(x[2]), "f"(x[3]) : "memory"); \
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" :: "r"(s + 32u), "f"(x[4]), "f"(x[5]) : "memory"); \
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" :: "r"(s + 32u * row + 32u), "f"(x[6]), "f"(x[7]) : "memory"); }
__device__ __forceinline__ void fqla_diag_store(void* p, const float* a, int w, unsigned row) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  switch (w) {
    case 0: FQLA_DIAG_ST(0) break;
    case 1: FQLA_DIAG_ST(1) break;
    case 2: FQLA_DIAG_ST(2) break;
    default: FQLA_DIAG_ST(3) break;
  }
}
"""


def block_rows(lane, row, col):
    return row + lane // 8 % 2 * 8 + lane % 8, col + lane // 16 * 8


def block_cols(lane, row, col):
    return row + lane // 16 * 8 + lane % 8, col + lane // 8 % 2 * 8


