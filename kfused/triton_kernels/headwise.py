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
from kfused.triton_kernels._common import _mm, dot_precision, next_pow2, use_dot

F32 = torch.float32


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
                HAS_B2: tl.constexpr, COLSUM: tl.constexpr):
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
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc2 = tl.zeros((BM, BN2), dtype=tl.float32)
    cs = tl.zeros((BM,), dtype=tl.float32)
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
        acc += _mm(at, bt, True, "ieee")
        if HAS_B2:
            b2 = tl.load(b2_ptr + b * s_b2b + rt[:, None] * s_b2t + rn2[None, :] * s_b2n,
                         mask=tmask[:, None] & (rn2[None, :] < N2), other=0.0).to(tl.float32)
            acc2 += _mm(at, b2, True, "ieee")
        if COLSUM:
            cs += tl.sum(a, axis=0)
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
    if device.type != "cuda":
        return min(chunks, 2)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
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
    BT = 32 if dev.type != "cuda" else 64
    BM = _blk(M, 16, 64)
    BN = _blk(N, 16, 64)
    BN2 = _rblk(N2)
    programs = NB * triton.cdiv(M, BM) * triton.cdiv(N, BN)
    S = _splits(dev, T, programs, BT)
    T_PER = max(BT, triton.cdiv(triton.cdiv(max(T, 1), S), BT) * BT)
    S = max(1, triton.cdiv(T, T_PER))
    c = _alloc.empty(S, NB, M, N, dtype=F32, device=dev)
    c2 = _alloc.empty(S, NB, M, N2, dtype=F32, device=dev) if b2 is not None else c
    cs = _alloc.empty(S, NB, M, dtype=F32, device=dev) if colsum else c
    sb = lambda t: t.stride(1) if t.shape[1] > 1 else 0  # noqa: E731
    bb2 = b2 if b2 is not None else b
    _atb_kernel[(programs, S)](
        a, a.stride(0), a.stride(1), a.stride(2),
        b, b.stride(0), sb(b), b.stride(2),
        bb2, bb2.stride(0), sb(bb2), bb2.stride(2),
        c, c2, cs, T, M, N, N2, NB, T_PER,
        BT=BT, BM=BM, BN=BN, BN2=BN2, HAS_B2=b2 is not None, COLSUM=colsum,
        num_warps=4)
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
            DOT_UP=use_dot(BT, RB, PB), num_warps=4)
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
            num_warps=4)
    dA = dB = db = None
    if need_factors:
        bview = basis if per_head else basis.unsqueeze(1)
        dA, _, _ = atb(dz, bview, out_dtype=A.dtype)
        dB, _, db = atb(g, z, colsum=has_bias, out_dtype=B.dtype)
        if db is not None:
            db = db.to(dt)
    return (dx if need_basis else None), dA, dB, db
