// Per-head low-rank product (docs/math.md §2) as a functional op:
//   out[t, h, :] = B_h (A_h basis[t(, h)]) + bias_h
// basis (T, d_b) shared by all heads (Kernel-wise, basis X) or (T, H, d_b) one per head
// (Kernel-wise-lite, basis K^h / O^h); A (H, r, d_b); B (H, p, r); bias (H, p) optional.
//
// Design. r is small (1-12 in the paper's configurations), so the work is two skinny
// products per (token, head). A warp owns 4 tokens of one head (a block = 8 warps of the
// same head, so A_h and B_h stay in L1): each lane walks the reduction dimension with stride
// 32 and accumulates 4 tokens x 8 ranks = 32 partial dot products, which one transpose-
// reduction (31 shuffles) leaves as one finished value per lane. U = A_h basis is rounded to
// the input dtype (as the reference chain does), then each lane writes output columns
// o = lane, lane+32, ... coalesced, with the bias added in float.
//
// Backward (one pass per quantity, no per-head Python loop, deterministic):
//   K1  U = A_h basis (rounded) and dU = g_h B_h (rounded) per (token, head) -> float workspaces
//   K2  dbasis = dU A  (shared basis: summed over heads and ranks; per-head: per head)
//   K3  dA_h = sum_t dU_h^T basis, dB_h = sum_t g_h^T U_h, dbias_h = sum_t g_h: one thread per
//       output column, tokens split over blockIdx.y, float partials reduced in a fixed order.

#include "common/common.cuh"
#include "common/mma.cuh"
#include "kfused.h"

