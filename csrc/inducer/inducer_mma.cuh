// Tensor-core (mma.sync m16n8k16) flash kernel of the inducer attention forward for float16 /
// bfloat16; included by inducer_mma_f16.cu and inducer_mma_bf16.cu only.
#pragma once

#include "common/mma.cuh"
#include "inducer/inducer.cuh"

namespace kfused {
namespace inducer {

// ------------------------------------------------------------------------------------------
// Tensor-core path (float16 / bfloat16): flash attention on mma.sync m16n8k16
// ------------------------------------------------------------------------------------------
//
// A block has RW x KW warps. Warp (rw, kw) owns MR row tiles of 16 query rows, rows
// [16 MR rw, 16 MR (rw + 1)) of the block's BM = 16 MR RW rows, and key tile kw of every
// stage; a stage is KW tiles of BN keys (SK keys),
// staged for the whole block in shared memory by 16-byte cp.async copies, double buffered
// (stage i + 1 is in flight while stage i is consumed). Two instantiation families:
//   prefill: RW = 4, KW = 1, BN = 64, MR = prefill_mr(D) (2 for D <= 64: 128 rows per block,
//            32 per warp; 1 above: 64 rows); every warp walks every key tile
//   decode : RW = 1, KW = 4, BN = 16, MR = 1 (16 rows per block, n_q <= 16; the 4 warps split
//            the keys of a stage and merge their states at the end)
// plus the flash-decoding split over blocks (nsplit, float32 workspace) when the (row tile,
// head, batch) blocks cannot fill the device; the last block of a tile to finish merges the
// splits (arrival counter, InducerParams::count), so decode stays one launch.
// Per warp and key tile: S = Q K^T (16 MR x BN, float accumulators; Q fragments stay in
// registers for the whole kernel, K fragments by ldmatrix from rows of pitch D + 8, which
// is conflict-free; each K or V fragment feeds the MR row tiles' products, so shared-memory
// traffic per product falls by MR), masking only in the stages that need it (the key range
// crosses kend, or the causal diagonal of one of the thread's rows), the online softmax in
// the log2 domain on the raw accumulators (the scale folded into the exponent's FFMA; a row
// lives in the 4 lanes of a quad), then O += P V with P re-packed from the accumulators into
// A fragments (rounded to the input dtype, as the reference's P is) and V fragments by
// ldmatrix.trans. The head width is padded with zeros to D (32, 64, 96, 128).
template <typename T, int D, int BN, int RW, int KW, int MR>
struct InducerMmaCfg {
  static constexpr int kThreads = 32 * RW * KW;
  static constexpr int kBM = 16 * RW * MR;
  static_assert(KW == 1 || MR == 1, "the key-split schedule merges 16-row warp states");
  static constexpr int kSK = BN * KW;
  static constexpr int kPitch = mma::pitch_for(D);
  static_assert(D % 32 == 0 && BN % 16 == 0, "tile shapes");
  static_assert(BN * KW >= kMlpMaxCols, "the MLP weight is staged in one K buffer");
  static constexpr size_t kKvBytes = 2 * 2 * size_t(kSK) * kPitch * sizeof(T);
  static constexpr size_t kMergeBytes = sizeof(float) * (size_t(KW) * 16 * D + 2 * KW * 16);
  static constexpr size_t kSmem = sizeof(T) * size_t(kBM) * kPitch +
                                  (KW > 1 && kMergeBytes > kKvBytes ? kMergeBytes : kKvBytes);
};

// 2^x by the SFU alone (ex2.approx.ftz: relative error below 2^-22, results below 2^-126
// flushed to zero, 2^-inf = 0), as Triton's exp2 and FlashAttention's fast-math build compile
// it; exp2f adds a range test and two multiplies around the same instruction.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

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
                                                int col, float v, bool lead, float m, float l,
                                                float s0) {
  if (P.nsplit == 1) {
    if (col < P.p) static_cast<T*>(P.f)[ridx * P.p + col] = static_cast<T>(l > 0.f ? v / l : 0.f);
    if (lead) {
      const float lse = row_lse(m, l);
      P.lse[ridx] = lse;
      P.lam[ridx] = sigmoid_of(s0 - lse);
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

// ---- the inducer MLP inside the kernel ---------------------------------------------------
//
// Column n of the combined weight C = [Ak | W1 | Bk^T | ck] (p x (2L + r + 1)) of head h at
// feature k < p. One product Q C on the tensor cores (16-bit operands, exact products,
// float32 accumulation, as the Triton kernel's prologue) gives every row's q Ak, q W1, q Bk^T
// and q . ck; the rest is per row: s0 = tau (|q|^2 + q . ck + sum_l tanh(q Ak + ak)_l (q Bk^T)_l)
// and hidden = tanh(q W1 + b1).
template <typename T>
__device__ __forceinline__ T mlp_weight(const InducerParams& P, int h, int n, int k) {
  const int L = P.L, r = P.r, p = P.p;
  if (n < L) return static_cast<const T*>(P.ak_w)[(static_cast<int64_t>(h) * p + k) * L + n];
  if (n < L + r)
    return static_cast<const T*>(P.w1)[(static_cast<int64_t>(h) * p + k) * r + (n - L)];
  if (n < 2 * L + r)
    return static_cast<const T*>(P.bk_w)[(static_cast<int64_t>(h) * L + (n - L - r)) * p + k];
  return static_cast<const T*>(P.ck)[static_cast<int64_t>(h) * p + k];
}

// C^T (ncp x D, K-major: element (n, k) at Wc[n * pitch + k]) into shared memory, zero beyond
// p and beyond the 2L + r + 1 real columns. Eight loads in flight per thread before the
// stores (the weights are L2-resident and small: p x ncp elements per block).
template <typename T, int D, int NT>
__device__ __forceinline__ void stage_mlp_weights(const InducerParams& P, int h, T* Wc,
                                                  int pitch) {
  constexpr int U = 8;
  const int total = P.ncp * D, ncols = 2 * P.L + P.r + 1;
  for (int e0 = threadIdx.x; e0 < total; e0 += NT * U) {
    T w[U];
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const int e = e0 + i * NT, n = e / D, k = e - n * D;
      w[i] = (e < total && n < ncols && k < P.p) ? mlp_weight<T>(P, h, n, k) : T(0.f);
    }
#pragma unroll
    for (int i = 0; i < U; ++i) {
      const int e = e0 + i * NT, n = e / D, k = e - n * D;
      if (e < total) Wc[n * pitch + k] = w[i];
    }
  }
}

template <typename T, int D, int BN, int RW, int KW, int MR>
__global__ void __launch_bounds__(32 * RW * KW, 1)
    inducer_mma_kernel(const InducerParams P) {
  using Cfg = InducerMmaCfg<T, D, BN, RW, KW, MR>;
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
  // Rows are packed rows R (InducerParams::gpack): with gpack = 1 the query rows of head hb.
  const int b = blockIdx.z, hb = blockIdx.y;
  const int NR = P.gpack * P.n_q;
  const int split = blockIdx.x % P.nsplit;
  const int row0 = (blockIdx.x / P.nsplit) * BM;
  const int p = P.p, l = P.l;
  const int R_last = (row0 + BM < NR ? row0 + BM : NR) - 1;
  int h_lo, h_hi, i_unused;  // the query heads of the block's rows
  packed_row(P, hb, row0, h_lo, i_unused);
  packed_row(P, hb, R_last, h_hi, i_unused);
  const int hk = h_lo / P.group;  // their kv head
  // (B, H, n_q) index of packed row R < NR
  auto ridx_of = [&](int R) -> int64_t {
    int hh, i;
    packed_row(P, hb, R, hh, i);
    return (static_cast<int64_t>(b) * P.H + hh) * P.n_q + i;
  };

  int len = P.n_k;
  if (P.lens) {
    len = P.lens[b];
    len = len < 0 ? 0 : (len > P.n_k ? P.n_k : len);
  }
  int seq_end = len;
  if (P.causal) {
    const int lim = P.n_k - P.n_q + last_query(P, row0, R_last) + 1;
    seq_end = lim < seq_end ? lim : seq_end;
  }
  seq_end = seq_end < 0 ? 0 : seq_end;
  const int kend = l + seq_end;
  const int nst_vis = (kend + SK - 1) / SK;
  const int st_beg = split * P.tiles_per_split;
  int st_end = st_beg + P.tiles_per_split;
  st_end = st_end < nst_vis ? st_end : nst_vis;
  const int nsteps = st_end > st_beg ? st_end - st_beg : 0;

  const T* qb = static_cast<const T*>(P.q) + b * P.q_sb + h_lo * P.q_sh;
  const T* kseq = static_cast<const T*>(P.k) + b * P.k_sb + hk * P.k_sh;
  const T* vseq = static_cast<const T*>(P.v) + b * P.v_sb + hk * P.v_sh;
  // (a prefix belongs to its query head: the host packs no heads when there is one)
  const T* kpre = P.pk ? static_cast<const T*>(P.pk) + static_cast<int64_t>(h_lo) * l * p : nullptr;
  const T* vpre = P.pv ? static_cast<const T*>(P.pv) + static_cast<int64_t>(h_lo) * l * p : nullptr;

  if (P.gpack == 1) {
    const int nrows = P.n_q - row0 < BM ? P.n_q - row0 : BM;
    mma::load_tile<T>(Qs, PITCH, qb + row0 * P.q_sn, P.q_sn, nrows, p, BM, D, P.vec, tid, NT);
  } else {
    const T* qbat = static_cast<const T*>(P.q) + b * P.q_sb;
    mma::load_rows<T>(
        Qs, PITCH,
        [&](int r) -> const T* {
          const int R = row0 + r;
          if (R >= NR) return nullptr;
          int hh, i;
          packed_row(P, hb, R, hh, i);
          return qbat + hh * P.q_sh + i * P.q_sn;
        },
        qb, p, BM, D, P.vec, tid, NT);
  }
  mma::cp_async_commit();  // group 0: the Q tile
  // The inducer MLP runs once per row: in the block of key split 0. Its per-row results live
  // after the kernel's tiles: Ms (BM, ncp + 1) floats (the products, then tanh(q W1 + b1) in
  // place of q W1), S0s (BM) (|q|^2, then s0).
  const bool mlp = P.L > 0 && split == 0;
  const int mpitch = P.ncp + 1;  // odd: a thread per row reads its row conflict-free
  float* Ms = reinterpret_cast<float*>(smem_raw + Cfg::kSmem);
  float* S0s = Ms + BM * mpitch;
  if (mlp) stage_mlp_weights<T, D, NT>(P, h_lo, Ks + SK * PITCH, PITCH);  // the second K buffer
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

  // Thread state of its 2 MR rows: row tile mi, rows rbase + 16 mi + g (e = 0, 1 of the
  // accumulators) and + 8 (e = 2, 3), block rows; packed rows row0 + those.
  const int rbase = rw * 16 * MR;
  float m_r[MR][2], l_r[MR][2];
  float o[MR][ND][4];
  int qi[MR][2];   // the rows' query indices
  int khi[MR][2];  // the rows' last visible key (prefix keys count; below l: none of the sequence)
  const int diag = P.n_k - P.n_q;  // causal: sequence key j visible to row i iff j <= diag + i
  int qmin = 0x7fffffff;           // the least of them: a stage below its diagonal needs no mask
#pragma unroll
  for (int mi = 0; mi < MR; ++mi)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      m_r[mi][i] = -INFINITY;
      l_r[mi][i] = 0.f;
#pragma unroll
      for (int j = 0; j < ND; ++j) {
        o[mi][j][2 * i] = 0.f;
        o[mi][j][2 * i + 1] = 0.f;
      }
      const int R = row0 + rbase + 16 * mi + g + 8 * i;
      int hh;
      packed_row(P, hb, R < NR ? R : row0, hh, qi[mi][i]);
      qmin = qi[mi][i] < qmin ? qi[mi][i] : qmin;
      const int lim = P.causal ? l + diag + qi[mi][i] : kend - 1;
      khi[mi][i] = lim < kend - 1 ? lim : kend - 1;
    }
  uint32_t qf[MR][D / 16][4];  // Q's A fragments, in registers for the whole kernel


  if (nsteps > 0) load_stage(st_beg, 0);
  mma::cp_async_commit();  // group 1: the first key stage (empty when nsteps == 0)
  mma::cp_async_wait<1>();
  __syncthreads();         // Q (and the MLP weights) in shared memory
#pragma unroll
  for (int mi = 0; mi < MR; ++mi)
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc)
      mma::load_a_kmajor<T>(qf[mi][kc], Qs, PITCH, rbase + 16 * mi, kc * 16);
  if (mlp) {
    // One product per query head of the block (packed rows: each head's own weights, staged
    // in turn; a row keeps its head's products).
    for (int hm = h_lo; hm <= h_hi; ++hm) {
      if (hm != h_lo) {
        __syncthreads();  // the previous head's weights consumed
        stage_mlp_weights<T, D, NT>(P, hm, Ks + SK * PITCH, PITCH);
        __syncthreads();
      }
      if (kw == 0) {
        const T* Wc = Ks + SK * PITCH;
#pragma unroll
        for (int mi = 0; mi < MR; ++mi) {
          const int rt = rbase + 16 * mi;  // the row tile's first block row
          bool mine[2];                    // rows rt + g (+ 8) belong to head hm
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            int hh, ii;
            packed_row(P, hb, row0 + rt + g + 8 * i, hh, ii);
            mine[i] = hh == hm;
          }
          for (int np = 0; np < P.ncp / 16; ++np) {
            float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int kc = 0; kc < D / 16; ++kc) {
              uint32_t bf[4];
              mma::load_b2_kmajor<T>(bf, Wc, PITCH, np * 16, kc * 16);
              mma::mma16816<T>(c0, qf[mi][kc], bf[0], bf[1]);
              mma::mma16816<T>(c1, qf[mi][kc], bf[2], bf[3]);
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int rr = rt + g + 8 * (e >> 1), cc = np * 16 + 2 * qd + (e & 1);
              if (!mine[e >> 1]) continue;
              Ms[rr * mpitch + cc] = c0[e];
              Ms[rr * mpitch + cc + 8] = c1[e];
            }
          }
          if (hm != h_lo) continue;  // |q|^2 once
          // |q|^2 of rows g and g + 8 from the A fragments (a[0], a[2]: row g; a[1], a[3]: row
          // g + 8; zero padding beyond p and n_q)
          float ss[2] = {0.f, 0.f};
#pragma unroll
          for (int kc = 0; kc < D / 16; ++kc)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              const float2 x = mma::unpack2<T>(qf[mi][kc][i]);
              ss[i & 1] += x.x * x.x + x.y * x.y;
            }
          ss[0] = quad_sum(ss[0]);
          ss[1] = quad_sum(ss[1]);
          if (qd == 0) {
            S0s[rt + g] = ss[0];
            S0s[rt + g + 8] = ss[1];
          }
        }
      }
    }
    __syncthreads();  // products in Ms; the second K buffer is free again
    const int Lk = P.L, R = P.r;
    for (int rr = tid; rr < BM; rr += NT) {
      const int Rr = row0 + rr;
      if (Rr >= NR) continue;  // padding rows (packed: no head's products)
      int hr, ir;
      packed_row(P, hb, Rr, hr, ir);
      const T* akb = static_cast<const T*>(P.ak_b) + static_cast<int64_t>(hr) * Lk;
      const T* b1 = static_cast<const T*>(P.b1) + static_cast<int64_t>(hr) * R;
      float* m = Ms + rr * mpitch;
      float acc = S0s[rr] + m[2 * Lk + R];
      for (int i = 0; i < Lk; ++i) acc += tanhf(m[i] + to_float(akb[i])) * m[Lk + R + i];
      const float s0 = acc * P.scale;
      S0s[rr] = s0;
      for (int j = 0; j < R; ++j) m[Lk + j] = tanhf(m[Lk + j] + to_float(b1[j]));
      if (P.nsplit > 1) {  // for the merge kernel
        const int64_t ridx = (static_cast<int64_t>(b) * P.H + hr) * P.n_q + ir;
        P.ws_s0[ridx] = s0;
        for (int j = 0; j < R; ++j) P.ws_hid[ridx * R + j] = m[Lk + j];
      }
    }
    __syncthreads();
  }
  for (int it = 0; it < nsteps; ++it) {
    if (it + 1 < nsteps) {
      load_stage(st_beg + it + 1, (it + 1) & 1);
      mma::cp_async_commit();
      mma::cp_async_wait<1>();
    } else {
      mma::cp_async_wait<0>();
    }
    __syncthreads();
    const T* ks = Ks + ((it & 1) * SK + kw * BN) * PITCH;
    const T* vs = Vs + ((it & 1) * SK + kw * BN) * PITCH;
    const int key0 = (st_beg + it) * SK + kw * BN;

    float s[MR][NJ][4];
#pragma unroll
    for (int mi = 0; mi < MR; ++mi)
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mi][j][e] = 0.f;
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
#pragma unroll
      for (int np = 0; np < NJ / 2; ++np) {
        uint32_t bf[4];
        mma::load_b2_kmajor<T>(bf, ks, PITCH, np * 16, kc * 16);
#pragma unroll
        for (int mi = 0; mi < MR; ++mi) {
          mma::mma16816<T>(s[mi][2 * np], qf[mi][kc], bf[0], bf[1]);
          mma::mma16816<T>(s[mi][2 * np + 1], qf[mi][kc], bf[2], bf[3]);
        }
      }
    }
    // Mask where the stage needs it: keys [key0, key0 + BN) all prefix keys, or all below kend
    // and (causal) at or below the diagonal of the thread's first query: nothing to mask.
    const int klast = key0 + BN - 1;
    const bool full = klast < l || (klast < kend && (!P.causal || klast - l <= diag + qmin));
    if (!full) {
#pragma unroll
      for (int mi = 0; mi < MR; ++mi)
#pragma unroll
        for (int j = 0; j < NJ; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = key0 + 8 * j + 2 * qd + (e & 1);
            // prefix keys always; sequence keys up to the row's last visible key
            const bool vis = (key < l) | (key <= khi[mi][e >> 1]);
            s[mi][j][e] = vis ? s[mi][j][e] : -INFINITY;
          }
    }
    // Online softmax on the raw scores: the scale is positive, so the row max of the scaled
    // scores is the scaled raw max; each probability is one FFMA and one SFU exp2.
    const float sl2 = P.scale_log2;
