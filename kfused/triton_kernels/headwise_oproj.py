"""Triton host functions of the fused output projection ``headwise_oproj`` (docs/math.md §2):
``Y = O W_oᵀ + b + concat_h(O^h A_hᵀ) Bᵀ + O A_sᵀ U_sᵀ`` (see
:mod:`kfused.triton_kernels._headwise_common` for the design and the predicted roofline).
"""

from __future__ import annotations

import collections
import weakref
from typing import Optional

import torch
import triton
import triton.language as tl

from kfused import _alloc
from kfused.triton_kernels._common import (cdiv, F32, _blk, _row_block_sum, next_pow2,
                                           targets_gpu)
from kfused.triton_kernels._headwise_common import (_PACKED_MAX, _operand_keys, colsum_rows,
                                                    frozen_gemm, gemm, reduce_tokens)


# ------------------------------------------------------------------------------------------
# Fused output projection: Y = O W_oᵀ + b + concat_h(O^h A_hᵀ) Bᵀ + O A_sᵀ U_sᵀ


@triton.jit
def _oproj_row(pid, HP, P, R, RS):
    """Row ``pid`` of D_o (H·R + R_s rows): (H·R, H·R + R_s, head h, rank j, the head's
    first column h·P, or 0 for a shared row)."""
    HR = (HP // P) * R
    rr = tl.maximum(R, 1)
    h = pid // rr
    return HR, HR + RS, h, pid % rr, tl.where(pid < HR, h * P, 0)


@triton.jit
def _oproj_pack_kernel(a_ptr, s_ah, s_ar, s_ap, as_ptr, s_asr, s_asc,
                       bw_ptr, s_bwn, s_bwm, sb_ptr, s_sbn, s_sbm, do_ptr, bc_ptr,
                       HP, P, R, RS, N, scale,
                       BC: tl.constexpr, BR: tl.constexpr, MP: tl.constexpr):
    # grid (M + cdiv(N, BR),), M = H·R + RS. Programs [0, M): row i of the dense
    # block-diagonal D_o (M, H·P): A_h[j, :] at columns [h·P, (h+1)·P) for i = h·R + j < H·R,
    # shared A_s[i − H·R, :] after. Programs [M, ..): BR rows of [B_w | scale·B_s] (N, M).
    # Outputs contiguous in the activation dtype; every entry is one factor entry (float32
    # product for the scaled B_s) rounded once.
    pid = tl.program_id(0)
    HR, M, h, j, lo = _oproj_row(pid, HP, P, R, RS)
    if pid < M:
        # Scalar conditions enter the vector masks as limits (the interpreter mishandles
        # scalar & vector masks): per-head rows read A inside their head's columns only,
        # shared rows read A_s everywhere.
        hi = tl.where(pid < HR, h * P + P, 0)
        hs = tl.where(pid < HR, 0, HP)
        js = tl.maximum(pid - HR, 0)
        for c0 in range(0, HP, BC):
            cs = c0 + tl.arange(0, BC)
            mine = (cs >= lo) & (cs < hi)
            v = tl.load(a_ptr + h * s_ah + j * s_ar + (cs - lo) * s_ap, mask=mine, other=0.0)
            v = v.to(tl.float32) + tl.load(as_ptr + js * s_asr + cs * s_asc, mask=cs < hs,
                                           other=0.0).to(tl.float32)
            tl.store(do_ptr + pid * HP + cs, v.to(do_ptr.dtype.element_ty), mask=cs < HP)
    else:
        n = (pid - M) * BR + tl.arange(0, BR)
        m = tl.arange(0, MP)
        nm = (n < N)[:, None]
        w = tl.load(bw_ptr + n[:, None] * s_bwn + m[None, :] * s_bwm,
                    mask=nm & (m < HR)[None, :], other=0.0).to(tl.float32)
        ms = tl.maximum(m - HR, 0)
        w += tl.load(sb_ptr + n[:, None] * s_sbn + ms[None, :] * s_sbm,
                     mask=nm & ((m >= HR) & (m < M))[None, :], other=0.0).to(tl.float32) * scale
        tl.store(bc_ptr + n[:, None] * M + m[None, :], w.to(bc_ptr.dtype.element_ty),
                 mask=nm & (m < M)[None, :])


@triton.jit
def _oproj_unpack_kernel(dd_ptr, s_dds, s_ddm, db_ptr, s_dbs, s_dbn, S_D, S_B,
                         da_ptr, das_ptr, dbw_ptr, dsb_ptr, cs_ptr, CS_ROWS, dbo_ptr,
                         HP, P, R, RS, N, scale,
                         BC: tl.constexpr, BR: tl.constexpr, MP: tl.constexpr,
                         HAS_CS: tl.constexpr, CSB: tl.constexpr,
                         SCALE_SHARED: tl.constexpr = False):
    # The gradients of _oproj_pack_kernel's outputs back to the factors, summing the token
    # reductions' partials in a fixed order: dD (S_D, M, H·P), dBcat (S_B, N, M), any float
    # dtype, unit last stride. Outputs contiguous in the factors' dtypes. HAS_CS: also the
    # bias gradient dbo (N,) float32 = the sum of the dx GEMM's column-sum rows cs
    # (CS_ROWS, N), CSB rows per load (a (CSB, BR) block reduced over its rows, the blocks
    # in order): CS_ROWS is T/16 (1024 rows at T = 16384), and one row per load was a chain
    # of that many dependent loads.
    pid = tl.program_id(0)
    HR, M, h, j, lo = _oproj_row(pid, HP, P, R, RS)
    if pid < M:
        for c0 in range(0, tl.where(pid < HR, P, HP), BC):
            # per-head rows: their head's P columns; shared rows: all H·P
            cs = c0 + tl.arange(0, BC)
            lim = tl.where(pid < HR, tl.minimum(lo + P, HP), HP)
            cc = tl.where(pid < HR, lo + cs, cs)
            # the token-split partials CSB per load (a fixed order), as the bias gradient's
            # rows below and the q|k|v unpack: one dependent load per split was a chain
            acc = _row_block_sum(tl.zeros((BC,), dtype=tl.float32), dd_ptr + pid * s_ddm,
                                 S_D, s_dds, cc, cc < lim, CSB)
            tl.store(da_ptr + (h * R + j) * P + cs, acc.to(da_ptr.dtype.element_ty),
                     mask=cc < tl.where(pid < HR, lim, 0))
            js = tl.maximum(pid - HR, 0)
            if SCALE_SHARED:   # dZ's shared rows were dY·B_s (RAW_SHARED fold): s here
                acc = acc * scale
            tl.store(das_ptr + js * HP + cs, acc.to(das_ptr.dtype.element_ty),
                     mask=cs < tl.where(pid < HR, 0, HP))
    else:
        n = (pid - M) * BR + tl.arange(0, BR)
        m = tl.arange(0, MP)
        nm = (n < N)[:, None]
        acc = tl.zeros((BR, MP), dtype=tl.float32)
        for s in range(0, S_B):
            acc += tl.load(db_ptr + s * s_dbs + n[:, None] * s_dbn + m[None, :],
                           mask=nm & (m < M)[None, :], other=0.0).to(tl.float32)
        tl.store(dbw_ptr + n[:, None] * HR + m[None, :], acc.to(dbw_ptr.dtype.element_ty),
                 mask=nm & (m < HR)[None, :])
        ms = tl.maximum(m - HR, 0)
        tl.store(dsb_ptr + n[:, None] * RS + ms[None, :],
                 (acc * scale).to(dsb_ptr.dtype.element_ty),
                 mask=nm & ((m >= HR) & (m < M))[None, :])
        if HAS_CS:
            db = _row_block_sum(tl.zeros((BR,), dtype=tl.float32), cs_ptr, CS_ROWS, N, n,
                                n < N, CSB)
            tl.store(dbo_ptr + n, db.to(dbo_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _oproj_fold_kernel(w_ptr, s_wn, s_wk, bc_ptr, do_ptr, out_ptr, s_on, N, HP, M,
                       us_ptr, s_usn, s_usr, HR, b_ptr, c_ptr, bs_ptr,
                       APPEND: tl.constexpr, RAW_SHARED: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
                       HAS_B: tl.constexpr, HAS_C: tl.constexpr):
    # W' (N, H·P) = W + [B_w | s·B_s] (N, M) · D_o (M, H·P), the packed 16-bit operands of
    # _oproj_pack_kernel (both contiguous): exact products summed with W in float32
    # (tensor-core dots), rounded once to the output dtype; out has row stride s_on.
    # APPEND 0: out = W', grid (cdiv(N, BN), cdiv(H·P, BK)). APPEND 1: out = [W'; D_o]
    # (N + M, H·P), rows N.. copy D_o (the forward's B operand: Y and Z from one GEMM), grid
    # (cdiv(N + M, BN), cdiv(H·P, BK)). APPEND 2: out = [W' | B_c] (N, H·P + M), columns
    # H·P.. copy B_c (the backward's: dO and dZ from one GEMM), grid (cdiv(N, BN),
    # cdiv(H·P + M, BK)). APPEND 3: both in one buffer, out = [[W', B_c], [D_o, 0]]
    # (N + M, s_on): its first H·P columns are APPEND 1's operand and its first N rows
    # APPEND 2's (a forward that keeps W' for its backward), the columns from H·P + M to the
    # row stride s_on zero, grid (cdiv(N + M, BN), cdiv(s_on, BK)). A copied entry is the
    # packed value itself (0 + v in float32: exact).
    # RAW_SHARED (APPEND 2, 3): the shared columns H·P + H·R.. copy B_s itself (us_ptr,
    # (N, R_s), any strides) rather than the packed s·B_s: dZ's shared rows come out of the
    # dO GEMM as dY·B_s, rounded once, and the unpack applies s to their token sums in float32.
    # HAS_B / HAS_C: the column-0 programs also write the forward GEMM's bias b + c (N,) to
    # bs_ptr in out's dtype, summed in float32 and rounded once (no torch op for it).
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    if HAS_B or HAS_C:
        if pid_k == 0:
            bm = rn < N
            bsum = tl.zeros((BN,), dtype=tl.float32)
            if HAS_B:
                bsum += tl.load(b_ptr + rn, mask=bm, other=0.0).to(tl.float32)
            if HAS_C:
                bsum += tl.load(c_ptr + rn, mask=bm, other=0.0).to(tl.float32)
            tl.store(bs_ptr + rn, bsum.to(bs_ptr.dtype.element_ty), mask=bm)
    rk = pid_k * BK + tl.arange(0, BK)
    nm = (rn < N)[:, None]
    km = (rk < HP)[None, :]
    acc = tl.load(w_ptr + rn[:, None] * s_wn + rk[None, :] * s_wk, mask=nm & km,
                  other=0.0).to(tl.float32)
    for m0 in range(0, M, BR):
        rm = m0 + tl.arange(0, BR)
        b = tl.load(bc_ptr + rn[:, None] * M + rm[None, :], mask=nm & (rm < M)[None, :],
                    other=0.0)
        d = tl.load(do_ptr + rm[:, None] * HP + rk[None, :], mask=(rm < M)[:, None] & km,
                    other=0.0)
        acc += tl.dot(b, d, out_dtype=tl.float32)
    if APPEND == 1 or APPEND == 3:
        dr = tl.maximum(rn - N, 0)
        acc += tl.load(do_ptr + dr[:, None] * HP + rk[None, :],
                       mask=((rn >= N) & (rn < N + M))[:, None] & km, other=0.0).to(tl.float32)
    if APPEND == 2 or APPEND == 3:
        bcol = tl.maximum(rk - HP, 0)
        cm = nm & ((rk >= HP) & (rk < HP + M))[None, :]
        if RAW_SHARED:
            acc += tl.load(bc_ptr + rn[:, None] * M + bcol[None, :],
                           mask=cm & (bcol < HR)[None, :], other=0.0).to(tl.float32)
            scol = tl.maximum(bcol - HR, 0)
            acc += tl.load(us_ptr + rn[:, None] * s_usn + scol[None, :] * s_usr,
                           mask=cm & (bcol >= HR)[None, :], other=0.0).to(tl.float32)
        else:
            acc += tl.load(bc_ptr + rn[:, None] * M + bcol[None, :], mask=cm,
                           other=0.0).to(tl.float32)
    if APPEND == 1:
        om = (rn < N + M)[:, None] & km
    elif APPEND == 2:
        om = nm & (rk < HP + M)[None, :]
    elif APPEND == 3:   # the padding columns up to the row stride get zeros (acc there)
        om = (rn < N + M)[:, None] & (rk < s_on)[None, :]
    else:
        om = nm & km
    tl.store(out_ptr + rn[:, None] * s_on + rk[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=om)


def oproj_fold(w: torch.Tensor, Bc: torch.Tensor, Do: torch.Tensor,
               append: int = 0, raw_shared: Optional[torch.Tensor] = None,
               bias_sum: Optional[tuple] = None) -> torch.Tensor:
    """W' = w + Bc·Do (N, H·P), contiguous, in the packed operands' (16-bit) dtype: the update
    folded into the frozen weight (any strides), one launch. ``append=1``: [W'; Do]
    (N + M, H·P), the forward's B operand (Y and Z = O Doᵀ from one GEMM); ``append=2``:
    [W' | Bc] (N, H·P + M), the backward's (dO and dZ = dY Bc from one GEMM); ``append=3``:
    both in one buffer [[W', Bc], [Do, 0]] (N + M, :func:`kept_width`), whose first H·P
    columns are append=1's operand and first N rows (H·P + M columns) append=2's
    (:func:`oproj_keeps_fold`; the columns past H·P + M are zero padding).
    ``raw_shared`` (append=2, 3): B_s (N, R_s), any strides: its last R_s appended columns
    hold B_s instead of Bc's s·B_s (W' still folds s·B_s). ``bias_sum``: (b, c, out) with b, c
    (N,) contiguous or None and out (N,) in Do's dtype: the same launch writes b + c there
    (float32 sum, rounded once)."""
    N, HP = w.shape
    M = Bc.shape[1]
    rows, cols = ((N + M, HP) if append == 1 else (N, HP + M) if append == 2
                  else (N + M, HP + M) if append == 3 else (N, HP))
    out = _alloc.empty(rows, kept_width(HP, M) if append == 3 else cols, dtype=Do.dtype,
                       device=w.device)
    if rows == 0 or cols == 0:
        return out
    gpu = targets_gpu(w.device)
    BN, BK = (64, 128) if gpu else (32, 32)
    BR = _blk(M, 16, 32)
    raw = append in (2, 3) and raw_shared is not None and raw_shared.shape[1] > 0
    us = raw_shared if raw else Bc
    bb, cc, bs = bias_sum if bias_sum is not None else (None, None, None)
    _oproj_fold_kernel[(cdiv(rows, BN), cdiv(out.shape[1], BK))](
        w, w.stride(0), w.stride(1), Bc, Do, out, out.shape[1], N, HP, M, us,
        us.stride(0) if raw else 0, us.stride(1) if raw else 0,
        M - raw_shared.shape[1] if raw else M, bb if bb is not None else out,
        cc if cc is not None else out, bs if bs is not None else out,
        APPEND=append, RAW_SHARED=raw, BN=BN, BK=BK, BR=BR,
        HAS_B=bs is not None and bb is not None, HAS_C=bs is not None and cc is not None,
        num_warps=4 if gpu else 1)
    return out


def kept_width(HP: int, M: int) -> int:
    """Row length of the kept folded operands (``oproj_fold(append=3)``): H·P + M rounded up
    to 16 elements, so that both GEMMs reading it see a row stride Triton specialises as
    divisible by 16 (at GPT-2 widths H·P + M = 828: the forward GEMM over the unpadded
    buffer's first H·P columns compiled for sm_90 with a 72-byte spill, kfused perf)."""
    return (HP + M + 15) // 16 * 16


def _pack_grid(M: int, N: int, width: int, dev):
    """(BR rows of the up-projection per program, BC columns per step, grid)."""
    BR = 32 if targets_gpu(dev) else 8
    return BR, _blk(width, 16, 256 if targets_gpu(dev) else 32), (M + cdiv(N, BR),)


def _oproj_pack(A, Bw, As, Bs, scale: float, H: int, P: int, N: int, dtype):
    """Dense down-projection D_o (H·R + R_s, H·P) and up-projection [B_w | scale·B_s]
    (N, H·R + R_s), in ``dtype``, contiguous: one launch."""
    R = A.shape[1] if A is not None else 0
    RS = As.shape[0] if As is not None else 0
    M, HP = H * R + RS, H * P
    ref = A if A is not None else As
    dev = ref.device
    Do = _alloc.empty(M, HP, dtype=dtype, device=dev)
    Bc = _alloc.empty(N, M, dtype=dtype, device=dev)
    BR, BC, grid = _pack_grid(M, N, HP, dev)
    a = A if A is not None else Do
    as_ = As if As is not None else Do
    bw = Bw if Bw is not None else Do
    bs = Bs if Bs is not None else Do
    _oproj_pack_kernel[grid](
        a, *(a.stride() if A is not None else (0, 0, 0)), as_,
        *(as_.stride() if As is not None else (0, 0)), bw,
        *(bw.stride() if Bw is not None else (0, 0)), bs,
        *(bs.stride() if Bs is not None else (0, 0)), Do, Bc,
        HP, P, R, RS, N, float(scale), BC=BC, BR=BR, MP=next_pow2(M), num_warps=4)
    return Do, Bc


def _oproj_unpack(dD, dB, A, Bw, As, Bs, scale: float, H: int, P: int,
                  cs: Optional[torch.Tensor] = None,
                  db_dtype: Optional[torch.dtype] = None, scale_shared: bool = False) -> dict:
    """Factor gradients from the token reductions' partials dD (S, M, H·P) and dB (S, N, M):
    dA (H, R, P), dB_w (N, H·R), dA_s (R_s, H·P), dB_s = scale·Σ (N, R_s), each in its
    factor's dtype, and with ``cs`` (the dx GEMM's column-sum rows, (rows, N) float32) the
    bias gradient "db" (N,) float32 or ``db_dtype`` (summed in float32, rounded on store)
    (one launch)."""
    R = A.shape[1] if A is not None else 0
    RS = As.shape[0] if As is not None else 0
    M, HP, N = H * R + RS, H * P, dB.shape[1]
    dev = dD.device
    out = {}
    if R:
        out["A"] = _alloc.empty(H, R, P, dtype=A.dtype, device=dev)
        out["Bw"] = _alloc.empty(N, H * R, dtype=Bw.dtype, device=dev)
    if RS:
        out["As"] = _alloc.empty(RS, HP, dtype=As.dtype, device=dev)
        out["Us"] = _alloc.empty(N, RS, dtype=Bs.dtype, device=dev)
    if cs is not None:
        out["db"] = _alloc.empty(N, dtype=db_dtype or F32, device=dev)
    BR, BC, grid = _pack_grid(M, N, P, dev)
    _oproj_unpack_kernel[grid](
        dD, dD.stride(0), dD.stride(1), dB, dB.stride(0), dB.stride(1), dD.shape[0],
        dB.shape[0], out.get("A", dD), out.get("As", dD), out.get("Bw", dD),
        out.get("Us", dD), cs if cs is not None else dD, cs.shape[0] if cs is not None else 0,
        out.get("db", dD), HP, P, R, RS, N, float(scale), BC=BC, BR=BR, MP=next_pow2(M),
        HAS_CS=cs is not None, CSB=64 if targets_gpu(dev) else 8,
        SCALE_SHARED=bool(scale_shared and RS), num_warps=4)
    return out


# D_o and [B_w | scale·B_s] built by an output-projection forward, handed to its backward
# (same contract as _PACKED: keyed by the factors' storage, version, shape and strides and
# the scale, valid only for the very Z the forward returned; popped on use, bounded).
_OPACKED: "collections.OrderedDict" = collections.OrderedDict()


def _oproj_operands(A, Bw, As, Bs, scale: float, H: int, P: int, N: int, dtype,
                    Z: torch.Tensor, keep: bool):
    keys = _operand_keys((A, Bw, As, Bs))     # (None for inference tensors: not recorded)
    key = None if keys is None else (keys, float(scale), dtype, H)
    keep = keep and key is not None
    if not keep and key is not None:
        rec = _OPACKED.pop(key, None)
        if rec is not None and rec[0]() is Z:
            return rec[1]
    out = _oproj_pack(A, Bw, As, Bs, scale, H, P, N, dtype)
    if keep:
        _OPACKED.pop(key, None)
        _OPACKED[key] = (weakref.ref(Z), out)
        while len(_OPACKED) > _PACKED_MAX:
            _OPACKED.popitem(last=False)
    return out


# out = a @ b for a GEMM with a thin side that needs no fusion: cuBLAS for 16-bit on a GPU,
# the Triton GEMM otherwise (exact float32 dots) — the folded q|k|v GEMMs' helper
_thin = frozen_gemm


# Tests set this to True or False to keep (or not) the folded weight whatever the shapes
# (None: oproj_keeps_fold decides).
FORCE_KEEP = None


def oproj_keeps_fold(N: int, HP: int, M: int, T: int) -> bool:
    """Whether a folded forward keeps its folded operands for the backward — one buffer
    [[W', B_c], [D_o, 0]] (N + M rows of H·P + M, padded to :func:`kept_width`) from one
    fold launch, the backward's dO GEMM reading its first N rows — instead of the backward
    folding W' again (one launch and one d×H·p pass fewer per step: PREDICTED 107.0 → 102.3 µs
    at GPT-2 small, T = 16384, H100): when the buffer is no larger than the rank-space Z
    (T × M) the forward saves anyway, the rule of the q|k|v projection's
    :func:`~kfused.triton_kernels.headwise_qkv.keeps_fold` (kept at GPT-2 small and medium
    widths with the benchmark preset, 0.70 and 0.97 of Z at 16k tokens; folded again at
    Llama-7B's, 7.8 × Z)."""
    if FORCE_KEEP is not None:
        return bool(FORCE_KEEP) and M > 0
    return M > 0 and (N + M) * (HP + M) <= T * M


def headwise_oproj_forward(o: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                           A: Optional[torch.Tensor], Bw: Optional[torch.Tensor],
                           As: Optional[torch.Tensor], Us: Optional[torch.Tensor], H: int,
                           scale: float = 1.0, c: Optional[torch.Tensor] = None,
                           fold: bool = False):
    """o (T, H·p) any strides; w (d, H·p) any strides; b (d,) contiguous or None; c (d,)
    (the per-head bias, added with b in the epilogue) contiguous or None; A (H, r, p),
    Bw (d, H·r), As (r_s, H·p), Us (d, r_s) any strides or None; ``scale`` multiplies Us.
    ``fold`` (16-bit only): [Y | Z] = O·[W'; D_o]ᵀ, one GEMM over the appended folded weight
    W' = W + [B_w | s·B_s] D_o (:func:`oproj_fold`), instead of Z's thin GEMM and the
    two-segment GEMM [O | Z]·[W | B]ᵀ.

    Returns Y (T, d) and the rank-space Z (T, H·r + r_s) in o.dtype for the backward, and
    the folded operands the backward reuses where :func:`oproj_keeps_fold` keeps them (else an
    empty tensor).
    """
    T, HP = o.shape
    N = w.shape[0]
    P = HP // H
    R = A.shape[1] if A is not None else 0
    RS = As.shape[0] if As is not None else 0
    dev = o.device
    M = H * R + RS
    Y = _alloc.empty(T, N, dtype=o.dtype, device=dev)
    Z = _alloc.empty(T, M, dtype=o.dtype, device=dev)
    if T == 0 or N == 0:
        return Y, Z, o.new_empty(0)
    segs = [(o, w.t())]
    if M:
        Do, Bcat = _oproj_operands(A, Bw, As, Us, scale, H, P, N, o.dtype, Z, keep=True)
        if fold:
            # Y = O W'ᵀ over the folded weight and Z = O D_oᵀ, each its own frozen-shaped GEMM
            # (cuBLAS on a GPU). One Triton GEMM over [W'; D_o] for both measured 91 µs on
            # the H200 (2026-11-30, GPT-2 small, 16k tokens) where cuBLAS's frozen GEMM of
            # the same width took 31 µs; Z's thin GEMM re-reads O (PREDICTED ~8 µs there).
            keep = oproj_keeps_fold(N, HP, M, T)
            # the GEMM's one bias, b + c in o's dtype, written by the fold launch
            bsum = (_alloc.empty(N, dtype=o.dtype, device=dev)
                    if b is not None or c is not None else None)
            if keep:
                # [[W', B_c], [D_o, 0]]: the forward reads its first H·P columns, the
                # backward's dO GEMM its first N rows (the shared columns as that GEMM
                # wants them: B_s itself when scale != 1, see headwise_oproj_backward)
                buf = oproj_fold(w, Bcat, Do, append=3,
                                 raw_shared=Us if RS and scale != 1.0 else None,
                                 bias_sum=(b, c, bsum))
            else:
                buf = oproj_fold(w, Bcat, Do, append=1, bias_sum=(b, c, bsum))
            frozen_gemm(o, buf[:N, :HP].t(), Y, bias=bsum)
            frozen_gemm(o, buf[N:N + M, :HP].t(), Z)
            return Y, Z, (buf if keep else o.new_empty(0))
        _thin(o, Do.t(), Z)
        segs.append((Z, Bcat.t()))
    gemm(segs, Y, bias=b, bias2=c)
    return Y, Z, o.new_empty(0)


def headwise_oproj_backward(g: torch.Tensor, o: torch.Tensor, w: torch.Tensor,
                            A: Optional[torch.Tensor], Bw: Optional[torch.Tensor],
                            As: Optional[torch.Tensor], Us: Optional[torch.Tensor],
                            Z: torch.Tensor, H: int, need_do: bool = True,
                            need_factors: bool = True, scale: float = 1.0, fold: bool = False,
                            db_dtype: Optional[torch.dtype] = None,
                            w_fold: Optional[torch.Tensor] = None):
    """g (T, d) any strides. Returns (dO, dict of dA, dBw, dAs, dUs (scale·Σ) for the present
    parts, and db, float32 or ``db_dtype``). ``fold``: dO = g W' with the forward's folded
    weight (recomputed) instead of [g | dZ]·[W; D_o]; dZ is then formed only for the factor
    gradients, by the same GEMM over [W' | B_c] when dO is wanted too. ``w_fold``: the
    forward's kept operands where it kept them (:func:`oproj_keeps_fold`; None or empty:
    fold again)."""
    T, HP = o.shape
    N = w.shape[0]
    P = HP // H
    R = A.shape[1] if A is not None else 0
    RS = As.shape[0] if As is not None else 0
    M = H * R + RS
    dev = o.device
    dt = o.dtype
    dO = _alloc.empty(T, HP, dtype=dt, device=dev) if need_do else None
    grads = {}
    if not M:
        if need_do:
            if T and N:
                gemm([(g, w)], dO)
            else:
                dO.zero_()
        return dO, grads
    Do, Bcat = _oproj_operands(A, Bw, As, Us, scale, H, P, N, dt, Z, keep=False)
    fold = fold and N > 0
    dZ = _alloc.empty(T, M, dtype=dt, device=dev) if need_factors or not fold else None
    # folded with dO and the factor gradients wanted: dO and dZ = dY Bc from the columns of
    # one folded operand [W' | Bc], each its own frozen-shaped GEMM (cuBLAS on a GPU: the one
    # Triton GEMM for both, with the bias gradient's column sums in its epilogue, measured
    # 274 µs on the H200 at GPT-2 small, 16k tokens, against cuBLAS's 30 µs for the frozen
    # dO); otherwise dZ (when wanted) from its own thin GEMM first
    fused_dz = fold and need_do and need_factors and T > 0
    # folded with a shared part and scale != 1: the [W' | B_c] GEMM's shared dZ columns are
    # dY·B_s (B_s itself appended, rounded once) and the unpack scales their token sums by s
    # in float32 — more exact than the torch path's round(round(s·dY)·B_s), and no pass over
    # dY (the multiply, thin GEMM and copy below took 19.8 + ~9 + 3 µs PREDICTED at GPT-2
    # small, T = 16384)
    raw = fused_dz and RS > 0 and scale != 1.0 and N > 0
    kept = w_fold if fold and w_fold is not None and w_fold.numel() else None
    if dZ is not None and not fused_dz:
        _thin(g, Bcat, dZ)
    cs = None
    if need_do and T:
        if N:
            if fused_dz:
                # (the kept buffer's shared columns hold B_s itself exactly when raw does);
                # the bias gradient then takes its own pass over dY below
                opnd = (kept[:N, :HP + M] if kept is not None else
                        oproj_fold(w, Bcat, Do, append=2, raw_shared=Us if raw else None))
                frozen_gemm(g, opnd[:, :HP], dO)
                frozen_gemm(g, opnd[:, HP:HP + M], dZ)
            elif fold:
                frozen_gemm(g, kept[:N, :HP] if kept is not None else oproj_fold(w, Bcat, Do),
                            dO)
            else:
                # the bias gradient Σ_t dY from the dx GEMM's own reads of dY (column sums
                # per row slice, summed by the unpack kernel): no separate pass over dY
                cs = (_alloc.empty(colsum_rows(T), N, dtype=F32, device=dev) if need_factors
                      else None)
                segs = [(g, w), (dZ, Do)]
                gemm(segs, dO, colsum=cs)
        else:
            gemm([(dZ, Do)], dO)
    if need_factors and RS and scale != 1.0 and T and N and not raw:
        # the shared rows of dZ as round(s·dY) B_s, the same-precision torch path's rounding
        # order (as the q|k|v rank pass's SH_SCALE does), not dY round(s·B_s) from the packed
        # B_c: the latter missed docs/math.md §4 on dA_s (float16, one token: 2.65e-3 against
        # 2.44e-3, tests/test_properties.py). Costs one more thin GEMM over dY (PREDICTED
        # ≈ 11 µs at GPT-2 small, T = 16384).
        gs = g * scale      # one rounding of s·dY to dt, as torch's half-precision multiply
        tmp = _alloc.empty(T, RS, dtype=dt, device=dev)
        _thin(gs, Us, tmp)
        dZ[:, H * R:] = tmp
    if need_factors:
        dB = reduce_tokens(g, Z, partials=True)           # (S, d, M)
        dD = reduce_tokens(dZ, o, partials=True)          # (S, M, H·p)
        grads = _oproj_unpack(dD, dB, A, Bw, As, Us, scale, H, P, cs, db_dtype,
                              scale_shared=raw)
        if cs is None:
            grads["db"] = g.sum(0, dtype=F32).to(db_dtype or F32)
    return dO, grads