namespace kfused {
namespace {

constexpr int kWarps = 8;
constexpr int kTokensPerWarp = 4;  // kTokensPerWarp * kRankChunk must be 32
constexpr int kRankChunk = 8;

struct HeadwiseShape {
  int64_t T;
  int H, r, d_b, p;
  bool shared;  // basis (T, d_b) shared by every head
};

// One halving step of the transpose-reduction: lanes keep the half of the values selected by
// their OFF bit and add the partner's copy of that half.
template <int OFF>
__device__ __forceinline__ void transpose_reduce_step(float (&vals)[32], int lane) {
  const bool upper = (lane & OFF) != 0;
#pragma unroll
  for (int i = 0; i < OFF; ++i) {
    const float send = upper ? vals[i] : vals[i + OFF];
    const float keep = upper ? vals[i + OFF] : vals[i];
    vals[i] = keep + __shfl_xor_sync(0xffffffffu, send, OFF);
  }
  if constexpr (OFF > 1) transpose_reduce_step<OFF / 2>(vals, lane);
}

// vals[i] summed over the warp lands in lane i (31 shuffles instead of 32 * 5).
__device__ __forceinline__ float warp_transpose_reduce(float (&vals)[32]) {
  transpose_reduce_step<16>(vals, threadIdx.x & 31);
  return vals[0];
}

// 4 rows x 8 weight vectors of length L: rows[tt][k] (row pointers, nullptr = absent) and
// w[jj * wj + k * wk] for jj < nj. Returns, in lane (tt * 8 + jj), the dot product.
template <typename T>
__device__ __forceinline__ float warp_dots(const T* const (&rows)[kTokensPerWarp], const T* w,
                                           int64_t wj, int64_t wk, int nj, int L) {
  const int lane = threadIdx.x & 31;
  float acc[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.f;
  for (int k = lane; k < L; k += 32) {
    float wv[kRankChunk], xv[kTokensPerWarp];
#pragma unroll
    for (int jj = 0; jj < kRankChunk; ++jj)
      wv[jj] = jj < nj ? to_float(w[jj * wj + k * wk]) : 0.f;
#pragma unroll
    for (int tt = 0; tt < kTokensPerWarp; ++tt) xv[tt] = rows[tt] ? to_float(rows[tt][k]) : 0.f;
#pragma unroll
    for (int tt = 0; tt < kTokensPerWarp; ++tt)
#pragma unroll
      for (int jj = 0; jj < kRankChunk; ++jj)
        acc[tt * kRankChunk + jj] = fmaf(xv[tt], wv[jj], acc[tt * kRankChunk + jj]);
  }
  return warp_transpose_reduce(acc);
}

struct HeadwiseFwdParams {
  const void* basis;
  const void* A;
  const void* B;
  const void* bias;  // nullptr when absent
  void* out;
  float* Uw;   // backward only: (T, H, r) float workspace for U
  float* dUw;  // backward only: (T, H, r) float workspace for dU
  const void* g;
  HeadwiseShape s;
};

template <typename T>
__device__ __forceinline__ const T* basis_row(const HeadwiseFwdParams& P, int64_t t, int h) {
  const T* basis = static_cast<const T*>(P.basis);
  const HeadwiseShape& s = P.s;
  return s.shared ? basis + t * s.d_b : basis + (t * s.H + h) * s.d_b;
}

// grid (ceil(T / 32), H); block kWarps warps. kBackward: write U to its workspace instead of
// computing the output.
template <typename T, bool kBackward>
__global__ void __launch_bounds__(kWarps * 32) headwise_rows_kernel(const HeadwiseFwdParams P) {
  extern __shared__ float smem[];
  const HeadwiseShape s = P.s;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int h = blockIdx.y;
  const int64_t t0 = (static_cast<int64_t>(blockIdx.x) * kWarps + warp) * kTokensPerWarp;
  if (t0 >= s.T) return;  // warp-uniform; the kernel has no block-wide barrier
  float* Us = smem + warp * kTokensPerWarp * s.r;  // (4, r) rounded U of this warp's tokens
  const T* A = static_cast<const T*>(P.A) + static_cast<int64_t>(h) * s.r * s.d_b;
  const T* B = static_cast<const T*>(P.B) + static_cast<int64_t>(h) * s.p * s.r;
  const int tt_l = lane / kRankChunk, jj_l = lane % kRankChunk;
  const int64_t t_l = t0 + tt_l;

  const T* rows[kTokensPerWarp];
#pragma unroll
  for (int tt = 0; tt < kTokensPerWarp; ++tt)
    rows[tt] = t0 + tt < s.T ? basis_row<T>(P, t0 + tt, h) : nullptr;
  for (int j0 = 0; j0 < s.r; j0 += kRankChunk) {
    const int nj = s.r - j0 < kRankChunk ? s.r - j0 : kRankChunk;
    // U[t][j] = sum_k basis[t][k] A_h[j][k]
    const float u = round_to<T>(warp_dots<T>(rows, A + j0 * s.d_b, s.d_b, 1, nj, s.d_b));
    if (jj_l < nj) {
      Us[tt_l * s.r + j0 + jj_l] = u;
      if (kBackward && t_l < s.T) P.Uw[(t_l * s.H + h) * s.r + j0 + jj_l] = u;
    }
  }

  if (kBackward) return;  // dU: headwise_du_kernel

  __syncwarp();
  // out[t][h][o] = bias[h][o] + sum_j B_h[o][j] U[t][j]
  T* out = static_cast<T*>(P.out);
  const T* bias = P.bias ? static_cast<const T*>(P.bias) + static_cast<int64_t>(h) * s.p : nullptr;
  for (int o = lane; o < s.p; o += 32) {
    const float b0 = bias ? to_float(bias[o]) : 0.f;
    float acc[kTokensPerWarp];
#pragma unroll
    for (int tt = 0; tt < kTokensPerWarp; ++tt) acc[tt] = b0;
    for (int j = 0; j < s.r; ++j) {
      const float bv = to_float(B[o * s.r + j]);
#pragma unroll
      for (int tt = 0; tt < kTokensPerWarp; ++tt)
        acc[tt] = fmaf(bv, Us[tt * s.r + j], acc[tt]);
    }
#pragma unroll
    for (int tt = 0; tt < kTokensPerWarp; ++tt)
      if (t0 + tt < s.T) out[((t0 + tt) * s.H + h) * s.p + o] = static_cast<T>(acc[tt]);
  }
}

// dbasis[t][(h,) k] = sum_c dU[t][c] A[c][k] over c = (h, j) of every head (shared basis) or of
// head blockIdx.y (per-head basis). grid (ceil(T / kDbTokens), shared ? 1 : H).
constexpr int kDbTokens = 8;
constexpr int kDbThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kDbThreads) headwise_dbasis_kernel(
    const float* __restrict__ dUw, const T* __restrict__ A, T* __restrict__ dbasis,
    const HeadwiseShape s) {
  extern __shared__ float smem[];  // (kDbTokens, C) coefficients
  const int h = blockIdx.y;
  const int C = s.shared ? s.H * s.r : s.r;  // reduction length
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kDbTokens;
  const int nt = static_cast<int>(s.T - t0 < kDbTokens ? s.T - t0 : kDbTokens);
  const int64_t coef_off = s.shared ? 0 : static_cast<int64_t>(h) * s.r;
  for (int e = threadIdx.x; e < nt * C; e += blockDim.x) {
    const int tt = e / C, c = e - tt * C;
    smem[e] = dUw[(t0 + tt) * s.H * s.r + coef_off + c];
  }
  __syncthreads();
  const T* Ah = A + coef_off * s.d_b;
  const int64_t row = s.shared ? s.d_b : static_cast<int64_t>(s.H) * s.d_b;
  T* out = dbasis + t0 * row + (s.shared ? 0 : static_cast<int64_t>(h) * s.d_b);
  for (int k = threadIdx.x; k < s.d_b; k += blockDim.x) {
    float acc[kDbTokens];
#pragma unroll
    for (int tt = 0; tt < kDbTokens; ++tt) acc[tt] = 0.f;
    for (int c = 0; c < C; ++c) {
      const float a = to_float(Ah[static_cast<int64_t>(c) * s.d_b + k]);
#pragma unroll
      for (int tt = 0; tt < kDbTokens; ++tt)
        if (tt < nt) acc[tt] = fmaf(smem[tt * C + c], a, acc[tt]);
    }
#pragma unroll
    for (int tt = 0; tt < kDbTokens; ++tt)
      if (tt < nt) out[tt * row + k] = static_cast<T>(acc[tt]);
  }
}

// Column reductions over tokens: for column c = (h, w), w < W,
//   part[split][out(h, j, w)] = sum_{t in split} coef[t][h][j] * data[t*ds + h*dh + w]
// and, with ones, part[split][n_main + c] = sum_t data[...] (the bias gradient).
// out(h, j, w) = (h*r + j)*W + w (layout 0: dA (H, r, d_b)) or (h*W + w)*r + j (layout 1:
// dB (H, p, r)). grid (ceil(H*W / 256), splits).
struct ColReduceParams {
  const void* data;
  int64_t ds, dh;
  const float* coef;  // (T, H, r)
  float* part;
  int64_t n_total;  // per-split stride of part
  int64_t T;
  int64_t tokens_per_split;
  int H, r, W;
  int layout;
  bool ones;
};

template <typename T>
__global__ void __launch_bounds__(256) headwise_colreduce_kernel(const ColReduceParams P) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= static_cast<int64_t>(P.H) * P.W) return;
  const int h = static_cast<int>(c / P.W), w = static_cast<int>(c - int64_t(h) * P.W);
  const int64_t ta = blockIdx.y * P.tokens_per_split;
  const int64_t tb = ta + P.tokens_per_split < P.T ? ta + P.tokens_per_split : P.T;
  const T* data = static_cast<const T*>(P.data) + h * P.dh + w;
  const float* coef = P.coef + static_cast<int64_t>(h) * P.r;
  float* part = P.part + blockIdx.y * P.n_total;
  const int64_t hr = static_cast<int64_t>(P.H) * P.r;
  for (int j0 = 0; j0 < P.r || (j0 == 0 && P.ones); j0 += kRankChunk) {
    const int nj = P.r - j0 < kRankChunk ? (P.r - j0 > 0 ? P.r - j0 : 0) : kRankChunk;
    const bool ones = P.ones && j0 == 0;
    float acc[kRankChunk];
#pragma unroll
    for (int jj = 0; jj < kRankChunk; ++jj) acc[jj] = 0.f;
    float sum = 0.f;
    for (int64_t t = ta; t < tb; ++t) {
      const float d = to_float(data[t * P.ds]);
      const float* ct = coef + t * hr + j0;
#pragma unroll
      for (int jj = 0; jj < kRankChunk; ++jj)
        if (jj < nj) acc[jj] = fmaf(ct[jj], d, acc[jj]);
      sum += d;
    }
#pragma unroll
    for (int jj = 0; jj < kRankChunk; ++jj) {
      if (jj >= nj) continue;
      const int j = j0 + jj;
      const int64_t idx = P.layout == 0 ? (int64_t(h) * P.r + j) * P.W + w
                                        : (int64_t(h) * P.W + w) * P.r + j;
      part[idx] = acc[jj];
    }
    if (ones) part[hr * P.W + c] = sum;
  }
}

// ------------------------------------------------------------------------------------------
// Tensor-core forward (float16 / bfloat16)
// ------------------------------------------------------------------------------------------
//
// A block owns 64 tokens x a group of HG heads (shared basis: HG = 64 / r8 heads, r8 = r
// rounded up to 8, so one GEMM serves HG heads; per-head basis: HG = 1). Two GEMMs on
// mma.sync m16n8k16, 4 warps, each warp 16 token rows:
//   U (64 x HG*r8) = basis (64 x d_b) A_group^T   K = d_b streamed in 64-wide chunks,
//                    basis and A chunks double buffered by 16-byte cp.async; float
//                    accumulators stay in registers; U rounded to T into shared memory
//                    (per head a 16-wide zero-padded slot)
//   out_h (64 x p) = U_h B_h^T + bias_h         K = r (padded to 16), B_h staged once.
constexpr int kHwBM = 64, kHwBK = 64, kHwThreads = 128, kHwMaxN = 64;

