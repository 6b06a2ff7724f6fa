// Kronecker matvec (docs/math.md §1): y[t] = vec(A X[t] B^T) with X[t] = x[t].view(a_in, b_in),
// and its backward, without ever forming A ⊗ B.
//
// Design. One thread block owns a tile of TT consecutive tokens (a persistent loop walks the
// tiles). The factors are staged once per block in shared memory as float; the token tile is
// loaded with coalesced reads and converted to float. The two small products are done by a
// register-tiled block GEMM (common/common.cuh) whose operands are strided views of shared
// memory:
//   forward   V = A X[t]              (a_out x b_in per token, rounded to the input dtype)
//             Y = V B^T               (rows (t, j) stacked: one GEMM over the tile)
// The order and the rounding point are those of the reference `(A @ X) @ B.T` run in the
// input dtype, so the kernel's error tracks torch's. Backward follows torch's autograd of that
// chain in one pass over g and x:
//   W = G[t] B (rounded), V = A X[t] (rounded), dX[t] = A^T W, dA += W X[t]^T, dB += G[t]^T V.
// dA and dB accumulate in float per block (shared memory, or the block's slice of a global
// workspace when they do not fit) and are reduced over blocks in a fixed order afterwards, so
// weight gradients are deterministic.
//
// Limits. Everything is float32 FMA on CUDA cores (no tensor cores): exact enough for the
// docs/math.md §4 rule in float32 too. When the factors do not fit in shared memory next to one token
// they are read from a float copy in global memory (L1/L2 resident); when a single token's
// working set (forward: a_in*b_in + a_out*b_in floats; backward: a_in*(b_in|1) + a_out*b_out
// + 2*a_out*b_in floats) exceeds the device's opt-in shared memory (227 KiB on sm_90, i.e.
// d around 28k) the host raises a clear error.

#include "common/common.cuh"
#include "common/mma.cuh"
#include "kfused.h"

#include <climits>

