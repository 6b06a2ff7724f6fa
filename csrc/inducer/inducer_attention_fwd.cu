// Inducer attention forward for inference (SPEC §3), flash-style:
//   f_i   = sum_j softmax_j(S_i.) v_j         over the real keys (prefix + sequence)
//   lse_i = log sum_j exp(S_ij)               S_ij = <q_i, k_j> / sqrt(p), masked keys excluded
//   lam_i = sigmoid(s0_i - lse_i)             the inducer column's share of the extended softmax
// The caller computes s0 (the virtual key's logit) from the inducer MLP and composes the
// output ("add": u = lam * tanh(q W1 + b1); "gate": (1 - lam) f + lam p_v) outside.
//
// Keys are the l prefix keys (P_k, P_v: (H, l, p), shared over the batch, never masked)
// followed by the n_k sequence keys of the KV cache. Sequence key j is visible to query row i
// when j < key_lengths[b] (if given) and, with causal, j <= n_k - n_q + i (the query rows are
// the last n_q positions: n_q = 1 is single-token decode).
//
// Fully masked rows (only possible without a prefix) return f = 0, lse = -1e30 (finite;
// mathematically -inf) and therefore lam = 1 (the virtual column is the only visible one).
//
// Design. CUDA-core flash attention with an online softmax over 32-key tiles (one key per
// lane): nothing of size n_q x n_k is ever stored. A block has 4 warps, each warp owns 4 query
// rows. Two schedules:
//   ksplit = 1 (prefill): 16 rows per block; every warp walks all key tiles, which the block
//                         stages once in shared memory for all four warps.
//   ksplit = 4 (decode / few rows): 4 rows per block; warp w walks tiles w, w+4, ... (the block
//                         stages four tiles per step) and the four partial softmax states are
//                         merged at the end. This keeps a whole SM busy for n_q = 1.
// When even that leaves SMs idle (decode with few batch x heads), the keys are also split over
// `nsplit` blocks (flash-decoding): each block writes its unnormalised state (max, sum, P V)
// to a float workspace and a second kernel merges the splits in a fixed order.
// Scores are computed lane-per-key (q broadcast from shared memory, K rows padded so the 32
// lanes hit 32 banks); P V is accumulated lane-per-feature with the probabilities broadcast by
// shuffles. Softmax runs in the log2 domain (q pre-scaled by log2(e)/sqrt(p), exp2f).
// Tiles beyond the last key any row of the block can see (lengths, causal) are skipped.

#include "common/common.cuh"
#include "common/mma.cuh"
#include "kfused.h"

#include <cmath>

