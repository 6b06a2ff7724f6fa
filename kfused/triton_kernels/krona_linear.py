"""Triton kernels and host functions of ``krona_linear``, the Kronecker adapter (docs/math.md §1).
The same kernels serve ``kron_matvec`` (no frozen weight; see kron_matvec.py).

``_kron_fold_kernel``  W' = W + s · (A ⊗ B), one d_out×d_in pass (CUDA cores, no dot).
    krona_linear's default path on a GPU at T ≥ 1024 in float16/bfloat16 (``exact=False``):
    y = x W'ᵀ + b and dx = dy W' are then the frozen GEMM itself (cuBLAS), and the adapter adds
    only this pass per direction plus the factor-gradient pass below.

``_krona_fwd_kernel``  y = [x Wᵀ + b] + s · (A ⊗ B) x, one output tile per program — the exact
    factored path (``exact=True``, float32, small T; kron_matvec always). On a GPU with
    16-bit inputs the exact forward and dx are three cuBLAS calls instead
    (:func:`_compose_exact`: this kernel ran at 16-26x its predicted time there); it runs
    there for float32, and everywhere in the CPU interpreter.
    The output tile is a (BI × BJ) block of the (i, j) grid of output features
    o = i·b_out + j (BJ a power of two; a partial last j-block is masked), so the Kronecker term of the tile is
    ``A[i-block] · X[t] · B[j-block]ᵀ`` — two small products per token block, computed from the
    x rows the frozen GEMM has just streamed (they are in L2), in the factored form: A ⊗ B is
    never formed, not even per tile. With HAS_W=False it is the plain ``kron_matvec``; the
    same kernel computes the input gradient ``dy (W + s A⊗B)`` when given Wᵀ, Aᵀ and Bᵀ as
    strided views. The term is formed in whichever order issues fewer products
    (:func:`_xb_first`): ``(A X) Bᵀ`` or ``A (X Bᵀ)``. On narrow factors the orders differ by
    ~25×: the input gradient of the paper's A 2×384, B 384×2 is this kernel on Aᵀ 384×2,
    Bᵀ 2×384, where A X first forms a 384×384 product per token (PREDICTED 768² exact dx
    1.24 ms) and X Bᵀ first a 2×2 one (37 µs); torch's autograd of the reference takes that
    order too (G B first). A product with a dim < 16 runs on the CUDA cores in float64: a
    reduction of 2 (LC or KC = 1) as an outer product into the output tile.

``_kron_dx_grad_kernel``  the folded path's backward in one pass over dy, when asked for
    (``KFUSED_KRONA_FOLDED_BWD=one-pass``; by default the folded backward takes two passes,
    cuBLAS dx and ``_kron_grad_kernel``, measured faster on the H100:
    :func:`folded_backward_mode`, :func:`fused_dx_grad_applies`): a (BM × BN) tile of
    dx = dy W' per program, then the factor-gradient steps below over a slice of the same
    row block's tokens (each column program of a row block takes its own slice; their dy
    rows were just streamed by the row block's GEMM tiles).

``_kron_grad_kernel``  one pass over (x, dy) for dA, dB (and optionally dx):
    dA = Σ_t G[t] B X[t]ᵀ,  dB = Σ_t G[t]ᵀ A X[t],  dX[t] = Aᵀ G[t] B,
    a grid-stride loop over token blocks with float32 partial sums per program, reduced on
    the host (deterministic, no atomics). With every (padded) factor dim ≥ 16 the four
    products are tensor-core dots (sm_90: HGMMA/HMMA in the SASS); dims < 16 (the paper's
    A 2×384, B 384×2) use broadcast products on the CUDA cores (``_mm``: float32 for 16-bit
    inputs, float64 for float32 ones).

Products keep the reference's order (A X first, then ·Bᵀ) and round the intermediate to the
input dtype as torch does, so 16-bit results track ``torch_t`` under docs/math.md §4.

Roofline (H100 SXM, bfloat16, T = 16384; all times *predicted*, not measured). Model: cuBLAS
GEMM 600 TFLOP/s effective, Triton mma.sync dots 300 TFLOP/s, CUDA-core float64 30 TFLOP/s,
HBM 2.8 TB/s; a kernel takes max(FLOPs/rate, bytes/bandwidth); a tiny launch 2 µs.

    frozen linear, fwd + dx:   2 × max(2·T·d_in·d_out / 600T, 2·(T·d_in + T·d_out + d_in·d_out) / 2.8T)
                               768→768: 2 × 32.2 µs (compute-bound; bytes 15 µs)
                               768→3072: 2 × 128.8 µs
    fold (each direction):     read W, write W': 4·d_in·d_out B → 0.4 µs (768²), 1.7 µs (768→3072),
                               + 2 µs launch; the adapter costs no MAC in either GEMM
    factor gradients:          reads x and dy once: 2·T·(d_in + d_out) B = 50 MB (768²),
                               126 MB (768→3072) → 18 / 45 µs at full bandwidth; tensor-core
                               FLOPs per token 2·(a·b·c) over W1 = G B, dA, V = A X, dB
                               (≈ 0.2 MFLOP/token at 24/32 factors: 2.8 GFLOP, 9 µs on mma.sync,
                               hidden under the bytes). At the sm_90 register budget (2 tokens
                               of 32×32 factors per step, 4 warps, 135 registers, no spill: 3 CTAs and 18 KB of loads in
                               flight per SM) we assume 60 %
                               of bandwidth: 38 µs (768²), 83 µs (768→3072).

    → predicted fwd+bwd: 768² ≈ 108 µs = 1.68 × frozen (target 1.15×: missed),
      768→3072 ≈ 351 µs = 1.36 ×; torch.kron materialised (5 GEMMs + adds): 2.1–2.3 × slower
      than this path; torch.compile of the reference (bmm/mm + pointwise, ≈ 8 passes over
      T·d bytes): 1.9–3.4 × slower. The paper's A 2×384 / B 384×2 factors (CUDA-core
      broadcast products, 1 CTA per SM, assumed 30–35 % of bandwidth): 2.0 × frozen at 768²,
      1.65 × at 768→3072, and only 1.8–1.9 × faster than torch.kron. (This hand estimate
      predates the kernels' current form; ``kfused perf`` has the current PREDICTED
      numbers: exact path 1.92 × / 1.77 × the frozen linear for the paper's factors.)

    Why 1.15× is out of reach with a separate factor-gradient pass: it must read x and dy
    (50 MB at 768² = 18 µs even at 100 % bandwidth) while the budget is 0.15 × 64 µs = 10 µs.
    What would reach it: fuse dA/dB into the dx GEMM (the only pass that already reads dy);
    that GEMM is compute-bound (32 µs of MMA against 27 µs of bytes with x added), so the x
    read hides and the cost is the 2.8 GFLOP of factor products (+15 %) — predicted 1.12 × if
    that Triton GEMM matched cuBLAS, ≈ 1.25 × at 85 % of cuBLAS. Built as
    ``_kron_dx_grad_kernel``; the static model (kfused perf, which also counts the 16-bit
    residue products, 5.5 GFLOP at 768², and charges each product by the instruction the
    sm_90 TTGIR shows: wgmma at M >= 64 rows, feed-limited at N = 32 with A in shared memory;
    mma.sync below M = 64) predicted 1.48 × at 768² and 1.29 × at 768→3072 for the whole
    fwd+bwd (from 1.65 × and 1.34 ×); with each hi/lo pair one stacked M = 64 wgmma (was
    two M = 32 mma.sync dots) 1.41 × and 1.25 ×, and the paper's 2×384 / 384×2 (8×384 /
    384×2) factors in the one pass too, their CUDA-core products in float32, 1.34 × and
    1.22 × (from 1.60 × and 1.33 ×).

Numerics of the fold (measured on the CPU, ``python benchmarks/bench_krona.py
--fold-numerics``, T = 512, factors 24x24/32x32 and 2x384/384x2, |s·A⊗B| / |W| from 1 to 1e-4):
W' rounds the update to W's ulp, so the part of s·A⊗B below half an ulp of W is lost from y
and dx. At the output this costs nothing measurable against the unfused same-precision torch
path, which rounds y at the same scale: the fold's max error is at or below torch_t's in every
case (float16 and bfloat16; docs/math.md §4 met everywhere), and the relative error of the adapter's
contribution to y is the same for both (float16: 6e-4 at |ΔW| ≈ |W|, 6e-2 at 1e-2, ≈ 0.6 at
1e-3; bfloat16: 5e-3, 0.45, 3.3). dA and dB never see W' (they come from the factors).
``exact=True`` keeps the factored kernels (the adapter term accumulated in float32 next to the
frozen product, one rounding of y) for small T and tiny updates at inference; float32 always
uses them (there the fold's W' rounding fails docs/math.md §4).
"""

from __future__ import annotations

import os

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from kfused import _alloc, tuning
from kfused.triton_kernels._common import (_bcast_mm, _blk, _grouped_tile, _mm, _row_block_sum,
                                           acc_dtype, cdiv, dot_precision, grid_programs,
                                           host_config, inter_dtype, next_pow2, resident_ctas,
                                           targets_gpu, use_dot)