namespace kfused {
namespace {

constexpr int kThreads = 256;
constexpr int kTileMaxTokens = 16;
constexpr size_t kPreferredSmem = 64 * 1024;  // three blocks per SM on sm_90
constexpr int kNoSplit = INT_MAX;             // GemmB.cdiv when columns are not split

inline int odd_pitch(int n) { return n | 1; }

struct KronShape {
  int a_out, a_in, b_out, b_in;
};

struct KronFwdParams {
  const void* x;
  void* y;
  int64_t T;
  const void* A;  // (a_out, a_in) with strides sA0, sA1
  const void* B;  // (b_out, b_in) with strides sB0, sB1
  int64_t sA0, sA1, sB0, sB1;
  const float* Ag;  // contiguous float copies, used when the factors are not staged
  const float* Bg;
  KronShape s;
  int TT;
  int pB;  // row pitch of B in shared memory
  bool stage;
};

template <typename T>
__device__ void stage_factors(float* As, float* Bs, int pB, const T* A, int64_t sA0,
                              int64_t sA1, const T* B, int64_t sB0, int64_t sB1,
                              const KronShape& s) {
  for (int e = threadIdx.x; e < s.a_out * s.a_in; e += blockDim.x) {
    const int j = e / s.a_in, i = e - j * s.a_in;
    As[e] = to_float(A[j * sA0 + i * sA1]);
  }
  for (int e = threadIdx.x; e < s.b_out * s.b_in; e += blockDim.x) {
    const int o = e / s.b_in, k = e - o * s.b_in;
    Bs[o * pB + k] = to_float(B[o * sB0 + k * sB1]);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) kron_fwd_kernel(const KronFwdParams P) {
  extern __shared__ float smem[];
  const KronShape s = P.s;
  const int d_in = s.a_in * s.b_in, d_out = s.a_out * s.b_out;
  float* sp = smem;
  const float* As = P.Ag;
  const float* Bs = P.Bg;
  int pB = s.b_in;
  if (P.stage) {
    float* a = sp;
    sp += s.a_out * s.a_in;
    float* b = sp;
    sp += s.b_out * P.pB;
    stage_factors<T>(a, b, P.pB, static_cast<const T*>(P.A), P.sA0, P.sA1,
                     static_cast<const T*>(P.B), P.sB0, P.sB1, s);
    As = a;
    Bs = b;
    pB = P.pB;
  }
  float* Xs = sp;  // (TT, a_in, b_in)
  sp += P.TT * d_in;
  float* Vs = sp;  // (TT, a_out, b_in)

  const T* x = static_cast<const T*>(P.x);
  T* y = static_cast<T*>(P.y);
  const int64_t ntiles = (P.T + P.TT - 1) / P.TT;
  for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const int64_t t0 = tile * P.TT;
    const int nt = static_cast<int>(P.T - t0 < P.TT ? P.T - t0 : P.TT);
    __syncthreads();  // factors staged / previous tile fully consumed
    const T* xt = x + t0 * d_in;
    for (int e = threadIdx.x; e < nt * d_in; e += blockDim.x) Xs[e] = to_float(xt[e]);
    __syncthreads();

    // V[t][j][k] = sum_i A[j][i] X[t][i][k]: M = a_out, N = (t, k), K = i.
    block_gemm<4, 4>(
        s.a_out, nt * s.b_in, s.a_in, 1, GemmA{As, s.a_in, 1, 0},
        GemmB{Xs, s.b_in, 1, s.b_in, d_in, 0}, [&](int j, int n, float v) {
          const int t = n / s.b_in, k = n - t * s.b_in;
          Vs[(t * s.a_out + j) * s.b_in + k] = round_to<T>(v);
        });
    __syncthreads();

    // Y[(t, j)][o] = sum_k V[(t, j)][k] B[o][k]: rows (t, j) are contiguous rows of y.
    T* yt = y + t0 * d_out;
    block_gemm<4, 4>(nt * s.a_out, s.b_out, s.b_in, 1, GemmA{Vs, s.b_in, 1, 0},
                     GemmB{Bs, 1, pB, kNoSplit, 0, 0}, [&](int r, int o, float v) {
                       yt[r * s.b_out + o] = static_cast<T>(v);
                     });
  }
}

struct KronBwdParams {
  const void* g;
  const void* x;
  void* dx;
  int64_t T;
  const void* A;
  const void* B;
  int64_t sA0, sA1, sB0, sB1;
  const float* Ag;
  const float* Bg;
  float* part;  // (gridDim.x, a_out*a_in + b_out*b_in) per-block dA | dB
  KronShape s;
  int TT;
  int pB;
  int pX;  // row pitch of X in shared memory (odd: X^T reads are bank-conflict free)
  bool stage;
  bool acc_smem;
  bool need_dx;  // false: dA, dB only (dx is not formed)
  float scale;   // dx (and, at the reduction, dA, dB) of scale * kron(x)
};

template <typename T>
__global__ void __launch_bounds__(kThreads) kron_bwd_kernel(const KronBwdParams P) {
  extern __shared__ float smem[];
  const KronShape s = P.s;
  const int d_in = s.a_in * s.b_in, d_out = s.a_out * s.b_out;
  const int nA = s.a_out * s.a_in, nB = s.b_out * s.b_in;
  float* sp = smem;
  const float* As = P.Ag;
  const float* Bs = P.Bg;
  int pB = s.b_in;
  if (P.stage) {
    float* a = sp;
    sp += nA;
    float* b = sp;
    sp += s.b_out * P.pB;
    stage_factors<T>(a, b, P.pB, static_cast<const T*>(P.A), P.sA0, P.sA1,
                     static_cast<const T*>(P.B), P.sB0, P.sB1, s);
    As = a;
    Bs = b;
    pB = P.pB;
  }
  float* part = P.part + static_cast<int64_t>(blockIdx.x) * (nA + nB);
  float* dAacc = part;
  if (P.acc_smem) {
    dAacc = sp;
    sp += nA + nB;
  }
  float* dBacc = dAacc + nA;
  for (int e = threadIdx.x; e < nA + nB; e += blockDim.x) dAacc[e] = 0.f;
  const int pX = P.pX;
  float* Xs = sp;  // (TT, a_in, pX)
  sp += P.TT * s.a_in * pX;
  float* Gs = sp;  // (TT, a_out, b_out)
  sp += P.TT * d_out;
  float* Ws = sp;  // (TT, a_out, b_in)
  sp += P.TT * s.a_out * s.b_in;
  float* Vs = sp;  // (TT, a_out, b_in)

  const T* x = static_cast<const T*>(P.x);
  const T* g = static_cast<const T*>(P.g);
  T* dx = static_cast<T*>(P.dx);
  const int64_t ntiles = (P.T + P.TT - 1) / P.TT;
  for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const int64_t t0 = tile * P.TT;
    const int nt = static_cast<int>(P.T - t0 < P.TT ? P.T - t0 : P.TT);
    __syncthreads();
    const T* xt = x + t0 * d_in;
    for (int e = threadIdx.x; e < nt * d_in; e += blockDim.x) {
      const int r = e / s.b_in, k = e - r * s.b_in;
      Xs[r * pX + k] = to_float(xt[e]);
    }
    const T* gt = g + t0 * d_out;
    for (int e = threadIdx.x; e < nt * d_out; e += blockDim.x) Gs[e] = to_float(gt[e]);
    __syncthreads();

    // W[(t, j)][k] = sum_o G[(t, j)][o] B[o][k]   (torch's dZ = G @ B, rounded)
    block_gemm<4, 4>(nt * s.a_out, s.b_in, s.b_out, 1, GemmA{Gs, s.b_out, 1, 0},
                     GemmB{Bs, pB, 1, kNoSplit, 0, 0}, [&](int r, int k, float v) {
                       Ws[r * s.b_in + k] = round_to<T>(v);
                     });
    // V[t][j][k] = sum_i A[j][i] X[t][i][k]       (the forward intermediate, rounded)
    block_gemm<4, 4>(
        s.a_out, nt * s.b_in, s.a_in, 1, GemmA{As, s.a_in, 1, 0},
        GemmB{Xs, pX, 1, s.b_in, s.a_in * pX, 0}, [&](int j, int n, float v) {
          const int t = n / s.b_in, k = n - t * s.b_in;
          Vs[(t * s.a_out + j) * s.b_in + k] = round_to<T>(v);
        });
    __syncthreads();

    // dX[t][i][k] = scale * sum_j A[j][i] W[t][j][k]
    if (P.need_dx) {
      T* dxt = dx + t0 * d_in;
      block_gemm<4, 4>(
          s.a_in, nt * s.b_in, s.a_out, 1, GemmA{As, 1, s.a_in, 0},
          GemmB{Ws, s.b_in, 1, s.b_in, s.a_out * s.b_in, 0}, [&](int i, int n, float v) {
            const int t = n / s.b_in, k = n - t * s.b_in;
            dxt[t * d_in + i * s.b_in + k] = static_cast<T>(v * P.scale);
          });
    }
    // dA[j][i] += sum_t sum_k W[t][j][k] X[t][i][k]   (each thread owns its elements)
    block_gemm<4, 4>(s.a_out, s.a_in, s.b_in, nt, GemmA{Ws, s.b_in, 1, s.a_out * s.b_in},
                     GemmB{Xs, 1, pX, kNoSplit, 0, s.a_in * pX},
                     [&](int j, int i, float v) { dAacc[j * s.a_in + i] += v; });
    // dB[o][k] += sum_t sum_j G[t][j][o] V[t][j][k]
    block_gemm<4, 4>(s.b_out, s.b_in, s.a_out, nt, GemmA{Gs, 1, s.b_out, d_out},
                     GemmB{Vs, s.b_in, 1, kNoSplit, 0, s.a_out * s.b_in},
                     [&](int o, int k, float v) { dBacc[o * s.b_in + k] += v; });
  }
  if (P.acc_smem) {
    __syncthreads();
    for (int e = threadIdx.x; e < nA + nB; e += blockDim.x) part[e] = dAacc[e];
  }
}

// ------------------------------------------------------------------------------------------
// Narrow factors (two small sides, the paper's 2 x 384 / 384 x 2): a block per token
// ------------------------------------------------------------------------------------------
//
// Written for one orientation, A' (m x K), B' (J x n) with m and n small, X'[t] (K x n),
// G'[t] (m x J); the other orientation (a_in and b_out small) is the same computation on the
// transposed tokens, Y[t]^T = B X[t]^T A^T: A' = B, B' = A, X' = X^T, G' = G^T (strides only).
// Every token's intermediates V = A' X' and W = G' B' are m x n values, each a dot product over
// K or J, and the rest are rank-m / rank-n updates:
//   dX'[k][l] = sum_i A'[i][k] W[i][l],  dA'[i][k] += sum_l W[i][l] X'[k][l],
//   dB'[j][l] += sum_i G'[i][j] V[i][l]   (V, W rounded to the input dtype, as everywhere).
// A block walks tokens (persistent); a token's rows x[t] and g[t] are staged in shared memory
// by 16-byte cp.async, double buffered (the next token lands while this one is computed).
// Thread c holds the big indices k = c + kThreads u (u < KC) and j = c + kThreads u (u < JC):
// V and W are per-thread partial sums reduced over the block (shuffles, then the warps' sums
// in a fixed order), the weight gradients accumulate in the thread's registers — every (i, k)
// and (j, l) belongs to one thread of the block, so the block's partial row is written without
// any reduction: deterministic. A' and B'^T (float, zero-padded to M rows / N columns) are
// staged in shared memory once. The tensor-core kernel would pad both small sides to 16 (64x
// the MACs at 2 x 384 / 384 x 2), and block_gemm parallelises over the m x n outputs of V and
// W only (the H100 ran that kernel at 753 us for T = 16384 at 768 x 768, against 68 us for
// the Triton factor kernel); here x and g are read once and the work spreads over K and J.
// FWD (kron_matvec's forward on the same factors): Y'[t] = V B'^T written at G'[t]'s layout
// (y in place of g), from x's rows alone; no weight gradients.
struct KronNarrowParams {
  const void* x;
  const void* g;  // dy (backward)
  void* y;        // y (FWD), at G'[t]'s layout
  void* dx;
  const void* A;  // A' (m x K): element (i, k) at A[i * sai + k * sak]
  const void* B;  // B' (J x n): element (j, l) at B[j * sbj + l * sbl]
  int64_t sai, sak, sbj, sbl;
  int64_t T;
  int d_in, d_out;
  int xk, xl;  // X'[t] element (k, l) at x[t * d_in + k * xk + l * xl] (dx likewise)
  int gi, gj;  // G'[t] element (i, j) at g[t * d_out + i * gi + j * gj]
  int m, n, K, J;
  int rx, rg;   // a token buffer's x and g rows (d_in, d_out rounded up to 16 bytes)
  float* part;  // (gridDim.x, nAB): dA'-grad at offA (m x K), dB'-grad at offB (J x n)
  int64_t nAB, offA, offB;
  bool vec;  // 16-byte rows (d_in, d_out multiples of 16 bytes, aligned x and g): cp.async
  bool need_dx;
  float scale;
};

constexpr int kNarrowWarps = kThreads / 32;

// Shared memory (bytes) of the narrow kernel: A' (M x K) and B'^T (N x J) float, the warps'
// partial sums and the block's V and W (floats), then two token buffers (x and g rows).
inline int64_t narrow_smem_bytes(int M, int N, int K, int J, int rx, int rg, int elem_bytes) {
  const int64_t floats = int64_t(M) * K + int64_t(N) * J + (kNarrowWarps + 1) * 2 * M * N;
  return (4 * floats + 15) / 16 * 16 + 2 * int64_t(rx + rg) * elem_bytes;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// One row of n elements from global src into shared dst by the block: 16-byte cp.async chunks
// where vec, else element by element (visible after the next __syncthreads either way).
template <typename T>
__device__ __forceinline__ void narrow_stage_row(T* dst, const T* src, int n, bool vec) {
  constexpr int E = 16 / sizeof(T);  // elements per 16-byte chunk
  if (vec) {
    for (int c = threadIdx.x * E; c < n; c += kThreads * E) mma::cp_async16(dst + c, src + c, true);
  } else {
    for (int c = threadIdx.x; c < n; c += kThreads) dst[c] = src[c];
  }
}

// (the 2 x 2 tier in 64 registers: 4 blocks per SM; the wider tiers take what they need)
template <int M, int N, int KC, int JC>
constexpr int narrow_min_blocks() { return M * N <= 4 && KC <= 2 && JC <= 2 ? 4 : 1; }

template <typename T, int M, int N, int KC, int JC, bool FWD>
__global__ void __launch_bounds__(kThreads, narrow_min_blocks<M, N, KC, JC>())
    kron_narrow_kernel(const KronNarrowParams P) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int m = P.m, n = P.n, K = P.K, J = P.J;
  float* As = reinterpret_cast<float*>(smem_raw);  // (M, K): rows >= m zero
  float* Bt = As + M * K;                          // (N, J): B'^T, rows >= n zero
  float* Red = Bt + N * J;                         // (warps, 2 M N) partial sums
  float* VW = Red + kNarrowWarps * 2 * M * N;      // (2 M N) the token's V, W
  const int64_t fbytes =
      (4 * (int64_t(M) * K + int64_t(N) * J + (kNarrowWarps + 1) * 2 * M * N) + 15) / 16 * 16;
  T* buf = reinterpret_cast<T*>(smem_raw + fbytes);  // 2 x (x row, g row)
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const T* A = static_cast<const T*>(P.A);
  const T* B = static_cast<const T*>(P.B);
  for (int e = tid; e < M * K; e += kThreads) {
    const int i = e / K, k = e - i * K;
    As[e] = i < m ? to_float(A[i * P.sai + k * P.sak]) : 0.f;
  }
  for (int e = tid; e < N * J; e += kThreads) {
    const int l = e / J, j = e - l * J;
    Bt[e] = l < n ? to_float(B[j * P.sbj + l * P.sbl]) : 0.f;
  }
  float accA[M][KC], accB[JC][N];
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int u = 0; u < KC; ++u) accA[i][u] = 0.f;
#pragma unroll
  for (int u = 0; u < JC; ++u)
#pragma unroll
    for (int l = 0; l < N; ++l) accB[u][l] = 0.f;
  const T* x = static_cast<const T*>(P.x);
  const T* g = static_cast<const T*>(P.g);
  T* dx = static_cast<T*>(P.dx);
  auto stage = [&](int64_t t, int b) {
    T* xs = buf + b * (P.rx + P.rg);
    narrow_stage_row<T>(xs, x + t * P.d_in, P.d_in, P.vec);
    if constexpr (!FWD) narrow_stage_row<T>(xs + P.rx, g + t * P.d_out, P.d_out, P.vec);
  };
  if (blockIdx.x < P.T) stage(blockIdx.x, 0);
  mma::cp_async_commit();
  int it = 0;
  for (int64_t t = blockIdx.x; t < P.T; t += gridDim.x, ++it) {
    if (t + gridDim.x < P.T) {
      stage(t + gridDim.x, (it + 1) & 1);
      mma::cp_async_commit();
      mma::cp_async_wait<1>();
    } else {
      mma::cp_async_wait<0>();
    }
    __syncthreads();  // token t's rows (and, the first time, A' and B'^T) in shared memory
    const T* xt = buf + (it & 1) * (P.rx + P.rg);
    const T* gt = xt + P.rx;
    // The thread's values of X'[t] at (k = tid + kThreads u, l) and of G'[t] at (i, j = tid +
    // kThreads u), zero out of range: the index is clamped to 0 (a valid address) and the
    // value selected away — no branch. x_off is the (clamped) offset, also dX's.
    auto x_off = [&](int u, int l) {
      const int k = tid + kThreads * u;
      return (k < K ? k : 0) * P.xk + (l < n ? l : 0) * P.xl;
    };
    auto x_in = [&](int u, int l) { return tid + kThreads * u < K && l < n; };
    auto x_at = [&](int u, int l) -> float {
      const float v = to_float(xt[x_off(u, l)]);
      return x_in(u, l) ? v : 0.f;
    };
    auto g_at = [&](int u, int i) -> float {
      const int j = tid + kThreads * u;
      const float v = to_float(gt[(i < m ? i : 0) * P.gi + (j < J ? j : 0) * P.gj]);
      return j < J && i < m ? v : 0.f;
    };
    // V = A' X', W = G' B': the thread's partial sums over its k and j (likewise clamped)
    float V[M][N], W[M][N];
#pragma unroll
    for (int i = 0; i < M; ++i)
#pragma unroll
      for (int l = 0; l < N; ++l) V[i][l] = W[i][l] = 0.f;
#pragma unroll
    for (int u = 0; u < KC; ++u) {
      const int k = tid + kThreads * u, kc = k < K ? k : 0;
#pragma unroll
      for (int l = 0; l < N; ++l) {
        const float xv = x_at(u, l);
#pragma unroll
        for (int i = 0; i < M; ++i) V[i][l] = fmaf(As[i * K + kc], xv, V[i][l]);
      }
    }
#pragma unroll
    for (int u = 0; u < JC; ++u) {
      if constexpr (FWD) break;
      const int j = tid + kThreads * u, jc = j < J ? j : 0;
#pragma unroll
      for (int i = 0; i < M; ++i) {
        const float gv = g_at(u, i);
#pragma unroll
        for (int l = 0; l < N; ++l) W[i][l] = fmaf(gv, Bt[l * J + jc], W[i][l]);
      }
    }
    // block sums: each warp's by shuffles, then the warps' in order by the first 2 M N threads
#pragma unroll
    for (int i = 0; i < M; ++i)
#pragma unroll
      for (int l = 0; l < N; ++l) {
        const float sv = warp_sum(V[i][l]), sw = warp_sum(W[i][l]);
        if (lane == 0) {
          Red[warp * 2 * M * N + i * N + l] = sv;
          Red[warp * 2 * M * N + M * N + i * N + l] = sw;
        }
      }
    __syncthreads();
    if (tid < 2 * M * N) {
      float a = 0.f;
      for (int w = 0; w < kNarrowWarps; ++w) a += Red[w * 2 * M * N + tid];
      VW[tid] = round_to<T>(a);
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < M; ++i)
#pragma unroll
      for (int l = 0; l < N; ++l) {
        V[i][l] = VW[i * N + l];
        W[i][l] = VW[M * N + i * N + l];
      }
    if constexpr (FWD) {
      // Y'[t][i][j] = sum_l V[i][l] B'[j][l] (the thread's j), written straight to y
      T* yt = static_cast<T*>(P.y) + t * P.d_out;
#pragma unroll
      for (int u = 0; u < JC; ++u) {
        const int j = tid + kThreads * u;
        const int jc = j < J ? j : 0;
#pragma unroll
        for (int i = 0; i < M; ++i) {
          float yv = 0.f;
#pragma unroll
          for (int l = 0; l < N; ++l) yv = fmaf(V[i][l], Bt[l * J + jc], yv);
          if (i < m && j < J) yt[i * P.gi + j * P.gj] = static_cast<T>(yv);
        }
      }
      __syncthreads();  // buffer (it & 1) and VW are reused by the next token
      continue;
    }
    // dA' += W X'^T and dX' = A'^T W (the thread's k); out-of-range threads add zeros to
    // accumulators that are never stored
#pragma unroll
    for (int u = 0; u < KC; ++u) {
      const int k = tid + kThreads * u, kc = k < K ? k : 0;
#pragma unroll
      for (int l = 0; l < N; ++l) {
        const float xv = x_at(u, l);
        float d = 0.f;
#pragma unroll
        for (int i = 0; i < M; ++i) {
          accA[i][u] = fmaf(W[i][l], xv, accA[i][u]);
          d = fmaf(As[i * K + kc], W[i][l], d);
        }
        if (P.need_dx && x_in(u, l)) dx[t * P.d_in + x_off(u, l)] = static_cast<T>(d * P.scale);
      }
    }
    // dB' += G'^T V (the thread's j)
#pragma unroll
    for (int u = 0; u < JC; ++u)
#pragma unroll
      for (int i = 0; i < M; ++i) {
        const float gv = g_at(u, i);
#pragma unroll
        for (int l = 0; l < N; ++l) accB[u][l] = fmaf(gv, V[i][l], accB[u][l]);
      }
    __syncthreads();  // buffer (it & 1) and VW are reused by the next token
  }
  mma::cp_async_wait<0>();
  if constexpr (FWD) return;
  // The block's partial row: every (i, k) and (j, l) is this thread's alone.
  float* row = P.part + static_cast<int64_t>(blockIdx.x) * P.nAB;
#pragma unroll
  for (int u = 0; u < KC; ++u) {
    const int k = tid + kThreads * u;
#pragma unroll
    for (int i = 0; i < M; ++i)
      if (i < m && k < K) row[P.offA + static_cast<int64_t>(i) * K + k] = accA[i][u];
  }
#pragma unroll
  for (int u = 0; u < JC; ++u) {
    const int j = tid + kThreads * u;
#pragma unroll
    for (int l = 0; l < N; ++l)
      if (l < n && j < J) row[P.offB + static_cast<int64_t>(j) * n + l] = accB[u][l];
  }
}