#pragma unroll
    for (int mi = 0; mi < MR; ++mi)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < NJ; ++j) mx = fmaxf(mx, fmaxf(s[mi][j][2 * i], s[mi][j][2 * i + 1]));
        const float m_new = fmaxf(m_r[mi][i], quad_max(mx) * sl2);
        const float m_use = m_new == -INFINITY ? 0.f : m_new;
        const float alpha = fast_exp2(m_r[mi][i] - m_use);
        m_r[mi][i] = m_new;
        float rs = 0.f;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
          s[mi][j][2 * i] = fast_exp2(fmaf(s[mi][j][2 * i], sl2, -m_use));
          s[mi][j][2 * i + 1] = fast_exp2(fmaf(s[mi][j][2 * i + 1], sl2, -m_use));
          rs += s[mi][j][2 * i] + s[mi][j][2 * i + 1];
        }
        l_r[mi][i] = l_r[mi][i] * alpha + rs;
#pragma unroll
        for (int j = 0; j < ND; ++j) {
          o[mi][j][2 * i] *= alpha;
          o[mi][j][2 * i + 1] *= alpha;
        }
      }
    // O += P V.
#pragma unroll
    for (int kc = 0; kc < BN / 16; ++kc) {
      uint32_t a[MR][4];
#pragma unroll
      for (int mi = 0; mi < MR; ++mi) {
        a[mi][0] = mma::pack2<T>(s[mi][2 * kc][0], s[mi][2 * kc][1]);
        a[mi][1] = mma::pack2<T>(s[mi][2 * kc][2], s[mi][2 * kc][3]);
        a[mi][2] = mma::pack2<T>(s[mi][2 * kc + 1][0], s[mi][2 * kc + 1][1]);
        a[mi][3] = mma::pack2<T>(s[mi][2 * kc + 1][2], s[mi][2 * kc + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < ND / 2; ++dp) {
        uint32_t bf[4];
        mma::load_b2_mnmajor<T>(bf, vs, PITCH, dp * 16, kc * 16);
#pragma unroll
        for (int mi = 0; mi < MR; ++mi) {
          mma::mma16816<T>(o[mi][2 * dp], a[mi], bf[0], bf[1]);
          mma::mma16816<T>(o[mi][2 * dp + 1], a[mi], bf[2], bf[3]);
        }
      }
    }
    __syncthreads();  // buffer (it & 1) is refilled by iteration it + 1
  }
  mma::cp_async_wait<0>();  // nothing may still be landing in shared memory (nsteps == 0)
#pragma unroll
  for (int mi = 0; mi < MR; ++mi) {
    l_r[mi][0] = quad_sum(l_r[mi][0]);
    l_r[mi][1] = quad_sum(l_r[mi][1]);
  }

  // s0 of global row ridx (block row lr): in-kernel MLP, given, or none (no inducer)
  auto row_s0 = [&](int64_t ridx, int lr) -> float {
    return P.s0 ? P.s0[ridx] : (P.L > 0 && split == 0 ? S0s[lr] : 0.f);
  };
  if constexpr (KW == 1) {
#pragma unroll
    for (int mi = 0; mi < MR; ++mi)
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int lr = rbase + 16 * mi + g + 8 * i, row = row0 + lr;
        if (row >= NR) continue;
        const int64_t ridx = ridx_of(row);
        const float s0 = row_s0(ridx, lr);
#pragma unroll
        for (int j = 0; j < ND; ++j) {
          const int col = 8 * j + 2 * qd;
          store_row_state<T>(P, ridx, split, col, o[mi][j][2 * i], j == 0 && qd == 0,
                             m_r[mi][i], l_r[mi][i], s0);
          store_row_state<T>(P, ridx, split, col + 1, o[mi][j][2 * i + 1], false, m_r[mi][i],
                             l_r[mi][i], s0);
        }
        if (P.L > 0 && P.nsplit == 1) {  // u = lam tanh(q W1 + b1), the row's quad over j
          // (nsplit == 1: this block is key split 0, which ran the MLP)
          const float lam = sigmoid_of(s0 - row_lse(m_r[mi][i], l_r[mi][i]));
          for (int j = qd; j < P.r; j += 4)
            store_u<T>(P, ridx, j, lam * Ms[lr * mpitch + P.L + j]);
        }
      }
  } else {
    // Merge the KW warps' states of the same 16 rows through shared memory (fixed order;
    // MR == 1 here).
    __syncthreads();
    float* Ob = reinterpret_cast<float*>(Ks);  // (KW, 16, D)
    float* Mb = Ob + KW * 16 * D;              // (KW, 16)
    float* Lb = Mb + KW * 16;                  // (KW, 16)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = g + 8 * i;
#pragma unroll
      for (int j = 0; j < ND; ++j) {
        Ob[(kw * 16 + r) * D + 8 * j + 2 * qd] = o[0][j][2 * i];
        Ob[(kw * 16 + r) * D + 8 * j + 2 * qd + 1] = o[0][j][2 * i + 1];
      }
      if (qd == 0) {
        Mb[kw * 16 + r] = m_r[0][i];
        Lb[kw * 16 + r] = l_r[0][i];
      }
    }
    __syncthreads();
    // row r's merged state: (max, sum, output column col; 0 for col < 0)
    auto merged = [&](int r, int col) -> float3 {
      float M = -INFINITY, L = 0.f, acc = 0.f;
#pragma unroll
      for (int w = 0; w < KW; ++w) M = fmaxf(M, Mb[w * 16 + r]);
      if (M != -INFINITY) {
#pragma unroll
        for (int w = 0; w < KW; ++w) {
          const float mw = Mb[w * 16 + r];
          const float sc = mw == -INFINITY ? 0.f : exp2f(mw - M);
          L += Lb[w * 16 + r] * sc;
          if (col >= 0) acc += Ob[(w * 16 + r) * D + col] * sc;
        }
      }
      return make_float3(M, L, acc);
    };
    for (int e = tid; e < 16 * D; e += NT) {
      const int r = e / D, col = e - r * D;
      const int row = row0 + r;
      if (row >= NR || col >= p) continue;
      const int64_t ridx = ridx_of(row);
      const float3 st = merged(r, col);
      store_row_state<T>(P, ridx, split, col, st.z, col == 0, st.x, st.y, row_s0(ridx, r));
    }
    if (P.L > 0 && P.nsplit == 1) {  // u = lam tanh(q W1 + b1) (split 0 ran the MLP)
      for (int e = tid; e < 16 * P.r; e += NT) {
        const int r = e / P.r, j = e - r * P.r;
        const int row = row0 + r;
        if (row >= NR) continue;
        const float3 st = merged(r, -1);
        const float lam = sigmoid_of(S0s[r] - row_lse(st.x, st.y));
        store_u<T>(P, ridx_of(row), j, lam * Ms[r * mpitch + P.L + j]);
      }
    }
  }
  if (P.nsplit > 1 && P.count) {
    // Flash-decoding merge without a second launch: every thread's partial stores are made
    // visible device-wide, then one ticket per block on the tile's arrival counter; the last
    // of the tile's nsplit blocks merges all of them (one warp per row, splits in order),
    // and leaves the counter at zero for the next launch.
    __shared__ int s_last;
    __threadfence();
    __syncthreads();
    if (tid == 0) {
      int* c = P.count + (static_cast<int64_t>(b) * gridDim.y + hb) * (gridDim.x / P.nsplit) +
               blockIdx.x / P.nsplit;
      s_last = atomicAdd(c, 1) == P.nsplit - 1;
      if (s_last) atomicExch(c, 0);
    }
    __syncthreads();
    if (s_last) {
      __threadfence();
      for (int r = warp; r < BM; r += NT / 32)
        if (row0 + r < NR) merge_row<T, (D + 31) / 32>(P, ridx_of(row0 + r));
    }
  }
}