struct HeadwiseTcParams {
  const void* basis;
  const void* A;
  const void* B;
  const void* bias;
  void* out;
  HeadwiseShape s;
  int64_t basis_ld;  // elements between consecutive tokens' basis rows
  int r8, r16, p16, HG;
  bool vec;     // 16-byte cp.async rows for basis and A
  void* u_out;  // U (T, H, uw) rounded to T here as well (the backward's dB operand), or null
  int uw;       // U's row length per head: u_width(r)
  bool u_only;  // backward recompute: U only, no output GEMM
};

// Row length per head of the saved U: r values, a column of ones at r (with a bias, dB's GEMM
// then also yields sum_t g = dbias), zeros up to a multiple of 8 (16-byte rows for the dB
// GEMM's cp.async loads). The same U serves a backward with or without a bias.
inline int u_width(int r) { return (r + 1 + 7) / 8 * 8; }

struct HeadwiseTcSmem {
  int PK, PU, PB;
  size_t xs, as, us, bs, total;  // byte offsets / total
};

__host__ __device__ inline HeadwiseTcSmem headwise_tc_smem(int HG, int r16, int p16) {
  HeadwiseTcSmem m;
  m.PK = kHwBK + 8;
  m.PU = HG * r16 + 8;
  m.PB = r16 + 8;
  m.xs = 0;
  m.as = m.xs + 2 * size_t(2) * kHwBM * m.PK;
  m.us = m.as + 2 * size_t(2) * kHwMaxN * m.PK;
  m.bs = m.us + size_t(2) * kHwBM * m.PU;
  m.total = m.bs + size_t(2) * HG * p16 * m.PB;
  return m;
}

// 4 blocks per SM: without a minimum ptxas held the kernel to 80 registers and spilled 4-8
// bytes around the U stores (tests/test_csrc_sass.py); with it, 110 registers and no spill.
template <typename T>
__global__ void __launch_bounds__(kHwThreads, 4) headwise_mma_kernel(const HeadwiseTcParams P) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const HeadwiseShape s = P.s;
  const HeadwiseTcSmem L = headwise_tc_smem(P.HG, P.r16, P.p16);
  T* Xs = reinterpret_cast<T*>(smem_raw + L.xs);  // (2, 64, PK)
  T* Aw = reinterpret_cast<T*>(smem_raw + L.as);  // (2, 64, PK)
  T* Us = reinterpret_cast<T*>(smem_raw + L.us);  // (64, PU)
  T* Bs = reinterpret_cast<T*>(smem_raw + L.bs);  // (HG, p16, PB)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, qd = lane & 3;
  const int h0 = blockIdx.y * P.HG;
  const int hg = s.H - h0 < P.HG ? s.H - h0 : P.HG;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kHwBM;
  const int nt = static_cast<int>(s.T - t0 < kHwBM ? s.T - t0 : kHwBM);
  const int N = hg * P.r8;              // GEMM 1 columns (h_local, j)
  const int N16 = (N + 15) / 16 * 16;   // rows of the A chunk that are read
  const int r8 = P.r8, r16 = P.r16, p16 = P.p16;
  const T* basis = static_cast<const T*>(P.basis) +
                   (s.shared ? t0 * s.d_b : (t0 * s.H + h0) * s.d_b);
  const T* A = static_cast<const T*>(P.A);
  const T* B = static_cast<const T*>(P.B);
  const int PK = L.PK, PU = L.PU, PB = L.PB;

  // B_h, zero padded to (p16, r16), and the zero columns [r8, r16) of every U slot.
  for (int e = tid; e < P.HG * p16 * r16; e += kHwThreads) {
    const int hl = e / (p16 * r16), rem = e - hl * p16 * r16;
    const int o = rem / r16, j = rem - o * r16;
    Bs[(hl * p16 + o) * PB + j] =
        (hl < hg && o < s.p && j < s.r) ? B[((int64_t(h0) + hl) * s.p + o) * s.r + j] : T(0.f);
  }
  if (r16 > r8)
    for (int e = tid; e < kHwBM * P.HG * (r16 - r8); e += kHwThreads) {
      const int m = e / (P.HG * (r16 - r8)), rem = e - m * P.HG * (r16 - r8);
      const int hl = rem / (r16 - r8), j = r8 + rem - hl * (r16 - r8);
      Us[m * PU + hl * r16 + j] = T(0.f);
    }

  if (P.u_out) {
    // U's columns [r, uw) do not depend on the products: the ones column at r, zeros after,
    // written here where few registers are live (after the GEMM they cost a spill)
    T* u = static_cast<T*>(P.u_out);
    const int extra = P.uw - s.r;
    for (int e = tid; e < nt * hg * extra; e += kHwThreads) {
      const int m = e / (hg * extra), rem = e - m * (hg * extra);
      const int hl = rem / extra, j = s.r + rem - hl * extra;
      u[((t0 + m) * s.H + h0 + hl) * P.uw + j] = T(j == s.r ? 1.f : 0.f);
    }
  }

  auto load_chunk = [&](int kc, int buf) {
    const int k0 = kc * kHwBK;
    const int kw = s.d_b - k0 < kHwBK ? s.d_b - k0 : kHwBK;
    mma::load_tile<T>(Xs + buf * kHwBM * PK, PK, basis + k0, P.basis_ld, nt, kw, kHwBM, kHwBK,
                      P.vec, tid, kHwThreads);
    T* aw = Aw + buf * kHwMaxN * PK;
    for (int e = tid; e < N16 * (kHwBK / 8); e += kHwThreads) {
      const int n = e / (kHwBK / 8), c = (e - n * (kHwBK / 8)) * 8;
      const int hl = n / r8, j = n - hl * r8;
      const bool row_ok = hl < hg && j < s.r;
      const T* src = A + ((int64_t(h0) + hl) * s.r + j) * s.d_b + k0 + c;
      if (P.vec) {
        const bool ok = row_ok && c < kw;
        mma::cp_async16(aw + n * PK + c, ok ? src : A, ok);
      } else {
        alignas(16) T v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = (row_ok && c + i < kw) ? src[i] : T(0.f);
        *reinterpret_cast<uint4*>(aw + n * PK + c) = *reinterpret_cast<const uint4*>(v);
      }
    }
  };

  float acc[kHwMaxN / 8][4];
