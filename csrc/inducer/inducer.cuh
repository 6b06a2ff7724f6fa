// Shared pieces of the inducer attention forward (docs/math.md §3): the kernel parameters, the row
// finalisation, the split-KV merge kernel, and the entry point of the tensor-core kernels,
// which are compiled in their own translation units (inducer_mma_f16.cu, inducer_mma_bf16.cu)
// so that the three dtypes build in parallel. See inducer_attention_fwd.cu for the design.
#pragma once

#include <cmath>

#include "common/common.cuh"

namespace kfused {
namespace inducer {

constexpr int kBK = 32;  // keys per tile (one per lane)
constexpr int kWarps = 4;
constexpr int kRowsPerWarp = 4;
constexpr float kFullyMaskedLse = -1e30f;
constexpr float kLn2 = 0.6931471805599453f;

// Tile shapes of the two tensor-core schedules (a GPU session tunes them here).
constexpr int kPrefillBN = 64, kPrefillRW = 4;
constexpr int kDecodeBN = 16, kDecodeKW = 4;
// Prefill row tiles of 16 per warp: 2 up to D = 64 (each K / V fragment from shared memory
// feeds two products; 248 registers at D = 64, no spill), 1 above (sm_90 ptxas: D = 96 spills
// 824 bytes and D = 128 72 bytes with two tiles, even with Q re-read from shared memory).
constexpr int kPrefillMrMaxD = 64;
constexpr int prefill_mr(int D) { return D <= kPrefillMrMaxD ? 2 : 1; }
// Query rows per prefill block for padded head width D (host and kernel agree through this).
constexpr int prefill_rows(int D) { return 16 * kPrefillRW * prefill_mr(D); }

struct InducerParams {
  const void* q;
  const void* k;
  const void* v;
  const float* s0;  // (B, H, n_q) contiguous float32, or nullptr with the in-kernel MLP
  const void* pk;   // (H, l, p) contiguous or nullptr
  const void* pv;
  const int* lens;  // (B,) int32 or nullptr
  void* f;          // (B, H, n_q, p) contiguous
  float* lse;       // (B, H, n_q)
  float* lam;       // (B, H, n_q)
  int64_t q_sb, q_sh, q_sn;
  int64_t k_sb, k_sh, k_sn;
  int64_t v_sb, v_sh, v_sn;
  int B, H, n_q, n_k, p, l;
  // Grouped-query attention: k and v have H / group heads; query head h reads kv head
  // h / group. gpack query heads (a divisor of group, all of them of one kv head; > 1 only in
  // the 16-bit decode schedule without a prefix) share a block, their n_q rows stacked:
  // packed row R of head block blockIdx.y is query R % n_q of head blockIdx.y * gpack +
  // R / n_q, so the block reads the kv head's keys once for all of them.
  int group, gpack;
  int pitch;  // row pitch (elements) of the K/V tiles in shared memory
  float scale_log2;
  bool causal;
  int ksplit;
  int nsplit;           // key splits over blocks (1: no workspace)
  int tiles_per_split;  // key tiles per split
  float* part_o;        // (B, H, n_q, nsplit, p) unnormalised P V        (nsplit > 1)
  float* part_ml;       // (B, H, n_q, nsplit, 2) running max (log2), sum (nsplit > 1)
  bool vec;             // tensor-core path: 16-byte cp.async rows (see inducer_attention_fwd)
  // The inducer MLP inside the tensor-core kernel (docs/math.md §3; L == 0: none, s0 given):
  // s0 = tau <q, q + tanh(q Ak + ak) Bk + ck>, u = lam tanh(q W1 + b1). Weights in q's dtype,
  // contiguous: Ak (H, p, L), ak (H, L), Bk (H, L, p), ck (H, p), W1 (H, p, r), b1 (H, r).
  const void* ak_w;
  const void* ak_b;
  const void* bk_w;
  const void* ck;
  const void* w1;
  const void* b1;
  int L, r;
  int ncp;       // columns of [Ak | W1 | Bk^T | ck] (2L + r + 1) padded to 16 (<= kMlpMaxCols)
  float scale;   // tau
  void* u;       // (B, H, n_q, r): float32 when u_f32, else q's dtype
  bool u_f32;
  float* ws_s0;  // nsplit > 1: the split-0 block's s0 (rows) and tanh(q W1 + b1) (rows, r)
  float* ws_hid; //   for the merge kernel
  // nsplit > 1, tensor-core kernel: one int32 arrival counter per (batch, head block, row
  // tile), zero before the launch and left zero after it. The last of a tile's nsplit blocks
  // to arrive merges the splits itself (no second launch). nullptr: inducer_merge_kernel.
  int* count;
};

// The combined MLP weight [Ak | W1 | Bk^T | ck] is staged in the second K buffer of the
// tensor-core kernel, which has 64 rows in both schedules.
constexpr int kMlpMaxCols = 64;

// Shared memory the in-kernel MLP adds after the kernel's tiles: per row of the block its
// ncp products (row pitch ncp + 1) and its s0.
inline size_t mlp_smem_bytes(int rows, int ncp) {
  return sizeof(float) * static_cast<size_t>(rows) * (ncp + 2);
}

// lse = ln(sum exp S) from the log2-domain max m and sum l (kFullyMaskedLse for an empty row)
// and lam = sigmoid(s0 - lse), evaluated without overflow.
__device__ __forceinline__ float row_lse(float m, float l) {
  return l > 0.f ? (m + log2f(l)) * kLn2 : kFullyMaskedLse;
}

__device__ __forceinline__ float sigmoid_of(float x) {
  return x >= 0.f ? 1.f / (1.f + expf(-x)) : expf(x) / (1.f + expf(x));
}

// Packed row R of head block hb (InducerParams::gpack): its query head and query index.
__device__ __forceinline__ void packed_row(const InducerParams& P, int hb, int R, int& h,
                                           int& i) {
  if (P.gpack == 1) {
    h = hb;
    i = R;
  } else {
    const int j = R / P.n_q;
    h = hb * P.gpack + j;
    i = R - j * P.n_q;
  }
}

// The largest query index among packed rows [R0, R1] of a block (causal: its last visible key).
__device__ __forceinline__ int last_query(const InducerParams& P, int R0, int R1) {
  if (P.gpack == 1) return R1;
  return R0 / P.n_q != R1 / P.n_q ? P.n_q - 1 : R1 % P.n_q;
}

// u[row, j] = lam * hidden (float32 or T, as the caller asked).
template <typename T>
__device__ __forceinline__ void store_u(const InducerParams& P, int64_t ridx, int j, float v) {
  if (P.u_f32)
    static_cast<float*>(P.u)[ridx * P.r + j] = v;
  else
    static_cast<T*>(P.u)[ridx * P.r + j] = static_cast<T>(v);
}

// f = o / l, lse = ln(sum exp S), lam = sigmoid(s0 - lse) (and, with the in-kernel MLP,
// u = lam * hidden from the split workspace); the warp's lanes hold o[c] for features
// lane + 32 c. m is the running max in the log2 domain.

template <typename T, int CH>
__device__ __forceinline__ void finalize_row(const InducerParams& P, int64_t ridx, float m,
                                             float lsum, const float (&o)[CH]) {
  const int lane = threadIdx.x & 31;
  const bool any = lsum > 0.f;
  const float inv = any ? 1.f / lsum : 0.f;
  T* f = static_cast<T*>(P.f);
#pragma unroll
  for (int c = 0; c < CH; ++c) {
    const int d = lane + 32 * c;
    if (d < P.p) f[ridx * P.p + d] = static_cast<T>(o[c] * inv);
  }
  const float lse = row_lse(m, lsum);
  // (the workspace was written by another block: read through L2, see merge_row)
  const float lam = sigmoid_of((P.L > 0 ? __ldcg(P.ws_s0 + ridx) : P.s0[ridx]) - lse);
  if (lane == 0) {
    P.lse[ridx] = lse;
    P.lam[ridx] = lam;
  }
  if (P.L > 0)
    for (int j = lane; j < P.r; j += 32)
      store_u<T>(P, ridx, j, lam * __ldcg(P.ws_hid + ridx * P.r + j));
}

// Merge the key splits of row ridx (one warp, splits in order: deterministic) and finalise it.
// The partials come from other blocks, so they are read through L2 (__ldcg), never from a
// possibly stale L1 line.
template <typename T, int CH>
__device__ __forceinline__ void merge_row(const InducerParams& P, int64_t ridx) {
  const int lane = threadIdx.x & 31;
  const int64_t sbase = ridx * P.nsplit;
  float M = -INFINITY;
  for (int sp = 0; sp < P.nsplit; ++sp) M = fmaxf(M, __ldcg(P.part_ml + 2 * (sbase + sp)));
  float L = 0.f, o[CH];
#pragma unroll
  for (int c = 0; c < CH; ++c) o[c] = 0.f;
  if (M != -INFINITY) {
    for (int sp = 0; sp < P.nsplit; ++sp) {
      const float ms = __ldcg(P.part_ml + 2 * (sbase + sp));
      const float sc = ms == -INFINITY ? 0.f : exp2f(ms - M);
      L += __ldcg(P.part_ml + 2 * (sbase + sp) + 1) * sc;
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        const int d = lane + 32 * c;
        if (d < P.p) o[c] += __ldcg(P.part_o + (sbase + sp) * P.p + d) * sc;
      }
    }
  }
  finalize_row<T, CH>(P, ridx, M, L, o);
}

// Shared-memory row pitch for K/V tiles: 32 lanes reading 32 different rows at the same
// column must hit 32 different banks.

template <typename T, int CH>
__global__ void __launch_bounds__(128) inducer_merge_kernel(const InducerParams P) {
  const int64_t ridx = static_cast<int64_t>(blockIdx.x) * 4 + (threadIdx.x >> 5);
  if (ridx >= static_cast<int64_t>(P.B) * P.H * P.n_q) return;
  merge_row<T, CH>(P, ridx);
}


// Tensor-core forward for T = c10::Half / c10::BFloat16 (inducer_mma.cuh; instantiated in
// inducer_mma_f16.cu / inducer_mma_bf16.cu). decode: the 16-row schedule (n_q <= 16);
// chunks = ceil(p / 32) picks the padded head width D = 32 * chunks.
template <typename T>
void launch_inducer_mma_p(const InducerParams& P, bool decode, int chunks, dim3 grid,
                          cudaStream_t stream);

}  // namespace inducer
}  // namespace kfused
