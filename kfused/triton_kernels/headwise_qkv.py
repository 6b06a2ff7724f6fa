"""Triton host functions of the fused attention-input projection ``headwise_qkv`` (docs/math.md §2):
Q, K, V with per-head and shared low-rank updates on q and v, one augmented GEMM per pass
(see :mod:`kfused.triton_kernels._headwise_common` for the design and the predicted roofline).
``headwise_projection`` (any single adapted projection) runs these same host functions with
the projection in the q slot.
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

from kfused import _alloc
from kfused.triton_kernels import _headwise_common as _hc
from kfused.triton_kernels._common import _AOT_TARGET, F32
from kfused.triton_kernels._headwise_common import (SectionFactors, _pack_all,
                                                    _packing, _tile_n, compact_dz,
                                                    compact_offsets, compact_pays,
                                                    fold_plan, fold_qkv, frozen_gemm, gemm,
                                                    lr_rank_backward_sections,
                                                    needs_sum, pack_dims, pack_width,
                                                    rank_space, reduce_tokens,
                                                    unpack_sections)


def qkv_zwidth(HQ: int, HV: int, P: int, rq: Tuple[int, int], rv: Tuple[int, int],
               device: torch.device, fold: int = 0, T: int = 0, K: int = 0, N: int = 0,
               dtype: torch.dtype = torch.float32) -> int:
    """Width of the rank-space buffer Z of the fused q|k|v projection (0 when the forward
    folds: ``fold``, T, K = d, N = the output width and ``dtype`` as the forward's)."""
    BN = _tile_n(device)
    if fold:
        # int(): under dynamic-shape tracing the plan specializes on these dimensions
        packs = qkv_packings(int(HQ), int(HV), int(P), tuple(map(int, rq)), tuple(map(int, rv)),
                             device)[0]
        if fold_plan(fold, packs, T, int(K), int(N), dtype)[0]:
            return 0
    M = 0
    for H, (r, rs) in ((HQ, rq), (HV, rv)):
        if (r or rs) and H:
            # int(): under dynamic-shape tracing the packing specializes on the head count.
            dims = (int(H), int(P), int(r), int(rs), BN)
            M += pack_dims(*dims)[0] * pack_width(*dims)
    return M


def keeps_fold(N: int, K: int, T: int, M: int) -> bool:
    """Whether a folded forward keeps its W' (N × K) for the backward's dX = dY·W' (one fold
    launch and one N × K pass per step instead of two): when W' is no larger than the
    rank-space buffer Z (T × M) that the exact path saves and the folded forward does not, so
    that the folded path never saves more for its backward than the exact one. The benchmark
    presets keep it at GPT-2 small and medium widths (W' 0.28–1.0 of Z at T = 16384) and
    fold again at Llama-7B's (W' 2.2–4.8 × Z)."""
    return N * K <= T * M


def qkv_fold_kept(HQ: int, HV: int, P: int, rq: Tuple[int, int], rv: Tuple[int, int],
                  device: torch.device, fold: int, T: int, K: int, N: int,
                  dtype: torch.dtype) -> bool:
    """Whether :func:`headwise_qkv_forward` returns its folded W' (arguments as
    :func:`qkv_zwidth`'s): the forward folds and :func:`keeps_fold`."""
    if not fold:
        return False
    packs, _, M = qkv_packings(int(HQ), int(HV), int(P), tuple(map(int, rq)),
                               tuple(map(int, rv)), device)
    # (T stays symbolic under dynamic-shape tracing: a guard on the comparison, no
    # specialisation on the token count)
    return bool(fold_plan(fold, packs, T, int(K), int(N), dtype)[0]) and bool(keeps_fold(
        int(N), int(K), T, M))


def qkv_packings(HQ: int, HV: int, P: int, rq: Tuple[int, int], rv: Tuple[int, int],
                 device: torch.device):
    """Packings of the q and v sections (None when not adapted), the column offsets of their
    blocks in the rank-space buffer Z (T, M), and M."""
    BN = _tile_n(device)
    packs, offs, M = [], [], 0
    for H, (r, rs) in ((HQ, rq), (HV, rv)):
        pk = _packing(H, P, r, rs, BN) if (r or rs) and H else None
        packs.append(pk)
        offs.append(M)
        if pk is not None:
            M += pk.L * pk.W
    return packs, offs, M


@functools.lru_cache(maxsize=256)
def _plan(HQ: int, HV: int, P: int, rq: Tuple[int, int], rv: Tuple[int, int],
          dev: torch.device, fold: int, T: int, D: int, N: int, dtype: torch.dtype,
          flags: tuple):
    """The per-shape decisions of a q|k|v call, worked out once per shape (a training step
    repeats them on every call; they cost about 30 µs of host time a forward and backward,
    ``benchmarks/host_overhead.py --gpu-path``): the packings and their offsets in Z, M,
    :func:`fold_plan`'s (fold the forward, fold dX), the compact rank space's offsets and
    width, whether the backward runs on it (:func:`compact_pays`) and whether its
    per-occurrence dZ sums several (float32). ``flags``: :func:`_plan_flags`, the switches
    those decisions also read."""
    (pq, pv), (oq, ov), M = qkv_packings(HQ, HV, P, rq, rv, dev)
    folds = fold_plan(fold, (pq, pv), T, D, N, dtype)
    (cq, cv), MC = compact_offsets((pq, pv))
    compact = compact_pays((pq, pv), T, D, dtype.itemsize, dx=not folds[1])
    summed = compact and any(pk is not None and needs_sum(pk) for pk in (pq, pv))
    return (pq, pv), (oq, ov), M, folds, (cq, cv), MC, compact, summed


def _plan_flags() -> tuple:
    """What :func:`_plan`'s decisions read besides its arguments: the tests' forcing switches
    and whether host functions choose GPU tiles (``_AOT_TARGET``: the tile width BN)."""
    return (_hc.FORCE_FOLD, _hc.FORCE_FOLD_DX, _hc.FORCE_COMPACT, _AOT_TARGET["on"])


def headwise_qkv_forward(x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor,
                         bq: Optional[torch.Tensor], bk: Optional[torch.Tensor],
                         bv: Optional[torch.Tensor], q: SectionFactors, v: SectionFactors,
                         P: int, cq: Optional[torch.Tensor] = None,
                         cv: Optional[torch.Tensor] = None, fold: int = 0):
    """x (T, d) any strides; w* (N*, d) nn.Linear layout, any strides (Conv1D column views
    work; N* may be 0 to skip a section, e.g. a single adapted projection in the q slot);
    biases (N*,) contiguous or None; cq, cv: the q and v sections' per-head biases (Nq,),
    (Nv,) contiguous or None, added with the frozen bias in the GEMM epilogue; P the head
    width.

    ``fold`` (see :func:`headwise_qkv_backward`): where :func:`fold_plan` folds the
    forward, Y = X W'ᵀ + b' with the updates and the biases folded (:func:`fold_qkv`, one
    launch; cuBLAS on a GPU) and no Z is stored (the backward computes it again by one GEMM).

    Returns the fused output [Q | K | V] (T, Nq + Nk + Nv) in x.dtype, the rank-space
    buffer Z (T, M) in x.dtype (packed layout of :func:`qkv_packings`; (T, 0) when folded)
    for the backward, and the folded W' (Nq + Nk + Nv, d) where the backward's dX may reuse
    it (:func:`qkv_fold_kept`; else an empty tensor).
    """
    T, D = x.shape
    HQ, HK, HV = wq.shape[0] // P, wk.shape[0] // P, wv.shape[0] // P
    N = (HQ + HK + HV) * P
    dev = x.device
    (pq, pv), (oq, ov), M, (folded, _), *_ = _plan(HQ, HV, P, q.ranks(), v.ranks(), dev,
                                                   fold, T, D, N, x.dtype, _plan_flags())
    Y = _alloc.empty(T, N, dtype=x.dtype, device=dev)
    Z = _alloc.empty(T, 0 if folded else M, dtype=x.dtype, device=dev)
    none = x.new_empty(0)
    if T == 0 or Y.shape[1] == 0:
        return Y, Z, none
    lrs = (None, None)
    if M:
        *_, lrs = _pack_all((pq, pv), (oq, ov), (q, v), M, D, x.dtype, Z, keep=True)
    if folded:
        wf, bf = fold_qkv((wq, wk, wv), lrs, D, x.dtype, biases=(bq, bk, bv), cs=(cq, cv))
        frozen_gemm(x, wf.t(), Y, bias=bf)
        return Y, Z, (wf if keeps_fold(N, D, T, M) else none)
    col = 0
    for w, b, c, pk, off, lr in ((wq, bq, cq, pq, oq, lrs[0]), (wk, bk, None, None, 0, None),
                                 (wv, bv, cv, pv, ov, lrs[1])):
        n = w.shape[0]
        if n:
            if lr is not None:
                lr = lr.with_z(Z[:, off:off + pk.L * pk.W])
            gemm([(x, w.t())], Y[:, col:col + n], bias=b, lr=lr, bias2=c)
        col += n
    return Y, Z, none


def headwise_qkv_backward(g: torch.Tensor, x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
                          wv: torch.Tensor, q: SectionFactors, v: SectionFactors,
                          Z: torch.Tensor, P: int, need_dx: bool = True,
                          need_factors: bool = True,
                          db_dtypes: Tuple[Optional[torch.dtype], ...] = (None, None),
                          fold: int = 0, w_fold: Optional[torch.Tensor] = None):
    """Gradients of :func:`headwise_qkv_forward`; g (T, Nq + Nk + Nv), any strides.

    fold (16-bit only; float32 ignores it), the forward's: 0 dx = [dY | dZ]·
    [W; D] exactly; 2 the forward folded (see :func:`headwise_qkv_forward`), Z is computed
    again from X by one GEMM (:func:`rank_space`) for the rank pass, and dx = dY·W' with
    W' = [W'_q; W_k; W'_v] folded again (the updates rounded once into the frozen weights:
    the part below half an ulp of W is lost in Y and dx; the factor gradients are
    unchanged); 1 what :func:`fold_plan` decides
    from the roofline: both folds, dx's alone (the forward exact), or neither. ``w_fold``:
    the forward's W' where it kept it (:func:`qkv_fold_kept`; None or empty: fold again).

    Returns dx and, per section q and v, a dict with the gradients of down, zb, up, sdown,
    sup (each in its factor's dtype; zb's in float32) and of the section's bias (``db``, the
    column sums of its output gradient, float32 or the section's ``db_dtypes`` entry) for
    the parts that exist.
    """
    T, D = x.shape
    HQ, HK, HV = wq.shape[0] // P, wk.shape[0] // P, wv.shape[0] // P
    Nq, Nk, Nv = HQ * P, HK * P, HV * P
    dev = x.device
    # zx: Z from X (the forward folded); the rank pass's dZ, one column per tile occurrence
    # of a row. Compact: float32 when some compact column sums several occurrences
    # (``summed``: rounded once, by compact_dz), and the dx GEMM and the token reduction read
    # the compact dZ; otherwise they read this one.
    ((pq, pv), (oq, ov), M, (zx, dx_fold), (cq, cv), MC, compact,
     summed) = _plan(HQ, HV, P, q.ranks(), v.ranks(), dev, fold, T, D, Nq + Nk + Nv, x.dtype,
                     _plan_flags())
    dZt = _alloc.empty(T, M, dtype=F32 if summed else x.dtype, device=dev)
    dZ = _alloc.empty(T, MC, dtype=x.dtype, device=dev) if compact else dZt
    lrs = (None, None)
    if M:
        Dp, zbp, _, Dc, lrs = _pack_all((pq, pv), (oq, ov), (q, v), M, D, x.dtype, Z,
                                        keep=False)
        if zx and (need_factors or not dx_fold):
            # the folded forward stored no Z: one GEMM over every tile of both sections
            Z = rank_space(x, Dp, zbp)
    secs, rank = [None, None], []
    zs = Z.shape[1] > 0
    for i, (pk, off, coff, c0, n, lr) in enumerate(((pq, oq, cq, 0, Nq, lrs[0]),
                                                    (pv, ov, cv, Nq + Nk, Nv, lrs[1]))):
        if pk is None:
            continue
        s = slice(off, off + pk.L * pk.W)
        if zs:
            lr = lr.with_z(Z[:, s])
        rank.append((i, pk, s, slice(coff, coff + pk.RS + pk.H * pk.R),
                     (g[:, c0:c0 + n], lr, dZt[:, s])))
    # The rank pass of both sections (one launch) is needed by dx too unless it folds (dZ is
    # one of its K segments); its token-split partials are summed by the unpack kernel.
    if rank and (need_factors or not dx_fold):
        parts = lr_rank_backward_sections([r[-1] for r in rank])
        for (i, pk, s, cs, _), sec in zip(rank, parts):
            if compact:
                compact_dz(pk, dZt[:, s], dZ[:, cs])
            secs[i] = (cs if compact else s, sec)
    dx = None
    if need_dx:
        dx = _alloc.empty(T, D, dtype=x.dtype, device=dev)
        if dx_fold:   # dx = dY·W', frozen-shaped (one fold launch, then cuBLAS on a GPU)
            if w_fold is None or w_fold.numel() == 0:
                w_fold = fold_qkv((wq, wk, wv), lrs, D, x.dtype)[0]
            frozen_gemm(g, w_fold, dx)
        else:
            segs = [(g[:, c0:c0 + n], w_) for c0, n, w_ in ((0, Nq, wq), (Nq, Nk, wk),
                                                              (Nq + Nk, Nv, wv)) if n]
            if M:
                segs.append((dZ, Dc) if compact else (dZ, Dp))
            if segs and T:
                gemm(segs, dx)
            else:
                dx.zero_()
    grads = [{}, {}]
    if need_factors and M:
        dDall = reduce_tokens(dZ, x, partials=True)               # (S, MC or M, d)
        items, which = [], []
        for i, (f, pk, sec) in enumerate(zip((q, v), (pq, pv), secs)):
            if sec is not None:
                cs, (dU, dzb, db) = sec
                S = dU.shape[0]
                items.append((pk, f, dDall[:, cs], dzb.view(S, -1), dU.view(S, -1, pk.BN), db,
                              db_dtypes[i]))
                which.append(i)
        for i, g_ in zip(which, unpack_sections(items, compact)):   # one launch
            grads[i] = g_
    return dx, grads[0], grads[1]