#pragma unroll
  for (int j = 0; j < kHwMaxN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  const int nk = (s.d_b + kHwBK - 1) / kHwBK;
  load_chunk(0, 0);
  mma::cp_async_commit();
  for (int kc = 0; kc < nk; ++kc) {
    if (kc + 1 < nk) {
      load_chunk(kc + 1, (kc + 1) & 1);
      mma::cp_async_commit();
      mma::cp_async_wait<1>();
    } else {
      mma::cp_async_wait<0>();
    }
    __syncthreads();
    const T* xs = Xs + (kc & 1) * kHwBM * PK;
    const T* aw = Aw + (kc & 1) * kHwMaxN * PK;
#pragma unroll
    for (int ks = 0; ks < kHwBK / 16; ++ks) {
      uint32_t af[4];
      mma::load_a_kmajor<T>(af, xs, PK, warp * 16, ks * 16);
#pragma unroll
      for (int np = 0; np < kHwMaxN / 16; ++np) {
        if (np * 16 < N16) {
          uint32_t bf[4];
          mma::load_b2_kmajor<T>(bf, aw, PK, np * 16, ks * 16);
          mma::mma16816<T>(acc[2 * np], af, bf[0], bf[1]);
          mma::mma16816<T>(acc[2 * np + 1], af, bf[2], bf[3]);
        }
      }
    }
    __syncthreads();
  }
  // U (rounded) into its per-head slots; columns n = 8 jt + 2 qd (+1) of rows g, g + 8.
#pragma unroll
  for (int jt = 0; jt < kHwMaxN / 8; ++jt) {
    if (jt * 8 >= N) continue;
    const int n = jt * 8 + 2 * qd;
    const int hl = n / r8, j = n - hl * r8;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int m = warp * 16 + g + 8 * i;
      *reinterpret_cast<uint32_t*>(Us + m * PU + hl * r16 + j) =
          mma::pack2<T>(acc[jt][2 * i], acc[jt][2 * i + 1]);
    }
  }
  if (P.u_out) {  // U (T, H, uw) in the input dtype (block-uniform branch)
    T* u = static_cast<T*>(P.u_out);
    const bool upair = P.uw % 2 == 0;  // j is even: 4-byte aligned pairs
#pragma unroll
    for (int jt = 0; jt < kHwMaxN / 8; ++jt) {
      if (jt * 8 >= N) continue;
      const int n = jt * 8 + 2 * qd;
      const int hl = n / r8, j = n - hl * r8;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int m = warp * 16 + g + 8 * i;
        if (m < nt && hl < hg)
          mma::store2<T>(u + ((t0 + m) * s.H + h0 + hl) * P.uw, j, s.r, upair, acc[jt][2 * i],
                         acc[jt][2 * i + 1]);
      }
    }
    if (P.u_only) return;
  }
  __syncthreads();
  // out[t, h0 + hl, o] = U_hl B_hl^T + bias.
  T* out = static_cast<T*>(P.out);
  const T* bias = static_cast<const T*>(P.bias);
  const bool pair = s.p % 2 == 0;
  mma::block_mma<T, true, true>(
      hg, kHwBM / 16, p16 / 16, 1, r16 / 16, mma::SmemOp{Us, PU, r16, 0},
      mma::SmemOp{Bs, PB, p16 * PB, 0}, [&](int hl, int m, int o, float v0, float v1) {
        if (m >= nt) return;
        const int64_t hh = int64_t(h0) + hl;
        if (bias) {
          if (o < s.p) v0 += to_float(bias[hh * s.p + o]);
          if (o + 1 < s.p) v1 += to_float(bias[hh * s.p + o + 1]);
        }
        mma::store2<T>(out + ((t0 + m) * s.H + hh) * s.p, o, s.p, pair, v0, v1);
      });
}

template <typename T>
void launch_headwise_tc(const HeadwiseTcParams& P, size_t smem, cudaStream_t stream) {
  set_smem(headwise_mma_kernel<T>, smem, "headwise_mma_kernel");
  const dim3 grid(static_cast<unsigned>(ceil_div(P.s.T, kHwBM)),
                  static_cast<unsigned>(ceil_div(P.s.H, P.HG)));
  headwise_mma_kernel<T><<<grid, kHwThreads, smem, stream>>>(P);
  check_launch("headwise_mma_kernel");
}


// dU[t][h][j] = sum_o g[t][h][o] B_h[o][j], rounded to T, stored as W (the float workspace of
// the CUDA-core path; the tensor-core path forms dU with stream_gemm_mma_kernel). One thread
// per (t, h, j); r * p FMAs each (cheap next to the d_b-long products).
template <typename T, typename W>
__global__ void __launch_bounds__(256) headwise_du_kernel(const T* __restrict__ g,
                                                          const T* __restrict__ B,
                                                          W* __restrict__ dU,
                                                          const HeadwiseShape s) {
  const int64_t n = s.T * s.H * s.r;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int j = static_cast<int>(e % s.r);
    const int64_t th = e / s.r;
    const int h = static_cast<int>(th % s.H);
    const T* gr = g + th * s.p;
    const T* bh = B + int64_t(h) * s.p * s.r + j;
    float acc = 0.f;
    for (int o = 0; o < s.p; ++o) acc = fmaf(to_float(gr[o]), to_float(bh[o * s.r]), acc);
    dU[e] = static_cast<W>(round_to<T>(acc));
  }
}

// ------------------------------------------------------------------------------------------
// Tensor-core streaming GEMM for the backward (float16 / bfloat16)
// ------------------------------------------------------------------------------------------
//
// C_z (M x N) = A_z (M x K) B_z (K x N) for z = blockIdx.y (a head or 1), K split over
// blockIdx.z. A is K-major (element (m, k) at a[m * lda + k]) or M-major (a[k * lda + m]);
// B is N-major (b[k * ldb + n]). 64 x 64 block tile, 4 warps of 32 x 32, K in 32-wide
// chunks double buffered by cp.async (16-byte rows when `vec`), zero padded at every edge.
// Output: T to c[z * c_batch + m * ldc + n] (nsplit == 1 and c != nullptr) or float to
// part[((split * nbatch + z) * M + m) * N + n] for a fixed-order reduction.
constexpr int kSgBM = 64, kSgBN = 64, kSgBK = 32, kSgThreads = 128;

struct StreamGemmParams {
  const void* a;
  const void* b;
  void* c;
  float* part;
  int64_t lda, ldb, ldc;
  int64_t a_batch, b_batch, c_batch;
  int M, N, K;
  int nbatch, nsplit, k_per_split;
  bool vec;
};

