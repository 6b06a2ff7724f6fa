// Tensor-core building blocks for the 16-bit (float16 / bfloat16) kernels, sm_80+:
//   * mma.sync.aligned.m16n8k16 with float32 accumulation (inline PTX),
//   * ldmatrix (.x4, optionally .trans) fragment loads from shared memory,
//   * cp.async 16-byte global -> shared copies (zero fill) and their group waits,
//   * 128-bit vector global loads / 16-bit pair packing.
//
// Fragment layout of mma.m16n8k16 (g = lane / 4, q = lane % 4), all from the PTX ISA:
//   A (16 x 16, row major)  a[0] = (g, 2q..2q+1)  a[1] = (g+8, 2q..)  a[2] = (g, 2q+8..)
//                           a[3] = (g+8, 2q+8..)                       (row, k) pairs
//   B (16 x 8, "col")       b[0] = (k 2q..2q+1, n g)  b[1] = (k 2q+8.., n g)
//   C (16 x 8, float)       c[0..1] = (g, 2q..2q+1)   c[2..3] = (g+8, 2q..2q+1)
//
// Shared-memory operand conventions used by the ldmatrix helpers below:
//   "K-major":  element (m|n, k) at p[(m|n) * pitch + k]   (rows of 8 k's are 16 bytes)
//   "MN-major": element (m|n, k) at p[k * pitch + (m|n)]   (loaded with .trans)
// pitch must be a multiple of 8 elements (16-byte rows); pitch = 8 (mod 16) elements makes
// the 8 row addresses of one 8x8 matrix fall in 8 different 16-byte bank groups
// (conflict-free). `mma_pitch` returns such a pitch.
#pragma once

#include <cstdint>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace kfused {
namespace mma {

// Conflict-free ldmatrix pitch (elements) for rows of n 16-bit values: round up to 16, add 8.
__host__ __device__ constexpr int pitch_for(int n) { return ((n + 15) / 16) * 16 + 8; }

template <typename T>
struct Is16 {
  static constexpr bool value = false;
};
template <>
struct Is16<c10::Half> {
  static constexpr bool value = true;
};
template <>
struct Is16<c10::BFloat16> {
  static constexpr bool value = true;
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mma ---------------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1);

template <>
__device__ __forceinline__ void mma16816<c10::Half>(float (&c)[4], const uint32_t (&a)[4],
                                                    uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma16816<c10::BFloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                        uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats -> one register holding the pair rounded to T (round to nearest even), low half
// first: the register layout of an A/B fragment element pair.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<c10::Half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <>
__device__ __forceinline__ uint32_t pack2<c10::BFloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// One register holding a pair of T (low half first) -> the two values as float (exact).
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v);

template <>
__device__ __forceinline__ float2 unpack2<c10::Half>(uint32_t v) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}

template <>
__device__ __forceinline__ float2 unpack2<c10::BFloat16>(uint32_t v) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v));
}

