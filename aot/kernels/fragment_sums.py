"""Row and column sums of a 64-row wgmma accumulator held by two warpgroups, left as per-warp (columns) or
per-warpgroup (rows) parts in shared memory, for the few threads that add them up after a barrier the kernel has anyway.

T.reduce_sum finishes a reduction across warps inside itself: a butterfly through a shared workspace with two CTA
barriers a step (column sums of a 64 x 64 accumulator: two steps, four barriers; row sums across the two warpgroups:
one step, two barriers). gdn_bwd_chunk's epilogue consumes each of its sums only on the threads tid < 64, after a
barrier of its own, so the parts can wait there and the barriers inside the reductions go (deterministic: every part and
every sum of parts in a fixed order).

Layout (fragment_io.py's, each warpgroup holding its own columns): element 4 j + 2 h + e of thread t (lane l, warp
w = t % 128 / 32 of warpgroup g = t / 128) is row 16 w + 8 h + l / 4, column g * 8 NJ + 8 j + 2 (l % 4) + e, for
j < NJ (the thread's 8-column blocks).
  fqla_col_part(a, part)       a 64 x 64 accumulator (NJ = 4): part[64 w + col] = the sum of column col over warp w's
                               16 rows (both 8-row halves added first, then the lanes by shuffles 4, 8, 16)
  fqla_row_part(a, part, nj)   part[64 g + row] = the sum of row `row` over warpgroup g's columns (the thread's
                               elements j ascending, then lanes by shuffles 1, 2)
col_total / row_total add a row's or column's parts up, in the order every caller uses (pairs first).
"""

PRELUDE = r"""
__device__ __forceinline__ void fqla_col_part(const float* a, float* part) {
  const int t = threadIdx.x, lane = t & 31, w = (t & 127) >> 5, g = t >> 7;
  float c[8];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    c[2 * j] = a[4 * j] + a[4 * j + 2];
    c[2 * j + 1] = a[4 * j + 1] + a[4 * j + 3];
  }
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
#pragma unroll
    for (int i = 0; i < 8; ++i) c[i] += __shfl_xor_sync(0xffffffffu, c[i], off);
  }
  if (lane < 4) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float* p = part + 64 * w + 32 * g + 8 * j + 2 * lane;
      p[0] = c[2 * j];
      p[1] = c[2 * j + 1];
    }
  }
}
__device__ __forceinline__ void fqla_row_part(const float* a, float* part, int nj) {
  const int t = threadIdx.x, lane = t & 31, w = (t & 127) >> 5, g = t >> 7;
  float r0 = 0.f, r1 = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    if (j < nj) {
      r0 += a[4 * j] + a[4 * j + 1];
      r1 += a[4 * j + 2] + a[4 * j + 3];
    }
  }
  r0 += __shfl_xor_sync(0xffffffffu, r0, 1);
  r1 += __shfl_xor_sync(0xffffffffu, r1, 1);
  r0 += __shfl_xor_sync(0xffffffffu, r0, 2);
  r1 += __shfl_xor_sync(0xffffffffu, r1, 2);
  if ((lane & 3) == 0) {
    part[64 * g + 16 * w + (lane >> 2)] = r0;
    part[64 * g + 16 * w + 8 + (lane >> 2)] = r1;
  }
}
"""


def col_total(part, i):
    """Column i's sum from fqla_col_part's four per-warp parts (a buffer or a list)."""
    return (part[i] + part[64 + i]) + (part[128 + i] + part[192 + i])


def row_total(part, i):
    """Row i's sum from fqla_row_part's two per-warpgroup parts (a buffer or a list)."""
    return part[i] + part[64 + i]


def element_position(t: int, s: int, nj: int):
    """(row, column) of element s of thread t in the layout above (nj 8-column blocks a thread)."""
    lane, w, g = t % 32, t % 128 // 32, t // 128
    j, h, e = s // 4, s // 2 % 2, s % 2
    return 16 * w + 8 * h + lane // 4, g * 8 * nj + 8 * j + 2 * (lane % 4) + e


def col_parts(acc, threads: int = 256):
    """fqla_col_part on every thread of a CTA (acc[t] = thread t's 16 floats, C x C): part[4 * 64], in its order."""
    part = [0.0] * (4 * 64)
    c = [[acc[t][4 * j + k] + acc[t][4 * j + k + 2] for j in range(4) for k in range(2)] for t in range(threads)]
    for off in (4, 8, 16):
        c = [[c[t][i] + c[t ^ off][i] for i in range(8)] for t in range(threads)]
    for t in range(threads):
        lane, w, g = t % 32, t % 128 // 32, t // 128
        if lane < 4:
            for j in range(4):
                for k in range(2):
                    part[64 * w + 32 * g + 8 * j + 2 * lane + k] = c[t][2 * j + k]
    return part


def row_parts(acc, nj: int, threads: int = 256):
    """fqla_row_part on every thread of a CTA (acc[t] = thread t's 4 nj floats): part[2 * 64], in its order."""
    part = [0.0] * (2 * 64)
    r = [[sum(acc[t][4 * j + 2 * h] + acc[t][4 * j + 2 * h + 1] for j in range(nj)) for h in range(2)]
         for t in range(threads)]
    for off in (1, 2):
        r = [[r[t][h] + r[t ^ off][h] for h in range(2)] for t in range(threads)]
    for t in range(threads):
        lane, w, g = t % 32, t % 128 // 32, t // 128
        if lane % 4 == 0:
            part[64 * g + 16 * w + lane // 4] = r[t][0]
            part[64 * g + 16 * w + 8 + lane // 4] = r[t][1]
    return part
