"""Triton kernels for the per-head low-rank updates of SPEC §2 (paper 000).

Three forward kernels and their backward partners:

``_hw_lowrank_fwd_kernel``  out[t,h] = (basis[t,(h)] @ A_hᵀ) @ B_hᵀ + c_h      (grid: T-blocks × H)
``_hw_qkv_fwd_kernel``      fused attention-input projection. One program owns one head's
                            output columns (width p) of Q, K or V for a block of tokens; its
                            K-loop over d reads the X tile once and feeds three products:
                            the frozen ``X W^hᵀ``, the per-head down-projection ``X D_hᵀ``
                            (Kernel-wise A_h and the lite bases ``A_h W_k^h`` stacked along the
                            rank) and the shared LoRA down-projection ``X A_sᵀ``. The epilogue
                            adds ``z_h U_hᵀ + z_s U_s^hᵀ`` (block-diagonal up-projection) and
                            the bias before Q/V are written. The shared down-projection is
                            recomputed by every head's program of a section (r_s/p extra
                            FLOPs) instead of costing a second pass over X.
``_hw_oproj_fwd_kernel``    fused output projection. One program owns a (tokens × d_out)
                            tile; its K-loop walks the heads (chunks of width p of O), and
                            each head's rank-r down-projection ``O^h A_hᵀ`` is complete after
                            its chunk, so its up-projection is applied in the same iteration.

Backward: ``_hw_*_bwd_kernel`` produce the input gradient and the rank-space gradient dZ in
one pass over the output gradient (dZ of a head is recomputed per d-block, written once);
every factor gradient is then a reduction over tokens ``Aᵀ B`` done by the generic split-T
kernel ``_atb_kernel`` (batched over heads with strides, optional column sums for biases).

All rank-space tensors (Z, dZ) are float32. Tiles are padded to >= 16 in every dim so
``tl.dot`` is legal on the GPU (ranks 1..16 use one 16-wide tile, masked), and every edge is
masked. Head-aligned tiles are ``next_pow2(p)`` wide, so non-power-of-two head widths (80, 96)
pay for masked lanes.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from kfused import _alloc
from kfused.triton_kernels import _aot
from kfused.triton_kernels._common import (_AOT_TARGET, _mm, dot_precision, next_pow2,
                                           targets_gpu, use_dot)

F32 = torch.float32


# Warps per program: 8 keeps the (64 x 128) float32 accumulators of the head-aligned tiles
# in registers (sm_90 compile check: 4 warps spilled up to 3.8 KB on p = 128 backward tiles).
_NW = 8


def _blk(n: int, lo: int = 16, hi: int = 64) -> int:
    return max(lo, min(hi, next_pow2(n)))


def _rblk(r: int) -> int:
    return max(16, next_pow2(max(r, 1)))


# ------------------------------------------------------------------------------------------
# Generic split-T  C[b] = A[b]ᵀ B[b]  (+ C2[b] = A[b]ᵀ B2[b]) (+ colsum_t A[b])


@triton.jit
def _atb_kernel(a_ptr, s_at, s_ab, s_am,
                b_ptr, s_bt, s_bb, s_bn,
                b2_ptr, s_b2t, s_b2b, s_b2n,
                c_ptr, c2_ptr, cs_ptr,
                T, M, N, N2, NB, T_PER,
                BT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BN2: tl.constexpr,
                HAS_B2: tl.constexpr, COLSUM: tl.constexpr, RACC: tl.constexpr):
    # grid: (NB * cdiv(M, BM) * cdiv(N, BN), S). Split s reduces tokens
    # [s*T_PER, (s+1)*T_PER) and writes float32 partials c[s, b]; the host sums over s.
    # C2 and the column sums are produced by the programs of the first N-block.
    pid = tl.program_id(0)
    s = tl.program_id(1)
    n_mb = tl.cdiv(M, BM)
    n_nb = tl.cdiv(N, BN)
    b = pid // (n_mb * n_nb)
    rest = pid % (n_mb * n_nb)
    mb = rest // n_nb
    nb = rest % n_nb
    rm = mb * BM + tl.arange(0, BM)
    rn = nb * BN + tl.arange(0, BN)
    rn2 = tl.arange(0, BN2)
    mmask = rm < M
    nmask = rn < N
    # Token sums accumulate across blocks in RACC (float64 for float32 inputs): the reduction
    # over T then adds no error beyond each block's product.
    acc = tl.zeros((BM, BN), dtype=RACC)
    acc2 = tl.zeros((BM, BN2), dtype=RACC)
    cs = tl.zeros((BM,), dtype=RACC)
    t_lo = s * T_PER
    t_hi = tl.minimum(t_lo + T_PER, T)
    rt0 = tl.arange(0, BT)
    for t0 in range(t_lo, t_hi, BT):
        rt = t0 + rt0
        tmask = rt < t_hi
        a = tl.load(a_ptr + b * s_ab + rt[:, None] * s_at + rm[None, :] * s_am,
                    mask=tmask[:, None] & mmask[None, :], other=0.0).to(tl.float32)
        bt = tl.load(b_ptr + b * s_bb + rt[:, None] * s_bt + rn[None, :] * s_bn,
                     mask=tmask[:, None] & nmask[None, :], other=0.0).to(tl.float32)
        at = tl.trans(a)
        acc += _mm(at, bt, True, "ieee").to(RACC)
        if HAS_B2:
            b2 = tl.load(b2_ptr + b * s_b2b + rt[:, None] * s_b2t + rn2[None, :] * s_b2n,
                         mask=tmask[:, None] & (rn2[None, :] < N2), other=0.0).to(tl.float32)
            acc2 += _mm(at, b2, True, "ieee").to(RACC)
        if COLSUM:
            cs += tl.sum(a.to(RACC), axis=0)
    base = (s * NB + b) * M
    tl.store(c_ptr + (base + rm[:, None]) * N + rn[None, :], acc,
             mask=mmask[:, None] & nmask[None, :])
    if nb == 0:
        if HAS_B2:
            tl.store(c2_ptr + (base + rm[:, None]) * N2 + rn2[None, :], acc2,
                     mask=mmask[:, None] & (rn2[None, :] < N2))
        if COLSUM:
            tl.store(cs_ptr + base + rm, cs, mask=mmask)


def _splits(device: torch.device, T: int, programs: int, BT: int) -> int:
    """How many token splits for a reduction over T: enough programs to fill the GPU."""
    chunks = max(1, triton.cdiv(T, BT))
    if not targets_gpu(device):
        return min(chunks, 2)
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else _AOT_TARGET["sms"])
    want = max(1, (2 * sms) // max(1, programs))
    return max(1, min(chunks, want, 64))


def atb(a: torch.Tensor, b: torch.Tensor, b2: Optional[torch.Tensor] = None,
        colsum: bool = False, out_dtype: torch.dtype = F32
        ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Batched ``a[:, i]ᵀ b[:, i]`` reduced over tokens (the factor gradients).

    a (T, NB, M); b (T, NB or 1, N); b2 (T, NB or 1, N2) with N2 <= 128; any strides (a
    size-1 batch dim of b/b2 is broadcast). Returns C (NB, M, N), C2 (NB, M, N2) or None and
    colsum_t a (NB, M) or None, in ``out_dtype``. Accumulates in float32 (IEEE dots).
    """
    T, NB, M = a.shape
    N = b.shape[2]
    N2 = b2.shape[2] if b2 is not None else 1
    if N2 > 128:
        C, _, CS = atb(a, b, None, colsum, out_dtype)
        C2, _, _ = atb(a, b2, None, False, out_dtype)
        return C, C2, CS
    dev = a.device
    BT = 64 if targets_gpu(dev) else 32
    BM = _blk(M, 16, 64)
    BN = _blk(N, 16, 64)
    BN2 = _rblk(N2)
    programs = NB * triton.cdiv(M, BM) * triton.cdiv(N, BN)
    S = _splits(dev, T, programs, BT)
    T_PER = max(BT, triton.cdiv(triton.cdiv(max(T, 1), S), BT) * BT)
    S = max(1, triton.cdiv(T, T_PER))
    wide = a.dtype == torch.float32 or out_dtype == torch.float64
    racc = torch.float64 if wide else F32
    c = _alloc.empty(S, NB, M, N, dtype=racc, device=dev)
    c2 = _alloc.empty(S, NB, M, N2, dtype=racc, device=dev) if b2 is not None else c
    cs = _alloc.empty(S, NB, M, dtype=racc, device=dev) if colsum else c
    sb = lambda t: t.stride(1) if t.shape[1] > 1 else 0  # noqa: E731
    bb2 = b2 if b2 is not None else b
    _atb_kernel[(programs, S)](
        a, a.stride(0), a.stride(1), a.stride(2),
        b, b.stride(0), sb(b), b.stride(2),
        bb2, bb2.stride(0), sb(bb2), bb2.stride(2),
        c, c2, cs, T, M, N, N2, NB, T_PER,
        BT=BT, BM=BM, BN=BN, BN2=BN2, HAS_B2=b2 is not None, COLSUM=colsum,
        RACC=tl.float64 if wide else tl.float32, num_warps=_NW)
    C = c.sum(0).to(out_dtype)
    C2 = c2.sum(0).to(out_dtype) if b2 is not None else None
    CS = cs.sum(0).to(out_dtype) if colsum else None
    return C, C2, CS