// ---- ldmatrix ----------------------------------------------------------------------------

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldsm_x4_t(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// A fragment (16 x 16 at rows m0, k0) of a K-major operand: a[0..3] as documented above.
template <typename T>
__device__ __forceinline__ void load_a_kmajor(uint32_t (&a)[4], const T* p, int pitch, int m0,
                                              int k0) {
  const int l = threadIdx.x & 31;
  ldsm_x4(a, p + (m0 + (l & 15)) * pitch + k0 + (l >> 4) * 8);
}

// A fragment of an MN-major operand (element (m, k) at p[k * pitch + m]).
template <typename T>
__device__ __forceinline__ void load_a_mnmajor(uint32_t (&a)[4], const T* p, int pitch, int m0,
                                               int k0) {
  const int l = threadIdx.x & 31, i = l >> 3;
  ldsm_x4_t(a, p + (k0 + (l & 7) + (i >> 1) * 8) * pitch + m0 + (i & 1) * 8);
}

// B fragments of two n8 tiles (n0 and n0 + 8) x k16 at k0 of a K-major operand
// (element (n, k) at p[n * pitch + k]): b[0], b[1] for tile n0, b[2], b[3] for tile n0 + 8.
template <typename T>
__device__ __forceinline__ void load_b2_kmajor(uint32_t (&b)[4], const T* p, int pitch, int n0,
                                               int k0) {
  const int l = threadIdx.x & 31, i = l >> 3;
  ldsm_x4(b, p + (n0 + (l & 7) + (i >> 1) * 8) * pitch + k0 + (i & 1) * 8);
}

// The same from an MN-major operand (element (n, k) at p[k * pitch + n]).
template <typename T>
__device__ __forceinline__ void load_b2_mnmajor(uint32_t (&b)[4], const T* p, int pitch, int n0,
                                                int k0) {
  const int l = threadIdx.x & 31, i = l >> 3;
  ldsm_x4_t(b, p + (k0 + (l & 7) + (i & 1) * 8) * pitch + n0 + (i >> 1) * 8);
}

// ---- cp.async ----------------------------------------------------------------------------

// 16 bytes global -> shared; when !pred nothing is read and the 16 bytes are zero-filled.
// `gsrc` must be a valid, 16-byte aligned global address even when !pred.
__device__ __forceinline__ void cp_async16(void* sdst, const void* gsrc, bool pred) {
  const int n = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(sdst)),
               "l"(gsrc), "r"(n));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- vector global access ------------------------------------------------------------------

__device__ __forceinline__ uint4 ldg128(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

__device__ __forceinline__ bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// Shared-memory tile loader, row by row: smem row r < rpad receives columns [0, ncols) of the
// global row row_ptr(r) (16-bit elements), zero-filling columns [ncols, cpad) and every column
// of a row whose row_ptr is nullptr. Vector path (16-byte cp.async) when `vec` (every row
// 16-byte aligned, ncols % 8 == 0; `any` is a valid 16-byte aligned global address, passed
// for the rows that read nothing); otherwise scalar loads. Asynchronous on the vector path:
// the caller commits / waits / synchronises.
template <typename T, typename RowPtr>
__device__ __forceinline__ void load_rows(T* s, int pitch, RowPtr row_ptr, const T* any,
                                          int ncols, int rpad, int cpad, bool vec, int tid,
                                          int nthreads) {
  const int cchunks = cpad / 8;
  const int total = rpad * cchunks;
  if (vec) {
    for (int e = tid; e < total; e += nthreads) {
      const int r = e / cchunks, c = (e - r * cchunks) * 8;
      const T* g = row_ptr(r);
      const bool ok = g != nullptr && c < ncols;
      cp_async16(s + r * pitch + c, ok ? g + c : any, ok);
    }
  } else {
    for (int e = tid; e < total; e += nthreads) {
      const int r = e / cchunks, c0 = (e - r * cchunks) * 8;
      const T* g = row_ptr(r);
      alignas(16) T v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int c = c0 + i;
        v[i] = (g != nullptr && c < ncols) ? g[c] : T(0.f);
      }
      *reinterpret_cast<uint4*>(s + r * pitch + c0) = *reinterpret_cast<const uint4*>(v);
    }
  }
}

// Rows [0, nrows) x columns [0, ncols) of a global matrix with row stride `ld` (elements)
// into smem rows of `pitch`, zero-filling columns [ncols, cpad) and rows [nrows, rpad)
// (load_rows; vector path: base 16-byte aligned and ld % 8 == 0 besides).
template <typename T>
__device__ __forceinline__ void load_tile(T* s, int pitch, const T* g, int64_t ld, int nrows,
                                          int ncols, int rpad, int cpad, bool vec, int tid,
                                          int nthreads) {
  load_rows<T>(s, pitch, [=](int r) -> const T* { return r < nrows ? g + r * ld : nullptr; },
               g, ncols, rpad, cpad, vec, tid, nthreads);
}