// The narrow kernel's tiers: (M, N) bound the small sides, kThreads KC and kThreads JC the big
// ones (accumulators M KC + JC N floats per thread).
struct NarrowTier {
  int M, N, KC, JC;
};
constexpr NarrowTier kNarrowTiers[] = {{2, 2, 2, 2}, {8, 2, 2, 2}, {2, 8, 2, 2}, {2, 2, 8, 8}};

// ------------------------------------------------------------------------------------------
// Tensor-core path (float16 / bfloat16): the same products on mma.sync m16n8k16
// ------------------------------------------------------------------------------------------
//
// Shared memory holds the operands in the input dtype, every dimension padded with zeros to a
// multiple of 16 and rows of pitch mma::pitch_for(cols) (conflict-free ldmatrix):
//   As  (ao_p, a_in)   Bs (bo_p, b_in)                       staged once per block
//   Xs  2 x TT x (ai_p, b_in)     Gs 2 x TT x (ao_p, b_out)  token tiles, double buffered:
//                                 the next tile lands by 16-byte cp.async during this one
//   Vs  TT x (ao_p, b_in)         Ws TT x (ao_p, b_in)       rounded intermediates
// Token t's rows are padded to ao_p / ai_p, so the stacked rows (t, j) of Vs / Ws / Gs form
// one K-major operand (Y = V B^T and W = G B are one GEMM over the whole tile) and a 16-wide
// k-step never mixes tokens (dX, dA, dB). The padded rows and columns of V and W come out of
// the GEMMs as exact zeros (products with zero padding), so no extra clearing is needed.
// GEMMs (block_mma, 16 x 16 warp tiles, float accumulation):
//   forward   V[t] = A X[t]          (per token)         -> Vs rounded to T
//             Y    = V B^T           (stacked rows)      -> y
//   backward  W    = G B             (stacked rows)      -> Ws rounded to T
//             V[t] = A X[t]                              -> Vs rounded to T
//             dX[t] = A^T W[t]       (per token)         -> dx
//             dA  += sum_t W[t] X[t]^T,  dB += sum_t G[t]^T V[t]   (float, block-private)

