"""Flash-style Triton kernels for inducer attention and prefix tuning (SPEC §3).

Forward (one pass over K/V tiles per query block, never materialising the n_q × n_k scores):
for each query tile, an online softmax over the l prefix columns (never masked), then over the
sequence key tiles (causal / key-padding masked; tiles wholly below the causal diagonal skip
the compare) gives f (ordinary attention over the real columns), LSE over the real columns
and, when the virtual key's logit s0 is given, λ = sigmoid(s0 − LSE) and 1 − λ in the epilogue.

The virtual column is one more term of the softmax; it joins in the epilogue instead of
seeding the running max/sum, because ``f`` is normalised over the real columns only: seeding
would force ``f = acc / (l − exp(s0 − m))``, a cancellation that loses every digit when λ → 1.
``sigmoid(s0 − LSE)`` is the same number without cancellation, and with no real column at all
(a fully masked row) it gives λ = 1, f = 0 and the finite LSE sentinel ``_EMPTY_LSE``.

Backward (SPEC §3): the ordinary flash backward with ``D_i`` replaced by ``D_i − dLSE_i``,
``dLSE_i = −dλ_i λ_i (1 − λ_i)`` (+ any direct LSE gradient), evaluated as
``dS_ij = P_ij ((dP_ij − D_i) + dLSE_i)``: dLSE is usually far smaller than D, and folding it
into D first would round it away (a row with one visible column has dP − D = 0 exactly and
dS = P·dLSE). ``P = exp(s − m) / l`` is recomputed from q, k and the saved row max and row
sum. The dQ kernel walks key tiles per query tile (in float32 it first forms
``D_i = Σ_j P_ij dP_ij`` from the same dP values, see ``EXACT_DELTA``); the dK/dV kernel walks
query tiles per key tile, over every query head of its kv head (grouped-query attention). The prefix tiles' dK/dV are written per batch element
(B·H·l·p floats) and summed on the host. Extra memory is O(n) per head (LSE, λ, stats, D).

Host functions: :func:`inducer_attention_forward`, :func:`inducer_attention_backward`.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from kfused import _alloc
from kfused.triton_kernels import _aot
from kfused.backends import triton_interpret
from kfused.triton_kernels._common import dot_precision, next_pow2

# LSE of a row with no visible real column (log 0): finite so that nothing downstream is NaN;
# exp(s − LSE) is never evaluated on such a row because every column is masked.
_EMPTY_LSE = tl.constexpr(-1.0e30)  # constexpr: compiled kernels may read only constexpr globals

SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 128)


@triton.jit
def _visible(offs_m, offs_n, n_ok, kmask_base, causal_off, MASKED: tl.constexpr,
             CAUSAL: tl.constexpr, HAS_KMASK: tl.constexpr):
    """(BLOCK_M, BLOCK_N) mask of the real keys each query row sees in this tile."""
    valid = n_ok[None, :] & (offs_m[:, None] >= 0)
    if MASKED:
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None] + causal_off)
        if HAS_KMASK:
            km = tl.load(kmask_base + offs_n, mask=n_ok, other=0)
            valid = valid & (km != 0)[None, :]
    return valid


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
               lo, hi, n_valid, offs_m, offs_d, kmask_base, causal_off, scale,
               HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
               CAUSAL: tl.constexpr, HAS_KMASK: tl.constexpr, PREC: tl.constexpr):
    d_ok = offs_d < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_valid
        kT = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                     mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        s = tl.dot(q, kT, input_precision=PREC, out_dtype=tl.float32) * scale
        valid = _visible(offs_m, offs_n, n_ok, kmask_base, causal_off, MASKED, CAUSAL,
                         HAS_KMASK)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible column yet keeps m = -inf; shift by 0 there so that
        # exp(-inf - -inf) never happens.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                     mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PREC,
                                            out_dtype=tl.float32)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _inducer_attn_fwd_kernel(
    Q, K, V, PK, PV, KMASK, S0, O, LSE, LAM, STATS, N_ROWS,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_pkh, stride_pkn, stride_pkd,
    stride_pvh, stride_pvn, stride_pvd,
    stride_mb,
    stride_ob, stride_oh, stride_on, stride_od,
    H, GROUP, N_Q, N_K, N_PREFIX, causal_off, scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KMASK: tl.constexpr, HAS_PREFIX: tl.constexpr,
    HAS_S0: tl.constexpr, PREC: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP                       # grouped-query attention: GROUP query heads per kv head
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    m_ok = offs_m < N_Q
    d_ok = offs_d < HEAD_DIM

    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn
                + offs_d[None, :] * stride_qd, mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

    kmask_base = KMASK + b * stride_mb
    if HAS_PREFIX:
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, PK + h * stride_pkh, PV + h * stride_pvh,
            stride_pkn, stride_pkd, stride_pvn, stride_pvd, 0, N_PREFIX, N_PREFIX,
            offs_m, offs_d, kmask_base, causal_off, scale,
            HEAD_DIM, BLOCK_N, False, False, False, PREC)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    if CAUSAL:
        # tiles wholly below the diagonal skip the causal compare; the rest apply it
        hi = tl.minimum(N_K, (pid_m + 1) * BLOCK_M + causal_off)
        full = tl.minimum(tl.maximum(pid_m * BLOCK_M + causal_off + 1, 0) // BLOCK_N * BLOCK_N,
                          tl.maximum(hi, 0))
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
            0, full, N_K, offs_m, offs_d, kmask_base, causal_off, scale,
            HEAD_DIM, BLOCK_N, True, False, HAS_KMASK, PREC)
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
            full, hi, N_K, offs_m, offs_d, kmask_base, causal_off, scale,
            HEAD_DIM, BLOCK_N, True, True, HAS_KMASK, PREC)
    else:
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
            0, N_K, N_K, offs_m, offs_d, kmask_base, causal_off, scale,
            HEAD_DIM, BLOCK_N, True, False, HAS_KMASK, PREC)

    # A row is empty only when its sum is exactly 0 (no visible column): a NaN sum (a NaN or
    # infinite visible key) is not empty and propagates into f, LSE, λ like the reference.
    has = l_i != 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), _EMPTY_LSE)
    tl.store(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_on
             + offs_d[None, :] * stride_od, out.to(O.dtype.element_ty),
             mask=m_ok[:, None] & d_ok[None, :])
    row = pid_bh.to(tl.int64) * N_Q + offs_m
    tl.store(LSE + row, lse, mask=m_ok)
    # The backward recomputes P = exp(s − m) / l from the row max and sum: exp(s − LSE)
    # would carry LSE's absolute rounding (eps·|LSE|) into every P in float32.
    tl.store(STATS + row, tl.where(m_i == float("-inf"), 0.0, m_i), mask=m_ok)
    tl.store(STATS + N_ROWS + row, tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0), mask=m_ok)
    if HAS_S0:
        s0 = tl.load(S0 + row, mask=m_ok, other=0.0).to(tl.float32)
        # λ and 1 − λ both as sigmoids: 1 − λ formed by subtraction loses its digits as λ → 1
        # |s0 − LSE| is clamped to 88 (exp stays finite in float32; σ(±88) is already 1 / ~0)
        x_raw = s0 - lse
        x = tl.minimum(tl.maximum(x_raw, -88.0), 88.0)
        is_nan = x_raw != x_raw              # the clamp would turn NaN into a number
        tl.store(LAM + row, tl.where(is_nan, x_raw, 1.0 / (1.0 + tl.exp(-x))), mask=m_ok)
        tl.store(LAM + N_ROWS + row, tl.where(is_nan, x_raw, 1.0 / (1.0 + tl.exp(x))),
                 mask=m_ok)


@triton.jit
def _inducer_attn_bwd_dkdv_kernel(
    Q, K, V, KMASK, DO, STATS, N_ROWS, DELTA, ADJ, DK, DV,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb,
    stride_dob, stride_doh, stride_don, stride_dod,
    H, H_KV, GROUP, N_Q, N_K, causal_off, scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_PREFIX: tl.constexpr, CAUSAL: tl.constexpr, HAS_KMASK: tl.constexpr,
    EXACT_DELTA: tl.constexpr, PREC: tl.constexpr,
):
    """One key tile against every query tile that sees it; dK, dV accumulate in registers.

    Works on transposed tiles (keys along rows) so that dK, dV need no transposes. K, V are
    the sequence keys, or (IS_PREFIX, batch stride 0) the prefix keys, which are never masked.
    DK/DV are contiguous (B, H, N_K, HEAD_DIM) (float32 per-batch partials for the prefix).
    """
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)                 # over batch × kv heads (H_KV)
    b = (pid_bh // H_KV).to(tl.int64)
    h = (pid_bh % H_KV).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N_K
    kv_mask = n_ok[:, None] & d_ok[None, :]
    kt = tl.load(K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kn
                 + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    vt = tl.load(V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vn
                 + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    if EXACT_DELTA:
        kT_r = tl.load(K + b * stride_kb + h * stride_kh + offs_n[None, :] * stride_kn
                       + offs_d[:, None] * stride_kd, mask=d_ok[:, None] & n_ok[None, :],
                       other=0.0)
    key_ok = n_ok
    lo = 0
    if not IS_PREFIX:
        if HAS_KMASK:
            km = tl.load(KMASK + b * stride_mb + offs_n, mask=n_ok, other=0)
            key_ok = key_ok & (km != 0)
        if CAUSAL:
            # query rows i < start_n - causal_off see none of this tile's keys
            lo = tl.maximum(start_n - causal_off, 0) // BLOCK_M * BLOCK_M

    dk = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
    for g in range(0, GROUP):
        hq = h * GROUP + g                    # the query heads sharing this kv head
        q_base = Q + b * stride_qb + hq * stride_qh
        do_base = DO + b * stride_dob + hq * stride_doh
        row_base = (b * H + hq) * N_Q
        for start_m in range(lo, N_Q, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            m_ok = offs_m < N_Q
            qT = tl.load(q_base + offs_m[None, :] * stride_qn + offs_d[:, None] * stride_qd,
                         mask=d_ok[:, None] & m_ok[None, :], other=0.0)
            doT = tl.load(do_base + offs_m[None, :] * stride_don + offs_d[:, None] * stride_dod,
                          mask=d_ok[:, None] & m_ok[None, :], other=0.0)
            mrow = tl.load(STATS + row_base + offs_m, mask=m_ok, other=0.0)
            inv_l = tl.load(STATS + N_ROWS + row_base + offs_m, mask=m_ok, other=0.0)
            delta = tl.load(DELTA + row_base + offs_m, mask=m_ok, other=0.0)
            adj = tl.load(ADJ + row_base + offs_m, mask=m_ok, other=0.0)
            if EXACT_DELTA:
                # S in the dQ kernel's orientation, so P here is bit-identical to the P that
                # formed D_i there (a single visible column then gives dS = P·dLSE exactly)
                q_r = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd,
                              mask=m_ok[:, None] & d_ok[None, :], other=0.0)
                sT = tl.trans(tl.dot(q_r, kT_r, input_precision=PREC,
                                     out_dtype=tl.float32) * scale)
            else:
                sT = tl.dot(kt, qT, input_precision=PREC, out_dtype=tl.float32) * scale
            valid = key_ok[:, None] & m_ok[None, :]
            if not IS_PREFIX:
                if CAUSAL:
                    valid = valid & (offs_n[:, None] <= offs_m[None, :] + causal_off)
            pT = tl.exp(tl.where(valid, sT - mrow[None, :], float("-inf"))) * inv_l[None, :]
            dv += tl.dot(pT.to(doT.dtype), tl.trans(doT), input_precision=PREC,
                         out_dtype=tl.float32)
            if EXACT_DELTA:
                # the same product, operand layout and shape as in the dQ kernel's D_i
                do_r = tl.load(do_base + offs_m[:, None] * stride_don
                               + offs_d[None, :] * stride_dod,
                               mask=m_ok[:, None] & d_ok[None, :], other=0.0)
                vT_r = tl.load(V + b * stride_vb + h * stride_vh + offs_n[None, :] * stride_vn
                               + offs_d[:, None] * stride_vd, mask=d_ok[:, None] & n_ok[None, :],
                               other=0.0)
                dpT = tl.trans(tl.dot(do_r, vT_r, input_precision=PREC, out_dtype=tl.float32))
            else:
                dpT = tl.dot(vt, doT, input_precision=PREC, out_dtype=tl.float32)
            # (dP − D) first, then + dLSE (adj = −dLSE): folding dLSE into D would round it away
            dsT = pT * ((dpT - delta[None, :]) - adj[None, :])
            dk += tl.dot(dsT.to(qT.dtype), tl.trans(qT), input_precision=PREC,
                         out_dtype=tl.float32)
    dk = dk * scale
    off = (pid_bh.to(tl.int64) * N_K + offs_n[:, None]) * HEAD_DIM + offs_d[None, :]
    tl.store(DK + off, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + off, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _p_dp_tile(q, do, mrow, inv_l, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
               offs_n, n_ok, offs_m, offs_d, d_ok, kmask_base, causal_off, scale,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_KMASK: tl.constexpr,
               PREC: tl.constexpr):
    """One key tile of the backward: Kᵀ, the recomputed P = exp(s − m) / l and dP = dO Vᵀ."""
    kT = tl.load(k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                 mask=d_ok[:, None] & n_ok[None, :], other=0.0)
    vT = tl.load(v_base + offs_n[None, :] * stride_vn + offs_d[:, None] * stride_vd,
                 mask=d_ok[:, None] & n_ok[None, :], other=0.0)
    s = tl.dot(q, kT, input_precision=PREC, out_dtype=tl.float32) * scale
    valid = _visible(offs_m, offs_n, n_ok, kmask_base, causal_off, MASKED, CAUSAL, HAS_KMASK)
    p = tl.exp(tl.where(valid, s - mrow[:, None], float("-inf"))) * inv_l[:, None]
    dp = tl.dot(do, vT, input_precision=PREC, out_dtype=tl.float32)
    return kT, p, dp


@triton.jit
def _delta_tiles(dsum, q, do, mrow, inv_l, k_base, v_base, stride_kn, stride_kd, stride_vn,
                 stride_vd,
                 lo, hi, n_valid, offs_m, offs_d, kmask_base, causal_off, scale,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                 CAUSAL: tl.constexpr, HAS_KMASK: tl.constexpr, PREC: tl.constexpr):
    """D_i = Σ_j P_ij dP_ij from the very dP values the gradient kernels use (see EXACT_DELTA)."""
    d_ok = offs_d < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_valid
        kT, p, dp = _p_dp_tile(q, do, mrow, inv_l, k_base, v_base, stride_kn, stride_kd,
                               stride_vn, stride_vd, offs_n, n_ok, offs_m, offs_d, d_ok,
                               kmask_base, causal_off, scale, MASKED, CAUSAL, HAS_KMASK, PREC)
        dsum += tl.sum(p * dp, 1)
    return dsum


@triton.jit
def _dq_tiles(dq, q, do, mrow, inv_l, delta, adj, k_base, v_base, stride_kn, stride_kd,
              stride_vn,
              stride_vd,
              lo, hi, n_valid, offs_m, offs_d, kmask_base, causal_off, scale,
              HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
              CAUSAL: tl.constexpr, HAS_KMASK: tl.constexpr, PREC: tl.constexpr):
    d_ok = offs_d < HEAD_DIM
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < n_valid
        kT, p, dp = _p_dp_tile(q, do, mrow, inv_l, k_base, v_base, stride_kn, stride_kd,
                               stride_vn, stride_vd, offs_n, n_ok, offs_m, offs_d, d_ok,
                               kmask_base, causal_off, scale, MASKED, CAUSAL, HAS_KMASK, PREC)
        ds = p * ((dp - delta[:, None]) - adj[:, None])
        dq += tl.dot(ds.to(kT.dtype), tl.trans(kT), input_precision=PREC, out_dtype=tl.float32)
    return dq


@triton.jit
def _inducer_attn_bwd_dq_kernel(
    Q, K, V, PK, PV, KMASK, DO, STATS, N_ROWS, DELTA, ADJ, DQ, DELTA_OUT,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_pkh, stride_pkn, stride_pkd,
    stride_pvh, stride_pvn, stride_pvd,
    stride_mb,
    stride_dob, stride_doh, stride_don, stride_dod,
    H, GROUP, N_Q, N_K, N_PREFIX, causal_off, scale,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_KMASK: tl.constexpr, HAS_PREFIX: tl.constexpr,
    EXACT_DELTA: tl.constexpr, PREC: tl.constexpr,
):
    """dQ for one query tile. ADJ holds −dLSE. With EXACT_DELTA a first pass forms
    D_i = Σ_j P_ij dP_ij from the same dP the gradient uses (stored to DELTA_OUT for the dK/dV
    kernel), so dP_ij − D_i cancels exactly where it should (a row with a single visible
    column has dS = P·dLSE, not rounding noise). Otherwise DELTA = ⟨dO_i, O_i⟩."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    m_ok = offs_m < N_Q
    d_ok = offs_d < HEAD_DIM
    io_mask = m_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qn
                + offs_d[None, :] * stride_qd, mask=io_mask, other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_don
                 + offs_d[None, :] * stride_dod, mask=io_mask, other=0.0)
    row = pid_bh.to(tl.int64) * N_Q + offs_m
    mrow = tl.load(STATS + row, mask=m_ok, other=0.0)
    inv_l = tl.load(STATS + N_ROWS + row, mask=m_ok, other=0.0)
    adj = tl.load(ADJ + row, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    kmask_base = KMASK + b * stride_mb
    hi = N_K
    if CAUSAL:
        hi = tl.minimum(N_K, (pid_m + 1) * BLOCK_M + causal_off)
    if EXACT_DELTA:
        dsum = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_PREFIX:
            dsum = _delta_tiles(dsum, q, do, mrow, inv_l, PK + h * stride_pkh, PV + h * stride_pvh,
                                stride_pkn, stride_pkd, stride_pvn, stride_pvd, 0, N_PREFIX,
                                N_PREFIX, offs_m, offs_d, kmask_base, causal_off, scale,
                                HEAD_DIM, BLOCK_N, False, False, False, PREC)
        dsum = _delta_tiles(dsum, q, do, mrow, inv_l, K + b * stride_kb + hk * stride_kh,
                            V + b * stride_vb + hk * stride_vh, stride_kn, stride_kd, stride_vn,
                            stride_vd, 0, hi, N_K, offs_m, offs_d, kmask_base, causal_off,
                            scale, HEAD_DIM, BLOCK_N, True, CAUSAL, HAS_KMASK, PREC)
        delta = dsum
        tl.store(DELTA_OUT + row, delta, mask=m_ok)
    else:
        delta = tl.load(DELTA + row, mask=m_ok, other=0.0)
    if HAS_PREFIX:
        dq = _dq_tiles(dq, q, do, mrow, inv_l, delta, adj, PK + h * stride_pkh, PV + h * stride_pvh,
                       stride_pkn, stride_pkd, stride_pvn, stride_pvd, 0, N_PREFIX, N_PREFIX,
                       offs_m, offs_d, kmask_base, causal_off, scale,
                       HEAD_DIM, BLOCK_N, False, False, False, PREC)
    dq = _dq_tiles(dq, q, do, mrow, inv_l, delta, adj, K + b * stride_kb + hk * stride_kh,
                   V + b * stride_vb + hk * stride_vh, stride_kn, stride_kd, stride_vn, stride_vd,
                   0, hi, N_K, offs_m, offs_d, kmask_base, causal_off, scale,
                   HEAD_DIM, BLOCK_N, True, CAUSAL, HAS_KMASK, PREC)
    dq = dq * scale
    tl.store(DQ + (row[:, None] * HEAD_DIM + offs_d[None, :]), dq.to(DQ.dtype.element_ty),
             mask=io_mask)


# ------------------------------------------------------------------------------------------
# host side


def _fwd_config(dtype: torch.dtype, d_pad: int) -> Tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    if triton_interpret():
        return 64, 64, 4, 1            # the interpreter is fastest with few, large tiles
    if dtype == torch.float32:
        return 64, (32 if d_pad > 64 else 64), 4, 1
    return (128 if d_pad <= 64 else 64), 64, (4 if d_pad <= 64 else 8), 2


def _bwd_config(dtype: torch.dtype, d_pad: int) -> Tuple[int, int, int, int]:
    if triton_interpret():
        return 64, 64, 4, 1
    if dtype == torch.float32:
        return 32, 32, 4, 1
    return 32, 64, (4 if d_pad <= 64 else 8), 2


def _key_mask_u8(key_mask: Optional[torch.Tensor], q: torch.Tensor):
    if key_mask is None:
        return q, 0, False                    # dummy pointer, never read
    km = key_mask.to(torch.bool).contiguous().view(torch.uint8)
    return km, km.stride(0), True


def _prefix_args(prefix_k, prefix_v, k):
    if prefix_k is None or prefix_k.shape[1] == 0:
        return k, k, (0, 0, 0), (0, 0, 0), 0, False
    return (prefix_k, prefix_v, tuple(prefix_k.stride()), tuple(prefix_v.stride()),
            prefix_k.shape[1], True)


def inducer_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s0: Optional[torch.Tensor] = None,
    prefix_k: Optional[torch.Tensor] = None, prefix_v: Optional[torch.Tensor] = None,
    key_mask: Optional[torch.Tensor] = None, causal: bool = False, scale: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash forward. q (B, H, n_q, p); k, v (B, H_kv, n_k, p) with H_kv dividing H (grouped-
    query attention: query head h reads kv head h // (H / H_kv)); s0 (B, H, n_q) or None;
    prefix_k/v (H, l, p) or None; key_mask (B, n_k) bool (True = real key) or None.

    Returns ``out`` (B, H, n_q, p) in q's dtype (contiguous), ``lse`` (B, H, n_q) float32 over
    the real columns (``_EMPTY_LSE`` for rows with none), ``lam`` (2, B, H, n_q) float32 holding
    λ and 1 − λ (an empty tensor when s0 is None) and ``stats`` (2, B, H, n_q) float32: the
    row max and the reciprocal row sum the backward uses to recompute P. Any strides are
    accepted.
    """
    B, H, n_q, p = q.shape
    n_k, h_kv = k.shape[2], k.shape[1]
    if scale is None:
        scale = p ** -0.5
    d_pad = max(16, next_pow2(p))
    BM, BN, warps, stages = _fwd_config(q.dtype, d_pad)
    out = _alloc.empty(B, H, n_q, p, dtype=q.dtype, device=q.device)
    lse = _alloc.empty(B, H, n_q, dtype=torch.float32, device=q.device)
    stats = _alloc.empty(2, B, H, n_q, dtype=torch.float32, device=q.device)
    has_s0 = s0 is not None
    if has_s0:
        s0 = s0.contiguous()
        lam = _alloc.empty(2, B, H, n_q, dtype=torch.float32, device=q.device)
    else:
        lam = torch.empty(0, dtype=torch.float32, device=q.device)
    km, smb, has_km = _key_mask_u8(key_mask, q)
    pk, pv, spk, spv, n_prefix, has_prefix = _prefix_args(prefix_k, prefix_v, k)
    if B * H * n_q > 0:
        grid = (triton.cdiv(n_q, BM), B * H)
        _inducer_attn_fwd_kernel[grid](
            q, k, v, pk, pv, km, s0 if has_s0 else lse, out, lse, lam if has_s0 else lse, stats,
            B * H * n_q,
            *q.stride(), *k.stride(), *v.stride(), *spk, *spv, smb, *out.stride(),
            H, H // h_kv, n_q, n_k, n_prefix, n_k - n_q, float(scale),
            HEAD_DIM=p, D_PAD=d_pad, BLOCK_M=BM, BLOCK_N=BN, CAUSAL=bool(causal),
            HAS_KMASK=has_km, HAS_PREFIX=has_prefix, HAS_S0=has_s0,
            PREC=dot_precision(q.dtype), num_warps=warps, num_stages=stages)
    return out, lse, lam, stats


def inducer_attention_backward(
    dout: torch.Tensor, dlam: Optional[torch.Tensor], dlse: Optional[torch.Tensor],
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    stats: torch.Tensor, lam: Optional[torch.Tensor], s0: Optional[torch.Tensor] = None,
    prefix_k: Optional[torch.Tensor] = None, prefix_v: Optional[torch.Tensor] = None,
    key_mask: Optional[torch.Tensor] = None, causal: bool = False,
    scale: Optional[float] = None,
):
    """Flash backward. Returns ``(dq, dk, dv, ds0, dprefix_k, dprefix_v)``; ``ds0`` is None
    without an inducer (``lam`` None/empty), the prefix grads None without a prefix.

    ``dLSE = dlse − dλ λ (1 − λ)`` and ``ds0 = dλ λ (1 − λ)`` (SPEC §3); the kernels use
    ``dS = P ((dP − D) + dLSE)``. In float32, ``D_i`` is formed inside the dQ kernel as
    ``Σ_j P_ij dP_ij`` (see ``EXACT_DELTA``); 16-bit inputs use ``D_i = ⟨dO_i, O_i⟩``.
    """
    B, H, n_q, p = q.shape
    n_k, h_kv = k.shape[2], k.shape[1]
    group = H // h_kv
    if scale is None:
        scale = p ** -0.5
    d_pad = max(16, next_pow2(p))
    BM, BN, warps, stages = _bwd_config(q.dtype, d_pad)
    # −dLSE, with dLSE = dlse − dλ λ (1 − λ); λ(1 − λ) = σ(x) σ(−x) with x = s0 − LSE (1 − λ
    # formed by subtraction would lose every digit when λ → 1).
    adj = torch.zeros(B, H, n_q, dtype=torch.float32, device=q.device)
    ds0 = None
    if s0 is not None and dlam is not None and lam is not None and lam.numel() > 0:
        wide = torch.float64 if s0.dtype == torch.float64 else torch.float32
        x = s0.to(wide) - lse.to(wide)
        dl = dlam.to(wide)
        dl = dl[0] - dl[1]                     # lam holds (λ, 1 − λ)
        ds0 = dl * (torch.sigmoid(x) * torch.sigmoid(-x))
        adj = adj + ds0.float()
        ds0 = ds0.to(s0.dtype)
    if dlse is not None:
        adj = adj - dlse.float()
    exact_delta = q.dtype == torch.float32
    adj = adj.contiguous()
    if exact_delta:
        delta = adj          # unused: the dQ kernel forms D_i = Σ_j P_ij dP_ij into delta_out
        delta_out = _alloc.empty(B, H, n_q, dtype=torch.float32, device=q.device)
    else:
        delta = (dout.float() * out.float()).sum(-1)
        delta_out = delta
    delta = delta.contiguous()
    lse = lse.contiguous()
    km, smb, has_km = _key_mask_u8(key_mask, q)
    pk, pv, spk, spv, n_prefix, has_prefix = _prefix_args(prefix_k, prefix_v, k)
    dq = _alloc.empty(B, H, n_q, p, dtype=q.dtype, device=q.device)
    dk = _alloc.empty(B, h_kv, n_k, p, dtype=k.dtype, device=q.device)
    dv = _alloc.empty(B, h_kv, n_k, p, dtype=v.dtype, device=q.device)
    dpk_part = dpv_part = None
    if has_prefix:
        dpk_part = _alloc.empty(B, H, n_prefix, p, dtype=torch.float32, device=q.device)
        dpv_part = _alloc.empty(B, H, n_prefix, p, dtype=torch.float32, device=q.device)
    common = (*q.stride(), *k.stride(), *v.stride(), *spk, *spv, smb, *dout.stride())
    kw = dict(HEAD_DIM=p, D_PAD=d_pad, BLOCK_M=BM, BLOCK_N=BN, CAUSAL=bool(causal),
              HAS_KMASK=has_km, EXACT_DELTA=exact_delta, PREC=dot_precision(q.dtype),
              num_warps=warps, num_stages=stages)
    if B * H * n_q > 0:
        grid = (triton.cdiv(n_q, BM), B * H)
        _inducer_attn_bwd_dq_kernel[grid](
            q, k, v, pk, pv, km, dout, stats, B * H * n_q, delta, adj, dq, delta_out,
            *common, H, group, n_q, n_k, n_prefix, n_k - n_q, float(scale),
            HEAD_DIM=p, D_PAD=d_pad, BLOCK_M=BM, BLOCK_N=BN, CAUSAL=bool(causal),
            HAS_KMASK=has_km, HAS_PREFIX=has_prefix, EXACT_DELTA=exact_delta,
            PREC=dot_precision(q.dtype),
            num_warps=warps, num_stages=stages)
    if B * h_kv * n_k > 0:
        _inducer_attn_bwd_dkdv_kernel[(triton.cdiv(n_k, BN), B * h_kv)](
            q, k, v, km, dout, stats, B * H * n_q, delta_out, adj, dk, dv, *q.stride(), *k.stride(),
            *v.stride(), smb, *dout.stride(), H, h_kv, group, n_q, n_k, n_k - n_q, float(scale),
            IS_PREFIX=False, **kw)
    if has_prefix and B * H > 0:
        _inducer_attn_bwd_dkdv_kernel[(triton.cdiv(n_prefix, BN), B * H)](
            q, pk, pv, km, dout, stats, B * H * n_q, delta_out, adj, dpk_part, dpv_part, *q.stride(),
            0, *spk, 0, *spv,
            smb, *dout.stride(), H, H, 1, n_q, n_prefix, n_k - n_q, float(scale), IS_PREFIX=True,
            **kw)
    dpk = dpv = None
    if has_prefix:
        dpk = dpk_part.sum(0).to(prefix_k.dtype)
        dpv = dpv_part.sum(0).to(prefix_v.dtype)
    return dq, dk, dv, ds0, dpk, dpv


@_aot.register("inducer_attention")
def _aot_launches() -> None:
    """Representative launches for the sm_90 compile check (see _aot.py): bfloat16 on every
    head width with the mask / prefix / causal variants, float32 (IEEE dots) on one."""
    B, H, n = 2, 2, 256
    runs = [(torch.bfloat16, p) for p in (32, 64, 80, 96, 128)] + [(torch.float32, 64)]
    for dtype, p in runs:
        for causal, masked, prefix in ((False, False, False), (True, True, True)):
            q = torch.empty(B, H, n, p, dtype=dtype)
            k = torch.empty(B, H, n, p, dtype=dtype)
            v = torch.empty(B, H, n, p, dtype=dtype)
            s0 = torch.zeros(B, H, n, dtype=torch.float32)
            km = torch.ones(B, n, dtype=torch.bool) if masked else None
            pk = torch.empty(H, 16, p, dtype=dtype) if prefix else None
            pv = torch.empty(H, 16, p, dtype=dtype) if prefix else None
            out, lse, lam, stats = inducer_attention_forward(q, k, v, s0, pk, pv, km, causal)
            lse.zero_()
            lam = torch.full((2, B, H, n), 0.5)
            inducer_attention_backward(torch.zeros_like(out), torch.zeros(2, B, H, n), None,
                                       q, k, v, torch.zeros_like(out), lse, stats, lam, s0,
                                       pk, pv, km, causal)
