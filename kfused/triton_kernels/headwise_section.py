"""Triton host functions that assemble a Kernel-wise-lite section's kernel-level factors
(docs/math.md §2) in one launch, and take their gradients back in one launch.

A section with lite heads feeds the packed GEMMs per-head rows ``down (H, R, d)``, biases
``zb (H, R)`` and up-projections ``up (H, p, R)``, float32, stacked along the rank:

    rows [0, RW)                Kernel-wise A_h                 zb 0         up B_h (wise)
    rows [RW, RW + RL)          lite basis A_h W_k^h  (hi)      b_k^h A_hᵀ   up B_h (lite)
    rows [RW + RL, RW + 2 RL)   A_h W_k^h − hi        (lo)      0            up B_h (lite)

(the hi/lo pair only for 16-bit activations, see ``kfused.ops._headwise_common._section``;
float32 has one basis row per lite rank). Query head h reads key head ``h // G``.

Built with torch ops this was about twenty launch-bound kernels per section and call (casts of
every factor and of the whole key weight to float32, the basis and bias products, the split,
zero blocks, concatenations) and seven more in the backward; here it is one kernel each way.
The basis product is p multiply-adds per element (p ≤ 256): CUDA-core float32 FMA, no tensor
cores (its operands are rounded 16-bit factors and weights, the product must stay float32).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from kfused import _alloc
from kfused.triton_kernels._common import (cdiv, F32, _bcast_mm, _blk, next_pow2,
                                           targets_gpu, tl_dtype)


@triton.jit
def _section_fwd_kernel(wa_ptr, s_wah, s_war, s_wad, wb_ptr, s_wbh, s_wbp, s_wbr,
                        la_ptr, s_lah, s_lar, s_lap, lb_ptr, s_lbh, s_lbp, s_lbr,
                        wk_ptr, s_wkn, s_wkd, bk_ptr,
                        down_ptr, zb_ptr, up_ptr, K, P, RW, RL, R, G,
                        SPLIT: tl.constexpr, HAS_BK: tl.constexpr, HI: tl.constexpr,
                        RWP: tl.constexpr, RLP: tl.constexpr, PP: tl.constexpr,
                        BD: tl.constexpr, PB: tl.constexpr):
    # grid (H, cdiv(K, BD)): program (h, i) writes columns [i·BD, (i+1)·BD) of head h's rows;
    # program (h, 0) also writes its zb and up. Outputs contiguous float32.
    h = tl.program_id(0)
    kh = h // G
    ds = tl.program_id(1) * BD + tl.arange(0, BD)
    dmask = ds < K
    jl = tl.arange(0, RLP)
    lmask = jl < RL
    jw = tl.arange(0, RWP)
    wmask = jw < RW
    # the basis rows: Σ_p A_h[j, p] W_k[kh·P + p, ds], PB rows of W_k per load (a (RLP, PB,
    # BD) product summed over p): one row per load made a chain of P dependent loads
    # (H100: 29 µs at P = 64 for 12 heads, GPT-2 small q|k|v)
    # Each block's loads are issued one step ahead (registers): a warp issues in order, so a
    # load placed after the previous block's products waits a DRAM round trip per block
    # (16 blocks at P = 64; the H100 ran this kernel at 15.0 µs against 4.0 predicted).
    acc = tl.zeros((RLP, BD), dtype=tl.float32)
    pb = tl.arange(0, PB)
    a_n = tl.load(la_ptr + h * s_lah + jl[:, None] * s_lar + pb[None, :] * s_lap,
                  mask=lmask[:, None] & (pb < P)[None, :], other=0.0)
    w_n = tl.load(wk_ptr + (kh * P + pb[:, None]) * s_wkn + ds[None, :] * s_wkd,
                  mask=(pb < P)[:, None] & dmask[None, :], other=0.0)
    for p0 in range(0, P, PB):
        a, w = a_n, w_n
        ps = p0 + PB + pb
        a_n = tl.load(la_ptr + h * s_lah + jl[:, None] * s_lar + ps[None, :] * s_lap,
                      mask=lmask[:, None] & (ps < P)[None, :], other=0.0)
        w_n = tl.load(wk_ptr + (kh * P + ps[:, None]) * s_wkn + ds[None, :] * s_wkd,
                      mask=(ps < P)[:, None] & dmask[None, :], other=0.0)
        acc += _bcast_mm(a.to(tl.float32), w.to(tl.float32))     # (no TF32: see _bcast_mm)
    rows = down_ptr + (h * R + RW + jl[:, None]) * K + ds[None, :]
    m2 = lmask[:, None] & dmask[None, :]
    if SPLIT:
        hi = acc.to(HI).to(tl.float32)
        tl.store(rows, hi, mask=m2)
        tl.store(rows + RL * K, acc - hi, mask=m2)
    else:
        tl.store(rows, acc, mask=m2)
    wa = tl.load(wa_ptr + h * s_wah + jw[:, None] * s_war + ds[None, :] * s_wad,
                 mask=wmask[:, None] & dmask[None, :], other=0.0)
    tl.store(down_ptr + (h * R + jw[:, None]) * K + ds[None, :], wa.to(tl.float32),
             mask=wmask[:, None] & dmask[None, :])
    if tl.program_id(1) == 0:
        pp = tl.arange(0, PP)
        pmask = pp < P
        # zb: 0 on wise rows, b_k^h A_hᵀ on the (hi) basis rows, 0 on the lo rows
        tl.store(zb_ptr + h * R + jw, tl.zeros((RWP,), dtype=tl.float32), mask=wmask)
        zl = tl.zeros((RLP,), dtype=tl.float32)
        if HAS_BK:
            a2 = tl.load(la_ptr + h * s_lah + jl[:, None] * s_lar + pp[None, :] * s_lap,
                         mask=lmask[:, None] & pmask[None, :], other=0.0).to(tl.float32)
            bk = tl.load(bk_ptr + kh * P + pp, mask=pmask, other=0.0).to(tl.float32)
            zl = tl.sum(a2 * bk[None, :], axis=1)
        tl.store(zb_ptr + h * R + RW + jl, zl, mask=lmask)
        if SPLIT:
            tl.store(zb_ptr + h * R + RW + RL + jl, tl.zeros((RLP,), dtype=tl.float32),
                     mask=lmask)
        # up: [B_wise | B_lite (| B_lite)] along the rank
        wb = tl.load(wb_ptr + h * s_wbh + pp[:, None] * s_wbp + jw[None, :] * s_wbr,
                     mask=pmask[:, None] & wmask[None, :], other=0.0).to(tl.float32)
        ub = up_ptr + (h * P + pp[:, None]) * R
        tl.store(ub + jw[None, :], wb, mask=pmask[:, None] & wmask[None, :])
        lb = tl.load(lb_ptr + h * s_lbh + pp[:, None] * s_lbp + jl[None, :] * s_lbr,
                     mask=pmask[:, None] & lmask[None, :], other=0.0).to(tl.float32)
        tl.store(ub + RW + jl[None, :], lb, mask=pmask[:, None] & lmask[None, :])
        if SPLIT:
            tl.store(ub + RW + RL + jl[None, :], lb, mask=pmask[:, None] & lmask[None, :])


@triton.jit
def _section_bwd_kernel(dd_ptr, dzb_ptr, du_ptr, wk_ptr, s_wkn, s_wkd, bk_ptr,
                        dwa_ptr, dwb_ptr, dla_ptr, dlb_ptr, K, P, RW, RL, R, G,
                        SPLIT: tl.constexpr, HAS_BK: tl.constexpr, NEED_LA: tl.constexpr,
                        RWP: tl.constexpr, RLP: tl.constexpr, PB: tl.constexpr,
                        BD: tl.constexpr, BDC: tl.constexpr):
    # grid (H, max(RW, RL, 1), cdiv(P, PB)). Program (h, j, i) owns the kernel positions
    # p in [i·PB, (i+1)·PB): the lite factor entries dA_h[j, p] = Σ_d dD[basis row j, d]
    # W_k^h[p, d] + dzb[basis row j]·b_k^h[p] (j < RL, NEED_LA; the basis gradient is read
    # from the lo row when split: hi is a constant rounding of the basis, see _section) and,
    # for j = 0, the up-projection gradients' rows p (lite: the sum of its two copies when
    # split); the wise down row j (j < RW, a copy in the factor's dtype) is copied in
    # BDC-column chunks spread over the i programs. Every output element has one owner: no
    # cross-program sums. Inputs contiguous float32 (H, R, K), (H, R), (H, P, R); outputs
    # contiguous in their dtypes.
    h = tl.program_id(0)
    j = tl.program_id(1)
    i = tl.program_id(2)
    n_pb = tl.num_programs(2)
    kh = h // G
    pp = i * PB + tl.arange(0, PB)
    pmask = pp < P
    # Scalar conditions enter the vector masks as limits (the interpreter mishandles
    # scalar & vector masks).
    # The loops' loads are independent of their sums, but a warp issues in order: a load
    # placed after the previous step's use waits a DRAM round trip per step (24 steps at
    # K = 768; the H100 ran this kernel at 13.5 µs against 4.0 predicted). The copy takes
    # BDC columns a step (the whole row at K <= 1024), the lite product loads one step ahead.
    k_w = tl.where(j < RW, K, 0)
    for d0 in range(i * BDC, K, n_pb * BDC):
        dc = d0 + tl.arange(0, BDC)
        v = tl.load(dd_ptr + (h * R + j) * K + dc, mask=dc < k_w, other=0.0)
        tl.store(dwa_ptr + (h * RW + j) * K + dc, v.to(dwa_ptr.dtype.element_ty), mask=dc < k_w)
    if NEED_LA:
        p_l = tl.where(j < RL, P, 0)
        jr = tl.minimum(j, tl.maximum(RL - 1, 0))
        row = RW + jr
        if SPLIT:
            row += RL
        acc = tl.zeros((PB, BD), dtype=tl.float32)
        db = tl.arange(0, BD)
        g_n = tl.load(dd_ptr + (h * R + row) * K + db, mask=db < K, other=0.0)
        w_n = tl.load(wk_ptr + (kh * P + pp[:, None]) * s_wkn + db[None, :] * s_wkd,
                      mask=pmask[:, None] & (db < K)[None, :], other=0.0)
        for d0 in range(0, K, BD):
            g, w = g_n, w_n.to(tl.float32)
            ds = d0 + BD + db
            dmask = ds < K
            g_n = tl.load(dd_ptr + (h * R + row) * K + ds, mask=dmask, other=0.0)
            w_n = tl.load(wk_ptr + (kh * P + pp[:, None]) * s_wkn + ds[None, :] * s_wkd,
                          mask=pmask[:, None] & dmask[None, :], other=0.0)
            acc += w * g[None, :]
        da = tl.sum(acc, axis=1)
        if HAS_BK:
            bk = tl.load(bk_ptr + kh * P + pp, mask=pmask, other=0.0).to(tl.float32)
            da += tl.load(dzb_ptr + h * R + RW + jr) * bk
        tl.store(dla_ptr + (h * RL + jr) * P + pp, da.to(dla_ptr.dtype.element_ty),
                 mask=pp < p_l)
    if j == 0:
        jw = tl.arange(0, RWP)
        jl = tl.arange(0, RLP)
        ub = du_ptr + (h * P + pp[:, None]) * R
        mw = pmask[:, None] & (jw < RW)[None, :]
        tl.store(dwb_ptr + (h * P + pp[:, None]) * RW + jw[None, :],
                 tl.load(ub + jw[None, :], mask=mw, other=0.0).to(dwb_ptr.dtype.element_ty),
                 mask=mw)
        ml = pmask[:, None] & (jl < RL)[None, :]
        lb = tl.load(ub + RW + jl[None, :], mask=ml, other=0.0)
        if SPLIT:
            lb += tl.load(ub + RW + RL + jl[None, :], mask=ml, other=0.0)
        tl.store(dlb_ptr + (h * P + pp[:, None]) * RL + jl[None, :],
                 lb.to(dlb_ptr.dtype.element_ty), mask=ml)


def _dims(wise_A, lite_A, split):
    H, RL, P = lite_A.shape
    RW = wise_A.shape[1] if wise_A is not None else 0
    return H, P, RW, RL, RW + RL * (2 if split else 1)


def _strides3(t: Optional[torch.Tensor], ref: torch.Tensor):
    return (t, *t.stride()) if t is not None else (ref, 0, 0, 0)


def section_forward(wise_A: Optional[torch.Tensor], wise_B: Optional[torch.Tensor],
                    lite_A: torch.Tensor, lite_B: torch.Tensor, w_k: torch.Tensor,
                    b_k: Optional[torch.Tensor], Hk: int, split: Optional[torch.dtype]):
    """``down (H, R, d)``, ``zb (H, R)``, ``up (H, p, R)`` float32 (layout in the module
    docstring). wise_A (H, RW, d) / wise_B (H, p, RW) or None; lite_A (H, RL, p), lite_B
    (H, p, RL); w_k (Hk·p, d), b_k (Hk·p,) or None; any dtypes and strides. ``split``: the
    16-bit activation dtype whose hi/lo pair carries the basis, or None (one float32 row)."""
    H, P, RW, RL, R = _dims(wise_A, lite_A, split is not None)
    K = w_k.shape[1]
    dev = lite_A.device
    down = _alloc.empty(H, R, K, dtype=F32, device=dev)
    zb = _alloc.empty(H, R, dtype=F32, device=dev)
    up = _alloc.empty(H, P, R, dtype=F32, device=dev)
    bk = b_k.contiguous() if b_k is not None else down
    BD = _blk(K, 16, 128 if targets_gpu(dev) else 32)
    _section_fwd_kernel[(H, cdiv(K, BD))](
        *_strides3(wise_A, down), *_strides3(wise_B, down), lite_A, *lite_A.stride(),
        lite_B, *lite_B.stride(), w_k, *w_k.stride(), bk, down, zb, up,
        K, P, RW, RL, R, H // Hk,
        SPLIT=split is not None, HAS_BK=b_k is not None,
        HI=tl_dtype(split) if split is not None else tl.float32,
        RWP=next_pow2(RW), RLP=next_pow2(RL), PP=next_pow2(P), BD=BD,
        # (RLP, PB, BD) float32 products: at most 8K on a GPU (64 registers a thread at 4
        # warps); a few hundred in the interpreter, so that its tests run several p blocks
        PB=max(1, min(next_pow2(P), (8192 if targets_gpu(dev) else 256)
                      // (next_pow2(RL) * BD))), num_warps=4)
    return down, zb, up


def section_backward(d_down: torch.Tensor, d_zb: torch.Tensor, d_up: torch.Tensor,
                     wise_A: Optional[torch.Tensor], wise_B: Optional[torch.Tensor],
                     lite_A: torch.Tensor, lite_B: torch.Tensor, w_k: torch.Tensor,
                     b_k: Optional[torch.Tensor], Hk: int, split: bool, need_lite_A: bool
                     ) -> Tuple[Optional[torch.Tensor], ...]:
    """Gradients of wise_A, wise_B, lite_A (None unless ``need_lite_A``), lite_B, each in its
    factor's dtype, from those of :func:`section_forward`'s outputs (float32, contiguous)."""
    H, P, RW, RL, R = _dims(wise_A, lite_A, split)
    K = w_k.shape[1]
    dev = lite_A.device
    dwa = _alloc.empty(H, RW, K, dtype=wise_A.dtype, device=dev) if RW else d_down
    dwb = _alloc.empty(H, P, RW, dtype=wise_B.dtype, device=dev) if RW else d_down
    dla = _alloc.empty(H, RL, P, dtype=lite_A.dtype, device=dev) if need_lite_A else d_down
    dlb = _alloc.empty(H, P, RL, dtype=lite_B.dtype, device=dev)
    bk = b_k.contiguous() if b_k is not None else d_down
    J = max(RW, RL, 1)
    PB, BD = section_bwd_tiles(H * J, P, K, targets_gpu(dev))
    _section_bwd_kernel[(H, J, cdiv(P, PB))](
        d_down, d_zb, d_up, w_k, *w_k.stride(), bk, dwa, dwb, dla, dlb,
        K, P, RW, RL, R, H // Hk,
        SPLIT=split, HAS_BK=b_k is not None, NEED_LA=need_lite_A,
        RWP=next_pow2(RW), RLP=next_pow2(RL), PB=PB, BD=BD,
        BDC=_blk(K, 16, 1024 if targets_gpu(dev) else 32), num_warps=4)
    return (dwa if RW else None, dwb if RW else None, dla if need_lite_A else None, dlb)


# programs :func:`section_bwd_tiles` aims the backward's grid at: about one per SM (132 on an
# H100) once the kernel positions are split
SECTION_BWD_PROGRAMS = 128


def section_bwd_tiles(rows: int, P: int, K: int, gpu: bool) -> Tuple[int, int]:
    """(PB, BD) of :func:`_section_bwd_kernel` for ``rows`` = H·max(RW, RL, 1) programs per
    kernel-position block: on a GPU the p positions split into blocks until the grid has
    about ``SECTION_BWD_PROGRAMS`` programs (at least 8 positions a block), and the product's
    (PB × BD) tile kept at about 4K elements. One program per (head, row) was 8–16 programs at
    the lite-qv-small presets' v section (one lite row), each reading its head's whole
    p × d slice of W_k — at Llama-7B's GQA (8 key heads, p = 128, d = 4096) 27.6 µs of
    PREDICTED memory time on 8 SMs. In the interpreter 4 positions a block and 32 columns,
    so the small test shapes cross several blocks both ways."""
    PP = next_pow2(P)
    if not gpu:
        return min(PP, 4), _blk(K, 16, 32)
    PB = min(PP, max(8, next_pow2(cdiv(P, cdiv(SECTION_BWD_PROGRAMS, max(1, rows))))))
    return PB, _blk(K, 16, max(64, 4096 // PB))