# ------------------------------------------------------------------------------------------
# headwise_lowrank: out[t, h] = (basis[t, (h)] @ A_hᵀ) @ B_hᵀ + c_h


@triton.jit
def _hw_lowrank_fwd_kernel(x_ptr, s_xt, s_xh, s_xk, a_ptr, b_ptr, c_ptr, out_ptr, z_ptr,
                           T, H, DB, P, R,
                           BT: tl.constexpr, BK: tl.constexpr, PB: tl.constexpr,
                           RB: tl.constexpr, HAS_C: tl.constexpr, PREC: tl.constexpr,
                           DOT_DOWN: tl.constexpr, DOT_UP: tl.constexpr):
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    rows = pid_t * BT + tl.arange(0, BT)
    tmask = rows < T
    rr = tl.arange(0, RB)
    rmask = rr < R
    z = tl.zeros((BT, RB), dtype=tl.float32)
    for k0 in range(0, DB, BK):
        ks = k0 + tl.arange(0, BK)
        kmask = ks < DB
        x = tl.load(x_ptr + rows[:, None] * s_xt + h * s_xh + ks[None, :] * s_xk,
                    mask=tmask[:, None] & kmask[None, :], other=0.0)
        at = tl.load(a_ptr + (h * R + rr[None, :]) * DB + ks[:, None],
                     mask=kmask[:, None] & rmask[None, :], other=0.0)
        z += _mm(x, at, DOT_DOWN, PREC)
    tl.store(z_ptr + (rows[:, None] * H + h) * R + rr[None, :], z,
             mask=tmask[:, None] & rmask[None, :])
    cols = tl.arange(0, PB)
    cmask = cols < P
    bt = tl.load(b_ptr + (h * P + cols[None, :]) * R + rr[:, None],
                 mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
    out = _mm(z, bt, DOT_UP, "ieee")
    if HAS_C:
        out += tl.load(c_ptr + h * P + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + (rows[:, None] * H + h) * P + cols[None, :],
             out.to(out_ptr.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])


@triton.jit
def _hw_lowrank_bwd_kernel(g_ptr, a_ptr, b_ptr, dx_ptr, s_dt, s_dh, dz_ptr,
                           T, H, DB, P, R, HEADS_PER_PROG,
                           BT: tl.constexpr, BD: tl.constexpr, PB: tl.constexpr,
                           RB: tl.constexpr, DOT_G: tl.constexpr, DOT_A: tl.constexpr):
    # grid: (T-blocks, DB-blocks, 1 for a shared basis | H for a per-head basis).
    # dZ_h = dOut_h B_h; dBasis(_h) = Σ_h dZ_h A_h. dZ is written by the first DB-block.
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_h = tl.program_id(2)
    rows = pid_t * BT + tl.arange(0, BT)
    tmask = rows < T
    dc = pid_d * BD + tl.arange(0, BD)
    dmask = dc < DB
    cols = tl.arange(0, PB)
    cmask = cols < P
    rr = tl.arange(0, RB)
    rmask = rr < R
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    h_lo = pid_h * HEADS_PER_PROG
    for h in range(h_lo, h_lo + HEADS_PER_PROG):
        g = tl.load(g_ptr + (rows[:, None] * H + h) * P + cols[None, :],
                    mask=tmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        u = tl.load(b_ptr + (h * P + cols[:, None]) * R + rr[None, :],
                    mask=cmask[:, None] & rmask[None, :], other=0.0).to(tl.float32)
        dz = _mm(g, u, DOT_G, "ieee")
        if pid_d == 0:
            tl.store(dz_ptr + (rows[:, None] * H + h) * R + rr[None, :], dz,
                     mask=tmask[:, None] & rmask[None, :])
        a = tl.load(a_ptr + (h * R + rr[:, None]) * DB + dc[None, :],
                    mask=rmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        acc += _mm(dz, a, DOT_A, "ieee")
    tl.store(dx_ptr + rows[:, None] * s_dt + pid_h * s_dh + dc[None, :],
             acc.to(dx_ptr.dtype.element_ty), mask=tmask[:, None] & dmask[None, :])


def headwise_lowrank_forward(basis: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                             bias: Optional[torch.Tensor], per_head: bool
                             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """basis (T, d_b) or (T, H, d_b); A (H, r, d_b), B (H, p, r) contiguous; bias (H, p).

    Returns out (T, H, p) in basis.dtype and the rank-space Z (T, H, r) float32 (saved for
    the backward).
    """
    T = basis.shape[0]
    H, R, DB = A.shape
    P = B.shape[1]
    dev = basis.device
    out = _alloc.empty(T, H, P, dtype=basis.dtype, device=dev)
    z = _alloc.empty(T, H, R, dtype=F32, device=dev)
    BT = _blk(T, 16, 64)
    BK = _blk(DB, 16, 64)
    PB = _rblk(P)
    RB = _rblk(R)
    s_xh = basis.stride(1) if per_head else 0
    s_xk = basis.stride(-1)
    grid = (triton.cdiv(T, BT), H)
    if T > 0:
        _hw_lowrank_fwd_kernel[grid](
            basis, basis.stride(0), s_xh, s_xk, A, B, bias if bias is not None else A, out, z,
            T, H, DB, P, R, BT=BT, BK=BK, PB=PB, RB=RB, HAS_C=bias is not None,
            PREC=dot_precision(basis.dtype), DOT_DOWN=use_dot(BT, BK, RB),
            DOT_UP=use_dot(BT, RB, PB), num_warps=_NW)
    return out, z


def headwise_lowrank_backward(g: torch.Tensor, basis: torch.Tensor, A: torch.Tensor,
                              B: torch.Tensor, z: torch.Tensor, per_head: bool,
                              need_basis: bool, need_factors: bool, has_bias: bool):
    """g (T, H, p) contiguous. Returns (dbasis, dA, dB, dbias); unneeded ones are None."""
    T = g.shape[0]
    H, R, DB = A.shape
    P = B.shape[1]
    dev = g.device
    dt = basis.dtype
    BT = _blk(T, 16, 64)
    BD = _blk(DB, 16, 64)
    PB = _rblk(P)
    RB = _rblk(R)
    dz = _alloc.empty(T, H, R, dtype=F32, device=dev)
    if per_head:
        dx = _alloc.empty(T, H, DB, dtype=dt, device=dev)
        s_dt, s_dh, nh, hpp = H * DB, DB, H, 1
    else:
        dx = _alloc.empty(T, DB, dtype=dt, device=dev)
        s_dt, s_dh, nh, hpp = DB, 0, 1, H
    # dZ is needed by dA, and computed by this kernel together with dbasis.
    if T > 0 and (need_basis or need_factors):
        grid = (triton.cdiv(T, BT), triton.cdiv(DB, BD) if need_basis else 1, nh)
        _hw_lowrank_bwd_kernel[grid](
            g, A, B, dx, s_dt, s_dh, dz, T, H, DB, P, R, hpp,
            BT=BT, BD=BD, PB=PB, RB=RB, DOT_G=use_dot(BT, PB, RB), DOT_A=use_dot(BT, RB, BD),
            num_warps=_NW)
    dA = dB = db = None
    if need_factors:
        bview = basis if per_head else basis.unsqueeze(1)
        dA, _, _ = atb(dz, bview, out_dtype=A.dtype)
        dB, _, db = atb(g, z, colsum=has_bias, out_dtype=B.dtype)
        if db is not None:
            db = db.to(dt)
    return (dx if need_basis else None), dA, dB, db


# ------------------------------------------------------------------------------------------
# Fused attention-input projection (Q, K, V with per-head and shared updates on q and v)


@triton.jit
def _qkv_head_fwd(x_ptr, s_xt, s_xk, w_ptr, s_wn, s_wk, b_ptr, out_ptr,
                  d_ptr, zb_ptr, u_ptr, ds_ptr, us_ptr, z_ptr, s_zt, zs_ptr,
                  h, pid_t, T, D, P, R, RS,
                  BT: tl.constexpr, BK: tl.constexpr, PB: tl.constexpr, RB: tl.constexpr,
                  RSB: tl.constexpr, HAS_B: tl.constexpr, HW: tl.constexpr, SH: tl.constexpr,
                  PREC: tl.constexpr, DOT_W: tl.constexpr, DOT_D: tl.constexpr,
                  DOT_S: tl.constexpr, DOT_U: tl.constexpr, DOT_US: tl.constexpr):
    rows = pid_t * BT + tl.arange(0, BT)
    tmask = rows < T
    cols = tl.arange(0, PB)
    cmask = cols < P
    n = h * P + cols
    rr = tl.arange(0, RB)
    rmask = rr < R
    rs = tl.arange(0, RSB)
    smask = rs < RS
    acc = tl.zeros((BT, PB), dtype=tl.float32)
    z = tl.zeros((BT, RB), dtype=tl.float32)
    zs = tl.zeros((BT, RSB), dtype=tl.float32)
    for k0 in range(0, D, BK):
        ks = k0 + tl.arange(0, BK)
        kmask = ks < D
        x = tl.load(x_ptr + rows[:, None] * s_xt + ks[None, :] * s_xk,
                    mask=tmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + n[None, :] * s_wn + ks[:, None] * s_wk,
                    mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc += _mm(x, w, DOT_W, PREC)
        if HW:
            dt = tl.load(d_ptr + (h * R + rr[None, :]) * D + ks[:, None],
                         mask=kmask[:, None] & rmask[None, :], other=0.0)
            z += _mm(x, dt.to(x.dtype), DOT_D, PREC)
        if SH:
            st = tl.load(ds_ptr + rs[None, :] * D + ks[:, None],
                         mask=kmask[:, None] & smask[None, :], other=0.0)
            zs += _mm(x, st.to(x.dtype), DOT_S, PREC)
    if HAS_B:
        acc += tl.load(b_ptr + n, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if HW:
        z += tl.load(zb_ptr + h * R + rr, mask=rmask, other=0.0).to(tl.float32)[None, :]
        tl.store(z_ptr + rows[:, None] * s_zt + h * R + rr[None, :], z,
                 mask=tmask[:, None] & rmask[None, :])
        ut = tl.load(u_ptr + (h * P + cols[None, :]) * R + rr[:, None],
                     mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        acc += _mm(z, ut, DOT_U, "ieee")
    if SH:
        if h == 0:
            tl.store(zs_ptr + rows[:, None] * s_zt + rs[None, :], zs,
                     mask=tmask[:, None] & smask[None, :])
        ust = tl.load(us_ptr + n[None, :] * RS + rs[:, None],
                      mask=smask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        acc += _mm(zs, ust, DOT_US, "ieee")
    return acc


@triton.jit
def _hw_qkv_fwd_kernel(
        x_ptr, s_xt, s_xk,
        wq_ptr, s_wqn, s_wqk, wk_ptr, s_wkn, s_wkk, wv_ptr, s_wvn, s_wvk,
        bq_ptr, bk_ptr, bv_ptr, y_ptr,
        dq_ptr, zbq_ptr, uq_ptr, dsq_ptr, usq_ptr,
        dv_ptr, zbv_ptr, uv_ptr, dsv_ptr, usv_ptr,
        z_ptr, s_zt, ZQ_OFF, ZSQ_OFF, ZV_OFF, ZSV_OFF,
        T, D, P, HQ, HK, HV, RQ, RSQ, RV, RSV,
        BT: tl.constexpr, BK: tl.constexpr, PB: tl.constexpr,
        RBQ: tl.constexpr, RSBQ: tl.constexpr, RBV: tl.constexpr, RSBV: tl.constexpr,
        HAS_BQ: tl.constexpr, HAS_BK: tl.constexpr, HAS_BV: tl.constexpr,
        HWQ: tl.constexpr, SHQ: tl.constexpr, HWV: tl.constexpr, SHV: tl.constexpr,
        PREC: tl.constexpr, DOT: tl.constexpr):
    # grid: (T-blocks, HQ + HK + HV). Program (i, j) writes head j's p columns of the fused
    # [Q | K | V] buffer for token block i. Every branch reads the same X rows: one GEMM pass
    # over X for the frozen projection and every down-projection.
    pid_t = tl.program_id(0)
    j = tl.program_id(1)
    rows = pid_t * BT + tl.arange(0, BT)
    tmask = rows < T
    cols = tl.arange(0, PB)
    cmask = cols < P
    if j < HQ:
        acc = _qkv_head_fwd(x_ptr, s_xt, s_xk, wq_ptr, s_wqn, s_wqk, bq_ptr, y_ptr,
                            dq_ptr, zbq_ptr, uq_ptr, dsq_ptr, usq_ptr,
                            z_ptr + ZQ_OFF, s_zt, z_ptr + ZSQ_OFF, j, pid_t, T, D, P, RQ, RSQ,
                            BT, BK, PB, RBQ, RSBQ, HAS_BQ, HWQ, SHQ, PREC, DOT, DOT, DOT, DOT,
                            DOT)
    elif j < HQ + HK:
        acc = _qkv_head_fwd(x_ptr, s_xt, s_xk, wk_ptr, s_wkn, s_wkk, bk_ptr, y_ptr,
                            dq_ptr, zbq_ptr, uq_ptr, dsq_ptr, usq_ptr,
                            z_ptr, s_zt, z_ptr, j - HQ, pid_t, T, D, P, 0, 0,
                            BT, BK, PB, 16, 16, HAS_BK, False, False, PREC, DOT, DOT, DOT, DOT,
                            DOT)
    else:
        acc = _qkv_head_fwd(x_ptr, s_xt, s_xk, wv_ptr, s_wvn, s_wvk, bv_ptr, y_ptr,
                            dv_ptr, zbv_ptr, uv_ptr, dsv_ptr, usv_ptr,
                            z_ptr + ZV_OFF, s_zt, z_ptr + ZSV_OFF, j - HQ - HK, pid_t, T, D, P,
                            RV, RSV, BT, BK, PB, RBV, RSBV, HAS_BV, HWV, SHV, PREC, DOT, DOT,
                            DOT, DOT, DOT)
    NT = (HQ + HK + HV) * P
    tl.store(y_ptr + rows[:, None] * NT + j * P + cols[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=tmask[:, None] & cmask[None, :])


@triton.jit
def _qkv_sec_bwd(acc, g_ptr, s_gt, H, w_ptr, s_wn, s_wk, d_ptr, u_ptr, ds_ptr, us_ptr,
                 dz_ptr, s_zt, dzs_ptr, pid_t, pid_d, T, D, P, R, RS,
                 BT: tl.constexpr, BD: tl.constexpr, PB: tl.constexpr, RB: tl.constexpr,
                 RSB: tl.constexpr, HW: tl.constexpr, SH: tl.constexpr, PREC: tl.constexpr,
                 DOT: tl.constexpr):
    # One section (q, k or v) of dX: Σ_h dY_h W^h + dZ_h D_h (+ dZ_s D_s), with
    # dZ_h = dY_h U_h recomputed per D-block and written by the first one.
    rows = pid_t * BT + tl.arange(0, BT)
    tmask = rows < T
    dc = pid_d * BD + tl.arange(0, BD)
    dmask = dc < D
    cols = tl.arange(0, PB)
    cmask = cols < P
    rr = tl.arange(0, RB)
    rmask = rr < R
    rs = tl.arange(0, RSB)
    smask = rs < RS
    dzs = tl.zeros((BT, RSB), dtype=tl.float32)
    for h in range(0, H):
        n = h * P + cols
        g = tl.load(g_ptr + rows[:, None] * s_gt + n[None, :],
                    mask=tmask[:, None] & cmask[None, :], other=0.0)
        w = tl.load(w_ptr + n[:, None] * s_wn + dc[None, :] * s_wk,
                    mask=cmask[:, None] & dmask[None, :], other=0.0)
        acc += _mm(g, w, DOT, PREC)
        if HW:
            u = tl.load(u_ptr + (h * P + cols[:, None]) * R + rr[None, :],
                        mask=cmask[:, None] & rmask[None, :], other=0.0).to(tl.float32)
            dz = _mm(g.to(tl.float32), u, DOT, "ieee")
            if pid_d == 0:
                tl.store(dz_ptr + rows[:, None] * s_zt + h * R + rr[None, :], dz,
                         mask=tmask[:, None] & rmask[None, :])
            dm = tl.load(d_ptr + (h * R + rr[:, None]) * D + dc[None, :],
                         mask=rmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            acc += _mm(dz, dm, DOT, "ieee")
        if SH:
            us = tl.load(us_ptr + n[:, None] * RS + rs[None, :],
                         mask=cmask[:, None] & smask[None, :], other=0.0).to(tl.float32)
            dzs += _mm(g.to(tl.float32), us, DOT, "ieee")
    if SH:
        if pid_d == 0:
            tl.store(dzs_ptr + rows[:, None] * s_zt + rs[None, :], dzs,
                     mask=tmask[:, None] & smask[None, :])
        dsm = tl.load(ds_ptr + rs[:, None] * D + dc[None, :],
                      mask=smask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        acc += _mm(dzs, dsm, DOT, "ieee")
    return acc


@triton.jit
def _hw_qkv_bwd_kernel(
        g_ptr,
        wq_ptr, s_wqn, s_wqk, wk_ptr, s_wkn, s_wkk, wv_ptr, s_wvn, s_wvk,
        dq_ptr, uq_ptr, dsq_ptr, usq_ptr, dv_ptr, uv_ptr, dsv_ptr, usv_ptr,
        dx_ptr, dz_ptr, s_zt, ZQ_OFF, ZSQ_OFF, ZV_OFF, ZSV_OFF,
        T, D, P, HQ, HK, HV, RQ, RSQ, RV, RSV,
        BT: tl.constexpr, BD: tl.constexpr, PB: tl.constexpr,
        RBQ: tl.constexpr, RSBQ: tl.constexpr, RBV: tl.constexpr, RSBV: tl.constexpr,
        HWQ: tl.constexpr, SHQ: tl.constexpr, HWV: tl.constexpr, SHV: tl.constexpr,
        PREC: tl.constexpr, DOT: tl.constexpr):
    # grid: (T-blocks, D-blocks); one pass over d[Q | K | V] for dX and the rank-space dZ.
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    NT = (HQ + HK + HV) * P
    acc = tl.zeros((BT, BD), dtype=tl.float32)
    acc = _qkv_sec_bwd(acc, g_ptr, NT, HQ, wq_ptr, s_wqn, s_wqk, dq_ptr, uq_ptr, dsq_ptr,
                       usq_ptr, dz_ptr + ZQ_OFF, s_zt, dz_ptr + ZSQ_OFF, pid_t, pid_d, T, D, P,
                       RQ, RSQ, BT, BD, PB, RBQ, RSBQ, HWQ, SHQ, PREC, DOT)
    acc = _qkv_sec_bwd(acc, g_ptr + HQ * P, NT, HK, wk_ptr, s_wkn, s_wkk, dq_ptr, uq_ptr,
                       dsq_ptr, usq_ptr, dz_ptr, s_zt, dz_ptr, pid_t, pid_d, T, D, P, 0, 0,
                       BT, BD, PB, 16, 16, False, False, PREC, DOT)
    acc = _qkv_sec_bwd(acc, g_ptr + (HQ + HK) * P, NT, HV, wv_ptr, s_wvn, s_wvk, dv_ptr, uv_ptr,
                       dsv_ptr, usv_ptr, dz_ptr + ZV_OFF, s_zt, dz_ptr + ZSV_OFF, pid_t, pid_d,
                       T, D, P, RV, RSV, BT, BD, PB, RBV, RSBV, HWV, SHV, PREC, DOT)
    rows = pid_t * BT + tl.arange(0, BT)
    dc = pid_d * BD + tl.arange(0, BD)
    tl.store(dx_ptr + rows[:, None] * D + dc[None, :], acc.to(dx_ptr.dtype.element_ty),
             mask=(rows[:, None] < T) & (dc[None, :] < D))


class SectionFactors:
    """Kernel-level factors of one projection section (host-built from the user factors).

    down (H, R, d): per-head down-projections (Kernel-wise A_h and lite A_h W_k^h stacked);
    zb (H, R): per-head down-projection bias (lite: b_k^h A_hᵀ; Kernel-wise: 0);
    up (H, p, R): per-head up-projections; sdown (R_s, d), sup (H·p, R_s): the shared LoRA
    part with its scale folded into ``sup``. Absent parts are None. All contiguous.
    """

    __slots__ = ("down", "zb", "up", "sdown", "sup")

    def __init__(self, down=None, zb=None, up=None, sdown=None, sup=None):
        self.down, self.zb, self.up, self.sdown, self.sup = down, zb, up, sdown, sup

    @property
    def hw(self) -> bool:
        return self.down is not None

    @property
    def sh(self) -> bool:
        return self.sdown is not None

    def ranks(self) -> Tuple[int, int]:
        return (self.down.shape[1] if self.hw else 0, self.sdown.shape[0] if self.sh else 0)


def qkv_zlayout(HQ: int, HV: int, q: SectionFactors, v: SectionFactors):
    """Column offsets of [Z_q | Z_sq | Z_v | Z_sv] in the rank-space buffer, and its width."""
    rq, rsq = q.ranks()
    rv, rsv = v.ranks()
    zq = 0
    zsq = zq + HQ * rq
    zv = zsq + rsq
    zsv = zv + HV * rv
    return (zq, zsq, zv, zsv), zsv + rsv


def _qkv_blocks(T, D, P, q: SectionFactors, v: SectionFactors, dev):
    cap = 64 if targets_gpu(dev) else 32
    BT = _blk(T, 16, cap)
    BK = _blk(D, 16, 64)
    PB = _rblk(P)
    rq, rsq = q.ranks()
    rv, rsv = v.ranks()
    return BT, BK, PB, _rblk(rq), _rblk(rsq), _rblk(rv), _rblk(rsv)


def headwise_qkv_forward(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor,
                         bq: Optional[torch.Tensor], bk: Optional[torch.Tensor],
                         bv: Optional[torch.Tensor], q: SectionFactors, v: SectionFactors,
                         P: int):
    """x (T, d) (unit stride along d); w* (N*, d) nn.Linear layout, any strides (Conv1D column
    views work; N* may be 0 to skip a section, e.g. a single adapted projection in the q
    slot); biases (N*,) or None (per-head biases c already folded in); P the head width.

    Returns the fused output [Q | K | V] (T, Nq + Nk + Nv) in x.dtype and the float32
    rank-space buffer Z (T, M) (layout :func:`qkv_zlayout`) that the backward needs.
    """
    T, D = x.shape
    HQ, HK, HV = wq.shape[0] // P, wk.shape[0] // P, wv.shape[0] // P
    dev = x.device
    Y = _alloc.empty(T, (HQ + HK + HV) * P, dtype=x.dtype, device=dev)
    offs, M = qkv_zlayout(HQ, HV, q, v)
    Z = _alloc.empty(T, M, dtype=F32, device=dev)
    if T == 0 or Y.shape[1] == 0:
        return Y, Z
    BT, BK, PB, RBQ, RSBQ, RBV, RSBV = _qkv_blocks(T, D, P, q, v, dev)
    rq, rsq = q.ranks()
    rv, rsv = v.ranks()
    f = lambda t: t if t is not None else x  # noqa: E731
    grid = (triton.cdiv(T, BT), HQ + HK + HV)
    _hw_qkv_fwd_kernel[grid](
        x, x.stride(0), x.stride(1),
        wq, wq.stride(0), wq.stride(1), wk, wk.stride(0), wk.stride(1),
        wv, wv.stride(0), wv.stride(1),
        f(bq), f(bk), f(bv), Y,
        f(q.down), f(q.zb), f(q.up), f(q.sdown), f(q.sup),
        f(v.down), f(v.zb), f(v.up), f(v.sdown), f(v.sup),
        Z, max(M, 1), *offs,
        T, D, P, HQ, HK, HV, rq, rsq, rv, rsv,
        BT=BT, BK=BK, PB=PB, RBQ=RBQ, RSBQ=RSBQ, RBV=RBV, RSBV=RSBV,
        HAS_BQ=bq is not None, HAS_BK=bk is not None, HAS_BV=bv is not None,
        HWQ=q.hw, SHQ=q.sh, HWV=v.hw, SHV=v.sh,
        PREC=dot_precision(x.dtype), DOT=use_dot(BT, min(BK, PB), min(RBQ, RSBQ, RBV, RSBV)),
        num_warps=_NW)
    return Y, Z


def headwise_qkv_backward(g: torch.Tensor, x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
                          wv: torch.Tensor, q: SectionFactors, v: SectionFactors,
                          Z: torch.Tensor, P: int, need_dx: bool = True,
                          need_factors: bool = True):
    """Gradients of :func:`headwise_qkv_forward`; g (T, Nq + Nk + Nv) contiguous.

    Returns dx and, per section q and v, a dict with the gradients of down, zb, up, sdown,
    sup (each in its factor's dtype; zb's and db's in float32) and of the section's bias
    (``db``, the column sums of its output gradient) for the parts that exist.
    """
    T, D = x.shape
    HQ, HK, HV = wq.shape[0] // P, wk.shape[0] // P, wv.shape[0] // P
    dev = x.device
    offs, M = qkv_zlayout(HQ, HV, q, v)
    dZ = _alloc.empty(T, M, dtype=F32, device=dev)
    dx = _alloc.empty(T, D, dtype=x.dtype, device=dev)
    BT, BK, PB, RBQ, RSBQ, RBV, RSBV = _qkv_blocks(T, D, P, q, v, dev)
    # 128-wide heads: 32-token tiles cut the register spills of the three inlined section
    # loops (sm_90 compile check).
    BD = _blk(D, 16, 64)
    if PB >= 128:
        BT = min(BT, 32)
    rq, rsq = q.ranks()
    rv, rsv = v.ranks()
    if T > 0 and (need_dx or (need_factors and M > 0)):
        f = lambda t: t if t is not None else x  # noqa: E731
        grid = (triton.cdiv(T, BT), triton.cdiv(D, BD) if need_dx else 1)
        _hw_qkv_bwd_kernel[grid](
            g,
            wq, wq.stride(0), wq.stride(1), wk, wk.stride(0), wk.stride(1),
            wv, wv.stride(0), wv.stride(1),
            f(q.down), f(q.up), f(q.sdown), f(q.sup), f(v.down), f(v.up), f(v.sdown), f(v.sup),
            dx, dZ, max(M, 1), *offs,
            T, D, P, HQ, HK, HV, rq, rsq, rv, rsv,
            BT=BT, BD=BD, PB=PB, RBQ=RBQ, RSBQ=RSBQ, RBV=RBV, RSBV=RSBV,
            HWQ=q.hw, SHQ=q.sh, HWV=v.hw, SHV=v.sh,
            PREC=dot_precision(x.dtype), DOT=use_dot(BT, min(BD, PB), min(RBQ, RSBQ, RBV, RSBV)),
            num_warps=_NW)
    elif T == 0 and need_dx:
        dx.zero_()
    grads = [{}, {}]
    if need_factors and M > 0:
        # Factor gradients come back in float32 (the host builds these factors in float32).
        dt = F32
        dDall, _, dzball = atb(dZ.unsqueeze(1), x.unsqueeze(1), colsum=True, out_dtype=dt)
        dDall, dzball = dDall[0], dzball[0]
        gq = g[:, :HQ * P]
        gv = g[:, (HQ + HK) * P:]
        for i, (f_, g_, Hs, off, soff) in enumerate(
                ((q, gq, HQ, offs[0], offs[1]), (v, gv, HV, offs[2], offs[3]))):
            r, rs = f_.ranks()
            out = grads[i]
            g3 = g_.unflatten(1, (Hs, P))
            zs = Z[:, soff:soff + rs].unsqueeze(1) if f_.sh else None
            if f_.hw:
                out["down"] = dDall[off:off + Hs * r].reshape(Hs, r, D).to(f_.down.dtype).clone()
                out["zb"] = dzball[off:off + Hs * r].reshape(Hs, r).clone()
                zh = Z[:, off:off + Hs * r].unflatten(1, (Hs, r))
                dU, dUs, db = atb(g3, zh, zs, colsum=True, out_dtype=dt)
                out["up"] = dU.to(f_.up.dtype)
                if f_.sh:
                    out["sup"] = dUs.reshape(Hs * P, rs).to(f_.sup.dtype)
                out["db"] = db.reshape(Hs * P)
            elif f_.sh:
                dUs, _, db = atb(g3, zs, colsum=True, out_dtype=dt)
                out["sup"] = dUs.reshape(Hs * P, rs).to(f_.sup.dtype)
                out["db"] = db.reshape(Hs * P)
            if f_.sh:
                out["sdown"] = dDall[soff:soff + rs].to(f_.sdown.dtype).clone()
    return (dx if need_dx else None), grads[0], grads[1]


# ------------------------------------------------------------------------------------------
# Fused output projection: Y = O W_oᵀ + b + concat_h(O^h A_hᵀ) Bᵀ + O A_sᵀ U_sᵀ


@triton.jit
def _hw_oproj_fwd_kernel(o_ptr, w_ptr, s_wn, s_wk, b_ptr, a_ptr, bw_ptr, as_ptr, us_ptr,
                         y_ptr, z_ptr, T, N, H, P, R, RS,
                         BT: tl.constexpr, BN: tl.constexpr, PB: tl.constexpr,
                         RB: tl.constexpr, RSB: tl.constexpr, HAS_B: tl.constexpr,
                         HW: tl.constexpr, SH: tl.constexpr, PREC: tl.constexpr,
                         DOT: tl.constexpr):
    # grid: (T-blocks, N-blocks). K-loop over heads; z_h = O^h A_hᵀ is complete after head
    # h's chunk, so its up-projection B[:, h] is applied in the same iteration.
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_t * BT + tl.arange(0, BT)
    tmask = rows < T
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < N
    cols = tl.arange(0, PB)
    cmask = cols < P
    rr = tl.arange(0, RB)
    rmask = rr < R
    rs = tl.arange(0, RSB)
    smask = rs < RS
    HP = H * P
    MZ = H * R + RS
    acc = tl.zeros((BT, BN), dtype=tl.float32)
    zs = tl.zeros((BT, RSB), dtype=tl.float32)
    for h in range(0, H):
        kc = h * P + cols
        o = tl.load(o_ptr + rows[:, None] * HP + kc[None, :],
                    mask=tmask[:, None] & cmask[None, :], other=0.0)
        w = tl.load(w_ptr + rn[None, :] * s_wn + kc[:, None] * s_wk,
                    mask=cmask[:, None] & nmask[None, :], other=0.0)
        acc += _mm(o, w, DOT, PREC)
        if HW:
            at = tl.load(a_ptr + (h * R + rr[None, :]) * P + cols[:, None],
                         mask=cmask[:, None] & rmask[None, :], other=0.0)
            z = _mm(o, at, DOT, PREC)
            if pid_n == 0:
                tl.store(z_ptr + rows[:, None] * MZ + h * R + rr[None, :], z,
                         mask=tmask[:, None] & rmask[None, :])
            bt = tl.load(bw_ptr + rn[None, :] * (H * R) + h * R + rr[:, None],
                         mask=rmask[:, None] & nmask[None, :], other=0.0).to(tl.float32)
            acc += _mm(z, bt, DOT, "ieee")
        if SH:
            ast = tl.load(as_ptr + rs[None, :] * HP + kc[:, None],
                          mask=cmask[:, None] & smask[None, :], other=0.0)
            zs += _mm(o, ast, DOT, PREC)
    if SH:
        if pid_n == 0:
            tl.store(z_ptr + rows[:, None] * MZ + H * R + rs[None, :], zs,
                     mask=tmask[:, None] & smask[None, :])
        ust = tl.load(us_ptr + rn[None, :] * RS + rs[:, None],
                      mask=smask[:, None] & nmask[None, :], other=0.0).to(tl.float32)
        acc += _mm(zs, ust, DOT, "ieee")
    if HAS_B:
        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=tmask[:, None] & nmask[None, :])


@triton.jit
def _hw_oproj_bwd_kernel(g_ptr, w_ptr, s_wn, s_wk, a_ptr, bw_ptr, as_ptr, us_ptr,
                         do_ptr, dz_ptr, T, N, H, P, R, RS,
                         BT: tl.constexpr, BN: tl.constexpr, PB: tl.constexpr,
                         RB: tl.constexpr, RSB: tl.constexpr, HW: tl.constexpr,
                         SH: tl.constexpr, PREC: tl.constexpr, DOT: tl.constexpr):
    # grid: (T-blocks, H). dO^h = dY W_o^h + (dY B_h) A_h + (dY U_s) A_s^h; one pass over dY
    # per head; dZ_h (and dZ_s, by head 0) are written for the factor gradients.
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    rows = pid_t * BT + tl.arange(0, BT)
    tmask = rows < T
    cols = tl.arange(0, PB)
    cmask = cols < P
    kc = h * P + cols
    rr = tl.arange(0, RB)
    rmask = rr < R
    rs = tl.arange(0, RSB)
    smask = rs < RS
    HP = H * P
    MZ = H * R + RS
    acc = tl.zeros((BT, PB), dtype=tl.float32)
    dz = tl.zeros((BT, RB), dtype=tl.float32)
    dzs = tl.zeros((BT, RSB), dtype=tl.float32)
    for n0 in range(0, N, BN):
        rn = n0 + tl.arange(0, BN)
        nmask = rn < N
        g = tl.load(g_ptr + rows[:, None] * N + rn[None, :],
                    mask=tmask[:, None] & nmask[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None] * s_wn + kc[None, :] * s_wk,
                    mask=nmask[:, None] & cmask[None, :], other=0.0)
        acc += _mm(g, w, DOT, PREC)
        if HW:
            b = tl.load(bw_ptr + rn[:, None] * (H * R) + h * R + rr[None, :],
                        mask=nmask[:, None] & rmask[None, :], other=0.0)
            dz += _mm(g, b, DOT, PREC)
        if SH:
            us = tl.load(us_ptr + rn[:, None] * RS + rs[None, :],
                         mask=nmask[:, None] & smask[None, :], other=0.0).to(tl.float32)
            dzs += _mm(g.to(tl.float32), us, DOT, "ieee")
    if HW:
        tl.store(dz_ptr + rows[:, None] * MZ + h * R + rr[None, :], dz,
                 mask=tmask[:, None] & rmask[None, :])
        a = tl.load(a_ptr + (h * R + rr[:, None]) * P + cols[None, :],
                    mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        acc += _mm(dz, a, DOT, "ieee")
    if SH:
        if h == 0:
            tl.store(dz_ptr + rows[:, None] * MZ + H * R + rs[None, :], dzs,
                     mask=tmask[:, None] & smask[None, :])
        asm = tl.load(as_ptr + rs[:, None] * HP + kc[None, :],
                      mask=smask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        acc += _mm(dzs, asm, DOT, "ieee")
    tl.store(do_ptr + rows[:, None] * HP + kc[None, :], acc.to(do_ptr.dtype.element_ty),
             mask=tmask[:, None] & cmask[None, :])


def _oproj_blocks(T, N, P, R, RS, dev):
    cap = 64 if targets_gpu(dev) else 32
    return _blk(T, 16, cap), _blk(N, 16, 64), _rblk(P), _rblk(R), _rblk(RS)


def headwise_oproj_forward(o: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                           A: Optional[torch.Tensor], Bw: Optional[torch.Tensor],
                           As: Optional[torch.Tensor], Us: Optional[torch.Tensor], H: int):
    """o (T, H·p) contiguous; w (d, H·p) any strides; b (d,) (c folded in) or None;
    A (H, r, p), Bw (d, H·r), As (r_s, H·p), Us (d, r_s) (scale folded in) contiguous or None.

    Returns Y (T, d) and the float32 rank-space Z (T, H·r + r_s) for the backward.
    """
    T, HP = o.shape
    N = w.shape[0]
    P = HP // H
    R = A.shape[1] if A is not None else 0
    RS = As.shape[0] if As is not None else 0
    dev = o.device
    Y = _alloc.empty(T, N, dtype=o.dtype, device=dev)
    Z = _alloc.empty(T, H * R + RS, dtype=F32, device=dev)
    if T == 0:
        return Y, Z
    BT, BN, PB, RB, RSB = _oproj_blocks(T, N, P, R, RS, dev)
    f = lambda t: t if t is not None else o  # noqa: E731
    grid = (triton.cdiv(T, BT), triton.cdiv(N, BN))
    _hw_oproj_fwd_kernel[grid](
        o, w, w.stride(0), w.stride(1), f(b), f(A), f(Bw), f(As), f(Us), Y, Z,
        T, N, H, P, R, RS, BT=BT, BN=BN, PB=PB, RB=RB, RSB=RSB, HAS_B=b is not None,
        HW=A is not None, SH=As is not None, PREC=dot_precision(o.dtype),
        DOT=use_dot(BT, min(PB, BN), min(RB, RSB)), num_warps=_NW)
    return Y, Z


def headwise_oproj_backward(g: torch.Tensor, o: torch.Tensor, w: torch.Tensor,
                            A: Optional[torch.Tensor], Bw: Optional[torch.Tensor],
                            As: Optional[torch.Tensor], Us: Optional[torch.Tensor],
                            Z: torch.Tensor, H: int, need_do: bool = True,
                            need_factors: bool = True):
    """g (T, d) contiguous. Returns (dO, dict of dA, dBw, dAs, dUs, db for present parts)."""
    T, HP = o.shape
    N = w.shape[0]
    P = HP // H
    R = A.shape[1] if A is not None else 0
    RS = As.shape[0] if As is not None else 0
    dev = o.device
    dt = o.dtype
    dO = _alloc.empty(T, HP, dtype=dt, device=dev)
    dZ = _alloc.empty(T, H * R + RS, dtype=F32, device=dev)
    BT, BN, PB, RB, RSB = _oproj_blocks(T, N, P, R, RS, dev)
    hw, sh = A is not None, As is not None
    if T > 0 and (need_do or (need_factors and (hw or sh))):
        f = lambda t: t if t is not None else o  # noqa: E731
        _hw_oproj_bwd_kernel[(triton.cdiv(T, BT), H)](
            g, w, w.stride(0), w.stride(1), f(A), f(Bw), f(As), f(Us), dO, dZ,
            T, N, H, P, R, RS, BT=BT, BN=BN, PB=PB, RB=RB, RSB=RSB, HW=hw, SH=sh,
            PREC=dot_precision(dt), DOT=use_dot(BT, min(PB, BN), min(RB, RSB)), num_warps=_NW)
    grads = {}
    if need_factors and (hw or sh):
        o3 = o.view(T, H, P)
        if hw:
            grads["A"], _, _ = atb(dZ[:, :H * R].unflatten(1, (H, R)), o3, out_dtype=A.dtype)
        if sh:
            dAs, _, _ = atb(dZ[:, H * R:].unsqueeze(1), o.unsqueeze(1), out_dtype=As.dtype)
            grads["As"] = dAs[0]  # (1, r_s, H·p)[0]: the only view of its buffer
        dBZ, _, db = atb(g.unsqueeze(1), Z.unsqueeze(1), colsum=True, out_dtype=F32)
        dBZ = dBZ[0]
        if hw:
            grads["Bw"] = dBZ[:, :H * R].to(Bw.dtype).contiguous()
        if sh:
            grads["Us"] = dBZ[:, H * R:].to(Us.dtype).contiguous()
        grads["db"] = db[0]
    return (dO if need_do else None), grads


# ------------------------------------------------------------------------------------------
# sm_90 ahead-of-time compile check (see _aot.py): representative launches


@_aot.register("headwise")
def _aot_launches() -> None:
    """GPT-2 small (p = 64), Llama-7B-like with GQA (p = 128), a p = 80 model; Kernel-mix(qvo)
    intermediate ranks; bfloat16 everywhere, float16 and float32 (IEEE dots) on one shape."""
    T = 4096
    f32 = torch.float32
    configs = [(768, 12, 12, 64), (4096, 32, 8, 128), (640, 8, 8, 80)]
    runs = [(torch.bfloat16, c) for c in configs] + [(torch.float16, configs[0]),
                                                     (f32, configs[0])]
    for dt, (d, H, Hkv, p) in runs:
        e = lambda *s, dtype=dt: torch.empty(*s, dtype=dtype)  # noqa: E731
        x = e(T, d)
        # headwise_lowrank: shared basis X (Kernel-wise) and per-head basis K (lite)
        for basis, per_head, db in ((x, False, d), (e(T, H, p), True, p)):
            A, B, c = e(H, 8, db), e(H, p, 8), e(H, p)
            out, z = headwise_lowrank_forward(basis, A, B, c, per_head)
            headwise_lowrank_backward(e(T, H, p), basis, A, B, z, per_head, True, True, True)
        # fused q|k|v: q = Kernel-wise 3 + shared 12, v = lite 8 (+ Kernel-wise 2) + shared 8
        wq, wk, wv = e(H * p, d), e(Hkv * p, d), e(Hkv * p, d)
        bq, bk, bv = e(H * p, dtype=f32), e(Hkv * p), e(Hkv * p, dtype=f32)
        q = SectionFactors(e(H, 3, d, dtype=f32), e(H, 3, dtype=f32), e(H, p, 3, dtype=f32),
                           e(12, d, dtype=f32), e(H * p, 12, dtype=f32))
        v = SectionFactors(e(Hkv, 10, d, dtype=f32), e(Hkv, 10, dtype=f32),
                           e(Hkv, p, 10, dtype=f32), e(8, d, dtype=f32),
                           e(Hkv * p, 8, dtype=f32))
        Y, Z = headwise_qkv_forward(x, wq, wk, wv, bq, bk, bv, q, v, p)
        headwise_qkv_backward(e(T, Y.shape[1]), x, wq, wk, wv, q, v, Z, p)
        # single adapted projection (q slot only), Conv1D-style strided weight, no bias
        none = SectionFactors()
        wt = e(d, H * p).t()
        Y, Z = headwise_qkv_forward(x, wt, e(0, d), e(0, d), None, None, None, q, none, p)
        headwise_qkv_backward(e(T, H * p), x, wt, e(0, d), e(0, d), q, none, Z, p)
        # output projection: Kernel-wise 8 + shared 8
        o, wo = e(T, H * p), e(d, H * p)
        A, Bw, As, Us = e(H, 8, p), e(d, H * 8), e(8, H * p), e(d, 8, dtype=f32)
        Y, Z = headwise_oproj_forward(o, wo, e(d, dtype=f32), A, Bw, As, Us, H)
        headwise_oproj_backward(e(T, d), o, wo, A, Bw, As, Us, Z, H)