template <typename T, bool A_KMAJOR>
__global__ void __launch_bounds__(kSgThreads) stream_gemm_mma_kernel(const StreamGemmParams P) {
  constexpr int PAK = kSgBK + 8, PMN = kSgBN + 8;
  constexpr int A_ELEMS = A_KMAJOR ? kSgBM * PAK : kSgBK * PMN;
  constexpr int B_ELEMS = kSgBK * PMN;
  __shared__ __align__(16) T As[2][A_ELEMS];
  __shared__ __align__(16) T Bs[2][B_ELEMS];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, qd = lane & 3;
  const int tiles_n = (P.N + kSgBN - 1) / kSgBN;
  const int tm = blockIdx.x / tiles_n, tn = blockIdx.x - tm * tiles_n;
  const int m0 = tm * kSgBM, n0 = tn * kSgBN;
  const int z = blockIdx.y, split = blockIdx.z;
  const int kbeg = split * P.k_per_split;
  const int kend = kbeg + P.k_per_split < P.K ? kbeg + P.k_per_split : P.K;
  const T* a = static_cast<const T*>(P.a) + z * P.a_batch;
  const T* b = static_cast<const T*>(P.b) + z * P.b_batch;
  const int mrows = P.M - m0 < kSgBM ? P.M - m0 : kSgBM;
  const int ncols = P.N - n0 < kSgBN ? P.N - n0 : kSgBN;
  const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;

  auto load = [&](int k0, int buf) {
    const int kw = kend - k0 < kSgBK ? kend - k0 : kSgBK;
    if constexpr (A_KMAJOR)
      mma::load_tile<T>(As[buf], PAK, a + m0 * P.lda + k0, P.lda, mrows, kw, kSgBM, kSgBK, P.vec,
                        tid, kSgThreads);
    else
      mma::load_tile<T>(As[buf], PMN, a + int64_t(k0) * P.lda + m0, P.lda, kw, mrows, kSgBK,
                        kSgBM, P.vec, tid, kSgThreads);
    mma::load_tile<T>(Bs[buf], PMN, b + int64_t(k0) * P.ldb + n0, P.ldb, kw, ncols, kSgBK, kSgBN,
                      P.vec, tid, kSgThreads);
  };

  float acc[2][4][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
  const int nk = kend > kbeg ? (kend - kbeg + kSgBK - 1) / kSgBK : 0;
  if (nk > 0) load(kbeg, 0);
  mma::cp_async_commit();
  for (int it = 0; it < nk; ++it) {
    if (it + 1 < nk) {
      load(kbeg + (it + 1) * kSgBK, (it + 1) & 1);
      mma::cp_async_commit();
      mma::cp_async_wait<1>();
    } else {
      mma::cp_async_wait<0>();
    }
    __syncthreads();
    const T* as = As[it & 1];
    const T* bs = Bs[it & 1];
#pragma unroll
    for (int ks = 0; ks < kSgBK / 16; ++ks) {
      uint32_t af[2][4], bf[2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        if constexpr (A_KMAJOR)
          mma::load_a_kmajor<T>(af[i], as, PAK, wm + 16 * i, ks * 16);
        else
          mma::load_a_mnmajor<T>(af[i], as, PMN, wm + 16 * i, ks * 16);
      }
#pragma unroll
      for (int jp = 0; jp < 2; ++jp) mma::load_b2_mnmajor<T>(bf[jp], bs, PMN, wn + 16 * jp, ks * 16);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int jp = 0; jp < 2; ++jp) {
          mma::mma16816<T>(acc[i][2 * jp], af[i], bf[jp][0], bf[jp][1]);
          mma::mma16816<T>(acc[i][2 * jp + 1], af[i], bf[jp][2], bf[jp][3]);
        }
    }
    __syncthreads();
  }
  mma::cp_async_wait<0>();

  const bool direct = P.c != nullptr && P.nsplit == 1;
  T* c = direct ? static_cast<T*>(P.c) + z * P.c_batch : nullptr;
  float* part = direct ? nullptr
                       : P.part + (int64_t(split) * P.nbatch + z) * int64_t(P.M) * P.N;
  const bool pair = P.ldc % 2 == 0 && P.c_batch % 2 == 0;
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int hrow = 0; hrow < 2; ++hrow) {
        const int m = m0 + wm + 16 * i + g + 8 * hrow;
        const int n = n0 + wn + 8 * j + 2 * qd;
        if (m >= P.M) continue;
        const float v0 = acc[i][j][2 * hrow], v1 = acc[i][j][2 * hrow + 1];
        if (direct) {
          mma::store2<T>(c + m * P.ldc, n, P.N, pair, v0, v1);
        } else {
          if (n < P.N) part[int64_t(m) * P.N + n] = v0;
          if (n + 1 < P.N) part[int64_t(m) * P.N + n + 1] = v1;
        }
      }
}

template <typename T, bool A_KMAJOR>
void launch_stream_gemm(StreamGemmParams P, cudaStream_t stream, const char* name) {
  const int tiles = static_cast<int>(ceil_div(P.M, kSgBM) * ceil_div(P.N, kSgBN));
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(P.nbatch),
                  static_cast<unsigned>(P.nsplit));
  stream_gemm_mma_kernel<T, A_KMAJOR><<<grid, kSgThreads, 0, stream>>>(P);
  check_launch(name);
}

// K splits for a reduction over K = T tokens: enough blocks for the device, >= 256 per split.
inline int stream_splits(int64_t blocks, int64_t K) {
  const int64_t sms = sm_count();
  int64_t sp = std::max<int64_t>(1, ceil_div(2 * sms, std::max<int64_t>(blocks, 1)));
  sp = std::min<int64_t>(sp, std::max<int64_t>(1, K / 256));
  return static_cast<int>(std::min<int64_t>(sp, 65535));
}

inline bool al16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

HeadwiseTcParams headwise_tc_params(const HeadwiseShape& s, const at::Tensor& basis,
                                    const at::Tensor& A, const at::Tensor& B, const void* bias,
                                    void* out) {
  HeadwiseTcParams Q{};
  Q.basis = basis.data_ptr();
  Q.A = A.data_ptr();
  Q.B = B.data_ptr();
  Q.bias = bias;
  Q.out = out;
  Q.s = s;
  Q.basis_ld = s.shared ? s.d_b : int64_t(s.H) * s.d_b;
  Q.r8 = (s.r + 7) / 8 * 8;
  Q.r16 = (s.r + 15) / 16 * 16;
  Q.p16 = (s.p + 15) / 16 * 16;
  Q.HG = s.shared ? std::max(1, std::min(s.H, kHwMaxN / Q.r8)) : 1;
  Q.vec = s.d_b % 8 == 0 && al16(Q.basis) && al16(Q.A);
  Q.u_out = nullptr;
  Q.uw = u_width(s.r);
  Q.u_only = false;
  return Q;
}

