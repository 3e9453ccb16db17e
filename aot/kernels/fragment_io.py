"""Moving a thread's wgmma accumulator (fp32) to and from 16-bit tiles in shared memory, 8 x 8 blocks at a time, by
stmatrix / ldmatrix: one instruction a thread where element-wise 2-byte loads or stores took sixteen or thirty-two.

The C helpers (PRELUDE, passed to T.Kernel's prelude; it precedes the CUDA headers: inline PTX, no cuda_bf16 types)
take a fragment's storage (its `.data`), in the wgmma accumulator's order: element 4 j + 2 h + e of a thread (lane l
of warp w of its warpgroup) is row 16 w + 8 h + l / 4, column 8 j + 2 (l % 4) + e. Each call moves the thread's
elements 8 j .. 8 j + 7 (blocks 2 j and 2 j + 1 of 8 columns, both 8-row halves: four 8 x 8 matrices), and lane l
gives the shared address of row l % 8 of matrix l / 8 (16 contiguous bytes: any swizzle of 16-byte units keeps
them whole):
  fqla_stsm_<dtype>(p, acc, j)     the blocks rounded and stored as they are: p = &tile[16 w + 8 (l / 8 % 2) + l % 8,
                                   16 j + 8 (l / 16)]
  fqla_stsm_t_<dtype>(p, acc, j)   stored transposed (the tile holds the accumulator's columns as rows): p =
                                   &tile[16 j + 8 (l / 16) + l % 8, 16 w + 8 (l / 8 % 2)]
  fqla_wt_<dtype>(p, eg, kst, wt, j, lane)
                                   W^T = V^T - (K S)^T diag(eg), the gated delta rule's chain step: V^T's blocks read
                                   from the [token, column] tile v by ldmatrix .trans (p = &v[16 j + 8 (l / 16) + l % 8,
                                   16 w + 8 (l / 8 % 2)]), eg the chunk's per-token factors (64 floats, shared), kst
                                   the fp32 (K S)^T accumulator, wt the 16-bit W^T fragment it writes (same order)
  fqla_ldsm4(p, r) / fqla_ldsm4_t(p, r)
                                   one .x4 ldmatrix (.trans) into r[0..3] (block_fragments.py's block products too)
The addresses above are block_fragments.py's: block_rows(l, 16 w, 16 j) for fqla_stsm_*, block_cols(l, 16 j, 16 w)
for fqla_stsm_t_* and fqla_wt_* (row and column within the tile, before any offset of the tile's own).
"""


PRELUDE = r"""// two floats as a 16-bit pair, the first at the lower address
__device__ __forceinline__ unsigned fqla_pack_bf16(float a, float b) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
  return r;
}
__device__ __forceinline__ unsigned fqla_pack_fp16(float a, float b) {
  unsigned r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
  return r;
}
#define FQLA_STSM_T(NAME, PACK) \
__device__ __forceinline__ void NAME(void* p, const float* a, int j) { \
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p)); \
  asm volatile("stmatrix.sync.aligned.x4.trans.m8n8.shared.b16 [%0], {%1, %2, %3, %4};" :: "r"(s), \
               "r"(PACK(a[8 * j], a[8 * j + 1])), "r"(PACK(a[8 * j + 2], a[8 * j + 3])), \
               "r"(PACK(a[8 * j + 4], a[8 * j + 5])), "r"(PACK(a[8 * j + 6], a[8 * j + 7])) : "memory"); \
}
FQLA_STSM_T(fqla_stsm_t_bf16, fqla_pack_bf16)
FQLA_STSM_T(fqla_stsm_t_fp16, fqla_pack_fp16)
__device__ __forceinline__ float fqla_bf16_lo(unsigned r) { return __uint_as_float(r << 16); }
__device__ __forceinline__ float fqla_bf16_hi(unsigned r) { return __uint_as_float(r & 0xFFFF0000u); }
__device__ __forceinline__ float fqla_fp16_lo(unsigned r) {
  float f; unsigned short h = (unsigned short)(r & 0xFFFFu);
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ float fqla_fp16_hi(unsigned r) { return fqla_fp16_lo(r >> 16); }
__device__ __forceinline__ void fqla_ldsm4(const void* p, unsigned* r) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.x4.m8n8.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s) : "memory");
}
__device__ __forceinline__ void fqla_ldsm4_t(const void* p, unsigned* r) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.x4.trans.m8n8.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s) : "memory");
}
// W^T = V^T - eg K S^T for blocks 2 j, 2 j + 1 of 8 columns: V^T's four 8 x 8 blocks by one ldmatrix .trans (rows
// 8 j' + l % 8 of v_s, addressed per lane), eg for this thread's columns, kst / wt in the accumulator's order
#define FQLA_WT(NAME, LO, HI, PACK) \
__device__ __forceinline__ void NAME(void* p, const float* eg, const float* kst, void* wt, int j, int lane) { \
  unsigned r[4]; \
  fqla_ldsm4_t(p, r); \
  const int c = 16 * j + 2 * (lane % 4); \
  const float e0 = eg[c], e1 = eg[c + 1], e2 = eg[c + 8], e3 = eg[c + 9]; \
  const float* k = kst + 8 * j; \
  unsigned* w = static_cast<unsigned*>(wt) + 4 * j; \
  w[0] = PACK(LO(r[0]) - e0 * k[0], HI(r[0]) - e1 * k[1]); \
  w[1] = PACK(LO(r[1]) - e0 * k[2], HI(r[1]) - e1 * k[3]); \
  w[2] = PACK(LO(r[2]) - e2 * k[4], HI(r[2]) - e3 * k[5]); \
  w[3] = PACK(LO(r[3]) - e2 * k[6], HI(r[3]) - e3 * k[7]); \
}
FQLA_WT(fqla_wt_bf16, fqla_bf16_lo, fqla_bf16_hi, fqla_pack_bf16)
FQLA_WT(fqla_wt_fp16, fqla_fp16_lo, fqla_fp16_hi, fqla_pack_fp16)
#define FQLA_STSM(NAME, PACK) \
__device__ __forceinline__ void NAME(void* p, const float* a, int j) { \
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(p)); \
  const float* x = a + 8 * j; \
  asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};" :: "r"(s), \
               "r"(PACK(x[0], x[1])), "r"(PACK(x[2], x[3])), "r"(PACK(x[4], x[5])), "r"(PACK(x[6], x[7])) \
               : "memory"); \
}
FQLA_STSM(fqla_stsm_bf16, fqla_pack_bf16)
FQLA_STSM(fqla_stsm_fp16, fqla_pack_fp16)
"""