namespace kfused {
namespace {

constexpr int kBK = 32;  // keys per tile (one per lane)
constexpr int kWarps = 4;
constexpr int kRowsPerWarp = 4;
constexpr float kFullyMaskedLse = -1e30f;
constexpr float kLn2 = 0.6931471805599453f;

struct InducerParams {
  const void* q;
  const void* k;
  const void* v;
  const float* s0;  // (B, H, n_q) contiguous float32
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
  int pitch;  // row pitch (elements) of the K/V tiles in shared memory
  float scale_log2;
  bool causal;
  int ksplit;
  int nsplit;           // key splits over blocks (1: no workspace)
  int tiles_per_split;  // key tiles per split
  float* part_o;        // (B, H, n_q, nsplit, p) unnormalised P V        (nsplit > 1)
  float* part_ml;       // (B, H, n_q, nsplit, 2) running max (log2), sum (nsplit > 1)
  bool vec;             // tensor-core path: 16-byte cp.async rows (see inducer_attention_fwd)
};

// f = o / l, lse = ln(sum exp S), lam = sigmoid(s0 - lse); the row's lanes hold o[c] for
// features lane + 32 c. m is the running max in the log2 domain.
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
  if (lane == 0) {
    const float lse = any ? (m + log2f(lsum)) * kLn2 : kFullyMaskedLse;
    const float x = P.s0[ridx] - lse;  // lam = sigmoid(x), evaluated without overflow
    const float lam = x >= 0.f ? 1.f / (1.f + expf(-x)) : expf(x) / (1.f + expf(x));
    P.lse[ridx] = lse;
    P.lam[ridx] = lam;
  }
}

// Shared-memory row pitch for K/V tiles: 32 lanes reading 32 different rows at the same
// column must hit 32 different banks.
inline int kv_pitch(int p, size_t elem) {
  int pitch = p;
  if (elem == 4) {
    pitch = p | 1;
  } else {
    while (pitch % 4 != 2) ++pitch;  // (pitch / 2) odd words
  }
  return pitch;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

template <typename T, int CH>
__global__ void __launch_bounds__(kWarps * 32) inducer_fwd_kernel(const InducerParams P) {
  extern __shared__ float smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int b = blockIdx.z, h = blockIdx.y;
  const int ksplit = P.ksplit;
  const int rows_blk = ksplit == 1 ? kWarps * kRowsPerWarp : kRowsPerWarp;
  const int split = blockIdx.x % P.nsplit;
  const int row0 = (blockIdx.x / P.nsplit) * rows_blk;
  const int p = P.p, pitch = P.pitch, l = P.l;

  float* Qs = smem;  // (rows_blk, p), pre-scaled
  T* Ks = reinterpret_cast<T*>(Qs + rows_blk * p);
  T* Vs = Ks + ksplit * kBK * pitch;

  int len = P.n_k;
  if (P.lens) {
    len = P.lens[b];
    len = len < 0 ? 0 : (len > P.n_k ? P.n_k : len);
  }
  const int last_row = (row0 + rows_blk < P.n_q ? row0 + rows_blk : P.n_q) - 1;
  int seq_end = len;  // sequence keys [0, seq_end) may be visible to some row of the block
  if (P.causal) {
    const int lim = P.n_k - P.n_q + last_row + 1;
    seq_end = lim < seq_end ? lim : seq_end;
  }
  seq_end = seq_end < 0 ? 0 : seq_end;
  const int kend = l + seq_end;
  // This block's key tiles: [tile_beg, tile_end) of the visible range.
  const int ntiles_vis = (kend + kBK - 1) / kBK;
  const int tile_beg = split * P.tiles_per_split;
  int tile_end = tile_beg + P.tiles_per_split;
  tile_end = tile_end < ntiles_vis ? tile_end : ntiles_vis;

  const T* q = static_cast<const T*>(P.q) + b * P.q_sb + h * P.q_sh;
  for (int e = threadIdx.x; e < rows_blk * p; e += blockDim.x) {
    const int r = e / p, d = e - r * p;
    const int row = row0 + r;
    Qs[e] = row < P.n_q ? to_float(q[row * P.q_sn + d]) * P.scale_log2 : 0.f;
  }
  const T* kseq = static_cast<const T*>(P.k) + b * P.k_sb + h * P.k_sh;
  const T* vseq = static_cast<const T*>(P.v) + b * P.v_sb + h * P.v_sh;
  const T* kpre = P.pk ? static_cast<const T*>(P.pk) + static_cast<int64_t>(h) * l * p : nullptr;
  const T* vpre = P.pv ? static_cast<const T*>(P.pv) + static_cast<int64_t>(h) * l * p : nullptr;

  const int base = ksplit == 1 ? warp * kRowsPerWarp : 0;  // this warp's first row in Qs
  const int slot = ksplit == 1 ? 0 : warp;                  // this warp's tile slot
  float m[kRowsPerWarp], lsum[kRowsPerWarp], o[kRowsPerWarp][CH];
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    m[rr] = -INFINITY;
    lsum[rr] = 0.f;
#pragma unroll
    for (int c = 0; c < CH; ++c) o[rr][c] = 0.f;
  }

  for (int it = 0; tile_beg + it * ksplit < tile_end; ++it) {
    __syncthreads();  // Q staged / previous tiles consumed
    const int tile_elems = kBK * p;
    for (int e = threadIdx.x; e < ksplit * tile_elems; e += blockDim.x) {
      const int s = e / tile_elems, rem = e - s * tile_elems;
      const int kk = rem / p, d = rem - kk * p;
      const int key = (tile_beg + it * ksplit + s) * kBK + kk;
      T kv = T(0.f), vv = T(0.f);
      if (key < l) {
        kv = kpre[key * p + d];
        vv = vpre[key * p + d];
      } else if (key < kend) {
        const int64_t j = key - l;
        kv = kseq[j * P.k_sn + d];
        vv = vseq[j * P.v_sn + d];
      }
      Ks[(s * kBK + kk) * pitch + d] = kv;
      Vs[(s * kBK + kk) * pitch + d] = vv;
    }
    __syncthreads();
    const int tile = tile_beg + it * ksplit + slot;
    if (tile >= tile_end) continue;  // warp-uniform; the next iteration's barrier is still met
    const int key = tile * kBK + lane;
    const T* krow = Ks + (slot * kBK + lane) * pitch;
    const T* vtile = Vs + slot * kBK * pitch;
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const int row = row0 + base + rr;
      if (row >= P.n_q) break;
      const float* qrow = Qs + (base + rr) * p;
      float s = 0.f;
#pragma unroll 8
      for (int d = 0; d < p; ++d) s = fmaf(qrow[d], to_float(krow[d]), s);
      bool ok = key < l;
      if (!ok && key < kend) ok = !P.causal || key - l <= P.n_k - P.n_q + row;
      s = ok ? s : -INFINITY;
      const float m_new = fmaxf(m[rr], warp_max(s));
      if (m_new == -INFINITY) continue;  // no visible key yet for this row (warp-uniform)
      const float alpha = exp2f(m[rr] - m_new);
      const float pr = exp2f(s - m_new);
      lsum[rr] = lsum[rr] * alpha + warp_sum(pr);
      m[rr] = m_new;
#pragma unroll
      for (int c = 0; c < CH; ++c) o[rr][c] *= alpha;
      for (int kk = 0; kk < kBK; ++kk) {
        const float pk = __shfl_sync(0xffffffffu, pr, kk);
        if (pk == 0.f) continue;  // masked key (uniform across the warp)
        const T* vrow = vtile + kk * pitch;
#pragma unroll
        for (int c = 0; c < CH; ++c) {
          const int d = lane + 32 * c;
          if (d < p) o[rr][c] = fmaf(pk, to_float(vrow[d]), o[rr][c]);
        }
      }
    }
  }

  if (ksplit > 1) {
    // Merge the per-warp softmax states of the same 4 rows; warp w finalises row w.
    __syncthreads();
    float* Mb = reinterpret_cast<float*>(Ks);  // (kWarps, 4) maxima
    float* Lb = Mb + kWarps * kRowsPerWarp;    // (kWarps, 4) sums
    float* Ob = Lb + kWarps * kRowsPerWarp;    // (kWarps, 4, p) accumulators
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      if (lane == 0) {
        Mb[warp * kRowsPerWarp + rr] = m[rr];
        Lb[warp * kRowsPerWarp + rr] = lsum[rr];
      }
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        const int d = lane + 32 * c;
        if (d < p) Ob[(warp * kRowsPerWarp + rr) * p + d] = o[rr][c];
      }
    }
    __syncthreads();
    const int rr = warp;
    float M = -INFINITY;
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, Mb[w * kRowsPerWarp + rr]);
    float L = 0.f;
    float acc[CH];