// Tensor-core backward: U (the forward's, or recomputed by the mma kernel), dU, dbasis = dU A,
// dA = dU^T basis, dB = g^T U and with it dbias = sum_t g (U's ones column); weight gradients
// split over tokens and reduced in a fixed order.
template <typename T>
void headwise_bwd_tc(const HeadwiseShape& s, const at::Tensor& g, const at::Tensor& basis,
                     const at::Tensor& A, const at::Tensor& B, bool has_bias,
                     const at::Tensor& U_saved, at::Tensor& dbasis, at::Tensor& dA,
                     at::Tensor& dB, at::Tensor& dbias, const HeadwiseTcParams& Q, size_t qsmem,
                     cudaStream_t stream) {
  const int64_t hr = int64_t(s.H) * s.r;
  const int uw = u_width(s.r);
  at::Tensor Uw = U_saved;
  if (Uw.numel() == 0) {  // no U from the forward: recompute it (one more pass over the basis)
    Uw = at::empty({s.T, int64_t(s.H), int64_t(uw)}, basis.options());
    HeadwiseTcParams P = Q;
    P.u_out = Uw.data_ptr();
    P.u_only = true;
    launch_headwise_tc<T>(P, qsmem, stream);
  }
  at::Tensor dUw = at::empty({s.T, hr}, basis.options());
  const auto fopts = basis.options().dtype(at::kFloat);
  // dU_h (T x r) = g_h (T x p) B_h (p x r), batch h, on the tensor cores (K = p): rounded to T
  // on store, as the reference rounds dU
  {
    StreamGemmParams G{};
    G.a = g.data_ptr();
    G.b = B.data_ptr();
    G.c = dUw.data_ptr();
    G.lda = int64_t(s.H) * s.p;
    G.ldb = s.r;
    G.ldc = hr;
    G.M = static_cast<int>(std::min<int64_t>(s.T, INT32_MAX));
    G.N = s.r;
    G.K = s.p;
    G.nbatch = s.H;
    G.a_batch = s.p;
    G.b_batch = int64_t(s.p) * s.r;
    G.c_batch = s.r;
    G.nsplit = 1;
    G.k_per_split = G.K;
    G.vec = s.p % 8 == 0 && s.r % 8 == 0 && al16(G.a) && al16(G.b);
    launch_stream_gemm<T, true>(G, stream, "stream_gemm_mma_kernel<dU>");
  }
  const T* basis_p = basis.data_ptr<T>();
  const int64_t bld = s.shared ? s.d_b : hr / s.r * s.d_b;  // basis row stride
  // dbasis (T, [H,] d_b) = dU (T, H*r) A (H*r, d_b): shared -> one GEMM with K = H*r;
  // per head -> batch h: K = r, A rows of head h, output columns of head h.
  if (dbasis.numel() > 0) {
    StreamGemmParams G{};
    G.a = dUw.data_ptr();
    G.b = A.data_ptr();
    G.c = dbasis.data_ptr();
    G.lda = hr;
    G.ldb = s.d_b;
    G.ldc = bld;
    G.M = static_cast<int>(std::min<int64_t>(s.T, INT32_MAX));
    G.N = s.d_b;
    G.nsplit = 1;
    if (s.shared) {
      G.K = static_cast<int>(hr);
      G.nbatch = 1;
    } else {
      G.K = s.r;
      G.nbatch = s.H;
      G.a_batch = s.r;
      G.b_batch = int64_t(s.r) * s.d_b;
      G.c_batch = s.d_b;
    }
    G.k_per_split = G.K;
    G.vec = hr % 8 == 0 && s.d_b % 8 == 0 && (s.shared || s.r % 8 == 0) && al16(G.a) &&
            al16(G.b);
    launch_stream_gemm<T, true>(G, stream, "stream_gemm_mma_kernel<dbasis>");
  }
  // dA (H, r, d_b): shared -> (H*r x d_b) = dU^T basis in one GEMM; per head -> batch h.
  {
    StreamGemmParams G{};
    G.a = dUw.data_ptr();
    G.b = basis_p;
    G.lda = hr;
    G.ldb = bld;
    G.M = s.shared ? static_cast<int>(hr) : s.r;
    G.N = s.d_b;
    G.K = static_cast<int>(s.T);
    G.nbatch = s.shared ? 1 : s.H;
    G.a_batch = s.shared ? 0 : s.r;
    G.b_batch = s.shared ? 0 : s.d_b;
    const int64_t tiles = ceil_div(G.M, kSgBM) * ceil_div(G.N, kSgBN) * G.nbatch;
    G.nsplit = stream_splits(tiles, s.T);
    G.k_per_split = static_cast<int>(ceil_div(ceil_div(s.T, G.nsplit), kSgBK) * kSgBK);
    G.nsplit = static_cast<int>(ceil_div(s.T, G.k_per_split));
    at::Tensor part = at::empty({int64_t(G.nsplit) * hr * s.d_b}, fopts);
    G.part = part.data_ptr<float>();
    G.vec = hr % 8 == 0 && bld % 8 == 0 && s.d_b % 8 == 0 && (s.shared || s.r % 8 == 0) &&
            al16(G.a) && al16(G.b);
    launch_stream_gemm<T, false>(G, stream, "stream_gemm_mma_kernel<dA>");
    reduce_partials<T>(G.part, G.nsplit, hr * s.d_b, hr * s.d_b, dA.data_ptr<T>(), nullptr,
                       stream);
  }
  // dB_h (p x r) = g_h^T U_h, batch h. With a bias, U's column r holds ones, so column r of
  // the same product is dbias_h = sum_t g_h: one pass over g for both, split apart by the
  // reduction (rows (h, o) of N = r + 1 values: r to dB, 1 to dbias).
  {
    const int N = s.r + (has_bias ? 1 : 0);
    StreamGemmParams G{};
    G.a = g.data_ptr();
    G.b = Uw.data_ptr();
    G.lda = int64_t(s.H) * s.p;
    G.ldb = int64_t(s.H) * uw;
    G.M = s.p;
    G.N = N;
    G.K = static_cast<int>(s.T);
    G.nbatch = s.H;
    G.a_batch = s.p;
    G.b_batch = uw;
    const int64_t tiles = ceil_div(G.M, kSgBM) * ceil_div(G.N, kSgBN) * G.nbatch;
    G.nsplit = stream_splits(tiles, s.T);
    G.k_per_split = static_cast<int>(ceil_div(ceil_div(s.T, G.nsplit), kSgBK) * kSgBK);
    G.nsplit = static_cast<int>(ceil_div(s.T, G.k_per_split));
    const int64_t rows = int64_t(s.H) * s.p;
    at::Tensor part = at::empty({int64_t(G.nsplit) * rows * N}, fopts);
    G.part = part.data_ptr<float>();
    G.vec = s.p % 8 == 0 && al16(G.a) && al16(G.b);  // uw is a multiple of 8
    launch_stream_gemm<T, false>(G, stream, "stream_gemm_mma_kernel<dB>");
    reduce_partials_rows<T>(G.part, G.nsplit, rows * N, N, s.r, has_bias ? 1 : 0,
                            dB.data_ptr<T>(), has_bias ? dbias.data_ptr<T>() : nullptr, stream);
  }
}

