// Inducer attention forward for inference (docs/math.md §3), flash-style:
//   f_i   = sum_j softmax_j(S_i.) v_j         over the real keys (prefix + sequence)
//   lse_i = log sum_j exp(S_ij)               S_ij = <q_i, k_j> / sqrt(p), masked keys excluded
//   lam_i = sigmoid(s0_i - lse_i)             the inducer column's share of the extended softmax
// s0 (the virtual key's logit) is either given, or — float16 / bfloat16 with the inducer MLP
// weights — computed inside the tensor-core kernel from the q tile it already holds
// (inducer_mma.cuh), which then also writes u = lam * tanh(q W1 + b1) ("add"; for "gate" the
// caller composes (1 - lam) f + u W2 + lam b2 from a float32 u).
//
// k, v: (B, H_kv, n_k, p) with H_kv dividing H (grouped-query attention: query head h reads kv
// head h / (H / H_kv); the 16-bit decode schedule packs a kv head's query heads into one block,
// inducer.cuh InducerParams::gpack).
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
#include "inducer/inducer.cuh"
#include "kfused.h"

#include <cmath>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace kfused {
namespace inducer {
namespace {

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
  const int hk = h / P.group;  // grouped-query attention: the kv head (no packing here)
  const T* kseq = static_cast<const T*>(P.k) + b * P.k_sb + hk * P.k_sh;
  const T* vseq = static_cast<const T*>(P.v) + b * P.v_sb + hk * P.v_sh;
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


// At least n int32 zeros for the tensor-core kernel's arrival counters (InducerParams::count),
// kept per (device, stream) and reused: every launch leaves them at zero, so no launch pays a
// memset, and launches on one stream run in order. A larger request replaces the buffer (the
// caching allocator keeps the old one until the stream's earlier work is done). The map is
// never destroyed: no tensor is freed after the CUDA runtime has shut down at exit.
at::Tensor arrival_counters(const at::Tensor& like, int64_t n) {
  static std::mutex mu;
  static auto* cache = new std::map<std::pair<int64_t, cudaStream_t>, at::Tensor>();
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(static_cast<int64_t>(like.get_device()), current_stream());
  auto it = cache->find(key);
  if (it != cache->end() && it->second.numel() >= n) return it->second;
  at::Tensor t = at::zeros({std::max<int64_t>(n, 1024)}, like.options().dtype(at::kInt));
  (*cache)[key] = t;
  return t;
}

}  // namespace
}  // namespace inducer