#pragma unroll
    for (int c = 0; c < CH; ++c) acc[c] = 0.f;
    if (M != -INFINITY) {
      for (int w = 0; w < kWarps; ++w) {
        const float mw = Mb[w * kRowsPerWarp + rr];
        const float sc = mw == -INFINITY ? 0.f : exp2f(mw - M);
        L += Lb[w * kRowsPerWarp + rr] * sc;
#pragma unroll
        for (int c = 0; c < CH; ++c) {
          const int d = lane + 32 * c;
          if (d < p) acc[c] += Ob[(w * kRowsPerWarp + rr) * p + d] * sc;
        }
      }
    }
#pragma unroll
    for (int c = 0; c < CH; ++c) o[0][c] = acc[c];
    m[0] = M;
    lsum[0] = L;
  }

  // Finalise the warp-owned rows (ksplit 1: rows base..base+3; ksplit 4: row `warp`, slot 0),
  // or hand the unnormalised state to the split-merge kernel.
  const int nrows = ksplit == 1 ? kRowsPerWarp : 1;
  const int first = ksplit == 1 ? base : warp;
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    if (rr >= nrows) break;
    const int row = row0 + first + rr;
    if (row >= P.n_q) break;
    const int64_t ridx = (static_cast<int64_t>(b) * P.H + h) * P.n_q + row;
    if (P.nsplit == 1) {
      finalize_row<T, CH>(P, ridx, m[rr], lsum[rr], o[rr]);
    } else {
      const int64_t sidx = ridx * P.nsplit + split;
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        const int d = lane + 32 * c;
        if (d < p) P.part_o[sidx * p + d] = o[rr][c];
      }
      if (lane == 0) {
        P.part_ml[2 * sidx] = m[rr];
        P.part_ml[2 * sidx + 1] = lsum[rr];
      }
    }
  }
}

// Merge the key splits of each row (one warp per row, splits in order).
template <typename T, int CH>
__global__ void __launch_bounds__(128) inducer_merge_kernel(const InducerParams P) {
  const int lane = threadIdx.x & 31;
  const int64_t ridx = static_cast<int64_t>(blockIdx.x) * 4 + (threadIdx.x >> 5);
  if (ridx >= static_cast<int64_t>(P.B) * P.H * P.n_q) return;
  const int64_t sbase = ridx * P.nsplit;
  float M = -INFINITY;
  for (int sp = 0; sp < P.nsplit; ++sp) M = fmaxf(M, P.part_ml[2 * (sbase + sp)]);
  float L = 0.f, o[CH];
#pragma unroll
  for (int c = 0; c < CH; ++c) o[c] = 0.f;
  if (M != -INFINITY) {
    for (int sp = 0; sp < P.nsplit; ++sp) {
      const float ms = P.part_ml[2 * (sbase + sp)];
      const float sc = ms == -INFINITY ? 0.f : exp2f(ms - M);
      L += P.part_ml[2 * (sbase + sp) + 1] * sc;
#pragma unroll
      for (int c = 0; c < CH; ++c) {
        const int d = lane + 32 * c;
        if (d < P.p) o[c] += P.part_o[(sbase + sp) * P.p + d] * sc;
      }
    }
  }
  finalize_row<T, CH>(P, ridx, M, L, o);
}