struct KronTcDims {
  int ao_p, ai_p, bo_p, bi_p;  // padded to 16
  int PA, PB, PX, PG, PV;      // pitches (elements)
  int sX, sG, sV;              // per-token strides (elements)
};

inline bool mma_aligned(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

inline int r16(int n) { return (n + 15) / 16 * 16; }

inline KronTcDims kron_tc_dims(const KronShape& s) {
  KronTcDims d;
  d.ao_p = r16(s.a_out);
  d.ai_p = r16(s.a_in);
  d.bo_p = r16(s.b_out);
  d.bi_p = r16(s.b_in);
  d.PA = mma::pitch_for(s.a_in);
  d.PB = mma::pitch_for(s.b_in);
  d.PX = mma::pitch_for(s.b_in);
  d.PG = mma::pitch_for(s.b_out);
  d.PV = mma::pitch_for(s.b_in);
  d.sX = d.ai_p * d.PX;
  d.sG = d.ao_p * d.PG;
  d.sV = d.ao_p * d.PV;
  return d;
}

struct KronTcParams {
  const void* x;
  const void* g;  // backward only
  void* y;        // forward: y; backward: dx
  int64_t T;
  const void* A;
  const void* B;
  int64_t sA0, sA1, sB0, sB1;
  float* part;     // backward: (gridDim.x, nA + nB)
  int64_t ntiles;  // ceil(T / TT), computed on the host (no 64-bit division on the device)
  KronShape s;
  KronTcDims d;
  int TT;
  bool vec_x, vec_g;  // 16-byte cp.async rows possible for x / g
  bool acc_smem;
  bool need_dx;  // backward: false -> dA, dB only (dx is not formed)
  float scale;   // backward: dx (and, at the reduction, dA, dB) of scale * kron(x)
};

// Factor (rows x cols, strides s0, s1) into a zero-padded (rpad, pitch) tile.
template <typename T>
__device__ void stage_factor_tc(T* dst, int pitch, int rpad, const T* src, int rows, int cols,
                                int64_t s0, int64_t s1) {
  for (int e = threadIdx.x; e < rpad * pitch; e += blockDim.x) {
    const int r = e / pitch, c = e - r * pitch;
    dst[e] = (r < rows && c < cols) ? src[r * s0 + c * s1] : T(0.f);
  }
}

// nt tokens of `rows` rows x `cols` columns (global row stride `cols`, token stride
// rows * cols) into per-token tiles of (rpad, pitch) with zero padding up to (rpad, cpad).
template <typename T>
__device__ __forceinline__ void load_tokens(T* dst, int pitch, int tok_stride, const T* src,
                                            int nt, int rows, int cols, int rpad, int cpad,
                                            bool vec) {
  const int cchunks = cpad / 8;
  const int per = rpad * cchunks;
  for (int e = threadIdx.x; e < nt * per; e += blockDim.x) {
    const int t = e / per;
    const int rem = e - t * per;
    const int r = rem / cchunks, c = (rem - r * cchunks) * 8;
    T* d = dst + t * tok_stride + r * pitch + c;
    const T* sp = src + (static_cast<int64_t>(t) * rows + r) * cols + c;
    const bool ok = r < rows && c < cols;
    if (vec) {
      mma::cp_async16(d, ok ? sp : src, ok);
    } else {
      alignas(16) T v[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = (ok && c + i < cols) ? sp[i] : T(0.f);
      *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(v);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) kron_mma_fwd_kernel(const KronTcParams P) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const KronShape s = P.s;
  const KronTcDims d = P.d;
  const int d_in = s.a_in * s.b_in, d_out = s.a_out * s.b_out;
  T* As = reinterpret_cast<T*>(smem_raw);
  T* Bs = As + d.ao_p * d.PA;
  T* Xs = Bs + d.bo_p * d.PB;  // 2 buffers
  T* Vs = Xs + 2 * P.TT * d.sX;
  stage_factor_tc<T>(As, d.PA, d.ao_p, static_cast<const T*>(P.A), s.a_out, s.a_in, P.sA0,
                     P.sA1);
  stage_factor_tc<T>(Bs, d.PB, d.bo_p, static_cast<const T*>(P.B), s.b_out, s.b_in, P.sB0,
                     P.sB1);
  const T* x = static_cast<const T*>(P.x);
  T* y = static_cast<T*>(P.y);
  const int64_t ntiles = P.ntiles;
  auto ntok = [&](int64_t tile) {
    const int64_t r = P.T - tile * P.TT;
    return static_cast<int>(r < P.TT ? r : P.TT);
  };
  const bool pair_y = s.b_out % 2 == 0;
  if (blockIdx.x < ntiles)
    load_tokens<T>(Xs, d.PX, d.sX, x + int64_t(blockIdx.x) * P.TT * d_in, ntok(blockIdx.x), s.a_in,
                   s.b_in, d.ai_p, d.bi_p, P.vec_x);
  mma::cp_async_commit();
  int it = 0;
  for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x, ++it) {
    const int64_t next = tile + gridDim.x;
    if (next < ntiles) {
      load_tokens<T>(Xs + ((it + 1) & 1) * P.TT * d.sX, d.PX, d.sX, x + next * P.TT * d_in,
                     ntok(next), s.a_in, s.b_in, d.ai_p, d.bi_p, P.vec_x);
      mma::cp_async_commit();
      mma::cp_async_wait<1>();
    } else {
      mma::cp_async_wait<0>();
    }
    __syncthreads();  // tile `it` (and the factors) visible to every warp
    const int nt = ntok(tile);
    const T* Xb = Xs + (it & 1) * P.TT * d.sX;
    // V[t] = A X[t]: M = a_out, N = b_in, K = a_in, per token.
    mma::block_mma<T, true, false>(
        nt, d.ao_p / 16, d.bi_p / 16, 1, d.ai_p / 16, mma::SmemOp{As, d.PA, 0, 0},
        mma::SmemOp{Xb, d.PX, d.sX, 0}, [&](int t, int j, int k, float v0, float v1) {
          *reinterpret_cast<uint32_t*>(Vs + t * d.sV + j * d.PV + k) = mma::pack2<T>(v0, v1);
        });
    __syncthreads();
    // Y[(t, j)] = V[(t, j)] B^T: stacked rows r = t * ao_p + j.
    T* yt = y + tile * P.TT * d_out;
    mma::block_mma<T, true, true>(
        1, nt * d.ao_p / 16, d.bo_p / 16, 1, d.bi_p / 16, mma::SmemOp{Vs, d.PV, 0, 0},
        mma::SmemOp{Bs, d.PB, 0, 0}, [&](int, int r, int o, float v0, float v1) {
          const int t = r / d.ao_p, j = r - t * d.ao_p;
          if (j < s.a_out) mma::store2<T>(yt + t * d_out + j * s.b_out, o, s.b_out, pair_y, v0, v1);
        });
    __syncthreads();  // Vs and buffer (it & 1) are reused by the next tile
  }
  mma::cp_async_wait<0>();
}

template <typename T>
__global__ void __launch_bounds__(kThreads) kron_mma_bwd_kernel(const KronTcParams P) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const KronShape s = P.s;
  const KronTcDims d = P.d;
  const int d_in = s.a_in * s.b_in, d_out = s.a_out * s.b_out;
  const int nA = s.a_out * s.a_in, nB = s.b_out * s.b_in;
  T* As = reinterpret_cast<T*>(smem_raw);
  T* Bs = As + d.ao_p * d.PA;
  T* Xs = Bs + d.bo_p * d.PB;      // 2 buffers
  T* Gs = Xs + 2 * P.TT * d.sX;    // 2 buffers
  T* Ws = Gs + 2 * P.TT * d.sG;
  T* Vs = Ws + P.TT * d.sV;
  T* end16 = Vs + P.TT * d.sV;
  float* part = P.part + static_cast<int64_t>(blockIdx.x) * (nA + nB);
  float* acc = part;
  if (P.acc_smem) {
    uintptr_t a = (reinterpret_cast<uintptr_t>(end16) + 15) & ~uintptr_t(15);
    acc = reinterpret_cast<float*>(a);
  }
  float* dAacc = acc;
  float* dBacc = acc + nA;
  for (int e = threadIdx.x; e < nA + nB; e += blockDim.x) acc[e] = 0.f;
  stage_factor_tc<T>(As, d.PA, d.ao_p, static_cast<const T*>(P.A), s.a_out, s.a_in, P.sA0,
                     P.sA1);
  stage_factor_tc<T>(Bs, d.PB, d.bo_p, static_cast<const T*>(P.B), s.b_out, s.b_in, P.sB0,
                     P.sB1);
  const T* x = static_cast<const T*>(P.x);
  const T* g = static_cast<const T*>(P.g);
  T* dx = static_cast<T*>(P.y);
  const int64_t ntiles = P.ntiles;
  auto ntok = [&](int64_t tile) {
    const int64_t r = P.T - tile * P.TT;
    return static_cast<int>(r < P.TT ? r : P.TT);
  };
  auto load = [&](int64_t tile, int buf) {
    const int nt = ntok(tile);
    load_tokens<T>(Xs + buf * P.TT * d.sX, d.PX, d.sX, x + tile * P.TT * d_in, nt, s.a_in,
                   s.b_in, d.ai_p, d.bi_p, P.vec_x);
    load_tokens<T>(Gs + buf * P.TT * d.sG, d.PG, d.sG, g + tile * P.TT * d_out, nt, s.a_out,
                   s.b_out, d.ao_p, d.bo_p, P.vec_g);
  };
  const bool pair_x = s.b_in % 2 == 0;
  if (blockIdx.x < ntiles) load(blockIdx.x, 0);
  mma::cp_async_commit();
  int it = 0;
  for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x, ++it) {
    const int64_t next = tile + gridDim.x;
    if (next < ntiles) {
      load(next, (it + 1) & 1);
      mma::cp_async_commit();
      mma::cp_async_wait<1>();
    } else {
      mma::cp_async_wait<0>();
    }
    __syncthreads();
    const int nt = ntok(tile);
    const T* Xb = Xs + (it & 1) * P.TT * d.sX;
    const T* Gb = Gs + (it & 1) * P.TT * d.sG;
    // W = G B (stacked rows (t, j)): M = nt * ao_p, N = b_in, K = b_out; rounded.
    mma::block_mma<T, true, false>(
        1, nt * d.ao_p / 16, d.bi_p / 16, 1, d.bo_p / 16, mma::SmemOp{Gb, d.PG, 0, 0},
        mma::SmemOp{Bs, d.PB, 0, 0}, [&](int, int r, int k, float v0, float v1) {
          *reinterpret_cast<uint32_t*>(Ws + r * d.PV + k) = mma::pack2<T>(v0, v1);
        });
    // V[t] = A X[t]; rounded.
    mma::block_mma<T, true, false>(
        nt, d.ao_p / 16, d.bi_p / 16, 1, d.ai_p / 16, mma::SmemOp{As, d.PA, 0, 0},
        mma::SmemOp{Xb, d.PX, d.sX, 0}, [&](int t, int j, int k, float v0, float v1) {
          *reinterpret_cast<uint32_t*>(Vs + t * d.sV + j * d.PV + k) = mma::pack2<T>(v0, v1);
        });
    __syncthreads();
    // dX[t] = scale * A^T W[t]: M = a_in, N = b_in, K = a_out.
    if (P.need_dx) {
      T* dxt = dx + tile * P.TT * d_in;
      mma::block_mma<T, false, false>(
          nt, d.ai_p / 16, d.bi_p / 16, 1, d.ao_p / 16, mma::SmemOp{As, d.PA, 0, 0},
          mma::SmemOp{Ws, d.PV, d.sV, 0}, [&](int t, int i, int k, float v0, float v1) {
            if (i < s.a_in)
              mma::store2<T>(dxt + t * d_in + i * s.b_in, k, s.b_in, pair_x, v0 * P.scale,
                             v1 * P.scale);
          });
    }
    // dA += sum_t W[t] X[t]^T: M = a_out, N = a_in, K = (t, k).
    mma::block_mma<T, true, true>(
        1, d.ao_p / 16, d.ai_p / 16, nt, d.bi_p / 16, mma::SmemOp{Ws, d.PV, 0, d.sV},
        mma::SmemOp{Xb, d.PX, 0, d.sX}, [&](int, int j, int i, float v0, float v1) {
          if (j < s.a_out) {
            if (i < s.a_in) dAacc[j * s.a_in + i] += v0;
            if (i + 1 < s.a_in) dAacc[j * s.a_in + i + 1] += v1;
          }
        });
    // dB += sum_t G[t]^T V[t]: M = b_out, N = b_in, K = (t, j).
    mma::block_mma<T, false, false>(
        1, d.bo_p / 16, d.bi_p / 16, nt, d.ao_p / 16, mma::SmemOp{Gb, d.PG, 0, d.sG},
        mma::SmemOp{Vs, d.PV, 0, d.sV}, [&](int, int o, int k, float v0, float v1) {
          if (o < s.b_out) {
            if (k < s.b_in) dBacc[o * s.b_in + k] += v0;
            if (k + 1 < s.b_in) dBacc[o * s.b_in + k + 1] += v1;
          }
        });
    __syncthreads();
  }
  mma::cp_async_wait<0>();
  if (P.acc_smem) {
    __syncthreads();
    for (int e = threadIdx.x; e < nA + nB; e += blockDim.x) part[e] = acc[e];
  }
}