// Two adjacent outputs (n, n + 1) of a row at `base`: one 32-bit store when both are in
// range and the pair is 4-byte aligned (`pair_ok`: even row length, aligned row), else
// element by element; nothing at or beyond ncols is written.
template <typename T>
__device__ __forceinline__ void store2(T* base, int n, int ncols, bool pair_ok, float v0,
                                       float v1) {
  if (pair_ok && n + 1 < ncols) {
    *reinterpret_cast<uint32_t*>(base + n) = pack2<T>(v0, v1);
  } else {
    if (n < ncols) base[n] = static_cast<T>(v0);
    if (n + 1 < ncols) base[n + 1] = static_cast<T>(v1);
  }
}

// ---- block-wide tensor-core GEMM on shared-memory operands --------------------------------
//
// For every output batch ob < nbatch, C_ob (16 tm x 16 tn tiles) = sum over reduction batches
// kb < kbatch and k-steps ks < ksteps of A_(ob,kb) (16 x 16 at rows 16 tm, k 16 ks) times
// B_(ob,kb); operand (ob, kb) starts at p + ob * ob_stride + kb * kb_stride. A_KMAJOR /
// B_KMAJOR select the layouts documented at the top of this file. The warp tiles
// (ob, tm, tn) are dealt to the block's warps round robin; each warp accumulates a 16 x 16
// tile in float (2 mma per k-step, one ldmatrix.x4 per operand) and hands it to
// epi(ob, m, n, v(m, n), v(m, n + 1)) with n even. Every element of C goes to exactly one
// thread once (deterministic). All padded rows / columns / k's must hold finite values
// (zeros in k): nothing is masked inside.
struct SmemOp {
  const void* p;
  int pitch;
  int ob_stride;
  int kb_stride;
};

template <typename T, bool A_KMAJOR, bool B_KMAJOR, typename Epi>
__device__ __forceinline__ void block_mma(int nbatch, int tiles_m, int tiles_n, int kbatch,
                                          int ksteps, const SmemOp& A, const SmemOp& B,
                                          Epi epi) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int g = lane >> 2, q = lane & 3;
  const int per = tiles_m * tiles_n;
  const int total = nbatch * per;
  for (int tile = warp; tile < total; tile += nwarps) {
    const int ob = tile / per;
    const int rem = tile - ob * per;
    const int tm = rem / tiles_n, tn = rem - tm * tiles_n;
    float c[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int e = 0; e < 4; ++e) c[h][e] = 0.f;
    const T* pa = static_cast<const T*>(A.p) + ob * A.ob_stride;
    const T* pb = static_cast<const T*>(B.p) + ob * B.ob_stride;
    for (int kb = 0; kb < kbatch; ++kb) {
      const T* a = pa + kb * A.kb_stride;
      const T* b = pb + kb * B.kb_stride;
      for (int ks = 0; ks < ksteps; ++ks) {
        uint32_t af[4], bf[4];
        if constexpr (A_KMAJOR)
          load_a_kmajor<T>(af, a, A.pitch, tm * 16, ks * 16);
        else
          load_a_mnmajor<T>(af, a, A.pitch, tm * 16, ks * 16);
        if constexpr (B_KMAJOR)
          load_b2_kmajor<T>(bf, b, B.pitch, tn * 16, ks * 16);
        else
          load_b2_mnmajor<T>(bf, b, B.pitch, tn * 16, ks * 16);
        mma16816<T>(c[0], af, bf[0], bf[1]);
        mma16816<T>(c[1], af, bf[2], bf[3]);
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < 2; ++i)
        epi(ob, tm * 16 + g + 8 * i, tn * 16 + 8 * h + 2 * q, c[h][2 * i], c[h][2 * i + 1]);
  }
}

}  // namespace mma
}  // namespace kfused
