"""gdn_bwd_chunk's C x C element-wise epilogue passes as C helpers on a thread's 64 x 64 wgmma accumulators: the
factors a thread's elements share (two rows, four columns a call) loaded once into registers, the 16-bit tiles read by
ldmatrix and written by stmatrix. As T.Parallel loops, nvcc reloaded every row and column factor from shared memory
at each element (the stores to other shared buffers between them may alias for it) and stored the tiles two bytes at
a time: 27 instructions an element in the gate pass.

Layout (fragment_sums.py's, each warpgroup holding its own 32 columns): element 4 j + 2 h + e of thread t (lane l,
warp w = t % 128 / 32 of warpgroup g = t / 128) is row 16 w + 8 h + l / 4, column 32 g + 8 j + 2 (l % 4) + e. A call
covers the thread's 8-column blocks 2 jj and 2 jj + 1 (elements 8 jj .. 8 jj + 7, jj < 2): the 16 x 16 tile block at
block_fragments.block_rows(l, 16 w, 32 g + 16 jj), whose per-lane address the caller passes for each tile (ldmatrix /
stmatrix .x4: register q holds elements 8 jj + 2 q and 8 jj + 2 q + 1).
  fqla_gate_pass_<dt>(pa, pm, pt, dP, dA, cc, gam, b, dd, jj, valid, scale)
      with G = exp2((gam_row - gam_col) log2 e) where row >= col and row < valid (else 0): the tile at pm = scale G dP;
      cc = (scale G dP) cc below the diagonal, else 0; the tile at pt = G dA b_col; dP = G dA A below the diagonal,
      else 0 (A from the tile at pa), its diagonal into dd[row]
  fqla_dl_pass_<dt>(pt, dP, cc, b, jj, valid)
      dP = -dP strictly below the diagonal on valid rows, else 0; cc *= dP; the tile at pt = dP b_row
The arithmetic is the replaced loops', element by element (the outputs are bit-identical). The C x K state-terms pass
stays a T.Parallel loop: nvcc keeps its row factors in registers there already, and as a helper (q / k by ldmatrix) it
spilled 56 bytes.
"""

LOG2E = 1.4426950408889634  # gdn_bwd_chunk.py's too (its per-row factors): one value for both

# after fragment_io.PRELUDE (fqla_bf16_lo / _hi, fqla_fp16_lo / _hi, fqla_ldsm4, fqla_stsm_*: a call's eight elements are
# its stmatrix block j = 0)
PRELUDE = f"#define FQLA_LOG2E {LOG2E!r}f" + r"""
__device__ __forceinline__ float fqla_ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
#define FQLA_CHUNK_PASSES(SUF, LO, HI) \
__device__ __forceinline__ void fqla_gate_pass_##SUF(const void* pa, void* pm, void* pt, float* dP, const float* dA, \
    float* cc, const float* gam, const float* b, float* dd, int jj, int valid, float scale) { \
  const int t = threadIdx.x, lane = t & 31, r0 = 16 * ((t & 127) >> 5) + (lane >> 2); \
  const int c0 = 32 * (t >> 7) + 16 * jj + 2 * (lane & 3); \
  const float gr[2] = {gam[r0], gam[r0 + 8]}; \
  const float gc[4] = {gam[c0], gam[c0 + 1], gam[c0 + 8], gam[c0 + 9]}; \
  const float bc[4] = {b[c0], b[c0 + 1], b[c0 + 8], b[c0 + 9]}; \
  unsigned a[4]; \
  float mv[8], tv[8]; /* the tiles' values in the call's element order, for fragment_io's stmatrix store */ \
  fqla_ldsm4(pa, a); \
  _Pragma("unroll") for (int q = 0; q < 4; ++q) { \
    const int row = r0 + 8 * (q & 1); \
    _Pragma("unroll") for (int e = 0; e < 2; ++e) { \
      const int i = 8 * jj + 2 * q + e, cj = 2 * (q >> 1) + e, col = c0 + 8 * (q >> 1) + e; \
      const float gm = (row >= col && row < valid) ? fqla_ex2((gr[q & 1] - gc[cj]) * FQLA_LOG2E) : 0.f; \
      const float dps = dP[i] * gm * scale; \
      mv[2 * q + e] = dps; \
      cc[i] = row > col ? dps * cc[i] : 0.f; \
      const float da = dA[i] * gm; \
      tv[2 * q + e] = da * bc[cj]; \
      const float ga = da * (e ? HI(a[q]) : LO(a[q])); \
      if (row == col) dd[row] = ga; \
      dP[i] = row > col ? ga : 0.f; \
    } \
  } \
  fqla_stsm_##SUF(pm, mv, 0); \
  fqla_stsm_##SUF(pt, tv, 0); \
} \
__device__ __forceinline__ void fqla_dl_pass_##SUF(void* pt, float* dP, float* cc, const float* b, int jj, int valid) { \
  const int t = threadIdx.x, lane = t & 31, r0 = 16 * ((t & 127) >> 5) + (lane >> 2); \
  const int c0 = 32 * (t >> 7) + 16 * jj + 2 * (lane & 3); \
  const float br[2] = {b[r0], b[r0 + 8]}; \
  float tv[8]; \
  _Pragma("unroll") for (int q = 0; q < 4; ++q) { \
    const int row = r0 + 8 * (q & 1); \
    _Pragma("unroll") for (int e = 0; e < 2; ++e) { \
      const int i = 8 * jj + 2 * q + e, col = c0 + 8 * (q >> 1) + e; \
      const float v = (row > col && row < valid) ? -dP[i] : 0.f; \
      dP[i] = v; \
      cc[i] = v * cc[i]; \
      tv[2 * q + e] = v * br[q & 1]; \
    } \
  } \
  fqla_stsm_##SUF(pt, tv, 0); \
}
FQLA_CHUNK_PASSES(bf16, fqla_bf16_lo, fqla_bf16_hi)
FQLA_CHUNK_PASSES(fp16, fqla_fp16_lo, fqla_fp16_hi)
"""


def block_origin(warp: int, group: int, nj: int, jj: int):
    """(row, column) of the 16 x 16 tile block a call covers for warp `warp` (within its warpgroup) of warpgroup
    `group`, the thread's accumulator holding nj 8-column blocks (4 here): block_fragments.block_rows's R and C."""
    return 16 * warp, group * (8 * nj) + 16 * jj


def call_elements(t: int, nj: int, jj: int):
    """[(element index, row, column)] of thread t's elements one call covers, in the helpers' order (q, then e)."""
    lane, w, g = t % 32, t % 128 // 32, t // 128
    r0, c0 = 16 * w + lane // 4, g * 8 * nj + 16 * jj + 2 * (lane % 4)
    return [(8 * jj + 2 * q + e, r0 + 8 * (q & 1), c0 + 8 * (q >> 1) + e) for q in range(4) for e in range(2)]