using namespace inducer;

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> inducer_attention_fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& s0_opt, const std::optional<at::Tensor>& prefix_k,
    const std::optional<at::Tensor>& prefix_v, const std::optional<at::Tensor>& key_lengths,
    bool causal, const std::optional<at::Tensor>& Ak, const std::optional<at::Tensor>& ak,
    const std::optional<at::Tensor>& Bk, const std::optional<at::Tensor>& ck,
    const std::optional<at::Tensor>& W1, const std::optional<at::Tensor>& b1, bool u_float) {
  check_float_cuda(q, "q");
  check_float_cuda(k, "k");
  check_float_cuda(v, "v");
  check_like(k, "k", q, "q");
  check_like(v, "v", q, "q");
  check_dim(q, 4, "q", "(B, H, n_q, p)");
  check_dim(k, 4, "k", "(B, H_kv, n_k, p)");
  check_dim(v, 4, "v", "(B, H_kv, n_k, p)");
  const int64_t Bn = q.size(0), H = q.size(1), n_q = q.size(2), p = q.size(3);
  const int64_t n_k = k.size(2), H_kv = k.size(1);
  TORCH_CHECK(k.size(0) == Bn && H_kv >= 1 && H % H_kv == 0 && k.size(3) == p,
              "kfused: inducer_attention_fwd: k (", describe(k), ") must be (", Bn,
              ", H_kv, n_k, ", p, ") with H_kv dividing q's ", H, " heads (grouped-query "
              "attention) to match q ", q.sizes());
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
  // The virtual key's logit: given (s0), or computed in the kernel from the inducer MLP.
  const std::optional<at::Tensor>* mlp_args[6] = {&Ak, &ak, &Bk, &ck, &W1, &b1};
  const char* mlp_names[6] = {"Ak", "ak", "Bk", "ck", "W1", "b1"};
  int n_mlp = 0;
  for (auto* t : mlp_args) n_mlp += (t->has_value() && (*t)->defined()) ? 1 : 0;
  TORCH_CHECK(n_mlp == 0 || n_mlp == 6, "kfused: inducer_attention_fwd: the inducer MLP needs "
              "all of Ak, ak, Bk, ck, W1, b1 (", n_mlp, " of 6 given)");
  const bool has_mlp = n_mlp == 6;
  const bool has_s0 = s0_opt.has_value() && s0_opt->defined();
  TORCH_CHECK(has_s0 != has_mlp, "kfused: inducer_attention_fwd: give either s0 or the inducer "
              "MLP weights (Ak, ak, Bk, ck, W1, b1), not ", has_s0 ? "both" : "neither");
  int64_t L = 0, r = 0;
  if (has_s0) {
    const at::Tensor& s0 = *s0_opt;
    TORCH_CHECK(s0.is_cuda() && s0.is_floating_point() && s0.dim() == 3 && s0.size(0) == Bn &&
                    s0.size(1) == H && s0.size(2) == n_q,
                "kfused: inducer_attention_fwd: s0 (", describe(s0),
                ") must be a floating CUDA tensor of shape (", Bn, ", ", H, ", ", n_q, ")");
    TORCH_CHECK(s0.device() == q.device(), "kfused: inducer_attention_fwd: s0 (", describe(s0),
                ") must be on the device of q (", q.device(), ")");
  } else {
    TORCH_CHECK(q.scalar_type() != at::kFloat, "kfused: inducer_attention_fwd: the in-kernel "
                "inducer MLP is the tensor-core (float16 / bfloat16) path; float32 q (",
                describe(q), ") takes s0");
    for (int i = 0; i < 6; ++i) {
      const at::Tensor& t = **mlp_args[i];
      check_float_cuda(t, mlp_names[i]);
      check_like(t, mlp_names[i], q, "q");
      check_contiguous(t, mlp_names[i]);
    }
    L = Ak->size(-1);
    r = W1->size(-1);
    auto want = [&](const at::Tensor& t, const char* name, std::vector<int64_t> shape,
                    const char* what) {
      TORCH_CHECK(t.sizes() == at::IntArrayRef(shape), "kfused: inducer_attention_fwd: ", name,
                  " (", describe(t), ") must be ", what, " = ", at::IntArrayRef(shape));
    };
    TORCH_CHECK(Ak->dim() == 3 && W1->dim() == 3, "kfused: inducer_attention_fwd: Ak (",
                describe(*Ak), ") and W1 (", describe(*W1), ") must be (H, p, L) and (H, p, r)");
    want(*Ak, "Ak", {H, p, L}, "(H, p, L)");
    want(*ak, "ak", {H, L}, "(H, L)");
    want(*Bk, "Bk", {H, L, p}, "(H, L, p)");
    want(*ck, "ck", {H, p}, "(H, p)");
    want(*W1, "W1", {H, p, r}, "(H, p, r)");
    want(*b1, "b1", {H, r}, "(H, r)");
    TORCH_CHECK(L >= 1 && r >= 1 && 2 * L + r + 1 <= kMlpMaxCols, "kfused: inducer_attention_fwd: "
                "the in-kernel MLP takes 2 L + r + 1 <= ", kMlpMaxCols, " columns (L = ", L,
                ", r = ", r, ")");
  }
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
    // clamp before narrowing: an int64 count >= 2^31 would wrap (2^32 + 5 -> 5 keys); the
    // kernel reads [0, n_k] either way
    lens = kl.clamp(0, n_k).to(at::kInt).contiguous();
  }

  at::Tensor f = at::empty({Bn, H, n_q, p}, q.options());
  const auto fopts = q.options().dtype(at::kFloat);
  at::Tensor lse = at::empty({Bn, H, n_q}, fopts);
  at::Tensor lam = at::empty({Bn, H, n_q}, fopts);
  at::Tensor u = has_mlp ? at::empty({Bn, H, n_q, r}, u_float ? fopts : q.options())
                         : at::empty({0}, q.options());
  if (Bn == 0 || H == 0 || n_q == 0) return {f, lse, lam, u};
  DeviceGuard guard(q);
  at::Tensor s0f = has_s0 ? s0_opt->to(at::kFloat).contiguous() : at::Tensor();

  const int64_t sms = sm_count();
  // float16 / bfloat16: tensor-core kernel (prefill: 128 or 64 rows per block; decode, n_q <= 16:
  // 16 rows, 4 warps splitting each stage's keys). float32: the CUDA-core kernel (tensor
  // cores would need TF32, which fails the docs/math.md §4 rule): 16 rows per block, or 4 rows with
  // the warps splitting the keys (ksplit = 4) for decode / few blocks.
  const bool tc = q.scalar_type() != at::kFloat;
  const bool decode = tc && n_q <= 16;
  int ksplit = 1, rows_blk = 0;
  int64_t stage_keys = kBK, min_steps = 1;
  if (tc) {
    // prefill: 128 rows per block up to p = 64 (two 16-row tiles per warp), 64 above
    rows_blk = decode ? 16 : prefill_rows(static_cast<int>(ceil_div(p, 32)) * 32);
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
  // Grouped-query decode (16-bit, no prefix): gpack query heads of one kv head share a block
  // (the most that divide the group and whose rows fit one tile), which reads the kv head's
  // keys once for all of them.
  const int64_t group = H / H_kv;
  int64_t gpack = 1;
  if (decode && l == 0)
    for (int64_t d = group; d > 1; --d)
      if (group % d == 0 && d * n_q <= rows_blk) {
        gpack = d;
        break;
      }
  const int64_t row_tiles = ceil_div(gpack * n_q, rows_blk);
  const int64_t blocks = row_tiles * Bn * (H / gpack);
  const int64_t ntiles = ceil_div(l + n_k, stage_keys);
  int64_t nsplit = 1;
  if (blocks < sms) {
    nsplit = std::min<int64_t>(ceil_div(2 * sms, blocks), ntiles / min_steps);
    nsplit = std::max<int64_t>(1, std::min<int64_t>(nsplit, 64));
  }
  const int64_t tiles_per_split = std::max<int64_t>(1, ceil_div(ntiles, nsplit));
  nsplit = std::max<int64_t>(1, ceil_div(ntiles, tiles_per_split));
  at::Tensor part_o, part_ml, ws_s0, ws_hid;
  if (nsplit > 1) {
    part_o = at::empty({Bn * H * n_q * nsplit * p}, fopts);
    part_ml = at::empty({Bn * H * n_q * nsplit * 2}, fopts);
    if (has_mlp) {
      ws_s0 = at::empty({Bn * H * n_q}, fopts);
      ws_hid = at::empty({Bn * H * n_q * r}, fopts);
    }
  }

  InducerParams P{};
  P.q = q.data_ptr();
  P.k = k.data_ptr();
  P.v = v.data_ptr();
  P.s0 = has_s0 ? s0f.data_ptr<float>() : nullptr;
  if (has_mlp) {
    P.ak_w = Ak->data_ptr();
    P.ak_b = ak->data_ptr();
    P.bk_w = Bk->data_ptr();
    P.ck = ck->data_ptr();
    P.w1 = W1->data_ptr();
    P.b1 = b1->data_ptr();
    P.L = static_cast<int>(L);
    P.r = static_cast<int>(r);
    P.ncp = static_cast<int>(ceil_div(2 * L + r + 1, 16) * 16);
    P.u = u.data_ptr();
    P.u_f32 = u_float;
    P.ws_s0 = nsplit > 1 ? ws_s0.data_ptr<float>() : nullptr;
    P.ws_hid = nsplit > 1 ? ws_hid.data_ptr<float>() : nullptr;
  }
  P.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(p)));
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
  P.group = static_cast<int>(group);
  P.gpack = static_cast<int>(gpack);
  P.scale_log2 = static_cast<float>(1.0 / std::sqrt(static_cast<double>(p)) * 1.4426950408889634);
  P.causal = causal;
  P.ksplit = ksplit;
  P.nsplit = static_cast<int>(nsplit);
  P.tiles_per_split = static_cast<int>(tiles_per_split);
  P.part_o = nsplit > 1 ? part_o.data_ptr<float>() : nullptr;
  P.part_ml = nsplit > 1 ? part_ml.data_ptr<float>() : nullptr;
  TORCH_CHECK(row_tiles * nsplit < (int64_t(1) << 31), "kfused: inducer_attention_fwd: too many rows");
  const dim3 grid(static_cast<unsigned>(row_tiles * nsplit), static_cast<unsigned>(H / gpack),
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
    // the splits merge in the kernel (its last block per tile): one counter per tile
    at::Tensor count;
    if (nsplit > 1) {
      count = arrival_counters(q, row_tiles * (H / gpack) * Bn);
      P.count = count.data_ptr<int>();
    }
    if (q.scalar_type() == at::kHalf)
      launch_inducer_mma_p<c10::Half>(P, decode, chunks, grid, stream);
    else
      launch_inducer_mma_p<c10::BFloat16>(P, decode, chunks, grid, stream);
    return {f, lse, lam, u};
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
  return {f, lse, lam, u};
}

}  // namespace kfused