template <typename T, int D, int BN, int RW, int KW, int MR>
void launch_inducer_mma(const InducerParams& P, dim3 grid, cudaStream_t stream) {
  using Cfg = InducerMmaCfg<T, D, BN, RW, KW, MR>;
  auto kernel = inducer_mma_kernel<T, D, BN, RW, KW, MR>;
  const size_t smem = Cfg::kSmem + (P.L > 0 ? mlp_smem_bytes(Cfg::kBM, P.ncp) : 0);
  set_smem(kernel, smem, "inducer_mma_kernel");
  kernel<<<grid, Cfg::kThreads, smem, stream>>>(P);
  check_launch("inducer_mma_kernel");
  if (P.nsplit > 1 && !P.count) {  // (with counters the kernel merged the splits itself)
    const int64_t rows = static_cast<int64_t>(P.B) * P.H * P.n_q;
    constexpr int CH = (D + 31) / 32;
    inducer_merge_kernel<T, CH><<<static_cast<unsigned>(ceil_div(rows, 4)), 128, 0, stream>>>(P);
    check_launch("inducer_merge_kernel");
  }
}


template <typename T, int D>
void launch_inducer_mma_d(const InducerParams& P, bool decode, dim3 grid, cudaStream_t stream) {
  if (decode)
    launch_inducer_mma<T, D, kDecodeBN, 1, kDecodeKW, 1>(P, grid, stream);
  else
    launch_inducer_mma<T, D, kPrefillBN, kPrefillRW, 1, prefill_mr(D)>(P, grid, stream);
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

}  // namespace inducer
}  // namespace kfused