// ------------------------------------------------------------------------------------------
// Tensor-core path (float16 / bfloat16): flash attention on mma.sync m16n8k16
// ------------------------------------------------------------------------------------------
//
// A block has RW x KW warps. Warp (rw, kw) owns query rows [16 rw, 16 rw + 16) of the block's
// BM = 16 RW rows and key tile kw of every stage; a stage is KW tiles of BN keys (SK keys),
// staged for the whole block in shared memory by 16-byte cp.async copies, double buffered
// (stage i + 1 is in flight while stage i is consumed). Two instantiation families:
//   prefill: RW = 4, KW = 1, BN = 64   (64 rows per block; every warp walks every key tile)
//   decode : RW = 1, KW = 4, BN = 16   (16 rows per block, n_q <= 16; the 4 warps split the
//                                       keys of a stage and merge their states at the end)
// plus the flash-decoding split over blocks (nsplit, workspace + inducer_merge_kernel) when
// the (row tile, head, batch) blocks cannot fill the device.
// Per warp and key tile: S = Q K^T (16 x BN, float accumulators; Q fragments stay in
// registers for the whole kernel, K fragments by ldmatrix from rows of pitch D + 8, which
// is conflict-free), masking and the online softmax in the log2 domain on the accumulator
// registers (a row lives in the 4 lanes of a quad), then O += P V with P re-packed from the
// accumulators into A fragments (rounded to the input dtype, as the reference's P is) and V
// fragments by ldmatrix.trans. The head width is padded with zeros to D (32, 64, 96, 128).
template <typename T, int D, int BN, int RW, int KW>
struct InducerMmaCfg {
  static constexpr int kThreads = 32 * RW * KW;
  static constexpr int kBM = 16 * RW;
  static constexpr int kSK = BN * KW;
  static constexpr int kPitch = mma::pitch_for(D);
  static_assert(D % 32 == 0 && BN % 16 == 0, "tile shapes");
  static constexpr size_t kKvBytes = 2 * 2 * size_t(kSK) * kPitch * sizeof(T);
  static constexpr size_t kMergeBytes = sizeof(float) * (size_t(KW) * 16 * D + 2 * KW * 16);
  static constexpr size_t kSmem = sizeof(T) * size_t(kBM) * kPitch +
                                  (KW > 1 && kMergeBytes > kKvBytes ? kMergeBytes : kKvBytes);
};

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Final (or per-split) row output from float state: f = o / l (or the raw state to the
// split workspace), lse and lam by the caller's `lead` thread of the row.
template <typename T>
__device__ __forceinline__ void store_row_state(const InducerParams& P, int64_t ridx, int split,
                                                int col, float v, bool lead, float m, float l) {
  if (P.nsplit == 1) {
    if (col < P.p) static_cast<T*>(P.f)[ridx * P.p + col] = static_cast<T>(l > 0.f ? v / l : 0.f);
    if (lead) {
      const bool any = l > 0.f;
      const float lse = any ? (m + log2f(l)) * kLn2 : kFullyMaskedLse;
      const float x = P.s0[ridx] - lse;
      P.lse[ridx] = lse;
      P.lam[ridx] = x >= 0.f ? 1.f / (1.f + expf(-x)) : expf(x) / (1.f + expf(x));
    }
  } else {
    const int64_t sidx = ridx * P.nsplit + split;
    if (col < P.p) P.part_o[sidx * P.p + col] = v;
    if (lead) {
      P.part_ml[2 * sidx] = m;
      P.part_ml[2 * sidx + 1] = l;
    }
  }
}

template <typename T, int D, int BN, int RW, int KW>
__global__ void __launch_bounds__(32 * RW * KW)
    inducer_mma_kernel(const InducerParams P) {
  using Cfg = InducerMmaCfg<T, D, BN, RW, KW>;
  constexpr int NT = Cfg::kThreads, BM = Cfg::kBM, SK = Cfg::kSK, PITCH = Cfg::kPitch;
  constexpr int NJ = BN / 8;  // n8 score tiles per warp and key tile
  constexpr int ND = D / 8;   // n8 output tiles
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* Qs = reinterpret_cast<T*>(smem_raw);  // (BM, PITCH)
  T* Ks = Qs + BM * PITCH;                 // (2, SK, PITCH)
  T* Vs = Ks + 2 * SK * PITCH;             // (2, SK, PITCH)

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int rw = warp % RW, kw = warp / RW;
  const int g = lane >> 2, qd = lane & 3;
  const int b = blockIdx.z, h = blockIdx.y;
  const int split = blockIdx.x % P.nsplit;
  const int row0 = (blockIdx.x / P.nsplit) * BM;
  const int p = P.p, l = P.l;

  int len = P.n_k;
  if (P.lens) {
    len = P.lens[b];
    len = len < 0 ? 0 : (len > P.n_k ? P.n_k : len);
  }
  const int last_row = (row0 + BM < P.n_q ? row0 + BM : P.n_q) - 1;
  int seq_end = len;
  if (P.causal) {
    const int lim = P.n_k - P.n_q + last_row + 1;
    seq_end = lim < seq_end ? lim : seq_end;
  }
  seq_end = seq_end < 0 ? 0 : seq_end;
  const int kend = l + seq_end;
  const int nst_vis = (kend + SK - 1) / SK;
  const int st_beg = split * P.tiles_per_split;
  int st_end = st_beg + P.tiles_per_split;
  st_end = st_end < nst_vis ? st_end : nst_vis;
  const int nsteps = st_end > st_beg ? st_end - st_beg : 0;

  const T* qb = static_cast<const T*>(P.q) + b * P.q_sb + h * P.q_sh;
  const T* kseq = static_cast<const T*>(P.k) + b * P.k_sb + h * P.k_sh;
  const T* vseq = static_cast<const T*>(P.v) + b * P.v_sb + h * P.v_sh;
  const T* kpre = P.pk ? static_cast<const T*>(P.pk) + static_cast<int64_t>(h) * l * p : nullptr;
  const T* vpre = P.pv ? static_cast<const T*>(P.pv) + static_cast<int64_t>(h) * l * p : nullptr;

  {
    const int nrows = P.n_q - row0 < BM ? P.n_q - row0 : BM;
    mma::load_tile<T>(Qs, PITCH, qb + row0 * P.q_sn, P.q_sn, nrows, p, BM, D, P.vec, tid, NT);
  }
  // Keys [st * SK, st * SK + SK): prefix keys, then sequence keys, zero beyond kend / p.
  auto load_stage = [&](int st, int buf) {
    T* ks = Ks + buf * SK * PITCH;
    T* vs = Vs + buf * SK * PITCH;
    constexpr int CH = D / 8;
    for (int e = tid; e < SK * CH; e += NT) {
      const int r = e / CH, c = (e - r * CH) * 8;
      const int key = st * SK + r;
      const T* kp = qb;  // any valid 16-byte aligned address when nothing is read
      const T* vp = qb;
      if (key < l) {
        kp = kpre + key * p + c;
        vp = vpre + key * p + c;
      } else if (key < kend) {
        kp = kseq + static_cast<int64_t>(key - l) * P.k_sn + c;
        vp = vseq + static_cast<int64_t>(key - l) * P.v_sn + c;
      }
      const bool ok = key < kend && c < p;
      if (P.vec) {
        mma::cp_async16(ks + r * PITCH + c, ok ? kp : qb, ok);
        mma::cp_async16(vs + r * PITCH + c, ok ? vp : qb, ok);
      } else {
        alignas(16) T kv[8], vv[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const bool in = ok && c + i < p;
          kv[i] = in ? kp[i] : T(0.f);
          vv[i] = in ? vp[i] : T(0.f);
        }
        *reinterpret_cast<uint4*>(ks + r * PITCH + c) = *reinterpret_cast<const uint4*>(kv);
        *reinterpret_cast<uint4*>(vs + r * PITCH + c) = *reinterpret_cast<const uint4*>(vv);
      }
    }
  };

  float m_r[2] = {-INFINITY, -INFINITY}, l_r[2] = {0.f, 0.f};
  float o[ND][4];
#pragma unroll
  for (int j = 0; j < ND; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[j][e] = 0.f;
  uint32_t qf[D / 16][4];
  const int rowA = row0 + rw * 16 + g;  // this thread's rows: rowA and rowA + 8
  const int diag = P.n_k - P.n_q;       // causal: sequence key j visible to row i iff j <= diag + i

  if (nsteps > 0) load_stage(st_beg, 0);
  mma::cp_async_commit();
  for (int it = 0; it < nsteps; ++it) {
    if (it + 1 < nsteps) {
      load_stage(st_beg + it + 1, (it + 1) & 1);
      mma::cp_async_commit();
      mma::cp_async_wait<1>();
    } else {
      mma::cp_async_wait<0>();
    }
    __syncthreads();
    if (it == 0) {
#pragma unroll
      for (int kc = 0; kc < D / 16; ++kc) mma::load_a_kmajor<T>(qf[kc], Qs, PITCH, rw * 16, kc * 16);
    }
    const T* ks = Ks + ((it & 1) * SK + kw * BN) * PITCH;
    const T* vs = Vs + ((it & 1) * SK + kw * BN) * PITCH;
    const int key0 = (st_beg + it) * SK + kw * BN;

    float s[NJ][4];
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] = 0.f;
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
#pragma unroll
      for (int np = 0; np < NJ / 2; ++np) {
        uint32_t bf[4];
        mma::load_b2_kmajor<T>(bf, ks, PITCH, np * 16, kc * 16);
        mma::mma16816<T>(s[2 * np], qf[kc], bf[0], bf[1]);
        mma::mma16816<T>(s[2 * np + 1], qf[kc], bf[2], bf[3]);
      }
    }
    // Scale, mask, online softmax (rows rowA (e = 0, 1) and rowA + 8 (e = 2, 3)).
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key0 + 8 * j + 2 * qd + (e & 1);
        const int row = rowA + (e >> 1) * 8;
        const bool vis =
            key < l || (key < kend && (!P.causal || key - l <= diag + row));
        s[j][e] = vis ? s[j][e] * P.scale_log2 : -INFINITY;
      }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < NJ; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * i], s[j][2 * i + 1]));
      const float m_new = fmaxf(m_r[i], quad_max(mx));
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = exp2f(m_r[i] - m_use);
      m_r[i] = m_new;
      float rs = 0.f;
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        s[j][2 * i] = exp2f(s[j][2 * i] - m_use);
        s[j][2 * i + 1] = exp2f(s[j][2 * i + 1] - m_use);
        rs += s[j][2 * i] + s[j][2 * i + 1];
      }
      l_r[i] = l_r[i] * alpha + rs;