// Elements (16-bit) of the fixed part and of one token, forward / backward.
inline int64_t kron_tc_fixed(const KronTcDims& d) {
  return int64_t(d.ao_p) * d.PA + int64_t(d.bo_p) * d.PB;
}
inline int64_t kron_tc_token_fwd(const KronTcDims& d) { return 2 * int64_t(d.sX) + d.sV; }
inline int64_t kron_tc_token_bwd(const KronTcDims& d) {
  return 2 * int64_t(d.sX) + 2 * int64_t(d.sG) + 2 * int64_t(d.sV);
}

// Whether the tensor-core kernels pay for these factors. Every factor side is padded to 16,
// and a 16 x 16 x 16 block_mma step is fed by two ldmatrix loads from shared memory (about
// 5x the float32 FMA rate of the CUDA cores on H100, kfused/perf/cases.py _block_mma_rate):
// when the padding multiplies the products' MACs by more than kTcMaxWaste, the CUDA-core
// kernel does the real MACs faster. The paper's 2 x 384 / 384 x 2 factors waste 64x (every
// product has two 2-wide sides); balanced factors (24 x 24, 32 x 32) 1.5x.
constexpr double kTcMaxWaste = 4.0;

inline bool kron_tc_pays(const KronShape& s, bool bwd) {
  auto macs = [&](double ao, double ai, double bo, double bi) {
    const double fwd = ao * ai * bi + ao * bi * bo;             // V = A X, Y = V B^T
    return bwd ? ao * bo * bi + ao * ai * bi + ai * ao * bi     // W = G B, V, dX = A^T W,
                     + ao * ai * bi + bo * ao * bi               // dA, dB
               : fwd;
  };
  const double useful = macs(s.a_out, s.a_in, s.b_out, s.b_in);
  const double padded = macs(r16(s.a_out), r16(s.a_in), r16(s.b_out), r16(s.b_in));
  return padded <= kTcMaxWaste * useful;
}

