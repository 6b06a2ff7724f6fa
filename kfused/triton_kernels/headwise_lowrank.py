"""Triton kernels of ``headwise_lowrank`` (docs/math.md §2): a per-head low-rank map of a user-given
basis, ``out[t, h] = (basis[t, (h)] @ A_hᵀ) @ B_hᵀ + c_h``. It keeps its own small kernels; the
modules do not use it (the fused projections of headwise_qkv / headwise_oproj subsume it) and
it is kept as a standalone public op.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from kfused import _alloc
from kfused.triton_kernels._common import (cdiv, _NW, _atb, _blk, _mm, _rblk, F32,
                                           dot_precision, use_dot)


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
                 mask=rmask[:, None] & cmask[None, :], other=0.0)
    # Z stays float32: an FMA dot (no tensor-core product of a split float32 operand; see
    # _common.py's note on Triton 3.6)
    out = _mm(z, bt.to(tl.float32), DOT_UP, "ieee")
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
                    mask=tmask[:, None] & cmask[None, :], other=0.0)
        u = tl.load(b_ptr + (h * P + cols[:, None]) * R + rr[None, :],
                    mask=cmask[:, None] & rmask[None, :], other=0.0)
        # every rank-space product an IEEE (FMA) dot in float32, in every dtype: with its
        # 16-bit tensor-core forms (dZ = g B on 16-bit operands, dZ A with dZ split hi + lo)
        # the 16-bit backward gave wrong dbasis/dA and an illegal address on the H200
        # (2026-11-30); the float32 form, these products as now, passed there (_common.py)
        dz = _mm(g.to(tl.float32), u.to(tl.float32), DOT_G, "ieee")
        if pid_d == 0:
            tl.store(dz_ptr + (rows[:, None] * H + h) * R + rr[None, :], dz,
                     mask=tmask[:, None] & rmask[None, :])
        a = tl.load(a_ptr + (h * R + rr[:, None]) * DB + dc[None, :],
                    mask=rmask[:, None] & dmask[None, :], other=0.0)
        acc += _mm(dz, a.to(tl.float32), DOT_A, "ieee")   # dZ float32, an FMA dot as above
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
    grid = (cdiv(T, BT), H)
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
        grid = (cdiv(T, BT), cdiv(DB, BD) if need_basis else 1, nh)
        _hw_lowrank_bwd_kernel[grid](
            g, A, B, dx, s_dt, s_dh, dz, T, H, DB, P, R, hpp,
            BT=BT, BD=BD, PB=PB, RB=RB, DOT_G=use_dot(BT, PB, RB), DOT_A=use_dot(BT, RB, BD),
            num_warps=_NW)
    dA = dB = db = None
    if need_factors:
        if per_head:
            dA, _, _ = _atb(dz, basis, out_dtype=A.dtype)
        else:
            # a shared basis: every head's dZ columns against it in one product
            # (M = H·r rows: the basis read once per row block, not once per head)
            dA, _, _ = _atb(dz.view(T, 1, H * R), basis.unsqueeze(1), out_dtype=A.dtype)
            dA = dA.view(H, R, DB)
        dB, _, db = _atb(g, z, colsum=has_bias, out_dtype=B.dtype)
        if db is not None:
            db = db.to(dt)
    return (dx if need_basis else None), dA, dB, db