#pragma unroll
      for (int j = 0; j < ND; ++j) {
        o[j][2 * i] *= alpha;
        o[j][2 * i + 1] *= alpha;
      }
    }
    // O += P V.
#pragma unroll
    for (int kc = 0; kc < BN / 16; ++kc) {
      const uint32_t a[4] = {mma::pack2<T>(s[2 * kc][0], s[2 * kc][1]),
                             mma::pack2<T>(s[2 * kc][2], s[2 * kc][3]),
                             mma::pack2<T>(s[2 * kc + 1][0], s[2 * kc + 1][1]),
                             mma::pack2<T>(s[2 * kc + 1][2], s[2 * kc + 1][3])};
#pragma unroll
      for (int dp = 0; dp < ND / 2; ++dp) {
        uint32_t bf[4];
        mma::load_b2_mnmajor<T>(bf, vs, PITCH, dp * 16, kc * 16);
        mma::mma16816<T>(o[2 * dp], a, bf[0], bf[1]);
        mma::mma16816<T>(o[2 * dp + 1], a, bf[2], bf[3]);
      }
    }
    __syncthreads();  // buffer (it & 1) is refilled by iteration it + 1
  }
  mma::cp_async_wait<0>();  // nothing may still be landing in shared memory (nsteps == 0)
  l_r[0] = quad_sum(l_r[0]);
  l_r[1] = quad_sum(l_r[1]);

  const int64_t rbase = (static_cast<int64_t>(b) * P.H + h) * P.n_q;
  if constexpr (KW == 1) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = rowA + 8 * i;
      if (row >= P.n_q) continue;