@triton.jit
def _krona_fwd_kernel(
    X, W, BIAS, A, B, Y,
    T, a_out, a_in, b_out, b_in,
    stride_xt, stride_wo, stride_wc, stride_ai, stride_ak, stride_bj, stride_bl, stride_yt,
    scale,
    HAS_W: tl.constexpr, HAS_BIAS: tl.constexpr,
    BM: tl.constexpr, BI: tl.constexpr, BJ: tl.constexpr, BK: tl.constexpr,
    KC: tl.constexpr, LC: tl.constexpr,
    DOT_W: tl.constexpr, DOT_U: tl.constexpr, DOT_Y: tl.constexpr, PREC: tl.constexpr,
    ACC: tl.constexpr, IDT: tl.constexpr, SPLIT: tl.constexpr, XB_FIRST: tl.constexpr = False,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    n_jb = tl.cdiv(b_out, BJ)
    ib = pid_n // n_jb
    jb = pid_n % n_jb
    d_in = a_in * b_in

    offs_m = pid_m * BM + tl.arange(0, BM)
    m_ok = offs_m < T
    ii = ib * BI + tl.arange(0, BI)
    jj = jb * BJ + tl.arange(0, BJ)
    i_ok = ii < a_out
    cols = tl.reshape(ii[:, None] * b_out + jj[None, :], (BI * BJ,))
    col_ok = tl.reshape(i_ok[:, None] & (jj[None, :] < b_out), (BI * BJ,))

    acc = tl.zeros((BM, BI * BJ), dtype=ACC)
    if HAS_W:
        for c0 in range(0, d_in, BK):
            cc = c0 + tl.arange(0, BK)
            c_ok = cc < d_in
            x = tl.load(X + offs_m[:, None] * stride_xt + cc[None, :],
                        mask=m_ok[:, None] & c_ok[None, :], other=0.0)
            w = tl.load(W + cols[None, :] * stride_wo + cc[:, None] * stride_wc,
                        mask=c_ok[:, None] & col_ok[None, :], other=0.0)
            acc += _mm(x, w.to(x.dtype), DOT_W, PREC, ACC)

    if not XB_FIRST:
        # Kronecker term, l (the b_in axis) in chunks of LC to bound the registers:
        # U[(t, l), i] = Σ_k X[t, k, l] A[i, k]  (= (A X[t])ᵀ, k in chunks of KC), then
        # Y[t, i, j] += Σ_l U[t, i, l] B[j, l] after bringing i next to t.
        r = tl.arange(0, BM * LC)
        rt = pid_m * BM + r // LC
        lc = tl.arange(0, LC)
        for l0 in range(0, b_in, LC):
            rl = l0 + r % LC
            r_ok = (rt < T) & (rl < b_in)
            u = tl.zeros((BM * LC, BI), dtype=ACC)
            for k0 in range(0, a_in, KC):
                kk = k0 + tl.arange(0, KC)
                k_ok = kk < a_in
                xk = tl.load(X + rt[:, None] * stride_xt + kk[None, :] * b_in + rl[:, None],
                             mask=r_ok[:, None] & k_ok[None, :], other=0.0)
                ak = tl.load(A + ii[None, :] * stride_ai + kk[:, None] * stride_ak,
                             mask=k_ok[:, None] & i_ok[None, :], other=0.0)
                u += _mm(xk, ak.to(xk.dtype), DOT_U, PREC, ACC)
            uf = tl.reshape(tl.permute(tl.reshape(u, (BM, LC, BI)), (0, 2, 1)), (BM * BI, LC))
            u = uf.to(IDT)
            ll = l0 + lc
            bt = tl.load(B + jj[None, :] * stride_bj + ll[:, None] * stride_bl,
                         mask=(ll[:, None] < b_in) & (jj[None, :] < b_out), other=0.0)
            if DOT_Y:
                yk = _mm(u, bt.to(u.dtype), DOT_Y, PREC, ACC)
                if SPLIT:
                    # 16-bit inputs: U = A X is a float32 sum; its rounding residue goes through
                    # the same product, so Y sees U to ~2^-22 rather than one 16-bit rounding
                    # (where the frozen and adapter terms cancel, that rounding alone exceeded
                    # the docs/math.md §4 bound: float16 dx of 1x1 factors, 16 ulp; test_krona
                    # seed 13)
                    ulo = (uf - u.to(ACC)).to(IDT)
                    yk += _mm(ulo, bt.to(u.dtype), DOT_Y, PREC, ACC)
                acc += scale * tl.reshape(yk, (BM, BI * BJ))
            else:
                # LC == 1 (a dim of this product < 16): U's column times the tile's row of B,
                # an outer product into the tile (no (M, K, N) temporary). 16-bit: U's float32
                # sum as is (what the hi/lo pair above amounts to), products exact in float64.
                if SPLIT:
                    uk = uf.to(tl.float64)
                else:
                    uk = u.to(tl.float64)
                bk = tl.sum(bt, axis=0).to(tl.float64)
                yk = tl.reshape(uk * bk[None, :], (BM, BI * BJ))
                acc += scale * yk.to(ACC)

    else:
        # Kronecker term in the other order (chosen on the host where it issues fewer
        # products: a narrow a_in with a wide b_in, e.g. dx of the paper's 2x384 / 384x2):
        # V[(t, k), j] = Σ_l X[t, k, l] B[j, l] (l in chunks of LC, contiguous in x), then
        # Y[t, i, j] += Σ_k A[i, k] V[t, k, j] — as a dot over a chunk of KC k's after bringing
        # j next to t, or (KC == 1, a dim < 16) as an outer product into the tile.
        r = tl.arange(0, BM * KC)
        rt = pid_m * BM + r // KC
        kc = tl.arange(0, KC)
        for k0 in range(0, a_in, KC):
            rk = k0 + r % KC
            r_ok = (rt < T) & (rk < a_in)
            v = tl.zeros((BM * KC, BJ), dtype=ACC)
            for l0 in range(0, b_in, LC):
                ll = l0 + tl.arange(0, LC)
                l_ok = ll < b_in
                xl = tl.load(X + rt[:, None] * stride_xt + rk[:, None] * b_in + ll[None, :],
                             mask=r_ok[:, None] & l_ok[None, :], other=0.0)
                bt = tl.load(B + jj[None, :] * stride_bj + ll[:, None] * stride_bl,
                             mask=l_ok[:, None] & (jj[None, :] < b_out), other=0.0)
                v += _mm(xl, bt.to(xl.dtype), DOT_U, PREC, ACC)
            kk = k0 + kc
            at = tl.load(A + ii[None, :] * stride_ai + kk[:, None] * stride_ak,
                         mask=(kk[:, None] < a_in) & i_ok[None, :], other=0.0)
            if DOT_Y:
                vf = tl.reshape(tl.permute(tl.reshape(v, (BM, KC, BJ)), (0, 2, 1)), (BM * BJ, KC))
                vv = vf.to(IDT)
                yk = _mm(vv, at.to(vv.dtype), DOT_Y, PREC, ACC)
                if SPLIT:
                    # V's rounding residue through the same product, as U's above
                    yk += _mm((vf - vv.to(ACC)).to(IDT), at.to(vv.dtype), DOT_Y, PREC, ACC)
                acc += scale * tl.reshape(tl.permute(tl.reshape(yk, (BM, BJ, BI)), (0, 2, 1)),
                                          (BM, BI * BJ))
            else:
                # KC == 1: V (BM, BJ) times the tile's column of A. 16-bit (SPLIT): V's
                # float32 sum is used as is (what the hi/lo pair of the dot path amounts to);
                # products of a 16-bit A and a float32 V are exact in float64.
                if SPLIT:
                    vk = v.to(tl.float64)
                else:
                    vk = v.to(IDT).to(tl.float64)
                ak = tl.sum(at, axis=0).to(tl.float64)
                yk = tl.reshape(ak[None, :, None] * vk[:, None, :], (BM, BI * BJ))
                acc += scale * yk.to(ACC)

    if HAS_BIAS:
        bias = tl.load(BIAS + cols, mask=col_ok, other=0.0)
        acc += bias.to(ACC)[None, :]
    tl.store(Y + offs_m[:, None] * stride_yt + cols[None, :], acc.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & col_ok[None, :])


@triton.jit
def _g_rows(G, t0, t_end, stride_gt, a_out, b_out, rg_t, rg_i, jo, VG: tl.constexpr = 1):
    """G[t] for the BT tokens from t0 (below t_end): rows (t, i), cols j, zero-padded.

    VG: b_out is a multiple of VG (host-checked). The row offsets i·b_out are then written
    i·((b_out // VG)·VG), which tells the compiler they are VG-aligned: with VG 16 bytes the
    loads become 16-byte vectors and asynchronous copies (pipelined). Triton only knows an
    integer argument's divisibility by 16, so b_out = 24 (the GLUE factor pairs) left them
    element-wise loads that every step waited on."""
    row = (b_out // VG) * VG       # = b_out; also in the mask, whose runs then align too
    g_ok = ((t0 + rg_t) < t_end)[:, None] & (rg_i < a_out)[:, None] & (jo < row)[None, :]
    return tl.load(G + (t0 + rg_t)[:, None] * stride_gt + rg_i[:, None] * row + jo[None, :],
                   mask=g_ok, other=0.0)


@triton.jit
def _stack2(hi, lo, M: tl.constexpr, K: tl.constexpr):
    """[hi; lo]: two (M × K) tiles stacked into one (2M × K) operand."""
    return tl.reshape(tl.permute(tl.join(hi, lo), (2, 0, 1)), (2 * M, K))


@triton.jit
def _dab_zeros(AOP: tl.constexpr, AIP: tl.constexpr, BOP: tl.constexpr, BIP: tl.constexpr,
               DOT_DA: tl.constexpr, DOT_DB: tl.constexpr, SPLIT: tl.constexpr,
               RACC: tl.constexpr):
    """Zero token sums for :func:`_dab_step`: dA (AOP × AIP) and dB (BOP × BIP), or, where a
    16-bit product and its residue share one stacked dot, dA as [hi; lo] rows (2·AOP × AIP)
    and dB transposed as [hi; lo] rows (2·BIP × BOP); :func:`_dab_final` folds them back."""
    if SPLIT and DOT_DA:
        da = tl.zeros((2 * AOP, AIP), dtype=RACC)
    else:
        da = tl.zeros((AOP, AIP), dtype=RACC)
    if SPLIT and DOT_DB:
        db = tl.zeros((2 * BIP, BOP), dtype=RACC)
    else:
        db = tl.zeros((BOP, BIP), dtype=RACC)
    return da, db


@triton.jit
def _dab_final(da, db, AOP: tl.constexpr, AIP: tl.constexpr, BOP: tl.constexpr,
               BIP: tl.constexpr, DOT_DA: tl.constexpr, DOT_DB: tl.constexpr,
               SPLIT: tl.constexpr):
    """dA (AOP × AIP) and dB (BOP × BIP) from :func:`_dab_zeros`' accumulators."""
    if SPLIT and DOT_DA:
        da = tl.sum(tl.reshape(da, (2, AOP, AIP)), axis=0)
    if SPLIT and DOT_DB:
        db = tl.trans(tl.sum(tl.reshape(db, (2, BIP, BOP)), axis=0))
    return da, db


@triton.jit
def _dab_step(da, db, X, g2, w1f, w1, a, t0, t_end, stride_xt, a_in, b_in, rx_t, rx_k, li,
              BT: tl.constexpr, AOP: tl.constexpr, AIP: tl.constexpr, BIP: tl.constexpr,
              DOT_DA: tl.constexpr, DOT_V: tl.constexpr, DOT_DB: tl.constexpr,
              PREC: tl.constexpr, ACC: tl.constexpr, RACC: tl.constexpr, IDT: tl.constexpr,
              SPLIT: tl.constexpr, VX: tl.constexpr = 1):
    """One token block's share of dA = Σ_t W1[t] X[t]ᵀ and dB = Σ_t G[t]ᵀ (A X[t]), given
    G[t] (g2, rows (t, i)) and W1[t] = G[t] B (w1f float32, w1 rounded to IDT), into the
    accumulators of :func:`_dab_zeros`.

    16-bit inputs (SPLIT) on the tensor cores: W1 and V are float32 sums; their rounding
    residues (lo parts, in the input dtype) go through the same products, so the token sums
    see W1 and V to ~2^-22 rather than one 16-bit rounding (which cancellation over many
    tokens can magnify past the docs/math.md §4 bound). Each hi/lo pair is one dot with the
    two parts stacked along M ([hi; lo] rows; dB as its transpose, M = 2·BIP): at 32-wide
    factors two M = 32 products are mma.sync dots (sm_90 wgmma needs M >= 64), the stacked
    M = 64 one a wgmma with its A operand in registers (the sm_90 TTGIR shows both). A
    product on the CUDA cores (a factor dim < 16, ``_mm``'s broadcast path) takes the float32
    W1 / V as they are: no split, one product instead of two."""
    # (b_in a multiple of VX: aligned rows and mask runs, as _g_rows' VG)
    xrow = (b_in // VX) * VX
    x_ok = ((t0 + rx_t) < t_end)[:, None] & (rx_k < a_in)[:, None] & (li < xrow)[None, :]
    x2 = tl.load(X + (t0 + rx_t)[:, None] * stride_xt + rx_k[:, None] * xrow + li[None, :],
                 mask=x_ok, other=0.0)
    xp = tl.reshape(tl.permute(tl.reshape(x2, (BT, AIP, BIP)), (0, 2, 1)),
                    (BT * BIP, AIP))                                # rows (t, l), cols k
    # dA = Σ_{t,l} W1[t][i, l] X[t][k, l]
    if DOT_DA:
        w1p = tl.reshape(tl.permute(tl.reshape(w1, (BT, AOP, BIP)), (1, 0, 2)),
                         (AOP, BT * BIP))
        if SPLIT:
            w1lo = (w1f - w1.to(tl.float32)).to(IDT)
            w1lop = tl.reshape(tl.permute(tl.reshape(w1lo, (BT, AOP, BIP)), (1, 0, 2)),
                               (AOP, BT * BIP))
            da += _mm(_stack2(w1p, w1lop, AOP, BT * BIP), xp, DOT_DA, PREC, ACC).to(RACC)
        else:
            da += _mm(w1p, xp, DOT_DA, PREC, ACC).to(RACC)
    else:
        w1fp = tl.reshape(tl.permute(tl.reshape(w1f, (BT, AOP, BIP)), (1, 0, 2)),
                          (AOP, BT * BIP))
        da += _mm(w1fp, xp, DOT_DA, PREC, ACC).to(RACC)
    # V[t] = A X[t] (rows (t, l), cols i), then dB = Σ_{t,i} G[t][i, j] V[t][i, l]
    vf = _mm(xp, tl.trans(a), DOT_V, PREC, ACC)                     # (BT*BIP, AOP)
    if DOT_DB:
        v = vf.to(IDT)
        if SPLIT:
            # dBᵀ = Σ_{t,i} V[t][i, l] G[t][i, j]: [Vᵀ; V_loᵀ] rows l, cols (t, i)
            vlo = (vf - v.to(tl.float32)).to(IDT)
            vt = tl.reshape(tl.permute(tl.reshape(v, (BT, BIP, AOP)), (1, 0, 2)),
                            (BIP, BT * AOP))
            vlot = tl.reshape(tl.permute(tl.reshape(vlo, (BT, BIP, AOP)), (1, 0, 2)),
                              (BIP, BT * AOP))
            db += _mm(_stack2(vt, vlot, BIP, BT * AOP), g2, DOT_DB, PREC, ACC).to(RACC)
        else:
            vp = tl.reshape(tl.permute(tl.reshape(v, (BT, BIP, AOP)), (0, 2, 1)),
                            (BT * AOP, BIP))
            db += _mm(tl.trans(g2), vp, DOT_DB, PREC, ACC).to(RACC)
    else:
        vfp = tl.reshape(tl.permute(tl.reshape(vf, (BT, BIP, AOP)), (0, 2, 1)),
                         (BT * AOP, BIP))
        db += _mm(tl.trans(g2), vfp, DOT_DB, PREC, ACC).to(RACC)
    return da, db


@triton.jit
def _step_lanes(BT: tl.constexpr, AOP: tl.constexpr, AIP: tl.constexpr, BOP: tl.constexpr,
                BIP: tl.constexpr):
    """Lane indices of a factor step: columns j of G[t] and l of X[t], and the (token, row)
    of the rows (t, i) of G[t] and (t, k) of X[t]."""
    rg = tl.arange(0, BT * AOP)
    rx = tl.arange(0, BT * AIP)
    return (tl.arange(0, BOP), tl.arange(0, BIP), rg // AOP, rg % AOP, rx // AIP, rx % AIP)


@triton.jit
def _factors(A, B, stride_ai, stride_ak, stride_bj, stride_bl, a_out, a_in, b_out, b_in,
             dt, AOP: tl.constexpr, AIP: tl.constexpr, BOP: tl.constexpr, BIP: tl.constexpr):
    io = tl.arange(0, AOP)
    ki = tl.arange(0, AIP)
    jo = tl.arange(0, BOP)
    li = tl.arange(0, BIP)
    a = tl.load(A + io[:, None] * stride_ai + ki[None, :] * stride_ak,
                mask=(io[:, None] < a_out) & (ki[None, :] < a_in), other=0.0).to(dt)
    b = tl.load(B + jo[:, None] * stride_bj + li[None, :] * stride_bl,
                mask=(jo[:, None] < b_out) & (li[None, :] < b_in), other=0.0).to(dt)
    return a, b


@triton.jit
def _store_factor_partials(DAB, slot, da, db, scale, a_out, a_in, b_out, b_in,
                           AOP: tl.constexpr, AIP: tl.constexpr, BOP: tl.constexpr,
                           BIP: tl.constexpr):
    """Row ``slot`` of the (programs, a_out·a_in + b_out·b_in) partial sums: dA then dB."""
    io = tl.arange(0, AOP)
    ki = tl.arange(0, AIP)
    jo = tl.arange(0, BOP)
    li = tl.arange(0, BIP)
    base = DAB + slot * (a_out * a_in + b_out * b_in)
    tl.store(base + io[:, None] * a_in + ki[None, :], da * scale,
             mask=(io[:, None] < a_out) & (ki[None, :] < a_in))
    tl.store(base + a_out * a_in + jo[:, None] * b_in + li[None, :], db * scale,
             mask=(jo[:, None] < b_out) & (li[None, :] < b_in))


@triton.jit
def _kron_grad_kernel(
    X, G, A, B, DX, DAB,
    T, a_out, a_in, b_out, b_in,
    stride_xt, stride_gt, stride_dxt, stride_ai, stride_ak, stride_bj, stride_bl,
    scale, n_blocks,
    COMPUTE_DX: tl.constexpr, COMPUTE_DAB: tl.constexpr,
    BT: tl.constexpr, AOP: tl.constexpr, AIP: tl.constexpr, BOP: tl.constexpr,
    BIP: tl.constexpr,
    DOT_W1: tl.constexpr, DOT_DA: tl.constexpr, DOT_V: tl.constexpr, DOT_DB: tl.constexpr,
    DOT_DX: tl.constexpr, PREC: tl.constexpr, ACC: tl.constexpr, RACC: tl.constexpr,
    IDT: tl.constexpr, SPLIT: tl.constexpr, VG: tl.constexpr = 1, VX: tl.constexpr = 1,
):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    a, b = _factors(A, B, stride_ai, stride_ak, stride_bj, stride_bl, a_out, a_in, b_out,
                    b_in, X.dtype.element_ty, AOP, AIP, BOP, BIP)
    jo, li, rg_t, rg_i, rx_t, rx_k = _step_lanes(BT, AOP, AIP, BOP, BIP)

    # The sums over tokens (dA, dB) accumulate across token blocks in RACC: float64 for float32
    # inputs, so that the reduction over T adds no error beyond the per-block products.
    da, db = _dab_zeros(AOP, AIP, BOP, BIP, DOT_DA, DOT_DB, SPLIT, RACC)
    for blk in range(pid, n_blocks, n_prog):
        t0 = blk * BT
        g2 = _g_rows(G, t0, T, stride_gt, a_out, b_out, rg_t, rg_i, jo, VG)
        # W1[t] = G[t] B : rows (t, i), cols l
        w1f = _mm(g2, b, DOT_W1, PREC, ACC)
        w1 = w1f.to(IDT)
        if COMPUTE_DX:
            # dX[t] = Aᵀ W1[t]: rows (t, l), contract i, then back to rows (t, k).
            w1t = tl.reshape(tl.permute(tl.reshape(w1, (BT, AOP, BIP)), (0, 2, 1)),
                             (BT * BIP, AOP))
            dxt = _mm(w1t, a, DOT_DX, PREC, ACC)                     # (BT*BIP, AIP)
            dx = tl.reshape(tl.permute(tl.reshape(dxt, (BT, BIP, AIP)), (0, 2, 1)),
                            (BT * AIP, BIP))
            x_ok = ((t0 + rx_t) < T)[:, None] & (rx_k < a_in)[:, None] & (li < b_in)[None, :]
            tl.store(DX + (t0 + rx_t)[:, None] * stride_dxt + rx_k[:, None] * b_in + li[None, :],
                     (dx * scale).to(DX.dtype.element_ty), mask=x_ok)
        if COMPUTE_DAB:
            da, db = _dab_step(da, db, X, g2, w1f, w1, a, t0, T, stride_xt, a_in, b_in,
                               rx_t, rx_k, li, BT, AOP, AIP, BIP, DOT_DA, DOT_V, DOT_DB, PREC,
                               ACC, RACC, IDT, SPLIT, VX)
    if COMPUTE_DAB:
        da, db = _dab_final(da, db, AOP, AIP, BOP, BIP, DOT_DA, DOT_DB, SPLIT)
        _store_factor_partials(DAB, pid, da, db, scale, a_out, a_in, b_out, b_in,
                               AOP, AIP, BOP, BIP)


@triton.jit
def _blockdiag(F, stride_r, stride_c, n_r, n_c, BT: tl.constexpr, RP: tl.constexpr,
               CP: tl.constexpr, dt):
    """(BT·RP × BT·CP): F (n_r × n_c, strides) in every diagonal block (t, t), zeros off it
    and in the padding — one factor applied to BT tokens by a single product."""
    r = tl.arange(0, BT * RP)
    c = tl.arange(0, BT * CP)
    rt, ri = r // RP, r % RP
    ct, ci = c // CP, c % CP
    ok = ((rt[:, None] == ct[None, :]) & (ri < n_r)[:, None] & (ci < n_c)[None, :])
    return tl.load(F + ri[:, None] * stride_r + ci[None, :] * stride_c, mask=ok,
                   other=0.0).to(dt)


@triton.jit
def _kron_grad_bd_kernel(
    X, G, A, B, DAB,
    T, a_out, a_in, b_out, b_in,
    stride_xt, stride_gt, stride_ai, stride_ak, stride_bj, stride_bl,
    scale, n_blocks,
    BT: tl.constexpr, AOP: tl.constexpr, AIP: tl.constexpr, BOP: tl.constexpr,
    BIP: tl.constexpr, IDT: tl.constexpr, VG: tl.constexpr = 1, VX: tl.constexpr = 1,
):
    """dA, dB of ``_kron_grad_kernel`` (16-bit inputs, every padded factor dim >= 16) with
    every operand in the layout its product wants, straight from memory — no register
    permutes. Per step of BT tokens:

        W1ᵀ-major  P = G_p · blockdiag(B)       G_p = G as [i, (t, j)]      (AOP × BT·BIP)
        dA        += P_hi · X_q + P_lo · X_q     X_q = X as [(t, l), k]
        Vᵀ-major  Q = X_p · blockdiag(Aᵀ)      X_p = X as [l, (t, k)]      (BIP × BT·AOP)
        dBᵀ       += Q_hi · G_q + Q_lo · G_q     G_q = G as [(t, i), j]

    P[i, (t, l)] = (G[t] B)[i, l] and Q[l, (t, i)] = (A X[t])[i, l]: the block-diagonal
    factor (one copy of B, or Aᵀ, per token of the step, loaded once) turns the per-token
    products into one dot each, whose outputs are already the left operands of the token
    sums (accumulator → dot operand in registers, as flash attention's P·V). The hi/lo pair
    of each float32 product goes through the sums as in _dab_step (W1 and V to ~2^-22). G and
    X are read in two layouts each: the second read hits L1/L2. The block-diagonal products
    issue BT× the FLOPs of the per-token ones (tensor cores, idle in this memory-bound pass);
    the sm_90 SASS of _kron_grad_kernel's step has ~100 shared-memory stores and 16 barriers
    for its permutes and stacks (nvdisasm, triton 3.6), which this form avoids."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    bblk = _blockdiag(B, stride_bj, stride_bl, b_out, b_in, BT, BOP, BIP, IDT)
    ablk = _blockdiag(A, stride_ak, stride_ai, a_in, a_out, BT, AIP, AOP, IDT)
    io = tl.arange(0, AOP)
    lo_ = tl.arange(0, BIP)
    cg = tl.arange(0, BT * BOP)          # (t, j) columns of G_p
    cx = tl.arange(0, BT * AIP)          # (t, k) columns of X_p
    rx = tl.arange(0, BT * BIP)          # (t, l) rows of X_q
    ki = tl.arange(0, AIP)
    jo = tl.arange(0, BOP)
    rg = tl.arange(0, BT * AOP)          # (t, i) rows of G_q
    da = tl.zeros((AOP, AIP), dtype=tl.float32)
    dbt = tl.zeros((BIP, BOP), dtype=tl.float32)
    gw = (b_out // VG) * VG              # = b_out, = b_in: aligned rows (see _g_rows)
    xw = (b_in // VX) * VX
    for blk in range(pid, n_blocks, n_prog):
        t0 = blk * BT
        tg = t0 + cg // BOP
        gp = tl.load(G + tg[None, :] * stride_gt + io[:, None] * gw + (cg % BOP)[None, :],
                     mask=(tg < T)[None, :] & (io < a_out)[:, None] & ((cg % BOP) < gw)[None, :],
                     other=0.0)
        tq = t0 + rx // BIP
        xq = tl.load(X + tq[:, None] * stride_xt + ki[None, :] * xw + (rx % BIP)[:, None],
                     mask=(tq < T)[:, None] & (ki < a_in)[None, :] & ((rx % BIP) < xw)[:, None],
                     other=0.0)
        tx = t0 + cx // AIP
        xp = tl.load(X + tx[None, :] * stride_xt + (cx % AIP)[None, :] * xw + lo_[:, None],
                     mask=(tx < T)[None, :] & ((cx % AIP) < a_in)[None, :] & (lo_ < xw)[:, None],
                     other=0.0)
        tr = t0 + rg // AOP
        gq = tl.load(G + tr[:, None] * stride_gt + (rg % AOP)[:, None] * gw + jo[None, :],
                     mask=(tr < T)[:, None] & ((rg % AOP) < a_out)[:, None] & (jo < gw)[None, :],
                     other=0.0)
        pf = tl.dot(gp, bblk, out_dtype=tl.float32)              # (AOP, BT·BIP)
        ph = pf.to(IDT)
        da = tl.dot(ph, xq, da, out_dtype=tl.float32)
        da = tl.dot((pf - ph.to(tl.float32)).to(IDT), xq, da, out_dtype=tl.float32)
        qf = tl.dot(xp, ablk, out_dtype=tl.float32)              # (BIP, BT·AOP)
        qh = qf.to(IDT)
        dbt = tl.dot(qh, gq, dbt, out_dtype=tl.float32)
        dbt = tl.dot((qf - qh.to(tl.float32)).to(IDT), gq, dbt, out_dtype=tl.float32)
    _store_factor_partials(DAB, pid, da, tl.trans(dbt), scale, a_out, a_in, b_out, b_in,
                           AOP, AIP, BOP, BIP)


@triton.jit
def _kron_dx_grad_kernel(
    G, WF, X, DX, A, B, DAB,
    T, a_out, a_in, b_out, b_in,
    stride_gt, stride_wo, stride_wc, stride_xt, stride_dxt,
    stride_ai, stride_ak, stride_bj, stride_bl, scale, tok_per_prog,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    BT: tl.constexpr, AOP: tl.constexpr, AIP: tl.constexpr, BOP: tl.constexpr,
    BIP: tl.constexpr,
    DOT_W1: tl.constexpr, DOT_DA: tl.constexpr, DOT_V: tl.constexpr, DOT_DB: tl.constexpr,
    PREC: tl.constexpr, ACC: tl.constexpr, RACC: tl.constexpr, IDT: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """The folded path's backward in one pass over dy: dx = dy W' (W' = W + s·A⊗B, the
    folded weight) as a (BM × BN) GEMM tile per program, and the factor gradients of the
    adapter for a slice of the same row block's tokens: the n-th column program of row block
    m takes tokens [m·BM + n·tok_per_prog, +tok_per_prog), so every token is reduced once
    and the dy rows it reads are the ones its row block's GEMM tiles stream (L2 hits). The
    factor sums are written per program (one row of DAB: dA then dB, float32) and summed
    on the host in a fixed order (deterministic)."""
    pid = tl.program_id(0)
    d_out = a_out * b_out
    d_in = a_in * b_in
    n_n = tl.cdiv(d_in, BN)
    pid_m, pid_n = _grouped_tile(pid, tl.cdiv(T, BM), n_n, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_ok = rm < T
    n_ok = rn < d_in
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, d_out, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < d_out
        g = tl.load(G + rm[:, None] * stride_gt + ks[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(WF + ks[:, None] * stride_wo + rn[None, :] * stride_wc,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        # PREC: IEEE for float32 (compiled Triton's default is TF32, which the interpreter
        # never shows); 16-bit products are exact either way
        acc += tl.dot(g, w, out_dtype=tl.float32, input_precision=PREC)
    tl.store(DX + rm[:, None] * stride_dxt + rn[None, :], acc.to(DX.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])

    a, b = _factors(A, B, stride_ai, stride_ak, stride_bj, stride_bl, a_out, a_in, b_out,
                    b_in, X.dtype.element_ty, AOP, AIP, BOP, BIP)
    jo, li, rg_t, rg_i, rx_t, rx_k = _step_lanes(BT, AOP, AIP, BOP, BIP)
    da, db = _dab_zeros(AOP, AIP, BOP, BIP, DOT_DA, DOT_DB, SPLIT, RACC)
    t_lo = pid_m * BM + pid_n * tok_per_prog
    t_hi = tl.minimum(tl.minimum(t_lo + tok_per_prog, pid_m * BM + BM), T)
    for t0 in range(t_lo, t_hi, BT):
        g2 = _g_rows(G, t0, t_hi, stride_gt, a_out, b_out, rg_t, rg_i, jo)
        w1f = _mm(g2, b, DOT_W1, PREC, ACC)
        w1 = w1f.to(IDT)
        da, db = _dab_step(da, db, X, g2, w1f, w1, a, t0, t_hi, stride_xt, a_in, b_in,
                           rx_t, rx_k, li, BT, AOP, AIP, BIP, DOT_DA, DOT_V, DOT_DB, PREC,
                           ACC, RACC, IDT, SPLIT)
    da, db = _dab_final(da, db, AOP, AIP, BOP, BIP, DOT_DA, DOT_DB, SPLIT)
    _store_factor_partials(DAB, pid_m * n_n + pid_n, da, db, scale, a_out, a_in, b_out, b_in,
                           AOP, AIP, BOP, BIP)


@triton.jit
def _kron_fold_kernel(
    W, A, B, OUT,
    d_out, d_in, b_out, b_in,
    stride_wo, stride_wc, stride_ai, stride_ak, stride_bj, stride_bl, stride_oo,
    scale,
    HAS_W: tl.constexpr, BO: tl.constexpr, BC: tl.constexpr, ACC: tl.constexpr,
):
    """OUT = W + scale · (A ⊗ B) for one (BO × BC) tile, in float32 (float64 for float64
    inputs, interpreter only), rounded once.

    Element (o, c) with o = i·b_out + j, c = k·b_in + l is W[o, c] + s·A[i, k]·B[j, l]; the
    A and B gathers hit L1/L2 (the factors are a few KB), so the pass streams W once and
    writes OUT once: a d_out×d_in pass on the CUDA cores, no dot.
    """
    oo = tl.program_id(0) * BO + tl.arange(0, BO)
    cc = tl.program_id(1) * BC + tl.arange(0, BC)
    o_ok = oo < d_out
    c_ok = cc < d_in
    ok = o_ok[:, None] & c_ok[None, :]
    i = oo // b_out
    j = oo % b_out
    k = cc // b_in
    l = cc % b_in
    a = tl.load(A + i[:, None] * stride_ai + k[None, :] * stride_ak, mask=ok, other=0.0)
    b = tl.load(B + j[:, None] * stride_bj + l[None, :] * stride_bl, mask=ok, other=0.0)
    acc = scale * (a.to(ACC) * b.to(ACC))
    if HAS_W:
        w = tl.load(W + oo[:, None] * stride_wo + cc[None, :] * stride_wc, mask=ok, other=0.0)
        acc += w.to(ACC)
    tl.store(OUT + oo[:, None] * stride_oo + cc[None, :], acc.to(OUT.dtype.element_ty), mask=ok)


# ------------------------------------------------------------------------------------------
# host functions


# GPU register budgets, set from the sm_90 compile (python -m kfused.triton_kernels._aot krona):
# elements of the largest per-step tile in _kron_grad_kernel (2 tokens of a 32x32 factor pair:
# 135 registers with 4 warps, no spill; with 8 warps 4 tokens spilled 16 B, 8 tokens 232 B —
# an older form of the step; with triton 3.6 none of those spills, see _GRAD_CANDIDATE_TILES),
# and float64 broadcast-product elements in _krona_fwd_kernel's narrow (< 16) products (16384
# spilled 1.2 KB on the paper's 2x384 / 384x2 factors).
_GRAD_GPU_TILE = 2048
_FWD_GPU_TMP = 4096


def _pow2_divisor(n: int, cap: int) -> int:
    d = 1
    while n % (d * 2) == 0 and d * 2 <= cap:
        d *= 2
    return d


def _token_tiles(T: int, gpu: bool, elem_bytes: int) -> Tuple[int, int]:
    """(BM, BK) of _krona_fwd_kernel before the register budgets, for either order.
    4-byte inputs: 16-token tiles and 8 warps on a GPU (IEEE float32 dots run on the CUDA
    cores; in the sm_90 compile 64 tokens spilled 64 B, 32 tokens or 4 warps 8-24 B; 16
    tokens with 8 warps: 142-166 registers, no spill)."""
    BM = (64 if elem_bytes <= 2 else 16) if gpu else 32
    return min(BM, max(16, next_pow2(T))), (64 if gpu else 128)


@host_config
def _fwd_config(T: int, a_out: int, a_in: int, b_out: int, b_in: int, has_w: bool,
                device: torch.device, elem_bytes: int = 2) -> dict:
    """Block sizes for _krona_fwd_kernel.

    The output tile is BI rows of A times BJ columns of B. When a_out, b_out >= 16, BI = BJ =
    16 (a 256-wide tile), so that both Kronecker products are tensor-core dots (tl.dot needs
    every dim >= 16); a b_out that 16 does not divide (24) is padded to whole blocks (masked
    columns: 1/4 of the work wasted at 24, instead of 8-wide broadcast products). Otherwise BJ
    is the largest power of two dividing b_out and the narrow product falls back to the
    broadcast path, which is kept small.
    """
    gpu = targets_gpu(device)
    p2 = _pow2_divisor(b_out, 128)
    if b_out >= 16 and a_out >= 16:
        BJ, BI = 16, 16
    else:
        bn_target = 128 if gpu else 64
        BJ = min(p2, 64)
        BI = max(1, min(next_pow2(a_out), bn_target // BJ))
    if _xb_first(a_out, a_in, b_out, b_in, BI, BJ):
        if gpu:
            BI = max(BI, min(next_pow2(a_out), 256 // BJ))
        return _fwd_config_xb(T, a_in, b_in, BI, BJ, has_w, gpu, elem_bytes)
    LC = max(2, min(next_pow2(b_in), 16))
    if not (LC >= 16 and BJ >= 16):
        LC = 1              # Y = U Bᵀ is not a dot: one l at a time, as an outer product
    KC = max(2, min(next_pow2(a_in), 16))
    BM, BK = _token_tiles(T, gpu, elem_bytes)
    # Registers: the U tile (BM*LC, BI) and the X chunk (BM*LC, KC); broadcast products (a tile
    # dim < 16) within a temporary budget.
    while BM > 16 and BM * LC * max(KC, BI) > 16384:
        BM //= 2

    def widest_broadcast(bm: int, lc: int) -> int:
        # Y = U Bᵀ needs none: a tensor-core dot, or (LC = 1) an outer product into the tile
        m_u = bm * lc
        tmp_u = 0 if use_dot(m_u, KC, BI) else m_u * KC * BI
        tmp_w = 0 if (not has_w or use_dot(bm, BK, BI * BJ)) else bm * BK * BI * BJ
        return max(tmp_u, tmp_w)

    # Narrow the l chunk first, then the token block — but with W, not below 16 tokens: the
    # frozen product is a tensor-core dot only from BM = 16 (an 8-token block turned it into a
    # broadcast product and spilled 1.2 KB in the sm_90 compile).
    bm_floor = 16 if has_w else 1
    while widest_broadcast(BM, LC) > (_FWD_GPU_TMP if gpu else 65536):
        if LC > 2:
            LC //= 2
        elif BM > bm_floor:
            BM //= 2
        else:
            break
    if not use_dot(BM * BI, LC, BJ):
        LC = 1
    return dict(BM=BM, BI=BI, BJ=BJ, BK=BK, KC=KC, LC=LC,
                DOT_W=has_w and use_dot(BM, BK, BI * BJ),
                DOT_U=use_dot(BM * LC, KC, BI), DOT_Y=use_dot(BM * BI, LC, BJ),
                num_warps=8 if gpu and (BM * BI * BJ >= 8192 or elem_bytes > 2) else 4)


def _kron_products(a_out: int, a_in: int, b_out: int, b_in: int, BI: int, BJ: int
                   ) -> Tuple[int, int]:
    """Multiply-adds per token of _krona_fwd_kernel's Kronecker term in its two orders at the
    tile (BI, BJ): (U = A X first, V = X Bᵀ first). Each order recomputes its first product for
    every tile of the other output axis."""
    n_ib, n_jb = cdiv(a_out, BI), cdiv(b_out, BJ)
    rows, cols = n_ib * BI, n_jb * BJ
    ax = n_jb * rows * a_in * b_in + rows * b_in * cols
    xb = n_ib * a_in * b_in * cols + rows * a_in * cols
    return ax, xb


def _xb_first(a_out: int, a_in: int, b_out: int, b_in: int, BI: int, BJ: int) -> bool:
    """Whether _krona_fwd_kernel takes the V = X Bᵀ-first order: when it issues under half the
    products of the A X-first one. Transposed narrow factors do (the input gradient of the
    paper's A 2×384, B 384×2 runs this kernel on Aᵀ 384×2, Bᵀ 2×384: A X first forms a 384×384
    product per token, 295k multiply-adds, X Bᵀ first about 11k); the balanced shapes and the
    paper's forward keep A X first."""
    ax, xb = _kron_products(a_out, a_in, b_out, b_in, BI, BJ)
    return 2 * xb < ax


@host_config
def _fwd_config_xb(T: int, a_in: int, b_in: int, BI: int, BJ: int, has_w: bool, gpu: bool,
                   elem_bytes: int) -> dict:
    """Block sizes of _krona_fwd_kernel in the X Bᵀ-first order (XB_FIRST): V (BM·KC, BJ) is
    summed over l in chunks of LC (contiguous in x), then brought through A by a dot over KC
    k's, or by an outer product (KC = 1) when that dot would have a dim < 16."""
    BM, BK = _token_tiles(T, gpu, elem_bytes)
    KC = min(next_pow2(a_in), 16)
    if not (KC >= 16 and use_dot(BM * BJ, KC, BI)):
        KC = 1
    LC = max(2, min(next_pow2(b_in), 64))
    bm_floor = 16 if has_w else 1

    def widest_broadcast(bm: int, lc: int) -> int:
        tmp_v = 0 if use_dot(bm * KC, lc, BJ) else bm * KC * lc * BJ
        tmp_w = 0 if (not has_w or use_dot(bm, BK, BI * BJ)) else bm * BK * BI * BJ
        return max(tmp_v, tmp_w)

    # registers: the x chunk (BM·KC, LC) and the broadcast temporaries, as in the A X order
    while (BM * KC * LC > 16384
           or widest_broadcast(BM, LC) > (_FWD_GPU_TMP if gpu else 65536)):
        if LC > 16 or (LC > 2 and BM <= bm_floor):
            LC //= 2
        elif BM > bm_floor:
            BM //= 2
        else:
            break
    if KC > 1 and not use_dot(BM * BJ, KC, BI):
        KC = 1
    return dict(BM=BM, BI=BI, BJ=BJ, BK=BK, KC=KC, LC=LC, XB_FIRST=True,
                DOT_W=has_w and use_dot(BM, BK, BI * BJ),
                DOT_U=use_dot(BM * KC, LC, BJ), DOT_Y=KC > 1 and use_dot(BM * BJ, KC, BI),
                num_warps=8 if gpu and (BM * BI * BJ >= 8192 or elem_bytes > 2) else 4)


def krona_linear_forward(x: torch.Tensor, weight: Optional[torch.Tensor],
                         bias: Optional[torch.Tensor], A: torch.Tensor, B: torch.Tensor,
                         scale: float = 1.0) -> torch.Tensor:
    """y = [x Wᵀ + b] + scale · kron_matvec(x; A, B).

    x: (T, a_in*b_in) with unit inner stride; weight: (a_out*b_out, a_in*b_in) any strides, or
    None; bias: (a_out*b_out,) or None; A: (a_out, a_in); B: (b_out, b_in) any strides.
    Returns (T, a_out*b_out) in x's dtype.
    """
    T = x.shape[0]
    a_out, a_in = A.shape
    b_out, b_in = B.shape
    if T and exact_composes(x.device, x.dtype, T):
        return _compose_exact(x, weight, bias, A, B, scale)
    y = _alloc.empty(T, a_out * b_out, dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    cfg = _fwd_config(T, a_out, a_in, b_out, b_in, weight is not None, x.device,
                      x.element_size())
    grid = (cdiv(T, cfg["BM"]), cdiv(a_out, cfg["BI"]) * cdiv(b_out, cfg["BJ"]))
    w = weight if weight is not None else x
    _krona_fwd_kernel[grid](
        x, w, bias if bias is not None else x, A, B, y,
        T, a_out, a_in, b_out, b_in,
        x.stride(0), w.stride(0), w.stride(1), A.stride(0), A.stride(1), B.stride(0), B.stride(1),
        y.stride(0), float(scale),
        HAS_W=weight is not None, HAS_BIAS=bias is not None, PREC=dot_precision(x.dtype),
        ACC=acc_dtype(x.dtype), IDT=inter_dtype(x.dtype),
        SPLIT=x.dtype in (torch.float16, torch.bfloat16), **cfg)
    return y


# The exact path's y = x Wᵀ + b + s·(A ⊗ B) x (and its dx = dy W + s·(Aᵀ ⊗ Bᵀ) dy; and
# kron_matvec's forward, without W) on a GPU, 16-bit, at every token count: three
# cuBLAS calls (two without W) instead of _krona_fwd_kernel —
# the Kronecker term as a plain GEMM over the token rows' factor axis (X Bᵀ as one
# (T·a_in × b_in) by (b_in × b_out) product, or U Bᵀ) and a batched one with the other factor
# broadcast (A V[t], or A X[t]), the bias and s in its epilogue, then the frozen GEMM added in
# place (beta = 1). The adapter term is never rounded into a weight (what exact promises);
# y is rounded three times (V, the scaled term plus bias, y), the same-precision torch path
# five. Why: the H100 of 2026-11-27 ran _krona_fwd_kernel at 693 µs a launch (T = 16384,
# 768², 24×24 / 32×32; 1387 µs for y and dx) against 44 µs predicted — 16-26x at every shape
# (benchmarks/results/h100/proof-2026-11-27), while the composition is three calls at cuBLAS
# speed (PREDICTED by kfused perf: see the exact cases of benchmarks/results/predicted).
# At any token count: that run's 693 µs was 1536 programs (64 tokens × a 256-column tile
# each) in ~12 waves of 132, ~60 µs a program, so even one token's forward (6 programs, one
# wave) takes about that long, against three small cuBLAS calls of a few µs each.
# float32 keeps the kernel (its IEEE dots: cuBLAS would follow torch's TF32 switch).
COMPOSE_MIN_TOKENS = 1


def exact_composes(device: torch.device, dtype: torch.dtype, T: int) -> bool:
    """Whether the exact path's forward / dx runs as the cuBLAS composition
    (:func:`_compose_exact`) rather than _krona_fwd_kernel. (kfused.perf's trace evaluates it
    as for a CUDA device.)"""
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and T >= COMPOSE_MIN_TOKENS)


def _compose_exact(x: torch.Tensor, weight: Optional[torch.Tensor],
                   bias: Optional[torch.Tensor], A: torch.Tensor, B: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """x Wᵀ + b + scale·(A ⊗ B) x by torch's GEMMs (cuBLAS on a GPU): x (T, a_in·b_in) with
    unit inner stride, weight (a_out·b_out, a_in·b_in) any strides or None (kron_matvec: the
    Kronecker term alone, two calls). Returns (T, d_out) contiguous in x's dtype. The frozen
    GEMM first (bias in its epilogue), then the Kronecker term in the order with the smaller
    per-token intermediate — X Bᵀ (a_in × b_out) then A·, or A X (a_out × b_in) then ·Bᵀ —
    its batched GEMM adding into y."""
    T = x.shape[0]
    a_out, a_in = A.shape
    b_out, b_in = B.shape
    dt = x.dtype
    A, B = A.to(dt), B.to(dt)
    X3 = x.view(T, a_in, b_in)
    if weight is not None:
        # y1 = x Wᵀ + b rounded once, as the torch path rounds it; then the Kronecker term
        # added to it in the batched GEMM's epilogue (beta = 1), rounded once more. Not the
        # bias inside the Kronecker GEMM: where b and the term cancel x Wᵀ, rounding their
        # sum first at its own (larger) scale cost 2.6 ulp of y (float16, 1×1 factors, §4
        # bound 2.5 ulp there; test_exact_path_cublas_composition)
        y = (torch.addmm(bias.to(dt), x, weight.t()) if bias is not None
             else torch.mm(x, weight.t()))
        Y3, beta = y.view(T, a_out, b_out), 1.0
    else:
        y = _alloc.empty(T, a_out * b_out, dtype=dt, device=x.device)
        Y3, beta = y.view(T, a_out, b_out), 0.0     # beta = 0: Y3's contents never read
    if a_in * b_out <= a_out * b_in:
        V = torch.matmul(X3, B.t())                                  # (T, a_in, b_out)
        torch.baddbmm(Y3, A.expand(T, a_out, a_in), V, beta=beta, alpha=float(scale), out=Y3)
    else:
        U = torch.matmul(A.expand(T, a_out, a_in), X3)               # (T, a_out, b_in)
        torch.baddbmm(Y3, U, B.t().expand(T, b_in, b_out), beta=beta, alpha=float(scale),
                      out=Y3)
    return y


def fold_weight(weight: Optional[torch.Tensor], A: torch.Tensor, B: torch.Tensor,
                scale: float = 1.0) -> torch.Tensor:
    """W' = W + scale · (A ⊗ B) as a new contiguous (d_out, d_in) tensor in A's dtype.

    Each element is formed in float32 and rounded once (torch's ``W + s * torch.kron(A, B)``
    rounds three times). weight: (a_out*b_out, a_in*b_in) any strides, or None (then W' is
    ``scale · A ⊗ B``).
    """
    a_out, a_in = A.shape
    b_out, b_in = B.shape
    d_out, d_in = a_out * b_out, a_in * b_in
    out = _alloc.empty(d_out, d_in, dtype=A.dtype, device=A.device)
    gpu = targets_gpu(A.device)
    BO, BC = (32, 128) if gpu else (16, 64)
    w = weight if weight is not None else A
    grid = (cdiv(d_out, BO), cdiv(d_in, BC))
    _kron_fold_kernel[grid](
        w, A, B, out, d_out, d_in, b_out, b_in,
        w.stride(0), w.stride(1) if weight is not None else 0,
        A.stride(0), A.stride(1), B.stride(0), B.stride(1), out.stride(0), float(scale),
        HAS_W=weight is not None, BO=BO, BC=BC, num_warps=8 if gpu else 4,
        ACC=tl.float64 if A.dtype == torch.float64 else tl.float32)
    return out


@host_config(tuned=True)
def _grad_config(T: int, a_out: int, a_in: int, b_out: int, b_in: int,
                 device: torch.device, elem_bytes: int = 2) -> dict:
    """Block sizes for _kron_grad_kernel: :func:`_grad_rule`'s, or on a CUDA device the
    configuration this GPU model timed fastest for these factors (16-bit, the tensor-core
    path, T >= _TUNE_MIN_T; benchmarks/tune_kernels.py, :mod:`kfused.tuning`)."""
    cfg = _grad_rule(T, a_out, a_in, b_out, b_in, device, elem_bytes)
    if (elem_bytes == 2 and T >= _TUNE_MIN_T and device.type == "cuda"
            and all(cfg[k] for k in ("DOT_W1", "DOT_DA", "DOT_V", "DOT_DB"))):
        tuned = tuning.lookup("_kron_grad_kernel", device,
                              grad_tuning_key(a_out, a_in, b_out, b_in, elem_bytes), T,
                              grad_candidates(T, a_out, a_in, b_out, b_in))
        if tuned is not None:
            cfg = with_grad_config(cfg, tuned)
    return cfg


@host_config
def _grad_rule(T: int, a_out: int, a_in: int, b_out: int, b_in: int,
               device: torch.device, elem_bytes: int = 2) -> dict:
    """The rule's block sizes for _kron_grad_kernel: BT tokens per step, every factor dim
    padded to a power of two. GPU budgets come from the sm_90 compile check (registers, no
    spills)."""
    gpu = targets_gpu(device)
    AOP, AIP = max(2, next_pow2(a_out)), max(2, next_pow2(a_in))
    BOP, BIP = max(2, next_pow2(b_out)), max(2, next_pow2(b_in))
    per_tok = max(AOP * BOP, AIP * BIP, AOP * BIP)
    # Every product a tensor-core dot (all padded factor dims >= 16) or some on the CUDA cores.
    dots = min(AOP, AIP, BOP, BIP) >= 16
    if gpu:
        # Dots: 4 warps, at least 2 tokens per step (32x32 factors: 135 registers, so 3 CTAs
        # per SM keep 18 KB of x/dy loads in flight per SM, against 6 KB with 8 warps at 157
        # registers and 1 CTA per SM). Broadcast products: 8 warps, 4096-element tiles.
        # 2 tokens of 64-wide factors: 135-156 registers; of 128-wide (A 128x24): 144 B spilled.
        wide = max(AOP, AIP, BOP, BIP) > 64
        budget = (_GRAD_GPU_TILE if wide else max(_GRAD_GPU_TILE, 2 * per_tok)) if dots else 4096
        warps = 4 if dots and not wide else 8  # 1 token of A 128x24 with 4 warps: 48 B spilled
        if elem_bytes > 2:  # float32 tiles and float64 token sums: half the tile, 8 warps
            budget, warps = _GRAD_GPU_TILE // 2, 8
    else:
        budget, warps = 8192, 4
    tmp_budget = 8192 if gpu else 65536
    BT = 1
    bt_cap = 32 if gpu else 1 << 30  # 64 tokens of (3, 5, 7, 2) factors spilled 24 B on sm_90
    while BT * 2 * per_tok <= budget and BT * 2 <= min(bt_cap, max(1, next_pow2(T))):
        BT *= 2

    def flags(bt):
        shapes = dict(DOT_W1=(bt * AOP, BOP, BIP), DOT_DA=(AOP, bt * BIP, AIP),
                      DOT_V=(bt * BIP, AIP, AOP), DOT_DB=(BOP, bt * AOP, BIP),
                      DOT_DX=(bt * BIP, AOP, AIP))
        f = {k: use_dot(*s) for k, s in shapes.items()}
        tmp = max([s[0] * s[1] * s[2] for k, s in shapes.items() if not f[k]] or [0])
        return f, tmp

    f, tmp = flags(BT)
    while BT > 1 and tmp > tmp_budget:
        BT //= 2
        f, tmp = flags(BT)
    return dict(BT=BT, AOP=AOP, AIP=AIP, BOP=BOP, BIP=BIP, num_warps=warps, **f)


# Candidates of the factor-gradient step timed by benchmarks/tune_kernels.py on a GPU (16-bit,
# every padded factor dim >= 16: the tensor-core path): (tile elements per step, warps,
# stages); the tokens per step are the tile over the per-token tile. All compile for sm_90
# without spills at 32x32 factor pairs (1024-element tiles: 2 tokens 4 warps 90 registers; 4
# tokens 4 warps 132, 8 warps 100; 8 tokens 8 warps 142; 16 tokens 8 warps 2 stages 204
# registers and 200 KB of shared memory) and at 64x64 (4096-element tiles: 1 token 4 warps
# 153 registers; 2 tokens 8 warps 134; 4 tokens 8 warps 2 stages 157); triton 3.6, sm_90,
# `python3 benchmarks/tune_kernels.py --compile-only`. The H100 of 2026-11-27 measured the
# rule's choice at 32x32 (2 tokens, 4 warps, 3 stages) at 2.1x its predicted time, each step
# taking 2.3-2.8 µs whatever the tile (see _GRAD_RESIDENT): a dependent chain per step (4
# dots, 3 waited on) and at most two steps' loads in flight per program. A fourth stage keeps
# three in flight (2 tokens, 4 warps: 45 KB shared, still 5 CTAs per SM).
_GRAD_CANDIDATE_TILES = ((2048, 4, 4), (4096, 4, 3), (4096, 8, 3), (4096, 8, 4), (8192, 8, 3),
                         (16384, 8, 2))
_TUNE_MIN_T = 2048      # below this the rule's config (few steps per program either way)


def grad_tuning_key(a_out: int, a_in: int, b_out: int, b_in: int, elem_bytes: int) -> dict:
    """The shape key of _kron_grad_kernel's entries in a tuning table (the factors as the
    kernel sees them: after :func:`_swap_factors`)."""
    return {"a_out": a_out, "a_in": a_in, "b_out": b_out, "b_in": b_in,
            "elem_bytes": elem_bytes}


def with_grad_config(cfg: dict, over: dict) -> dict:
    """``cfg`` (a :func:`_grad_config`) with tokens per step, warps, stages and the step's
    form (``BD`` 1: :func:`_kron_grad_bd_kernel`) from ``over``; the product flags
    recomputed for the new step."""
    cfg = dict(cfg)
    for k in ("BT", "num_warps", "num_stages", "BD", "TC"):
        if k in over:
            cfg[k] = int(over[k])
    bt, AOP, AIP, BOP, BIP = (cfg[k] for k in ("BT", "AOP", "AIP", "BOP", "BIP"))
    shapes = dict(DOT_W1=(bt * AOP, BOP, BIP), DOT_DA=(AOP, bt * BIP, AIP),
                  DOT_V=(bt * BIP, AIP, AOP), DOT_DB=(BOP, bt * AOP, BIP),
                  DOT_DX=(bt * BIP, AOP, AIP))
    cfg.update({k: use_dot(*s) for k, s in shapes.items()})
    return cfg


def grad_candidates(T: int, a_out: int, a_in: int, b_out: int, b_in: int) -> list:
    """The configurations benchmarks/tune_kernels.py times for these (kernel-side) factors:
    [{"BT", "num_warps", "num_stages"}], the rule's own first; [] off the tensor-core path."""
    AOP, AIP = max(2, next_pow2(a_out)), max(2, next_pow2(a_in))
    BOP, BIP = max(2, next_pow2(b_out)), max(2, next_pow2(b_in))
    if min(AOP, AIP, BOP, BIP) < 16:
        return []
    per_tok = max(AOP * BOP, AIP * BIP, AOP * BIP)
    rule = _grad_rule(T, a_out, a_in, b_out, b_in, torch.device("cuda"), 2)
    out = [{"BT": rule["BT"], "num_warps": rule["num_warps"], "num_stages": 3}]
    for tile, warps, stages in _GRAD_CANDIDATE_TILES:
        bt = 1
        while bt * 2 * per_tok <= tile and bt * 2 <= min(32, max(1, next_pow2(T))):
            bt *= 2
        c = {"BT": bt, "num_warps": warps, "num_stages": stages}
        if c not in out:
            out.append(c)
    # the block-diagonal form (_kron_grad_bd_kernel): its factor blocks hold BT copies of a
    # factor (BT·BOP × BT·BIP), so few tokens per step
    for bt, warps, stages in _GRAD_BD_CANDIDATES:
        if bt <= max(1, next_pow2(T)) and bt * max(BOP * BIP, AIP * AOP) <= _GRAD_BD_BLOCK:
            out.append({"BT": bt, "num_warps": warps, "num_stages": stages, "BD": 1})
    # the tensor-core form of the narrow kernel (_kron_narrow_tc_kernel, 16-bit; float32 runs
    # the rule's step): tokens a step from its tile budget
    tiles = narrow_tc_tiles(grad_tc_plan(a_out, a_in, b_out, b_in), _GRAD_TC_TILE, 64)
    if tiles is not None:
        bt = min(tiles[4], max(1, next_pow2(T)))
        for warps, stages in _GRAD_TC_CANDIDATES:
            out.append({"BT": bt, "num_warps": warps, "num_stages": stages, "TC": 1})
    return out


# The tensor-core narrow kernel as a candidate of the factor-gradient step (factor pairs with
# every padded dim >= 16; tile elements a step, (warps, stages)): sm_90, Triton 3.6, 24×24 /
# 32×32 at 4 tokens a step 300 warp-instructions a token at 4 warps (252 registers; 2
# stages, 309 at 3) and 378 at 8 (240), no spill; the standard step's traced loop 612 at 2
# tokens, 4 warps; 48×24 / 64×32 at 1 token 756 / 1008 (148 / 104 registers). Twice the
# tile spilled 496 B at 24×24 / 32×32. Not the rule: not yet measured (the H200 timed the
# standard step at 50-52 µs there, call and sums, T = 16384)
_GRAD_TC_TILE = 8192
_GRAD_TC_CANDIDATES = ((4, 2), (8, 2), (4, 3))


def grad_tc_plan(a_out: int, a_in: int, b_out: int, b_in: int):
    """The narrow plan tuple the tensor-core kernel takes for factors of the standard path
    (unswapped: small sides a_out and b_in, big sides a_in and b_out)."""
    return (None, False, a_out, b_in, a_in, b_out)


# (tokens per step, warps, stages) of the block-diagonal form's candidates, and the largest
# block-diagonal factor (elements of one of its BT diagonal blocks times BT) they may hold
# sm_90 (triton 3.6), 24×24 / 32×32 at 2 tokens, 4 warps: mma.sync (M = 32 rows), 187
# registers (its two block-diagonal factors stay in registers: 2 CTAs per SM against the
# standard step's 5), 7 barriers and 48 shared stores in the kernel against 16 and 88; at 4
# tokens 255 registers, so not a candidate
_GRAD_BD_CANDIDATES = ((2, 4, 3),)
_GRAD_BD_BLOCK = 4096


def kron_factor_grads(g: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                      scale: float = 1.0, *, compute_dx: bool = True, compute_dab: bool = True,
                      config: Optional[dict] = None
                      ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor],
                                 Optional[torch.Tensor]]:
    """Gradients of ``scale · kron_matvec(x; A, B)`` given its upstream gradient ``g``.

    g: (T, a_out*b_out), x: (T, a_in*b_in), both with unit inner stride. Returns
    (dx or None, dA or None, dB or None); dA/dB are reduced in float32 and cast to A/B's dtype.
    ``config``: tokens per step, warps and stages to launch with ({"BT", "num_warps",
    "num_stages"}, ``BD`` or ``TC`` for the block-diagonal or tensor-core narrow form; e.g.
    one of :func:`grad_candidates`) instead of the chosen ones (tuning, tests). The measured configurations of a tuning table apply to the factor gradients
    alone (``compute_dx=False``, the folded backward's second pass): they were timed so.
    """
    T = x.shape[0]
    a_out, a_in = A.shape
    b_out, b_in = B.shape
    # the narrow kernel for two small factor sides, unless a config of the standard kernel
    # is asked for (tuning, tests); a NARROW config is one of its own candidates
    narrow = None
    if config is None or config.get("NARROW"):
        narrow = narrow_grad_plan(a_out, a_in, b_out, b_in)
    if T > 0 and narrow is not None:
        return _factor_grads_narrow(g, x, A, B, scale, compute_dx, compute_dab, narrow,
                                    config)
    if T > 0 and _swap_factors(a_out, a_in, b_out, b_in):
        # (A ⊗ B) vec(X) = vec(A X Bᵀ), whose transpose B Xᵀ Aᵀ is (B ⊗ A) on vec(Xᵀ): the
        # same gradients with the factors' roles swapped, on x and g with their factor axes
        # transposed (two copies), where the per-token G B tile is b_out × a_in, not a_out × b_in
        xs = x.view(T, a_in, b_in).transpose(1, 2).reshape(T, a_in * b_in)
        gs = g.view(T, a_out, b_out).transpose(1, 2).reshape(T, a_out * b_out)
        dxs, dB, dA = kron_factor_grads(gs, xs, B, A, scale, compute_dx=compute_dx,
                                        compute_dab=compute_dab, config=config)
        dx = None if dxs is None else dxs.view(T, b_in, a_in).transpose(1, 2).reshape(
            T, a_in * b_in)
        return dx, dA, dB
    dx = _alloc.empty(T, a_in * b_in, dtype=x.dtype, device=x.device) if compute_dx else None
    if T == 0:
        zA = torch.zeros_like(A) if compute_dab else None
        zB = torch.zeros_like(B) if compute_dab else None
        return dx, zA, zB
    cfg = (_grad_rule if compute_dx else _grad_config)(T, a_out, a_in, b_out, b_in, x.device,
                                                        x.element_size())
    if config is not None:
        cfg = with_grad_config(cfg, config)
    # the tensor-core narrow kernel (a launch choice): 16-bit factor gradients alone, factors
    # its tiles fit; elsewhere the standard step (the rule's tokens a step) computes the sums
    if cfg.pop("TC", 0):
        plan = grad_tc_plan(a_out, a_in, b_out, b_in)
        if (not compute_dx and compute_dab and x.dtype in (torch.float16, torch.bfloat16)
                and narrow_tc_tiles(plan, _GRAD_TC_TILE, 64) is not None):
            return None, *_factor_grads_narrow_tc(
                g, x, A, B, scale, plan,
                dict(TILE=_GRAD_TC_TILE, SMALL_MAX=64, BT=cfg["BT"],
                     num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 2)))
        cfg = with_grad_config(cfg, {k: v for k, v in _grad_rule(
            T, a_out, a_in, b_out, b_in, x.device, x.element_size()).items()
            if k in ("BT", "num_warps")})
    # the block-diagonal form (a launch choice, not a result's): 16-bit tensor-core steps of
    # the factor gradients alone; elsewhere the standard kernel computes the same sums
    if (cfg.pop("BD", 0) and not compute_dx and compute_dab
            and x.dtype in (torch.float16, torch.bfloat16)
            and all(cfg[k] for k in ("DOT_W1", "DOT_DA", "DOT_V", "DOT_DB"))):
        return None, *_factor_grads_bd(g, x, A, B, scale, cfg)
    key = (x.device, x.dtype, compute_dx, compute_dab, tuple(sorted(cfg.items())))
    if key in _GRAD_NO_LAUNCH:
        return _factor_grads_torch(g, x, A, B, scale, compute_dx, compute_dab)
    n_blocks = cdiv(T, cfg["BT"])
    # a persistent grid of as many programs as the GPU holds at once: the CTAs per SM the
    # compiled kernel allows (asked after its first launch), 4 until then
    n_prog = _grid_for(key, x.device, n_blocks)
    dab = _factor_partials(n_prog, A, B, x.dtype) if compute_dab else x
    try:
        compiled = _kron_grad_kernel[(n_prog,)](
            x, g, A, B, dx if dx is not None else x, dab,
            T, a_out, a_in, b_out, b_in,
            x.stride(0), g.stride(0), dx.stride(0) if dx is not None else 0,
            A.stride(0), A.stride(1), B.stride(0), B.stride(1),
            float(scale), n_blocks,
            COMPUTE_DX=compute_dx, COMPUTE_DAB=compute_dab, **_grad_numerics(x.dtype),
            **_row_vectors(x, b_out, b_in), **cfg)
        _note_residency(key, x.device, compiled)
    except OutOfResources:
        # raised when the GPU loads the kernel, before it runs (nothing written): factor
        # shapes whose per-token tiles need more shared memory than an SM has, in either
        # orientation (e.g. A 64×256, B 256×64 on sm_90); remembered, so asked once
        _GRAD_NO_LAUNCH.add(key)
        return _factor_grads_torch(g, x, A, B, scale, compute_dx, compute_dab)
    if not compute_dab:
        return dx, None, None
    return (dx, *_sum_factor_partials(dab, A, B))


@triton.jit
def _kron_narrow_grad_kernel(
    X, G, A, B, DX, DAB,
    T, m, n, K, J,
    stride_xt, stride_gt, stride_dxt, xk, xl, gi, gj,
    sai, sak, sbj, sbl, offA, offB, nAB,
    scale, n_blocks,
    COMPUTE_DX: tl.constexpr, COMPUTE_DAB: tl.constexpr,
    M: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BJ: tl.constexpr,
    ACC: tl.constexpr, RACC: tl.constexpr,
):
    """Factor gradients (and dx) for two small factor sides: A' (m × K), B' (J × n) with m ≤ M,
    n ≤ N small (the paper's 2×384 / 384×2; the other orientation is the same sums on the
    transposed tokens: A' = B, B' = A, X' = Xᵀ, G' = Gᵀ, by strides), X'[t] (K × n) at
    t·stride_xt + k·xk + l·xl, G'[t] (m × J) at t·stride_gt + i·gi + j·gj. Per token the
    intermediates V = A' X'[t] and W = G'[t] B' are m × n values, each a dot over K or J, and
    the rest are rank-m / rank-n updates:
        dA'[i, k] += Σ_l W[i, l] X'[k, l],  dB'[j, l] += Σ_i G'[i, j] V[i, l],
        dX'[k, l] = scale · Σ_i A'[i, k] W[i, l].
    A program walks blocks of BT tokens (persistent); each block is a handful of (BT × M × BK)
    broadcast products reduced over K, J or the tokens: no per-token tile padded to 16 and no
    dot chain. V and W stay in the accumulator (not rounded to the input dtype), as the
    standard kernel's hi/lo split keeps them. The program's dA' and dB' (scaled) are its row
    of DAB at offA (m × K) and offB (J × n)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    rt = tl.arange(0, BT)
    rm = tl.arange(0, M)
    rn = tl.arange(0, N)
    rk = tl.arange(0, BK)
    rj = tl.arange(0, BJ)
    m_ok = rm < m
    n_ok = rn < n
    k_ok = rk < K
    j_ok = rj < J
    a = tl.load(A + rm[:, None] * sai + rk[None, :] * sak, mask=m_ok[:, None] & k_ok[None, :],
                other=0.0).to(ACC)                                               # (M, BK)
    bt = tl.load(B + rj[None, :] * sbj + rn[:, None] * sbl, mask=n_ok[:, None] & j_ok[None, :],
                 other=0.0).to(ACC)                                              # (N, BJ)
    da = tl.zeros((M, BK), dtype=RACC)
    db = tl.zeros((N, BJ), dtype=RACC)
    kn_ok = n_ok[:, None] & k_ok[None, :]
    mj_ok = m_ok[:, None] & j_ok[None, :]
    # each block's tiles are loaded one block ahead: these loads feed no dot, so Triton does
    # not pipeline them, and a step that waited on its own loads would be a DRAM round trip
    t = pid * BT + rt
    x3_n = tl.load(X + t[:, None, None] * stride_xt + rn[None, :, None] * xl
                   + rk[None, None, :] * xk, mask=(t < T)[:, None, None] & kn_ok[None, :, :],
                   other=0.0)                                                    # (BT, N, BK)
    g3_n = tl.load(G + t[:, None, None] * stride_gt + rm[None, :, None] * gi
                   + rj[None, None, :] * gj, mask=(t < T)[:, None, None] & mj_ok[None, :, :],
                   other=0.0)                                                    # (BT, M, BJ)
    for blk in range(pid, n_blocks, nprog):
        t = blk * BT + rt
        t_ok = t < T
        x3 = x3_n.to(ACC)
        g3 = g3_n.to(ACC)
        t_n = (blk + nprog) * BT + rt
        x3_n = tl.load(X + t_n[:, None, None] * stride_xt + rn[None, :, None] * xl
                       + rk[None, None, :] * xk,
                       mask=(t_n < T)[:, None, None] & kn_ok[None, :, :], other=0.0)
        g3_n = tl.load(G + t_n[:, None, None] * stride_gt + rm[None, :, None] * gi
                       + rj[None, None, :] * gj,
                       mask=(t_n < T)[:, None, None] & mj_ok[None, :, :], other=0.0)
        for l in tl.static_range(N):
            x_l = tl.sum(tl.where(rn[None, :, None] == l, x3, 0.0), axis=1)     # (BT, BK)
            b_l = tl.sum(tl.where(rn[:, None] == l, bt, 0.0), axis=0)           # (BJ,)
            w_l = tl.sum(g3 * b_l[None, None, :], axis=2)                        # (BT, M)
            if COMPUTE_DAB:
                v_l = tl.sum(x_l[:, None, :] * a[None, :, :], axis=2)            # (BT, M)
                da += tl.sum(w_l[:, :, None] * x_l[:, None, :], axis=0).to(RACC)
                db_l = tl.sum(tl.sum(g3 * v_l[:, :, None], axis=1), axis=0)     # (BJ,)
                db += tl.where(rn[:, None] == l, db_l[None, :], 0.0).to(RACC)
            if COMPUTE_DX:
                l_ok = tl.full((1, 1), l, tl.int32) < n       # (n may arrive as a constexpr)
                dx_l = _bcast_mm(w_l, a)                     # (BT, BK); no TF32: see _bcast_mm
                tl.store(DX + t[:, None] * stride_dxt + rk[None, :] * xk + l * xl,
                         (dx_l * scale).to(DX.dtype.element_ty),
                         mask=t_ok[:, None] & k_ok[None, :] & l_ok)
    if COMPUTE_DAB:
        base = DAB + pid * nAB
        tl.store(base + offA + rm[:, None] * K + rk[None, :], da * scale,
                 mask=m_ok[:, None] & k_ok[None, :])
        tl.store(base + offB + rj[None, :] * n + rn[:, None], db * scale,
                 mask=n_ok[:, None] & j_ok[None, :])


@triton.jit
def _cat_cols(a, b, ROWS: tl.constexpr, C: tl.constexpr):
    """[a | b]: two (ROWS × C) tiles side by side, (ROWS × 2C)."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), (ROWS, 2 * C))


@triton.jit
def _pad_cols(v, ROWS: tl.constexpr, C: tl.constexpr, P: tl.constexpr, IDT: tl.constexpr):
    """(ROWS × P) dot operand from a float32 (ROWS × C) tile v, C <= P (powers of two): v
    rounded to IDT in columns [0, C), zero in the rest. (No rounding residue as a second
    part: a float32 operand split into 16-bit hi and lo parts for tensor-core dots is what
    Triton 3.6 miscompiled for sm_90 in other kernels, kfused/triton_kernels/_common.py.)"""
    out = v.to(IDT)
    if C < P:
        out = _cat_cols(out, tl.zeros((ROWS, C), dtype=IDT), ROWS, C)
    if 2 * C < P:
        out = _cat_cols(out, tl.zeros((ROWS, 2 * C), dtype=IDT), ROWS, 2 * C)
    if 4 * C < P:
        out = _cat_cols(out, tl.zeros((ROWS, 4 * C), dtype=IDT), ROWS, 4 * C)
    if 8 * C < P:
        out = _cat_cols(out, tl.zeros((ROWS, 8 * C), dtype=IDT), ROWS, 8 * C)
    return out


@triton.jit
def _tc_rows(P, t0, T, stride_t, s_small, s_big, big0, BIG, small,
             BT: tl.constexpr, S: tl.constexpr, BP: tl.constexpr, FLAT: tl.constexpr,
             FULL: tl.constexpr):
    """Rows (t, s) of the BT tokens from t0 (s < S, the padded small side), columns
    [big0, big0 + BP) of the big side (below BIG), zero-padded: a (BT·S × BP) tile.

    FLAT (small = S, s_small = 1, s_big = S: a token's (big × small) block is contiguous
    with the small side fastest, as X' is in the unswapped orientation): each token's part
    is read as one contiguous row of BP·S elements (16-byte vectors) and transposed in
    registers — read as (t, s) rows its elements are S apart, one 2-byte load each. FULL:
    the parts cover the big side exactly (no column mask, which would cost the vectors)."""
    if FLAT:
        t = t0 + tl.arange(0, BT)
        f = big0 * S + tl.arange(0, BP * S)
        ok = (t < T)[:, None]
        if not FULL:
            ok = ok & (f < BIG * S)[None, :]
        v = tl.load(P + t[:, None] * stride_t + f[None, :], mask=ok, other=0.0)
        return tl.reshape(tl.permute(tl.reshape(v, (BT, BP, S)), (0, 2, 1)), (BT * S, BP))
    else:
        r = tl.arange(0, BT * S)
        t = t0 + r // S
        si = r % S
        c = big0 + tl.arange(0, BP)
        ok = ((t < T) & (si < small))[:, None]
        if not FULL:
            ok = ok & (c < BIG)[None, :]
        return tl.load(P + t[:, None] * stride_t + si[:, None] * s_small + c[None, :] * s_big,
                       mask=ok, other=0.0)


@triton.jit
def _tc_factor(F, s_small, s_big, small, big0, BIG, BP: tl.constexpr, P: tl.constexpr,
               IDT: tl.constexpr):
    """(BP × P) product operand [c, s] = F'[s, big0 + c] of a factor (its small side s on the
    P columns): zero past ``small`` columns and BIG rows."""
    c = big0 + tl.arange(0, BP)
    sp = tl.arange(0, P)
    return tl.load(F + sp[None, :] * s_small + c[:, None] * s_big,
                   mask=(c < BIG)[:, None] & (sp < small)[None, :], other=0.0).to(IDT)


@triton.jit
def _tc_store(DAB, off, acc, S: tl.constexpr, BP: tl.constexpr, P: tl.constexpr, big0, BIG,
              small, row_big, col_big, scale):
    """A (BP × P) token sum of :func:`_kron_narrow_tc_kernel` (column s < S; the columns past
    S are exact zeros) as the factor entries (s, big0 + c), s < small, big0 + c < BIG, at
    DAB + off + s·row_big + (big0 + c)·col_big, scaled."""
    v = tl.sum(tl.reshape(acc, (BP, P // S, S)), axis=1)                 # (BP, S)
    c = big0 + tl.arange(0, BP)
    s = tl.arange(0, S)
    tl.store(DAB + off + s[None, :] * row_big + c[:, None] * col_big, v * scale,
             mask=(s < small)[None, :] & (c < BIG)[:, None])


@triton.jit
def _kron_narrow_tc_kernel(
    X, G, A, B, DAB,
    T, m, n, K, J,
    stride_xt, stride_gt, xk, xl, gi, gj,
    sai, sak, sbj, sbl, offA, offB, nAB,
    scale, n_blocks,
    M: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, K1: tl.constexpr,
    K2: tl.constexpr, J1: tl.constexpr, J2: tl.constexpr, IDT: tl.constexpr,
    X_FLAT: tl.constexpr, G_FLAT: tl.constexpr, K_FULL: tl.constexpr, J_FULL: tl.constexpr,
    MP: tl.constexpr = 16, NP: tl.constexpr = 16,
):
    """The factor gradients of :func:`_kron_narrow_grad_kernel` (same orientation, strides and
    partial-sum rows; 16-bit inputs, dx not computed) as tensor-core products over blocks of
    BT tokens, with no reduction across the block's threads in the step. Per step:

        G2   = G'[t] as rows (t, i), cols j         (BT·M × J)   loaded
        R    = X'[t]ᵀ as rows (t, l), cols k        (BT·N × K)   loaded
        Wᵀ   = B'ᵀ · G2ᵀ                rows l, cols (t, i)   (B' zero-padded to NP cols)
        Vᵀ   = R · A'ᵀ                  rows (t, l), cols i   (A'ᵀ zero-padded to MP cols)
        dA'ᵀ += Rᵀ  · W as rows (t, l), cols i      (K × MP; W rounded to the input dtype)
        dB'  += G2ᵀ · V as rows (t, i), cols l      (J × NP; V rounded likewise)

    MP, NP = max(16, M), max(16, N): 16 for the narrow plans (small sides up to 8); up to 64
    where the kernel is a candidate of the standard factor-gradient step (grad_candidates).

    The token sums put the big side on the product's M, so each is a wgmma whose A operand
    (Rᵀ, G2ᵀ) is read from the shared-memory copy of the loaded tile, not held in registers.
    Each big side is covered by two power-of-two parts, K1 (+ K2) and J1 (+ J2; 0: none),
    not one padded tile: 384 = 256 + 128, a quarter less tile, registers and issue than 512.
    W and V are float32 dot outputs rounded once to the input dtype for the token sums (as
    the same-precision torch backward rounds its intermediates; the sums are float32): no
    hi/lo split (:func:`_pad_cols`). In the interpreter, float16, T up to 1000, that met
    docs/math.md §4 with the kernel's error at most 0.34 of the bound.

    The CUDA-core kernel reduces 512-wide axes across all its warps several times a step,
    one or four tokens per step at the paper's factors: the H200 measured it at 56.5 µs (A
    2×384, B 384×2) and 193 µs (A 8×384) at T = 16384 against 15.5 and 34 µs of memory
    traffic; its loop (sm_90, Triton 3.6, the tuned 2-warp tile) issues 1178 / 3280
    warp-instructions (both warps) and 16 barriers a token, this kernel's (the rule: 8 warps,
    16 / 8 tokens a step) 354 / 739 and 0.19 / 0.38."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    ap1 = _tc_factor(A, sai, sak, m, 0, K, K1, MP, IDT)      # A'ᵀ (K × MP) by parts
    bp1 = _tc_factor(B, sbl, sbj, n, 0, J, J1, NP, IDT)      # B'  (J × NP)
    da1 = tl.zeros((K1, MP), dtype=tl.float32)
    db1 = tl.zeros((J1, NP), dtype=tl.float32)
    if K2 > 0:
        ap2 = _tc_factor(A, sai, sak, m, K1, K, K2, MP, IDT)
        da2 = tl.zeros((K2, MP), dtype=tl.float32)
    if J2 > 0:
        bp2 = _tc_factor(B, sbl, sbj, n, J1, J, J2, NP, IDT)
        db2 = tl.zeros((J2, NP), dtype=tl.float32)
    for blk in range(pid, n_blocks, nprog):
        t0 = blk * BT
        g1 = _tc_rows(G, t0, T, stride_gt, gi, gj, 0, J, m, BT, M, J1, G_FLAT, J_FULL)
        r1 = _tc_rows(X, t0, T, stride_xt, xl, xk, 0, K, n, BT, N, K1, X_FLAT, K_FULL)
        # W as Wᵀ = B'ᵀ G2ᵀ (16 × BT·M): an mma.sync with G2 a register operand. As G2 · B' it
        # was a wgmma (M = BT·M = 64 at A 8×384) and took the kernel from 127 registers to
        # 255 and a 144-312 B spill (sm_90, Triton 3.6 and 3.9); transposed, 130, none
        wt = tl.dot(tl.trans(bp1), tl.trans(g1), out_dtype=tl.float32)
        v16 = tl.dot(r1, ap1, out_dtype=tl.float32)                       # (BT·N, MP)
        if J2 > 0:
            g2 = _tc_rows(G, t0, T, stride_gt, gi, gj, J1, J, m, BT, M, J2, G_FLAT, J_FULL)
            wt = tl.dot(tl.trans(bp2), tl.trans(g2), wt, out_dtype=tl.float32)
        w16 = tl.trans(wt)                                                 # (BT·M, NP)
        if K2 > 0:
            r2 = _tc_rows(X, t0, T, stride_xt, xl, xk, K1, K, n, BT, N, K2, X_FLAT, K_FULL)
            v16 = tl.dot(r2, ap2, v16, out_dtype=tl.float32)
        # columns past N (M) are exact zeros: summing the 16 // N groups keeps the first
        w = tl.sum(tl.reshape(w16, (BT * M, NP // N, N)), axis=1)        # (BT·M, N)
        vt = tl.sum(tl.reshape(v16, (BT * N, MP // M, M)), axis=1)       # (BT·N, M)
        wr = _pad_cols(tl.reshape(tl.permute(tl.reshape(w, (BT, M, N)), (0, 2, 1)),
                                  (BT * N, M)), BT * N, M, MP, IDT)        # rows (t, l)
        vr = _pad_cols(tl.reshape(tl.permute(tl.reshape(vt, (BT, N, M)), (0, 2, 1)),
                                  (BT * M, N)), BT * M, N, NP, IDT)        # rows (t, i)
        da1 = tl.dot(tl.trans(r1), wr, da1, out_dtype=tl.float32)
        db1 = tl.dot(tl.trans(g1), vr, db1, out_dtype=tl.float32)
        if K2 > 0:
            da2 = tl.dot(tl.trans(r2), wr, da2, out_dtype=tl.float32)
        if J2 > 0:
            db2 = tl.dot(tl.trans(g2), vr, db2, out_dtype=tl.float32)
    base = DAB + pid * nAB
    # dA'[i, k] at offA + i·K + k; dB'[j, l] at offB + j·n + l
    _tc_store(base, offA, da1, M, K1, MP, 0, K, m, K, 1, scale)
    _tc_store(base, offB, db1, N, J1, NP, 0, J, n, 1, n, scale)
    if K2 > 0:
        _tc_store(base, offA, da2, M, K2, MP, K1, K, m, K, 1, scale)
    if J2 > 0:
        _tc_store(base, offB, db2, N, J2, NP, J1, J, n, 1, n, scale)


@host_config
def narrow_grad_plan(a_out: int, a_in: int, b_out: int, b_in: int):
    """The narrow factor-gradient kernel's orientation for these factors, or None where the
    standard kernel runs: two small factor sides (the CUDA extension's narrow plan,
    :func:`kfused.ops._krona_common.cuda_narrow_plan`) and some padded factor dim below 16
    (the standard kernel then runs broadcast products per token; with every dim >= 16 its
    steps are tensor-core dots)."""
    from kfused.ops._krona_common import cuda_narrow_plan

    if min(next_pow2(v) for v in (a_out, a_in, b_out, b_in)) >= 16:
        return None
    return cuda_narrow_plan(a_out, a_in, b_out, b_in)


# elements of one (BT × M × max(BK, BJ)) broadcast product of the narrow kernel on a GPU (8
# warps: 16 per thread; the next block's x and dy tiles are held too); the interpreter 16x
_NARROW_GPU_TILE = 4096
# Launch candidates of the narrow kernel timed by benchmarks/tune_kernels.py on a GPU (tile
# elements per broadcast product, warps), the rule's first. Its roofline time (memory-bound)
# does not count its 12 block-wide reductions a step, each across the warps that hold the
# big side: fewer warps or more tokens per step trade them against registers and residency.
# (4096, 4) left the list: it spills 128 B per thread on sm_90 at the paper's 2x384/384x2
# pair (255 registers; seen once the perf tool read spills from the stack frame); (8192, 8)
# too: 255 registers and a 72 B spill there under Triton 3.6, the GPU machine's (none under
# Triton 3.9, at 255 registers: no room either way)
NARROW_CANDIDATES = tuple({"NARROW": 1, "TILE": t, "num_warps": w}
                          for t, w in ((_NARROW_GPU_TILE, 8), (2048, 4), (1024, 2)))


# Launch candidates of the tensor-core narrow kernel (factor gradients alone, 16-bit: tile
# elements a step as _NARROW_TC_TILE, warps, stages), the rule's first. sm_90, the paper's
# A 2×384 / 8×384 with B 384×2 and the swapped 384×2 / 2×384, Triton 3.6 and 3.9, 8 or 16
# tokens a step: 8 warps 125-132 registers at 2 or 3 stages, 4 warps 211-236, no spill; 1
# stage (no asynchronous copies) spilled 8-48 B at 255 registers
NARROW_TC_CANDIDATES = tuple({"NARROW": 2, "TILE": t, "num_warps": w, "num_stages": st}
                             for t, w, st in ((32768, 8, 2), (16384, 8, 2), (32768, 8, 3),
                                              (32768, 4, 2)))
# tile elements (dy's BT·M × (J1 + J2) plus x's BT·N × (K1 + K2)) of one tensor-core step at
# most: the rule's. At the paper's factors (sm_90, Triton 3.6) 16 tokens a step at A 2×384
# (its loop 44 warp-instructions a token per warp, 127 registers; 8 tokens, the 16384
# candidate: 83, the same registers), 8 at A 8×384 (92). Twice the tokens (65536) left A
# 8×384 at 169 registers, one CTA an SM, and A 2×384 at 255, spilling 120 B under Triton 3.9
_NARROW_TC_TILE = 32768


@host_config
def narrow_tc_tiles(plan, tile: int = _NARROW_TC_TILE, small_max: int = 8):
    """(M, N, MP, NP, BT, K1, K2, J1, J2) of :func:`_kron_narrow_tc_kernel` for a plan
    ``(tier, swapped, m, n, K, J)`` (:func:`narrow_grad_plan`'s), or None where it does not
    apply: both small sides (m, n, padded to M, N) at most ``small_max`` (8: the narrow plans'
    tiers), both big sides at most 512 (its (K × MP) and (J × NP) float32 sums stay in
    registers, MP, NP = max(16, M), max(16, N); each big side in two power-of-two parts:
    :func:`_tc_parts`). BT, the tokens a step: at least the fewest for which the dy rows (t, i)
    and the x rows (t, l) are both 16 (an mma's M), then doubled while the step's tiles stay
    within ``tile`` elements, at most 32."""
    _, _, m, n, K, J = plan
    M, N = max(2, next_pow2(m)), max(2, next_pow2(n))
    if M > small_max or N > small_max or K > 512 or J > 512:
        return None
    K1, K2 = _tc_parts(K)
    J1, J2 = _tc_parts(J)
    per_token = M * (J1 + J2) + N * (K1 + K2)
    BT = max(1, 16 // M, 16 // N)
    while BT < 32 and 2 * BT * per_token <= tile:
        BT *= 2
    if BT * per_token > tile:
        return None
    return M, N, max(16, M), max(16, N), BT, K1, K2, J1, J2


def _tc_parts(n: int) -> Tuple[int, int]:
    """A big side of the tensor-core narrow kernel as two power-of-two parts, each at least
    16 (the second 0 where one covers it): 384 -> (256, 128), 300 -> (256, 64), 40 -> (32, 16),
    512 -> (512, 0)."""
    p1 = max(16, next_pow2(n))
    if p1 > 16 and p1 != n:
        p1 //= 2
        return p1, max(16, next_pow2(n - p1))
    return p1, 0


def narrow_candidates(plan, elem_bytes: int, dx: bool = False) -> list:
    """The narrow launches benchmarks/tune_kernels.py times for ``plan`` (factor gradients
    alone unless ``dx``): the tensor-core kernel's first where it applies (16-bit, no dx),
    then the CUDA-core kernel's."""
    tc = elem_bytes == 2 and not dx and narrow_tc_tiles(plan) is not None
    return list(NARROW_TC_CANDIDATES if tc else ()) + list(NARROW_CANDIDATES)


def narrow_tuning_key(m: int, n: int, K: int, J: int, elem_bytes: int) -> dict:
    """The shape key of _kron_narrow_grad_kernel's entries in a tuning table (its
    orientation's small sides m, n and big sides K, J; ``tc``: the tensor-core kernel was
    among the candidates — entries timed before it existed key without it and are not
    used where it applies)."""
    tc = elem_bytes == 2 and narrow_tc_tiles((None, False, m, n, K, J)) is not None
    return {"m": m, "n": n, "K": K, "J": J, "elem_bytes": elem_bytes, **({"tc": 1} if tc else {})}


def narrow_config(T: int, plan, device: torch.device, elem_bytes: int,
                  dx: bool = False) -> dict:
    """The narrow kernel's launch: the rule's (the first of :func:`narrow_candidates`; the
    CUDA-core kernel's tile 16x in the interpreter), or on a CUDA device the candidate this GPU
    model timed fastest for the shape (16-bit, factor gradients alone, T >= _TUNE_MIN_T;
    :mod:`kfused.tuning`)."""
    cands = narrow_candidates(plan, elem_bytes, dx)
    cfg = dict(cands[0])
    if cfg["NARROW"] == 1 and not targets_gpu(device):
        cfg["TILE"] = 16 * _NARROW_GPU_TILE
    if elem_bytes == 2 and not dx and T >= _TUNE_MIN_T and device.type == "cuda":
        _, _, m, n, K, J = plan
        tuned = tuning.lookup("_kron_narrow_grad_kernel", device,
                              narrow_tuning_key(m, n, K, J, elem_bytes), T, cands)
        if tuned is not None:
            cfg = dict(tuned)
    return cfg


def _narrow_strides(plan, A, B):
    """(factor A', factor B', xk, xl, gi, gj, offA, offB) of the narrow kernels for ``plan``:
    the swapped orientation reads the transposed tokens by strides (no copies)."""
    a_out, a_in = A.shape
    b_out, b_in = B.shape
    if plan[1]:   # A' = B, B' = A, X' = Xᵀ, G' = Gᵀ: dA' is dB (after dA), dB' is dA
        return B, A, 1, b_in, 1, b_out, a_out * a_in, 0
    return A, B, b_in, 1, b_out, 1, 0, a_out * a_in


def _factor_grads_narrow_tc(g, x, A, B, scale, plan, cfg):
    """dA, dB by :func:`_kron_narrow_tc_kernel` (16-bit; ``cfg``: a NARROW = 2 candidate)."""
    T = x.shape[0]
    _, _, m, n, K, J = plan
    tiles = narrow_tc_tiles(plan, cfg.get("TILE", _NARROW_TC_TILE), cfg.get("SMALL_MAX", 8))
    M, N, MP, NP, BT, K1, K2, J1, J2 = tiles
    BT = cfg.get("BT", BT)          # a standard-step candidate's tokens a step (capped by T)
    tiles = (M, N, MP, NP, BT, K1, K2, J1, J2)
    n_blocks = cdiv(T, BT)
    warps, stages = cfg["num_warps"], cfg["num_stages"]
    key = ("narrow-tc", x.device, x.dtype, tiles, warps, stages)
    if key in _GRAD_NO_LAUNCH:
        return _factor_grads_torch(g, x, A, B, scale, False, True)[1:]
    n_prog = _grid_for(key, x.device, n_blocks)
    fa, fb, xk, xl, gi, gj, offA, offB = _narrow_strides(plan, A, B)
    dab = _factor_partials(n_prog, A, B, x.dtype)
    try:
        compiled = _kron_narrow_tc_kernel[(n_prog,)](
            x, g, fa, fb, dab, T, m, n, K, J, x.stride(0), g.stride(0), xk, xl, gi, gj,
            fa.stride(0), fa.stride(1), fb.stride(0), fb.stride(1), offA, offB,
            A.numel() + B.numel(), float(scale), n_blocks,
            M=M, N=N, BT=BT, K1=K1, K2=K2, J1=J1, J2=J2, IDT=inter_dtype(x.dtype),
            X_FLAT=xl == 1 and xk == n == N, G_FLAT=gi == 1 and gj == m == M,
            K_FULL=K1 + K2 == K, J_FULL=J1 + J2 == J, MP=MP, NP=NP,
            num_warps=warps,
            num_stages=stages)
        _note_residency(key, x.device, compiled)
    except OutOfResources:   # as the other factor kernels: remembered, torch computes the same
        _GRAD_NO_LAUNCH.add(key)
        return _factor_grads_torch(g, x, A, B, scale, False, True)[1:]
    return _sum_factor_partials(dab, A, B)


def _factor_grads_narrow(g, x, A, B, scale, compute_dx, compute_dab, plan, config=None):
    """kron_factor_grads by :func:`_kron_narrow_grad_kernel` or, for the factor gradients
    alone of 16-bit inputs, :func:`_kron_narrow_tc_kernel` (``plan``: narrow_grad_plan;
    ``config``: one of :func:`narrow_candidates`, else :func:`narrow_config`)."""
    T = x.shape[0]
    a_in, b_in = A.shape[1], B.shape[1]
    _, _, m, n, K, J = plan
    M, N = max(2, next_pow2(m)), max(2, next_pow2(n))
    BK, BJ = max(2, next_pow2(K)), max(2, next_pow2(J))
    cfg = config or narrow_config(T, plan, x.device, x.element_size(), dx=compute_dx)
    if cfg["NARROW"] == 2:
        if compute_dx or not compute_dab or narrow_tc_tiles(plan) is None or \
                x.element_size() != 2:
            raise ValueError(f"narrow tensor-core config {cfg} computes the factor gradients "
                             f"of 16-bit inputs alone, for factors it fits")
        return (None, *_factor_grads_narrow_tc(g, x, A, B, scale, plan, cfg))
    tile, warps = cfg["TILE"], cfg["num_warps"]
    BT = max(1, min(32, tile // (M * max(BK, BJ))))
    BT = 1 << (BT.bit_length() - 1)
    n_blocks = cdiv(T, BT)
    key = ("narrow", x.device, x.dtype, compute_dx, compute_dab, M, N, BT, BK, BJ, warps)
    if key in _GRAD_NO_LAUNCH:
        return _factor_grads_torch(g, x, A, B, scale, compute_dx, compute_dab)
    n_prog = _grid_for(key, x.device, n_blocks)
    dx = _alloc.empty(T, a_in * b_in, dtype=x.dtype, device=x.device) if compute_dx else None
    fa, fb, xk, xl, gi, gj, offA, offB = _narrow_strides(plan, A, B)
    dab = _factor_partials(n_prog, A, B, x.dtype) if compute_dab else x
    num = _grad_numerics(x.dtype)
    try:
        compiled = _kron_narrow_grad_kernel[(n_prog,)](
            x, g, fa, fb, dx if dx is not None else x, dab,
            T, m, n, K, J,
            x.stride(0), g.stride(0), dx.stride(0) if dx is not None else 0, xk, xl, gi, gj,
            fa.stride(0), fa.stride(1), fb.stride(0), fb.stride(1), offA, offB,
            A.numel() + B.numel(), float(scale), n_blocks,
            COMPUTE_DX=compute_dx, COMPUTE_DAB=compute_dab, M=M, N=N, BT=BT, BK=BK, BJ=BJ,
            ACC=num["ACC"], RACC=num["RACC"], num_warps=warps)
        _note_residency(key, x.device, compiled)
    except OutOfResources:   # as the standard kernel: remembered, torch computes the same
        _GRAD_NO_LAUNCH.add(key)
        return _factor_grads_torch(g, x, A, B, scale, compute_dx, compute_dab)
    if not compute_dab:
        return dx, None, None
    return (dx, *_sum_factor_partials(dab, A, B))


# Per-token tile (elements) of _kron_grad_kernel's W1 = G[t] B (a_out × b_in, padded) above
# which the swapped orientation is taken when its tile (b_out × a_in) is smaller: on sm_90 a
# 512 × 512 tile (A 384×2, B 2×384) needs 256 KB of shared memory and cannot launch, a
# 128 × 128 one (A 128×2, B 2×128: the interpreter's stand-in of that pair) 128 KB at one
# token per step and 255 registers; swapped, both are 2 × 2 tiles at 4-16 tokens per step
# (sm_90 compile, kfused perf's representative launches)
_GRAD_TILE_LIMIT = 64 * 64
_GRAD_NO_LAUNCH: set = set()     # configurations the GPU refused (OutOfResources)
# CTAs per SM of _kron_grad_kernel's compiled configurations (key as _GRAD_NO_LAUNCH's): the
# persistent grid's programs per SM. The H100 of 2026-11-27 ran its steps at a near-constant
# 2.3-2.8 µs each whatever the tile (T = 4096-65536; 24×24 / 32×32 and 48×24 / 64×32 factor
# pairs: 43.0 µs for 15.5 steps a program, 145.2 for 62, 82.9 for 2 × 15.5 at 2 CTAs per SM),
# a latency chain per step, so its time is the steps each SM runs one after another: blocks
# per SM over the programs resident on it. At 32×32 factors (90 registers, 36 KB shared) an
# SM holds 5 CTAs, and 4 programs per SM left one slot empty: PREDICTED from those step times
# 43 → ~35 µs at T = 16384, 768².
_GRAD_RESIDENT: dict = {}
# at most this many programs per SM: each writes a row of float32 partials that the sum reads
# (small-factor configurations could reside 16 to an SM: 2112 rows on an H100)
_GRAD_MAX_PER_SM = 8


def _grid_for(key, device: torch.device, n_blocks: int) -> int:
    """Programs of a persistent factor-gradient grid: as many as the GPU holds at once (the
    CTAs per SM the compiled kernel allows, recorded by :func:`_note_residency` after its
    first launch; 4 until then), at most one per block."""
    return grid_programs(device, n_blocks, per_sm=_GRAD_RESIDENT.get(key, 4))


def _note_residency(key, device: torch.device, compiled) -> None:
    if key not in _GRAD_RESIDENT and device.type == "cuda":
        _GRAD_RESIDENT[key] = min(_GRAD_MAX_PER_SM, resident_ctas(device, compiled) or 4)


@host_config
def _swap_factors(a_out: int, a_in: int, b_out: int, b_in: int) -> bool:
    """Whether kron_factor_grads runs the kernel on the swapped factors (B, A)."""
    tile = max(2, next_pow2(a_out)) * max(2, next_pow2(b_in))
    swapped = max(2, next_pow2(b_out)) * max(2, next_pow2(a_in))
    return tile > _GRAD_TILE_LIMIT and swapped < tile


def _row_vectors(x: torch.Tensor, b_out: int, b_in: int) -> dict:
    """VG, VX of the factor-gradient kernels: the elements of a 16-byte vector where b_out
    (G's factor rows) or b_in (X's) is a multiple of it, else 1 (see :func:`_g_rows`)."""
    v = max(1, 16 // x.element_size())
    return dict(VG=v if b_out % v == 0 else 1, VX=v if b_in % v == 0 else 1)


def _factor_grads_bd(g, x, A, B, scale, cfg):
    """dA, dB by :func:`_kron_grad_bd_kernel` (its persistent grid as _kron_grad_kernel's)."""
    T = x.shape[0]
    a_out, a_in = A.shape
    b_out, b_in = B.shape
    n_blocks = cdiv(T, cfg["BT"])
    key = ("bd", x.device, x.dtype, tuple(sorted(cfg.items())))
    n_prog = _grid_for(key, x.device, n_blocks)
    dab = _factor_partials(n_prog, A, B, x.dtype)
    launch = {k: cfg[k] for k in ("BT", "AOP", "AIP", "BOP", "BIP", "num_warps")}
    if "num_stages" in cfg:
        launch["num_stages"] = cfg["num_stages"]
    compiled = _kron_grad_bd_kernel[(n_prog,)](
        x, g, A, B, dab, T, a_out, a_in, b_out, b_in, x.stride(0), g.stride(0),
        A.stride(0), A.stride(1), B.stride(0), B.stride(1), float(scale), n_blocks,
        IDT=inter_dtype(x.dtype), **_row_vectors(x, b_out, b_in), **launch)
    _note_residency(key, x.device, compiled)
    return _sum_factor_partials(dab, A, B)


def _factor_grads_torch(g, x, A, B, scale, compute_dx, compute_dab):
    """kron_factor_grads in torch (float32 accumulation; float64 for float32 inputs, as the
    kernel's token sums), each product in the order with the smaller per-token intermediate:
    the fallback for factor shapes the kernel cannot launch with. Explicit products, not
    autograd of the reference: the custom op's body runs below torch's autograd key, and the
    reference's A X first order would form an a_out × b_in matrix per token."""
    T = x.shape[0]
    a_out, a_in = A.shape
    b_out, b_in = B.shape
    acc = torch.float64 if x.dtype in (torch.float32, torch.float64) else torch.float32
    G = g.reshape(T, a_out, b_out).to(acc)
    X = x.reshape(T, a_in, b_in).to(acc)
    Af, Bf = A.to(acc), B.to(acc)
    dx = dA = dB = None
    if compute_dx:   # dX[t] = Aᵀ G[t] B
        if a_out * b_in <= a_in * b_out:
            d = torch.matmul(Af.t(), torch.matmul(G, Bf))
        else:
            d = torch.matmul(torch.matmul(Af.t(), G), Bf)
        dx = (scale * d).reshape(T, a_in * b_in).to(x.dtype)
    if compute_dab:  # dA = Σ G[t] B X[t]ᵀ, dB = Σ G[t]ᵀ A X[t]
        if a_out * b_in <= b_out * a_in:
            dA = torch.einsum("til,tkl->ik", torch.matmul(G, Bf), X)
        else:
            dA = torch.einsum("tij,tjk->ik", G, torch.matmul(Bf, X.transpose(1, 2)))
        if a_out * b_in <= b_out * a_in:
            dB = torch.einsum("tij,til->jl", G, torch.matmul(Af, X))
        else:
            dB = torch.einsum("tjk,tkl->jl", torch.matmul(G.transpose(1, 2), Af), X)
        dA, dB = (scale * dA).to(A.dtype), (scale * dB).to(B.dtype)
    return dx, dA, dB


@host_config
def _grad_numerics(dtype: torch.dtype) -> dict:
    """Dot precision, accumulators and the 16-bit hi/lo split of the factor-gradient steps."""
    return dict(PREC=dot_precision(dtype), ACC=acc_dtype(dtype), IDT=inter_dtype(dtype),
                SPLIT=dtype in (torch.float16, torch.bfloat16),
                RACC=tl.float64 if dtype in (torch.float32, torch.float64) else tl.float32)


def _factor_partials(n_prog: int, A: torch.Tensor, B: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """Per-program partial sums of dA and dB, one row each: (n_prog, a_out·a_in + b_out·b_in),
    float32 (float64 for float32/float64 inputs: the token sum adds no error)."""
    racc = torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32
    return _alloc.empty(n_prog, A.numel() + B.numel(), dtype=racc, device=A.device)


@triton.jit
def _sum_partials_kernel(DAB, n_rows, n_cols, n_a, DA, DB, BR: tl.constexpr, BC: tl.constexpr):
    """dA, dB from the (n_rows, n_cols) per-program partials DAB (dA's n_a columns, then
    dB's): BC columns per program, summed over the rows in BR-row blocks in a fixed order
    (deterministic) in DAB's dtype, each total rounded once to the factor's dtype."""
    cols = tl.program_id(0) * BC + tl.arange(0, BC)
    c_ok = cols < n_cols
    acc = _row_block_sum(tl.zeros((BC,), dtype=DAB.dtype.element_ty), DAB, n_rows, n_cols,
                         cols, c_ok, BR)
    in_a = cols < n_a
    tl.store(DA + tl.where(in_a, cols, 0), acc.to(DA.dtype.element_ty), mask=c_ok & in_a)
    tl.store(DB + tl.where(in_a, 0, cols - n_a), acc.to(DB.dtype.element_ty),
             mask=c_ok & ~in_a)


def _sum_factor_partials(dab: torch.Tensor, A: torch.Tensor, B: torch.Tensor):
    """dA, dB from the per-program partials: one launch of :func:`_sum_partials_kernel`
    (fixed order: deterministic), in place of a torch column sum and two casts (three
    launches; on the H100 the sum took 11.5 µs for 528 × 1600 float32 partials and the
    casts 2.5 µs, T = 16384, 768², 24×24 / 32×32)."""
    dA = _alloc.empty(A.shape, dtype=A.dtype, device=A.device)
    dB = _alloc.empty(B.shape, dtype=B.dtype, device=B.device)
    n_rows, n_cols = dab.shape
    BR, BC = _sum_partials_tiles(n_rows, targets_gpu(dab.device))
    _sum_partials_kernel[(cdiv(n_cols, BC),)](dab, n_rows, n_cols, A.numel(), dA, dB,
                                             BR=BR, BC=BC, num_warps=8)
    return dA, dB


def _sum_partials_tiles(n_rows: int, gpu: bool) -> Tuple[int, int]:
    """(BR, BC) of :func:`_sum_partials_kernel`. On a GPU 16 columns (64 B of float32 per row,
    two sectors) per program and up to 256 rows per load: the grad kernels' 132–660 partial
    rows in 1–3 dependent loads per program and 100–200 programs (T = 16384, 768², 24×24 /
    32×32: 528 × 1600 partials; was 64 columns × 64 rows: 25 programs, each a chain of 9
    row-block loads holding 0.8 MB in flight on 25 SMs), launched with 8 warps: with 4,
    Triton 3.6 (the GPU machine's) compiled the 256 × 16 tile to 72 registers and a 16 B
    spill for sm_90, 8 warps to 54 and none (Triton 3.9: no spill either way). In the
    interpreter 8 × 32, so the small test shapes cross several row and column blocks."""
    if not gpu:
        return 8, 32
    return _blk(n_rows, 16, 256), 16


@host_config
def _dx_grad_config(T: int, d_in: int, a_out: int, a_in: int, b_out: int, b_in: int,
                    device: torch.device, elem_bytes: int) -> dict:
    """Tiles of _kron_dx_grad_kernel: the GEMM tile, and the factor steps of _grad_config at
    the same warp count."""
    gpu = targets_gpu(device)
    cfg = _grad_rule(T, a_out, a_in, b_out, b_in, device, elem_bytes)
    cfg.pop("DOT_DX")
    if gpu:
        gemm = dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3)
    else:
        gemm = dict(BM=32, BN=32, BK=32, num_warps=4, num_stages=1)
    cfg.update(gemm)
    return cfg


# Folded backward, one pass or two (PREDICTED by the roofline constants of kfused.perf: FMA32
# 53.6 TFLOP/s, HBM 3.0 TB/s): the one-pass kernel adds its CUDA-core factor products to the
# GEMM's time, the separate pass reads x and dy again (2·(d_in + d_out) bytes per token at
# 16 bits) and hides its products under those bytes; one pass wins while the CUDA-core FLOPs
# per token stay below ~17.9 per byte the separate pass would read.
_ONE_PASS_CUDA_FLOPS_PER_BYTE = 17.9


def _cuda_core_flops_per_token(cfg: dict) -> float:
    """FLOPs per token of the factor products in ``cfg`` (a :func:`_grad_config`) that are not
    tensor-core dots (a padded dim < 16: CUDA-core broadcast products)."""
    bt, AOP, AIP, BOP, BIP = (cfg[k] for k in ("BT", "AOP", "AIP", "BOP", "BIP"))
    mnk = dict(DOT_W1=bt * AOP * BOP * BIP, DOT_DA=AOP * bt * BIP * AIP,
               DOT_V=bt * BIP * AIP * AOP, DOT_DB=BOP * bt * AOP * BIP)
    return sum(2.0 * v / bt for k, v in mnk.items() if not cfg[k])


# The folded backward's form, chosen by measurement. H100 (benchmarks/results/h100/
# proof-2026-11-27, bf16, kernel times from torch.profiler, summed per fwd+bwd): the two
# passes — dx = dy W' on cuBLAS, then _kron_grad_kernel for dA, dB — composed from that
# run's kernel times, take 0.60–0.87× the device time of the one-pass
# _kron_dx_grad_kernel at all 13 shapes, e.g. T = 16384, 768², A 24×24 / B 32×32: one pass
# 115.9 µs + 20.5 µs partial sums, two passes 30.6 + 43.0 + 11.5 µs (136 → 85); the paper's
# 2×384 / 384×2: 177 → 111 µs; 768→3072, 48×24 / 64×32: 325 → 217 µs; T = 65536, 768²:
# 465 → 282 µs (the table: the run's README). The model had predicted the opposite (kfused perf:
# _kron_dx_grad_kernel measured 2.3–4.6× its prediction; its factor steps take 2 tokens per
# step, a serial chain of small dots in every program). The one-pass kernel stays, correct and
# tested, for ``KFUSED_KRONA_FOLDED_BWD=one-pass`` (a GPU session re-measures both:
# ``bash benchmarks/gpu_suite.sh bench:krona,onepass``).
FOLDED_BWD_ENV = "KFUSED_KRONA_FOLDED_BWD"
FOLDED_BWD_MODES = ("two-pass", "one-pass")
FOLDED_BWD_DEFAULT = "two-pass"


def folded_backward_mode() -> str:
    """The folded backward's form: ``KFUSED_KRONA_FOLDED_BWD`` ("two-pass" or "one-pass"),
    else the measured default (``FOLDED_BWD_DEFAULT``); another value is an error naming
    the variable."""
    mode = os.environ.get(FOLDED_BWD_ENV, "").strip() or FOLDED_BWD_DEFAULT
    if mode not in FOLDED_BWD_MODES:
        raise ValueError(f"{FOLDED_BWD_ENV}={mode!r}: expected one of "
                         f"{', '.join(FOLDED_BWD_MODES)}")
    return mode


def fused_dx_grad_applies(a_out: int, a_in: int, b_out: int, b_in: int, T: int = 16384,
                          elem_bytes: int = 2) -> bool:
    """Whether the folded backward takes :func:`krona_dx_and_factor_grads` (one pass) rather
    than the frozen GEMM plus the separate factor-gradient pass (:func:`kron_factor_grads`):
    only in the "one-pass" mode (:func:`folded_backward_mode`; two passes measured faster on
    the H100) and where :func:`one_pass_fits`."""
    return (folded_backward_mode() == "one-pass"
            and one_pass_fits(a_out, a_in, b_out, b_in, T, elem_bytes))


@host_config
def one_pass_fits(a_out: int, a_in: int, b_out: int, b_in: int, T: int = 16384,
                  elem_bytes: int = 2) -> bool:
    """Where the one-pass kernel is an option at all, by the roofline model: when the
    factor products run unswapped (:func:`_swap_factors`: the one-pass kernel has no
    swapped form) and their CUDA-core part (padded dims < 16) costs less than the separate
    pass's second read of x and dy (``_ONE_PASS_CUDA_FLOPS_PER_BYTE``): every 24/32-wide
    pair (tensor-core dots only) and the paper's 2×384 / 384×2 and 8×384 / 384×2 (16 and 66
    CUDA-core kFLOP per token against 55 and 137 allowed); not A 2×2, B 384×384 (a 2-row G·B
    per token on the CUDA cores). PREDICTED (kfused perf, bf16, T = 16384, with the float32
    broadcast products of ``_mm``): paper 768² 87.0 µs in two passes → 73.9 µs in one;
    768→3072 A 8×384 265.4 → 243.5 µs — the H100 measured the opposite (see
    ``FOLDED_BWD_DEFAULT``). Decided with the GPU's tile configuration wherever it runs, so
    the CPU interpreter takes the path a GPU takes."""
    if _swap_factors(a_out, a_in, b_out, b_in):
        return False
    cfg = _grad_rule(T, a_out, a_in, b_out, b_in, torch.device("cuda"), elem_bytes)
    read = elem_bytes * (a_in * b_in + a_out * b_out)
    return _cuda_core_flops_per_token(cfg) <= _ONE_PASS_CUDA_FLOPS_PER_BYTE * read


_DX_GRAD_NO_LAUNCH: set = set()  # one-pass configurations the GPU refused (OutOfResources)


def krona_dx_and_factor_grads(g: torch.Tensor, x: torch.Tensor, w_fold: torch.Tensor,
                              A: torch.Tensor, B: torch.Tensor, scale: float = 1.0
                              ) -> Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The folded path's backward in one launch (:func:`_kron_dx_grad_kernel`): dx = g W'
    with W' = :func:`fold_weight` (W, A, B, scale) given as ``w_fold`` (d_out, d_in), and
    dA, dB of ``scale · (A ⊗ B) x``. g (T, d_out), x (T, d_in) with unit inner stride,
    16-bit. Returns (dx, dA, dB), or None when the GPU cannot load the kernel at these factor
    shapes (OutOfResources, raised before it runs; remembered): the caller then takes the two
    passes."""
    T = x.shape[0]
    a_out, a_in = A.shape
    b_out, b_in = B.shape
    d_in = a_in * b_in
    dx = _alloc.empty(T, d_in, dtype=x.dtype, device=x.device)
    if T == 0:
        return dx, torch.zeros_like(A), torch.zeros_like(B)
    cfg = _dx_grad_config(T, d_in, a_out, a_in, b_out, b_in, x.device, x.element_size())
    key = (x.device, x.dtype, tuple(sorted(cfg.items())))
    if key in _DX_GRAD_NO_LAUNCH:
        return None
    n_m, n_n = cdiv(T, cfg["BM"]), cdiv(d_in, cfg["BN"])
    # the row block's tokens shared out among its column programs, in whole factor steps
    tok = cdiv(cdiv(cfg["BM"], n_n), cfg["BT"]) * cfg["BT"]
    dab = _factor_partials(n_m * n_n, A, B, x.dtype)
    try:
        _kron_dx_grad_kernel[(n_m * n_n,)](
            g, w_fold, x, dx, A, B, dab,
            T, a_out, a_in, b_out, b_in,
            g.stride(0), w_fold.stride(0), w_fold.stride(1), x.stride(0), dx.stride(0),
            A.stride(0), A.stride(1), B.stride(0), B.stride(1), float(scale), tok,
            GROUP_M=8, **_grad_numerics(x.dtype), **cfg)
    except OutOfResources:
        _DX_GRAD_NO_LAUNCH.add(key)
        return None
    return (dx, *_sum_factor_partials(dab, A, B))


def krona_linear_backward(g: torch.Tensor, x: torch.Tensor, weight: Optional[torch.Tensor],
                          A: torch.Tensor, B: torch.Tensor, scale: float = 1.0, *,
                          need_dx: bool = True, need_dab: bool = True
                          ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor],
                                     Optional[torch.Tensor]]:
    """Gradients of ``x Wᵀ + b + scale · (A ⊗ B) x`` for x, A and B given ``g``: dx = g (W +
    scale · A⊗B) in one pass over g (the forward kernel run on Wᵀ, Aᵀ, Bᵀ), dA and dB in one
    pass over (x, g). Returns (dx or None, dA or None, dB or None) as need_dx / need_dab ask."""
    dx = dA = dB = None
    if need_dx:
        wt = weight.t() if weight is not None else None
        dx = krona_linear_forward(g, wt, None, A.t(), B.t(), scale)
    if need_dab:
        _, dA, dB = kron_factor_grads(g, x, A, B, scale, compute_dx=False, compute_dab=True)
    return dx, dA, dB