// Tokens per tile for the tensor-core kernels (0: does not fit -> CUDA-core kernel).
inline int kron_tc_tokens(int64_t fixed_bytes, int64_t token_bytes, int64_t T, int64_t optin) {
  constexpr int64_t kPreferred = 100 * 1024;  // two blocks per SM on sm_90
  auto fit = [&](int64_t budget) {
    const int64_t avail = budget - fixed_bytes;
    return avail < token_bytes ? int64_t(0) : std::min<int64_t>(kTileMaxTokens, avail / token_bytes);
  };
  int64_t tt = fit(std::min<int64_t>(kPreferred, optin));
  if (tt == 0) tt = fit(optin);
  if (tt == 0) return 0;
  const int64_t sms = sm_count();
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(tt, ceil_div(T, 2 * sms))));
}

template <typename Kernel>
inline unsigned persistent_grid(Kernel kernel, size_t smem, int64_t ntiles) {
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem);
  per_sm = std::max(per_sm, 1);
  return static_cast<unsigned>(std::min<int64_t>(ntiles, int64_t(per_sm) * sm_count()));
}

// Host side of the narrow kernel: the orientation and register tier the factors fit, if any.
struct NarrowPlan {
  int tier;  // index into kNarrowTiers, -1: none fits
  bool swap;  // the transposed orientation (a_in and b_out are the small sides)
  int m, n, K, J;
};

inline NarrowPlan narrow_plan(const KronShape& s, int64_t elem_bytes, int64_t optin) {
  const int64_t E = 16 / elem_bytes;
  const int rx = static_cast<int>(ceil_div(int64_t(s.a_in) * s.b_in, E) * E);
  const int rg = static_cast<int>(ceil_div(int64_t(s.a_out) * s.b_out, E) * E);
  for (int o = 0; o < 2; ++o) {
    const int m = o ? s.b_out : s.a_out, n = o ? s.a_in : s.b_in;
    const int K = o ? s.b_in : s.a_in, J = o ? s.a_out : s.b_out;
    for (int i = 0; i < int(sizeof(kNarrowTiers) / sizeof(kNarrowTiers[0])); ++i) {
      const NarrowTier& q = kNarrowTiers[i];
      if (m <= q.M && n <= q.N && K <= kThreads * q.KC && J <= kThreads * q.JC &&
          narrow_smem_bytes(q.M, q.N, K, J, rx, rg, static_cast<int>(elem_bytes)) <= optin)
        return {i, o == 1, m, n, K, J};
    }
  }
  return {-1, false, 0, 0, 0, 0};
}

// One tier's launch; FWD: y written (no partials), else dA, dB reduced from the partials.
template <typename T, int M, int N, int KC, int JC, bool FWD>
void launch_narrow_tier(KronNarrowParams P, at::Tensor* dA, at::Tensor* dB, int64_t nA,
                        const at::Tensor& like, cudaStream_t stream) {
  auto kernel = kron_narrow_kernel<T, M, N, KC, JC, FWD>;
  const size_t smem = static_cast<size_t>(
      narrow_smem_bytes(M, N, P.K, P.J, P.rx, FWD ? 0 : P.rg, sizeof(T)));
  set_smem(kernel, smem, "kron_narrow_kernel");
  const unsigned grid = persistent_grid(kernel, smem, P.T);
  at::Tensor part;
  if (!FWD) {
    part = at::empty({int64_t(grid), P.nAB}, like.options().dtype(at::kFloat));
    P.part = part.data_ptr<float>();
  }
  if (FWD) P.rg = 0;  // (no g row staged)
  kernel<<<grid, kThreads, smem, stream>>>(P);
  check_launch("kron_narrow_kernel");
  if (!FWD)
    reduce_partials<T>(P.part, grid, P.nAB, nA, dA->data_ptr<T>(), dB->data_ptr<T>(), stream,
                       P.scale);
}

template <typename T, bool FWD>
void launch_kron_narrow(const KronNarrowParams& P, int tier, at::Tensor* dA, at::Tensor* dB,
                        int64_t nA, const at::Tensor& like, cudaStream_t stream) {
  switch (tier) {
    case 0: launch_narrow_tier<T, 2, 2, 2, 2, FWD>(P, dA, dB, nA, like, stream); break;
    case 1: launch_narrow_tier<T, 8, 2, 2, 2, FWD>(P, dA, dB, nA, like, stream); break;
    case 2: launch_narrow_tier<T, 2, 8, 2, 2, FWD>(P, dA, dB, nA, like, stream); break;
    default: launch_narrow_tier<T, 2, 2, 8, 8, FWD>(P, dA, dB, nA, like, stream); break;
  }
}

// The narrow kernel's parameters for x, its partner row tensor (g, or y for the forward) and
// the factors, in the orientation of ``np`` (the transposed one by strides).
KronNarrowParams narrow_params(const NarrowPlan& np, const KronShape& s, const at::Tensor& x,
                               const at::Tensor& other, const at::Tensor& A,
                               const at::Tensor& B) {
  KronNarrowParams P{};
  P.x = x.data_ptr();
  P.g = other.data_ptr();
  P.T = x.size(0);
  P.d_in = s.a_in * s.b_in;
  P.d_out = s.a_out * s.b_out;
  P.m = np.m;
  P.n = np.n;
  P.K = np.K;
  P.J = np.J;
  const int64_t nA = int64_t(s.a_out) * s.a_in;
  P.nAB = nA + int64_t(s.b_out) * s.b_in;
  const int E = 16 / static_cast<int>(x.element_size());  // elements per 16 bytes
  P.rx = static_cast<int>(ceil_div(P.d_in, E) * E);
  P.rg = static_cast<int>(ceil_div(P.d_out, E) * E);
  P.vec = P.d_in % E == 0 && P.d_out % E == 0 && mma_aligned(x.data_ptr()) &&
          mma_aligned(other.data_ptr());
  if (!np.swap) {  // A' = A, B' = B, X' = X, G' = G
    P.A = A.data_ptr();
    P.B = B.data_ptr();
    P.sai = A.stride(0), P.sak = A.stride(1), P.sbj = B.stride(0), P.sbl = B.stride(1);
    P.xk = s.b_in, P.xl = 1, P.gi = s.b_out, P.gj = 1;
    P.offA = 0, P.offB = nA;
  } else {  // A' = B, B' = A, X' = X^T, G' = G^T
    P.A = B.data_ptr();
    P.B = A.data_ptr();
    P.sai = B.stride(0), P.sak = B.stride(1), P.sbj = A.stride(0), P.sbl = A.stride(1);
    P.xk = 1, P.xl = s.b_in, P.gi = 1, P.gj = s.b_out;
    P.offA = nA, P.offB = 0;
  }
  return P;
}