#pragma unroll
      for (int j = 0; j < ND; ++j) {
        const int col = 8 * j + 2 * qd;
        store_row_state<T>(P, rbase + row, split, col, o[j][2 * i], j == 0 && qd == 0, m_r[i],
                           l_r[i]);
        store_row_state<T>(P, rbase + row, split, col + 1, o[j][2 * i + 1], false, m_r[i],
                           l_r[i]);
      }
    }
  } else {
    // Merge the KW warps' states of the same 16 rows through shared memory (fixed order).
    __syncthreads();
    float* Ob = reinterpret_cast<float*>(Ks);  // (KW, 16, D)
    float* Mb = Ob + KW * 16 * D;              // (KW, 16)
    float* Lb = Mb + KW * 16;                  // (KW, 16)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = g + 8 * i;
#pragma unroll
      for (int j = 0; j < ND; ++j) {
        Ob[(kw * 16 + r) * D + 8 * j + 2 * qd] = o[j][2 * i];
        Ob[(kw * 16 + r) * D + 8 * j + 2 * qd + 1] = o[j][2 * i + 1];
      }
      if (qd == 0) {
        Mb[kw * 16 + r] = m_r[i];
        Lb[kw * 16 + r] = l_r[i];
      }
    }
    __syncthreads();
    for (int e = tid; e < 16 * D; e += NT) {
      const int r = e / D, col = e - r * D;
      const int row = row0 + r;
      if (row >= P.n_q || col >= p) continue;
      float M = -INFINITY;
#pragma unroll
      for (int w = 0; w < KW; ++w) M = fmaxf(M, Mb[w * 16 + r]);
      float L = 0.f, acc = 0.f;
      if (M != -INFINITY) {
#pragma unroll
        for (int w = 0; w < KW; ++w) {
          const float mw = Mb[w * 16 + r];
          const float sc = mw == -INFINITY ? 0.f : exp2f(mw - M);
          L += Lb[w * 16 + r] * sc;
          acc += Ob[(w * 16 + r) * D + col] * sc;
        }
      }
      store_row_state<T>(P, rbase + row, split, col, acc, col == 0, M, L);
    }
  }
}

template <typename T, int D, int BN, int RW, int KW>
void launch_inducer_mma(const InducerParams& P, dim3 grid, cudaStream_t stream) {
  using Cfg = InducerMmaCfg<T, D, BN, RW, KW>;
  auto kernel = inducer_mma_kernel<T, D, BN, RW, KW>;
  set_smem(kernel, Cfg::kSmem, "inducer_mma_kernel");
  kernel<<<grid, Cfg::kThreads, Cfg::kSmem, stream>>>(P);
  check_launch("inducer_mma_kernel");
  if (P.nsplit > 1) {
    const int64_t rows = static_cast<int64_t>(P.B) * P.H * P.n_q;
    constexpr int CH = (D + 31) / 32;
    inducer_merge_kernel<T, CH><<<static_cast<unsigned>(ceil_div(rows, 4)), 128, 0, stream>>>(P);
    check_launch("inducer_merge_kernel");
  }
}

// Tile shapes of the two schedules (a GPU session tunes them here).
constexpr int kPrefillBN = 64, kPrefillRW = 4;
constexpr int kDecodeBN = 16, kDecodeKW = 4;

template <typename T, int D>
void launch_inducer_mma_d(const InducerParams& P, bool decode, dim3 grid, cudaStream_t stream) {
  if (decode)
    launch_inducer_mma<T, D, kDecodeBN, 1, kDecodeKW>(P, grid, stream);
  else
    launch_inducer_mma<T, D, kPrefillBN, kPrefillRW, 1>(P, grid, stream);
}

template <typename T>
void launch_inducer_mma_p(const InducerParams& P, bool decode, int chunks, dim3 grid,
                          cudaStream_t stream) {
  switch (chunks) {
    case 1: launch_inducer_mma_d<T, 32>(P, decode, grid, stream); break;
    case 2: launch_inducer_mma_d<T, 64>(P, decode, grid, stream); break;
    case 3: launch_inducer_mma_d<T, 96>(P, decode, grid, stream); break;
    default: launch_inducer_mma_d<T, 128>(P, decode, grid, stream); break;
  }
}