HeadwiseShape check_headwise(const char* op, const at::Tensor& basis, const at::Tensor& A,
                             const at::Tensor& B) {
  check_float_cuda(basis, "basis");
  check_float_cuda(A, "A");
  check_float_cuda(B, "B");
  check_like(A, "A", basis, "basis");
  check_like(B, "B", basis, "basis");
  check_dim(A, 3, "A", "(H, r, d_b)");
  check_dim(B, 3, "B", "(H, p, r)");
  TORCH_CHECK(basis.dim() == 2 || basis.dim() == 3, "kfused: ", op,
              ": basis must be (T, d_b) shared by all heads or (T, H, d_b) one per head (",
              describe(basis), ")");
  check_contiguous(basis, "basis");
  check_contiguous(A, "A");
  check_contiguous(B, "B");
  HeadwiseShape s;
  s.T = basis.size(0);
  s.H = static_cast<int>(A.size(0));
  s.r = static_cast<int>(A.size(1));
  s.d_b = static_cast<int>(A.size(2));
  s.p = static_cast<int>(B.size(1));
  s.shared = basis.dim() == 2;
  TORCH_CHECK(B.size(0) == s.H && B.size(2) == s.r, "kfused: ", op, ": B (", describe(B),
              ") must be (H, p, r) = (", s.H, ", p, ", s.r, ") to match A ", A.sizes());
  TORCH_CHECK(basis.size(-1) == s.d_b && (s.shared || basis.size(1) == s.H), "kfused: ", op,
              ": basis (", describe(basis), ") must be (T, ", s.d_b, ") or (T, ", s.H, ", ",
              s.d_b, ") to match A ", A.sizes());
  TORCH_CHECK(s.H <= 65535, "kfused: ", op, ": at most 65535 heads (A ", A.sizes(), ")");
  return s;
}

// The tensor-core path's shape rule: 16-bit, 1 <= r <= 64 (also the rule for a saved U, which
// the Python fake follows: it cannot see the shared-memory check below).
bool tc_shape(const HeadwiseShape& s, const at::Tensor& basis) {
  return basis.scalar_type() != at::kFloat && s.r >= 1 && s.r <= kHwMaxN && s.d_b >= 1 &&
         s.p >= 1;
}