// Host side: the factor pointers, strides, token count and shape every kron kernel reads.
template <typename Params>
void set_factor_params(Params& P, const at::Tensor& A, const at::Tensor& B, int64_t T,
                       const KronShape& s) {
  P.T = T;
  P.A = A.data_ptr();
  P.B = B.data_ptr();
  P.sA0 = A.stride(0);
  P.sA1 = A.stride(1);
  P.sB0 = B.stride(0);
  P.sB1 = B.stride(1);
  P.s = s;
}

// Host side: the CUDA-core kernels' staging choice (factors in shared memory, or float copies).
template <typename Params>
void set_staging_params(Params& P, bool stage, const at::Tensor& Ag, const at::Tensor& Bg,
                        const KronShape& s, int64_t TT) {
  P.Ag = stage ? nullptr : Ag.data_ptr<float>();
  P.Bg = stage ? nullptr : Bg.data_ptr<float>();
  P.TT = static_cast<int>(TT);
  P.pB = stage ? odd_pitch(s.b_in) : s.b_in;
  P.stage = stage;
}

template <typename T>
void launch_kron_tc_fwd(KronTcParams P, size_t smem, cudaStream_t stream) {
  set_smem(kron_mma_fwd_kernel<T>, smem, "kron_mma_fwd_kernel");
  const unsigned grid = persistent_grid(kron_mma_fwd_kernel<T>, smem, P.ntiles);
  kron_mma_fwd_kernel<T><<<grid, kThreads, smem, stream>>>(P);
  check_launch("kron_mma_fwd_kernel");
}

template <typename T>
void launch_kron_tc_bwd(KronTcParams P, size_t smem, int64_t nAB, int64_t nA, at::Tensor& dA,
                        at::Tensor& dB, cudaStream_t stream) {
  set_smem(kron_mma_bwd_kernel<T>, smem, "kron_mma_bwd_kernel");
  const unsigned grid = persistent_grid(kron_mma_bwd_kernel<T>, smem, P.ntiles);
  at::Tensor part = at::empty({int64_t(grid), nAB}, dA.options().dtype(at::kFloat));
  P.part = part.data_ptr<float>();
  kron_mma_bwd_kernel<T><<<grid, kThreads, smem, stream>>>(P);
  check_launch("kron_mma_bwd_kernel");
  reduce_partials<T>(P.part, grid, nAB, nA, dA.data_ptr<T>(), dB.data_ptr<T>(), stream,
                     P.scale);
}

// Tokens per tile that fit `budget` bytes next to `fixed` floats (0: not even one token).
inline int64_t fit_tokens(int64_t fixed, int64_t per_token, int64_t budget_bytes) {
  const int64_t avail = budget_bytes / 4 - fixed;
  if (avail < per_token) return 0;
  return std::min<int64_t>(kTileMaxTokens, avail / per_token);
}

KronShape check_factors(const char* op, const at::Tensor& x, const at::Tensor& A,
                        const at::Tensor& B) {
  check_float_cuda(x, "x");
  check_float_cuda(A, "A");
  check_float_cuda(B, "B");
  check_like(A, "A", x, "x");
  check_like(B, "B", x, "x");
  check_dim(x, 2, "x", "(T, a_in*b_in)");
  check_dim(A, 2, "A", "(a_out, a_in)");
  check_dim(B, 2, "B", "(b_out, b_in)");
  check_contiguous(x, "x");
  const int64_t a_out = A.size(0), a_in = A.size(1), b_out = B.size(0), b_in = B.size(1);
  TORCH_CHECK(a_out > 0 && a_in > 0 && b_out > 0 && b_in > 0, "kfused: ", op,
              ": factors must be non-empty (A ", A.sizes(), ", B ", B.sizes(), ")");
  TORCH_CHECK(x.size(1) == a_in * b_in, "kfused: ", op, ": x has ", x.size(1),
              " features per token (", describe(x), ") but A ", A.sizes(), " and B ", B.sizes(),
              " need a_in*b_in = ", a_in * b_in);
  TORCH_CHECK(a_in * b_in < (1 << 24) && a_out * b_out < (1 << 24), "kfused: ", op,
              ": widths above 2^24 are not supported (A ", A.sizes(), ", B ", B.sizes(), ")");
  return KronShape{static_cast<int>(a_out), static_cast<int>(a_in), static_cast<int>(b_out),
                   static_cast<int>(b_in)};
}

}  // namespace