template <typename T, int CH>
void launch_inducer(const InducerParams& P, dim3 grid, size_t smem, cudaStream_t stream) {
  set_smem(inducer_fwd_kernel<T, CH>, smem, "inducer_fwd_kernel");
  inducer_fwd_kernel<T, CH><<<grid, kWarps * 32, smem, stream>>>(P);
  check_launch("inducer_fwd_kernel");
  if (P.nsplit > 1) {
    const int64_t rows = static_cast<int64_t>(P.B) * P.H * P.n_q;
    inducer_merge_kernel<T, CH><<<static_cast<unsigned>(ceil_div(rows, 4)), 128, 0, stream>>>(P);
    check_launch("inducer_merge_kernel");
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> inducer_attention_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& s0,
    const std::optional<at::Tensor>& prefix_k, const std::optional<at::Tensor>& prefix_v,
    const std::optional<at::Tensor>& key_lengths, bool causal) {
  check_float_cuda(q, "q");
  check_float_cuda(k, "k");
  check_float_cuda(v, "v");
  check_like(k, "k", q, "q");
  check_like(v, "v", q, "q");
  check_dim(q, 4, "q", "(B, H, n_q, p)");
  check_dim(k, 4, "k", "(B, H, n_k, p)");
  check_dim(v, 4, "v", "(B, H, n_k, p)");
  const int64_t Bn = q.size(0), H = q.size(1), n_q = q.size(2), p = q.size(3);
  const int64_t n_k = k.size(2);
  TORCH_CHECK(k.size(0) == Bn && k.size(1) == H && k.size(3) == p,
              "kfused: inducer_attention_fwd: k (", describe(k), ") must be (", Bn, ", ", H,
              ", n_k, ", p, ") to match q ", q.sizes());
  TORCH_CHECK(v.sizes() == k.sizes(), "kfused: inducer_attention_fwd: v (", describe(v),
              ") must have the shape of k ", k.sizes());
  TORCH_CHECK(p >= 1 && p <= 128, "kfused: inducer_attention_fwd: head width p = ", p,
              " is not supported (1..128; tested 32, 64, 80, 96, 128); q ", q.sizes());
  for (const auto& pr : {std::make_pair(&q, "q"), std::make_pair(&k, "k"), std::make_pair(&v, "v")})
    TORCH_CHECK(pr.first->size(3) <= 1 || pr.first->stride(3) == 1, "kfused: inducer_attention_fwd: ",
                pr.second, " must have a contiguous last dimension (", describe(*pr.first),
                ", strides ", pr.first->strides(), ")");
  TORCH_CHECK(Bn <= 65535 && H <= 65535, "kfused: inducer_attention_fwd: batch and heads must be "
              "at most 65535 (q ", q.sizes(), ")");
  TORCH_CHECK(n_q < (int64_t(1) << 31) && n_k < (int64_t(1) << 31),
              "kfused: inducer_attention_fwd: sequence lengths must fit in int32");
  TORCH_CHECK(s0.is_cuda() && s0.is_floating_point() && s0.dim() == 3 && s0.size(0) == Bn &&
                  s0.size(1) == H && s0.size(2) == n_q,
              "kfused: inducer_attention_fwd: s0 (", describe(s0),
              ") must be a floating CUDA tensor of shape (", Bn, ", ", H, ", ", n_q, ")");
  TORCH_CHECK(s0.device() == q.device(), "kfused: inducer_attention_fwd: s0 (", describe(s0),
              ") must be on the device of q (", q.device(), ")");
  const bool has_pk = prefix_k.has_value() && prefix_k->defined();
  const bool has_pv = prefix_v.has_value() && prefix_v->defined();
  TORCH_CHECK(has_pk == has_pv, "kfused: inducer_attention_fwd: prefix_k and prefix_v must be "
              "given together");
  int64_t l = 0;
  if (has_pk) {
    for (const auto& pr : {std::make_pair(&*prefix_k, "prefix_k"),
                           std::make_pair(&*prefix_v, "prefix_v")}) {
      check_float_cuda(*pr.first, pr.second);
      check_like(*pr.first, pr.second, q, "q");
      check_contiguous(*pr.first, pr.second);
      TORCH_CHECK(pr.first->dim() == 3 && pr.first->size(0) == H && pr.first->size(2) == p,
                  "kfused: inducer_attention_fwd: ", pr.second, " (", describe(*pr.first),
                  ") must be (H, l, p) = (", H, ", l, ", p, ")");
    }
    TORCH_CHECK(prefix_k->size(1) == prefix_v->size(1), "kfused: inducer_attention_fwd: prefix_k ",
                prefix_k->sizes(), " and prefix_v ", prefix_v->sizes(), " must have the same l");
    l = prefix_k->size(1);
  }
  at::Tensor lens;
  if (key_lengths.has_value() && key_lengths->defined()) {
    const at::Tensor& kl = *key_lengths;
    TORCH_CHECK(kl.is_cuda() && kl.device() == q.device(),
                "kfused: inducer_attention_fwd: key_lengths (", describe(kl),
                ") must be on the device of q (", q.device(), ")");
    TORCH_CHECK(kl.scalar_type() == at::kInt || kl.scalar_type() == at::kLong,
                "kfused: inducer_attention_fwd: key_lengths (", describe(kl),
                ") must be int32 or int64");
    TORCH_CHECK(kl.dim() == 1 && kl.size(0) == Bn, "kfused: inducer_attention_fwd: key_lengths (",
                describe(kl), ") must have shape (", Bn, ")");
    lens = kl.to(at::kInt).contiguous();
  }

  at::Tensor f = at::empty({Bn, H, n_q, p}, q.options());
  const auto fopts = q.options().dtype(at::kFloat);
  at::Tensor lse = at::empty({Bn, H, n_q}, fopts);
  at::Tensor lam = at::empty({Bn, H, n_q}, fopts);
  if (Bn == 0 || H == 0 || n_q == 0) return {f, lse, lam};
  DeviceGuard guard(q);
  at::Tensor s0f = s0.to(at::kFloat).contiguous();

  const int64_t sms = sm_count();
  // float16 / bfloat16: tensor-core kernel (prefill: 64 rows per block; decode, n_q <= 16:
  // 16 rows, 4 warps splitting each stage's keys). float32: the CUDA-core kernel (tensor
  // cores would need TF32, which fails the SPEC §4 rule): 16 rows per block, or 4 rows with
  // the warps splitting the keys (ksplit = 4) for decode / few blocks.
  const bool tc = q.scalar_type() != at::kFloat;
  const bool decode = tc && n_q <= 16;
  int ksplit = 1, rows_blk = 0;
  int64_t stage_keys = kBK, min_steps = 1;
  if (tc) {
    rows_blk = decode ? 16 : 16 * kPrefillRW;
    stage_keys = decode ? kDecodeBN * kDecodeKW : kPrefillBN;
  } else {
    const int64_t blocks1 = ceil_div(n_q, kWarps * kRowsPerWarp) * Bn * H;
    ksplit = (n_q <= kRowsPerWarp || (blocks1 < sms && l + n_k > 4 * kBK)) ? 4 : 1;
    rows_blk = ksplit == 1 ? kWarps * kRowsPerWarp : kRowsPerWarp;
    min_steps = 2 * ksplit;
  }
  // Flash-decoding: split the keys over blocks when the (row tile, head, batch) blocks cannot
  // fill the device (CUDA-core kernel: every split walks at least 2 steps of ksplit tiles;
  // tensor-core kernel: at least one stage).
  const int64_t row_tiles = ceil_div(n_q, rows_blk);
  const int64_t blocks = row_tiles * Bn * H;
  const int64_t ntiles = ceil_div(l + n_k, stage_keys);
  int64_t nsplit = 1;
  if (blocks < sms) {
    nsplit = std::min<int64_t>(ceil_div(2 * sms, blocks), ntiles / min_steps);
    nsplit = std::max<int64_t>(1, std::min<int64_t>(nsplit, 64));
  }
  const int64_t tiles_per_split = std::max<int64_t>(1, ceil_div(ntiles, nsplit));
  nsplit = std::max<int64_t>(1, ceil_div(ntiles, tiles_per_split));
  at::Tensor part_o, part_ml;
  if (nsplit > 1) {
    part_o = at::empty({Bn * H * n_q * nsplit * p}, fopts);
    part_ml = at::empty({Bn * H * n_q * nsplit * 2}, fopts);
  }

  InducerParams P{};
  P.q = q.data_ptr();
  P.k = k.data_ptr();
  P.v = v.data_ptr();
  P.s0 = s0f.data_ptr<float>();
  P.pk = has_pk ? prefix_k->data_ptr() : nullptr;
  P.pv = has_pv ? prefix_v->data_ptr() : nullptr;
  P.lens = lens.defined() ? lens.data_ptr<int>() : nullptr;
  P.f = f.data_ptr();
  P.lse = lse.data_ptr<float>();
  P.lam = lam.data_ptr<float>();
  P.q_sb = q.stride(0);
  P.q_sh = q.stride(1);
  P.q_sn = q.stride(2);
  P.k_sb = k.stride(0);
  P.k_sh = k.stride(1);
  P.k_sn = k.stride(2);
  P.v_sb = v.stride(0);
  P.v_sh = v.stride(1);
  P.v_sn = v.stride(2);
  P.B = static_cast<int>(Bn);
  P.H = static_cast<int>(H);
  P.n_q = static_cast<int>(n_q);
  P.n_k = static_cast<int>(n_k);
  P.p = static_cast<int>(p);
  P.l = static_cast<int>(l);
  P.scale_log2 = static_cast<float>(1.0 / std::sqrt(static_cast<double>(p)) * 1.4426950408889634);
  P.causal = causal;
  P.ksplit = ksplit;
  P.nsplit = static_cast<int>(nsplit);
  P.tiles_per_split = static_cast<int>(tiles_per_split);
  P.part_o = nsplit > 1 ? part_o.data_ptr<float>() : nullptr;
  P.part_ml = nsplit > 1 ? part_ml.data_ptr<float>() : nullptr;
  TORCH_CHECK(row_tiles * nsplit < (int64_t(1) << 31), "kfused: inducer_attention_fwd: too many rows");
  const dim3 grid(static_cast<unsigned>(row_tiles * nsplit), static_cast<unsigned>(H),
                  static_cast<unsigned>(Bn));
  const int chunks = static_cast<int>(ceil_div(p, 32));
  cudaStream_t stream = current_stream();
  if (tc) {
    // 16-byte cp.async rows need 16-byte aligned rows: p and every row stride a multiple of 8
    // elements and aligned base pointers; otherwise the same kernel stages with scalar loads.
    auto al = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; };
    bool vec = p % 8 == 0 && al(P.q) && al(P.k) && al(P.v) && (!has_pk || (al(P.pk) && al(P.pv)));
    for (int64_t st : {P.q_sb, P.q_sh, P.q_sn, P.k_sb, P.k_sh, P.k_sn, P.v_sb, P.v_sh, P.v_sn})
      vec = vec && st % 8 == 0;
    P.vec = vec;
    if (q.scalar_type() == at::kHalf)
      launch_inducer_mma_p<c10::Half>(P, decode, chunks, grid, stream);
    else
      launch_inducer_mma_p<c10::BFloat16>(P, decode, chunks, grid, stream);
    return {f, lse, lam};
  }
  const int64_t optin = max_smem_optin();
  {
    using scalar_t = float;
    P.pitch = kv_pitch(P.p, sizeof(scalar_t));
    const size_t kv_bytes = 2 * sizeof(scalar_t) * size_t(ksplit) * kBK * P.pitch;
    const size_t merge_bytes = sizeof(float) * kWarps * kRowsPerWarp * (p + 2);
    const size_t smem =
        sizeof(float) * rows_blk * p + std::max(kv_bytes, ksplit > 1 ? merge_bytes : size_t(0));
    TORCH_CHECK(static_cast<int64_t>(smem) <= optin, "kfused: inducer_attention_fwd needs ", smem,
                " bytes of shared memory; the device allows ", optin);
    switch (chunks) {
      case 1: launch_inducer<scalar_t, 1>(P, grid, smem, stream); break;
      case 2: launch_inducer<scalar_t, 2>(P, grid, smem, stream); break;
      case 3: launch_inducer<scalar_t, 3>(P, grid, smem, stream); break;
      default: launch_inducer<scalar_t, 4>(P, grid, smem, stream); break;
    }
  }
  return {f, lse, lam};
}

}  // namespace kfused