// The tensor-core path's rule (forward and backward alike): tc_shape, and its tiles fit in
// shared memory; `smem` gets their size.
bool tc_path(const HeadwiseShape& s, const at::Tensor& basis, const HeadwiseTcParams& Q,
             size_t* smem) {
  if (!tc_shape(s, basis)) return false;
  *smem = headwise_tc_smem(Q.HG, Q.r16, Q.p16).total;
  return static_cast<int64_t>(*smem) <= max_smem_optin();
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> headwise_lowrank_fwd(const at::Tensor& basis,
                                                        const at::Tensor& A, const at::Tensor& B,
                                                        const std::optional<at::Tensor>& bias,
                                                        bool save_u) {
  const HeadwiseShape s = check_headwise("headwise_lowrank_fwd", basis, A, B);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    check_float_cuda(*bias, "bias");
    check_like(*bias, "bias", basis, "basis");
    check_contiguous(*bias, "bias");
    TORCH_CHECK(bias->dim() == 2 && bias->size(0) == s.H && bias->size(1) == s.p,
                "kfused: headwise_lowrank_fwd: bias (", describe(*bias), ") must be (H, p) = (",
                s.H, ", ", s.p, ")");
  }
  at::Tensor out = at::empty({s.T, static_cast<int64_t>(s.H), static_cast<int64_t>(s.p)},
                             basis.options());
  // U for the backward (only the tensor-core path writes it, and only that path of the
  // backward reads it)
  at::Tensor U = save_u && tc_shape(s, basis) ? at::empty({s.T, static_cast<int64_t>(s.H),
                                            static_cast<int64_t>(u_width(s.r))},
                                           basis.options())
                               : at::empty({0}, basis.options());
  if (out.numel() == 0) return {out, U};
  DeviceGuard guard(basis);
  cudaStream_t stream = current_stream();
  HeadwiseTcParams Q = headwise_tc_params(s, basis, A, B, has_bias ? bias->data_ptr() : nullptr,
                                          out.data_ptr());
  size_t tc_smem = 0;
  if (tc_path(s, basis, Q, &tc_smem)) {
    if (U.numel() > 0) Q.u_out = U.data_ptr();
    if (basis.scalar_type() == at::kHalf)
      launch_headwise_tc<c10::Half>(Q, tc_smem, stream);
    else
      launch_headwise_tc<c10::BFloat16>(Q, tc_smem, stream);
    return {out, U};
  }
  HeadwiseFwdParams P{};
  P.basis = basis.data_ptr();
  P.A = A.data_ptr();
  P.B = B.data_ptr();
  P.bias = has_bias ? bias->data_ptr() : nullptr;
  P.out = out.data_ptr();
  P.s = s;
  const dim3 grid(static_cast<unsigned>(ceil_div(s.T, kWarps * kTokensPerWarp)), s.H);
  const size_t smem = sizeof(float) * kWarps * kTokensPerWarp * std::max(s.r, 1);
  KFUSED_DISPATCH_FLOAT(basis.scalar_type(), "headwise_lowrank_fwd", [&] {
    set_smem(headwise_rows_kernel<scalar_t, false>, smem, "headwise_rows_kernel");
    headwise_rows_kernel<scalar_t, false><<<grid, kWarps * 32, smem, stream>>>(P);
    check_launch("headwise_rows_kernel");
  });
  return {out, U};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> headwise_lowrank_bwd(
    const at::Tensor& g, const at::Tensor& basis, const at::Tensor& A, const at::Tensor& B,
    bool has_bias, const std::optional<at::Tensor>& U) {
  const HeadwiseShape s = check_headwise("headwise_lowrank_bwd", basis, A, B);
  at::Tensor Us = U.has_value() && U->defined() ? *U : at::Tensor();
  if (Us.defined() && Us.numel() == 0) Us = at::Tensor();
  if (Us.defined()) {
    check_float_cuda(Us, "U");
    check_like(Us, "U", basis, "basis");
    check_contiguous(Us, "U");
    const int uw = u_width(s.r);
    TORCH_CHECK(basis.scalar_type() != at::kFloat && Us.dim() == 3 && Us.size(0) == s.T &&
                    Us.size(1) == s.H && Us.size(2) == uw,
                "kfused: headwise_lowrank_bwd: U (", describe(Us), ") must be the (T, H, ", uw,
                ") = (", s.T, ", ", s.H, ", ", uw, ") tensor headwise_lowrank_fwd(save_u=True) "
                "returned for this 16-bit basis, or None");
  }
  check_float_cuda(g, "g");
  check_like(g, "g", basis, "basis");
  check_contiguous(g, "g");
  TORCH_CHECK(g.dim() == 3 && g.size(0) == s.T && g.size(1) == s.H && g.size(2) == s.p,
              "kfused: headwise_lowrank_bwd: g (", describe(g), ") must be (T, H, p) = (", s.T,
              ", ", s.H, ", ", s.p, ")");
  at::Tensor dbasis = at::empty_like(basis);
  at::Tensor dA = at::empty_like(A);
  at::Tensor dB = at::empty_like(B);
  at::Tensor dbias = has_bias ? at::empty({s.H, s.p}, basis.options())
                              : at::empty({0}, basis.options());
  if (s.T == 0 || s.H == 0) {
    dA.zero_();
    dB.zero_();
    dbias.zero_();
    return {dbasis, dA, dB, dbias};
  }
  DeviceGuard guard(basis);
  cudaStream_t stream = current_stream();
  {
    const HeadwiseTcParams Q = headwise_tc_params(s, basis, A, B, nullptr, nullptr);
    size_t smem = 0;
    if (tc_path(s, basis, Q, &smem)) {
      const at::Tensor Uin = Us.defined() ? Us : at::empty({0}, basis.options());
      if (basis.scalar_type() == at::kHalf)
        headwise_bwd_tc<c10::Half>(s, g, basis, A, B, has_bias, Uin, dbasis, dA, dB, dbias, Q,
                                   smem, stream);
      else
        headwise_bwd_tc<c10::BFloat16>(s, g, basis, A, B, has_bias, Uin, dbasis, dA, dB, dbias,
                                       Q, smem, stream);
      return {dbasis, dA, dB, dbias};
    }
  }
  const auto fopts = basis.options().dtype(at::kFloat);
  const int64_t hr = int64_t(s.H) * s.r;
  at::Tensor Uw = at::empty({s.T, hr}, fopts);
  at::Tensor dUw = at::empty({s.T, hr}, fopts);

  // Token splits for the weight-gradient reductions: enough blocks to fill the device, at
  // least 32 tokens per split.
  const int64_t sms = sm_count();
  auto splits_for = [&](int64_t ncols) {
    const int64_t bx = ceil_div(ncols, 256);
    int64_t sp = std::max<int64_t>(1, ceil_div(4 * sms, bx));
    sp = std::min<int64_t>(sp, std::max<int64_t>(1, ceil_div(s.T, 32)));
    return std::min<int64_t>(sp, 65535);
  };
  const int64_t nA = hr * s.d_b, nB = hr * s.p, nbias = has_bias ? int64_t(s.H) * s.p : 0;
  const int64_t spA = splits_for(int64_t(s.H) * s.d_b), spB = splits_for(int64_t(s.H) * s.p);
  at::Tensor partA = at::empty({spA, nA}, fopts);
  at::Tensor partB = at::empty({spB, nB + nbias}, fopts);

  KFUSED_DISPATCH_FLOAT(basis.scalar_type(), "headwise_lowrank_bwd", [&] {
    HeadwiseFwdParams P{};
    P.basis = basis.data_ptr();
    P.A = A.data_ptr();
    P.B = B.data_ptr();
    P.g = g.data_ptr();
    P.Uw = Uw.data_ptr<float>();
    P.dUw = dUw.data_ptr<float>();
    P.s = s;
    const size_t smem = sizeof(float) * kWarps * kTokensPerWarp * std::max(s.r, 1);
    set_smem(headwise_rows_kernel<scalar_t, true>, smem, "headwise_rows_kernel");
    const dim3 grid(static_cast<unsigned>(ceil_div(s.T, kWarps * kTokensPerWarp)), s.H);
    headwise_rows_kernel<scalar_t, true><<<grid, kWarps * 32, smem, stream>>>(P);
    check_launch("headwise_rows_kernel<bwd>");
    {
      const int64_t n = s.T * hr;
      const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div(n, 256), 65535));
      headwise_du_kernel<scalar_t, float><<<blocks, 256, 0, stream>>>(
          g.data_ptr<scalar_t>(), B.data_ptr<scalar_t>(), P.dUw, s);
      check_launch("headwise_du_kernel");
    }

    if (dbasis.numel() > 0) {
      const int C = s.shared ? s.H * s.r : s.r;
      const size_t dsmem = sizeof(float) * kDbTokens * std::max(C, 1);
      set_smem(headwise_dbasis_kernel<scalar_t>, dsmem, "headwise_dbasis_kernel");
      const dim3 dgrid(static_cast<unsigned>(ceil_div(s.T, kDbTokens)), s.shared ? 1 : s.H);
      headwise_dbasis_kernel<scalar_t><<<dgrid, kDbThreads, dsmem, stream>>>(
          P.dUw, A.data_ptr<scalar_t>(), dbasis.data_ptr<scalar_t>(), s);
      check_launch("headwise_dbasis_kernel");
    }

    ColReduceParams R{};
    R.coef = P.dUw;
    R.T = s.T;
    R.H = s.H;
    R.r = s.r;
    if (nA > 0) {
      R.data = basis.data_ptr();
      R.ds = s.shared ? s.d_b : int64_t(s.H) * s.d_b;
      R.dh = s.shared ? 0 : s.d_b;
      R.part = partA.data_ptr<float>();
      R.n_total = nA;
      R.tokens_per_split = ceil_div(s.T, spA);
      R.W = s.d_b;
      R.layout = 0;
      R.ones = false;
      const dim3 cgrid(static_cast<unsigned>(ceil_div(int64_t(s.H) * s.d_b, 256)),
                       static_cast<unsigned>(spA));
      headwise_colreduce_kernel<scalar_t><<<cgrid, 256, 0, stream>>>(R);
      check_launch("headwise_colreduce_kernel<dA>");
      reduce_partials<scalar_t>(R.part, spA, nA, nA, dA.data_ptr<scalar_t>(), nullptr, stream);
    } else {
      dA.zero_();
    }
    if (nB + nbias > 0) {
      R.data = g.data_ptr();
      R.coef = P.Uw;
      R.ds = int64_t(s.H) * s.p;
      R.dh = s.p;
      R.part = partB.data_ptr<float>();
      R.n_total = nB + nbias;
      R.tokens_per_split = ceil_div(s.T, spB);
      R.W = s.p;
      R.layout = 1;
      R.ones = has_bias;
      const dim3 cgrid(static_cast<unsigned>(ceil_div(int64_t(s.H) * s.p, 256)),
                       static_cast<unsigned>(spB));
      headwise_colreduce_kernel<scalar_t><<<cgrid, 256, 0, stream>>>(R);
      check_launch("headwise_colreduce_kernel<dB>");
      reduce_partials<scalar_t>(R.part, spB, nB + nbias, nB, dB.data_ptr<scalar_t>(),
                                has_bias ? dbias.data_ptr<scalar_t>() : nullptr, stream);
    }
  });
  return {dbasis, dA, dB, dbias};
}

}  // namespace kfused