at::Tensor kron_matvec_fwd(const at::Tensor& x, const at::Tensor& A, const at::Tensor& B) {
  const KronShape s = check_factors("kron_matvec_fwd", x, A, B);
  const int64_t T = x.size(0);
  at::Tensor y = at::empty({T, static_cast<int64_t>(s.a_out) * s.b_out}, x.options());
  if (T == 0) return y;
  DeviceGuard guard(x);
  cudaStream_t stream = current_stream();
  const int64_t optin = max_smem_optin();

  if (x.scalar_type() != at::kFloat && kron_tc_pays(s, false)) {
    // Tensor-core kernel when its zero-padded tiles fit in shared memory.
    const KronTcDims d = kron_tc_dims(s);
    const int64_t fixed_b = 2 * kron_tc_fixed(d), token_b = 2 * kron_tc_token_fwd(d);
    const int TT = kron_tc_tokens(fixed_b, token_b, T, optin);
    if (TT > 0) {
      KronTcParams P{};
      P.x = x.data_ptr();
      P.y = y.data_ptr();
      set_factor_params(P, A, B, T, s);
      P.d = d;
      P.TT = TT;
      P.vec_x = s.b_in % 8 == 0 && mma_aligned(x.data_ptr());
      const size_t smem = static_cast<size_t>(fixed_b + TT * token_b);
      const int64_t ntiles = ceil_div(T, TT);
      P.ntiles = ntiles;
      if (x.scalar_type() == at::kHalf)
        launch_kron_tc_fwd<c10::Half>(P, smem, stream);
      else
        launch_kron_tc_fwd<c10::BFloat16>(P, smem, stream);
      return y;
    }
  }

  // Two small factor sides: the narrow kernel's forward (a block per token).
  const NarrowPlan np = narrow_plan(s, x.element_size(), optin);
  if (np.tier >= 0) {
    KronNarrowParams P = narrow_params(np, s, x, y, A, B);
    P.g = nullptr;
    P.y = y.data_ptr();
    P.scale = 1.f;
    KFUSED_DISPATCH_FLOAT(x.scalar_type(), "kron_matvec_fwd", [&] {
      launch_kron_narrow<scalar_t, true>(P, np.tier, nullptr, nullptr, 0, x, stream);
    });
    return y;
  }
  const int64_t d_in = int64_t(s.a_in) * s.b_in;
  const int64_t fixed = int64_t(s.a_out) * s.a_in + int64_t(s.b_out) * odd_pitch(s.b_in);
  const int64_t per_token = d_in + int64_t(s.a_out) * s.b_in;
  bool stage = true;
  int64_t TT = fit_tokens(fixed, per_token, std::min<int64_t>(kPreferredSmem, optin));
  if (TT == 0) TT = fit_tokens(fixed, per_token, optin);
  if (TT == 0) {
    stage = false;
    TT = fit_tokens(0, per_token, optin);
  }
  TORCH_CHECK(TT > 0, "kfused: kron_matvec_fwd: one token needs ", per_token * 4,
              " bytes of shared memory (a_in*b_in + a_out*b_in floats) but the device allows ",
              optin, " per block; A ", A.sizes(), " / B ", B.sizes(),
              " are too large for the CUDA kernel (use the triton or reference backend)");
  const int64_t sms = sm_count();
  TT = std::max<int64_t>(1, std::min<int64_t>(TT, ceil_div(T, 2 * sms)));
  const size_t smem = 4 * static_cast<size_t>((stage ? fixed : 0) + TT * per_token);

  at::Tensor Ag, Bg;
  if (!stage) {
    Ag = A.to(at::kFloat).contiguous();
    Bg = B.to(at::kFloat).contiguous();
  }
  KronFwdParams P;
  P.x = x.data_ptr();
  P.y = y.data_ptr();
  set_factor_params(P, A, B, T, s);
  set_staging_params(P, stage, Ag, Bg, s, TT);
  const int64_t ntiles = ceil_div(T, TT);
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(ntiles, int64_t(1) << 30));
  KFUSED_DISPATCH_FLOAT(x.scalar_type(), "kron_matvec_fwd", [&] {
    set_smem(kron_fwd_kernel<scalar_t>, smem, "kron_fwd_kernel");
    kron_fwd_kernel<scalar_t><<<grid, kThreads, smem, stream>>>(P);
    check_launch("kron_fwd_kernel");
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> kron_matvec_bwd(const at::Tensor& g,
                                                               const at::Tensor& x,
                                                               const at::Tensor& A,
                                                               const at::Tensor& B,
                                                               bool need_dx, double scale_d) {
  const float scale = static_cast<float>(scale_d);
  const KronShape s = check_factors("kron_matvec_bwd", x, A, B);
  check_float_cuda(g, "g");
  check_like(g, "g", x, "x");
  check_dim(g, 2, "g", "(T, a_out*b_out)");
  check_contiguous(g, "g");
  const int64_t T = x.size(0);
  TORCH_CHECK(g.size(0) == T && g.size(1) == int64_t(s.a_out) * s.b_out,
              "kfused: kron_matvec_bwd: g (", describe(g), ") must have shape (", T, ", ",
              int64_t(s.a_out) * s.b_out, ") to match x ", x.sizes(), ", A ", A.sizes(), ", B ",
              B.sizes());
  at::Tensor dx = need_dx ? at::empty_like(x) : at::empty({0}, x.options());
  at::Tensor dA = at::empty({s.a_out, s.a_in}, x.options());
  at::Tensor dB = at::empty({s.b_out, s.b_in}, x.options());
  if (T == 0) return {dx, dA.zero_(), dB.zero_()};
  DeviceGuard guard(x);
  cudaStream_t stream = current_stream();
  const int64_t optin = max_smem_optin();
  const int64_t sms = sm_count();

  if (x.scalar_type() != at::kFloat && kron_tc_pays(s, true)) {
    // Tensor-core kernel when its zero-padded tiles fit (float dA | dB accumulators in shared
    // memory when they fit too, else in the block's slice of the partials workspace).
    const KronTcDims d = kron_tc_dims(s);
    const int64_t nAB = int64_t(s.a_out) * s.a_in + int64_t(s.b_out) * s.b_in;
    const int64_t token_b = 2 * kron_tc_token_bwd(d);
    const int64_t fixed16 = 2 * kron_tc_fixed(d);
    bool acc_smem = true;
    int TT = kron_tc_tokens(fixed16 + 16 + 4 * nAB, token_b, T, optin);
    if (TT == 0) {
      acc_smem = false;
      TT = kron_tc_tokens(fixed16, token_b, T, optin);
    }
    if (TT > 0) {
      KronTcParams P{};
      P.x = x.data_ptr();
      P.g = g.data_ptr();
      P.y = dx.data_ptr();
      set_factor_params(P, A, B, T, s);
      P.d = d;
      P.TT = TT;
      P.vec_x = s.b_in % 8 == 0 && mma_aligned(x.data_ptr());
      P.vec_g = s.b_out % 8 == 0 && mma_aligned(g.data_ptr());
      P.acc_smem = acc_smem;
      P.need_dx = need_dx;
      P.scale = scale;
      const size_t smem =
          static_cast<size_t>(fixed16 + TT * token_b + (acc_smem ? 16 + 4 * nAB : 0));
      const int64_t ntiles = ceil_div(T, TT);
      P.ntiles = ntiles;
      if (x.scalar_type() == at::kHalf)
        launch_kron_tc_bwd<c10::Half>(P, smem, nAB, int64_t(s.a_out) * s.a_in, dA, dB, stream);
      else
        launch_kron_tc_bwd<c10::BFloat16>(P, smem, nAB, int64_t(s.a_out) * s.a_in, dA, dB,
                                          stream);
      return {dx, dA, dB};
    }
  }

  const int64_t nA = int64_t(s.a_out) * s.a_in, nB = int64_t(s.b_out) * s.b_in;
  const NarrowPlan np = narrow_plan(s, x.element_size(), optin);
  if (np.tier >= 0) {
    // Two small factor sides (the paper's 2 x 384 / 384 x 2): a block per token.
    KronNarrowParams P = narrow_params(np, s, x, g, A, B);
    P.dx = dx.data_ptr();
    P.need_dx = need_dx;
    P.scale = scale;
    KFUSED_DISPATCH_FLOAT(x.scalar_type(), "kron_matvec_bwd", [&] {
      launch_kron_narrow<scalar_t, false>(P, np.tier, &dA, &dB, nA, x, stream);
    });
    return {dx, dA, dB};
  }
  const int64_t pX = odd_pitch(s.b_in);
  const int64_t fixed_stage = nA + int64_t(s.b_out) * odd_pitch(s.b_in);
  const int64_t fixed_acc = nA + nB;
  const int64_t per_token = int64_t(s.a_in) * pX + int64_t(s.a_out) * s.b_out +
                            2 * int64_t(s.a_out) * s.b_in;
  bool stage = true, acc_smem = true;
  int64_t TT = fit_tokens(fixed_stage + fixed_acc, per_token,
                          std::min<int64_t>(kPreferredSmem, optin));
  if (TT == 0) TT = fit_tokens(fixed_stage + fixed_acc, per_token, optin);
  if (TT == 0) {
    acc_smem = false;
    TT = fit_tokens(fixed_stage, per_token, optin);
  }
  if (TT == 0) {
    stage = false;
    TT = fit_tokens(0, per_token, optin);
  }
  TORCH_CHECK(TT > 0, "kfused: kron_matvec_bwd: one token needs ", per_token * 4,
              " bytes of shared memory (a_in*(b_in|1) + a_out*b_out + 2*a_out*b_in floats) but "
              "the device allows ",
              optin, " per block; A ", A.sizes(), " / B ", B.sizes(),
              " are too large for the CUDA kernel (use the triton or reference backend)");
  TT = std::max<int64_t>(1, std::min<int64_t>(TT, ceil_div(T, 2 * sms)));
  const int64_t ntiles = ceil_div(T, TT);
  const int64_t grid = std::min<int64_t>(ntiles, 2 * sms);
  const size_t smem = 4 * static_cast<size_t>((stage ? fixed_stage : 0) +
                                              (acc_smem ? fixed_acc : 0) + TT * per_token);

  at::Tensor Ag, Bg;
  if (!stage) {
    Ag = A.to(at::kFloat).contiguous();
    Bg = B.to(at::kFloat).contiguous();
  }
  at::Tensor part = at::empty({grid, nA + nB}, x.options().dtype(at::kFloat));
  KronBwdParams P;
  P.g = g.data_ptr();
  P.x = x.data_ptr();
  P.dx = dx.data_ptr();
  set_factor_params(P, A, B, T, s);
  set_staging_params(P, stage, Ag, Bg, s, TT);
  P.part = part.data_ptr<float>();
  P.pX = static_cast<int>(pX);
  P.acc_smem = acc_smem;
  P.need_dx = need_dx;
  P.scale = scale;
  KFUSED_DISPATCH_FLOAT(x.scalar_type(), "kron_matvec_bwd", [&] {
    set_smem(kron_bwd_kernel<scalar_t>, smem, "kron_bwd_kernel");
    kron_bwd_kernel<scalar_t><<<static_cast<unsigned>(grid), kThreads, smem, stream>>>(P);
    check_launch("kron_bwd_kernel");
    reduce_partials<scalar_t>(P.part, grid, nA + nB, nA, dA.data_ptr<scalar_t>(),
                              dB.data_ptr<scalar_t>(), stream, scale);
  });
  return {dx, dA, dB};
}

}  // namespace kfused
