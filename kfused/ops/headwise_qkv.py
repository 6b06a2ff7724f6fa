"""``headwise_qkv`` (docs/math.md §2): the fused attention-input projection — Q, K, V with per-head
and shared updates on q and v in one custom op (torch.library registrations, autograd and the
public functional API).

    headwise_qkv(x, w_q, w_k, w_v, b_q, b_k, b_v, n_heads=, n_kv_heads=, q=, v=)
                                                      -> Q, K, V

``backend="auto" | "triton" | "reference"``. Custom ops: kfused::headwise_qkv_triton_fwd / _bwd
(also the kernels of :func:`kfused.ops.headwise_projection.headwise_projection`).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from kfused import _validate
from kfused._validate import fits
from kfused.backends import select_backend
from kfused.ops._common import custom_op, kops, register_autograd
from kfused.ops._fold import check_exact, fold_decision
from kfused.ops._headwise_common import (IMPLS, _check_factors, _check_flag,
                                         _check_input_width, _check_linear,
                                         _check_n_heads, _dense, _empty,
                                         LiteKeyGrad, _head_width,
                                         _no_float64, _one_dtype, _opt, _scalar_factors,
                                         _section, no_double_backward)
from kfused.reference.headwise import HeadFactors, headwise_qkv_ref


def _tk():
    # Imported lazily: Triton decides at decoration time whether to interpret.
    from kfused.triton_kernels import headwise_qkv

    return headwise_qkv

# ==========================================================================================
# Fused attention-input projection


_SEC_KEYS = ("down", "zb", "up", "sdown", "sup")


@custom_op("kfused::headwise_qkv_triton_fwd")
def _qkv_fwd(x: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor,
             b_q: Optional[torch.Tensor], b_k: Optional[torch.Tensor],
             b_v: Optional[torch.Tensor],
             q_down: Optional[torch.Tensor], q_zb: Optional[torch.Tensor],
             q_up: Optional[torch.Tensor], q_sdown: Optional[torch.Tensor],
             q_sup: Optional[torch.Tensor],
             v_down: Optional[torch.Tensor], v_zb: Optional[torch.Tensor],
             v_up: Optional[torch.Tensor], v_sdown: Optional[torch.Tensor],
             v_sup: Optional[torch.Tensor], head_dim: int, q_scale: float = 1.0,
             v_scale: float = 1.0, q_c: Optional[torch.Tensor] = None,
             v_c: Optional[torch.Tensor] = None,
             fold: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # fold: 0 exact, 1 fold where the roofline says it pays, 2 fold (16-bit; see
    # kfused.triton_kernels.headwise_qkv), the same for the backward (saved by _qkv_setup).
    # Returns [Q | K | V], the rank-space Z and the folded W' the backward reuses (empty
    # where it folds again: kfused.triton_kernels.headwise_qkv.qkv_fold_kept)
    k = _tk()
    q = k.SectionFactors(q_down, q_zb, q_up, q_sdown, q_sup, q_scale)
    v = k.SectionFactors(v_down, v_zb, v_up, v_sdown, v_sup, v_scale)
    # the GEMM epilogue reads the biases with unit stride (x and the weights via strides)
    return k.headwise_qkv_forward(x, w_q, w_k, w_v, _dense(b_q), _dense(b_k), _dense(b_v), q, v,
                                  head_dim, _dense(q_c), _dense(v_c), fold)


def _ranks(q_down, q_sdown, v_down, v_sdown):
    return ((q_down.shape[1] if q_down is not None else 0,
             q_sdown.shape[0] if q_sdown is not None else 0),
            (v_down.shape[1] if v_down is not None else 0,
             v_sdown.shape[0] if v_sdown is not None else 0))


def _zwidth(HQ, HV, head_dim, q_down, q_sdown, v_down, v_sdown, device, fold=0, T=0, K=0,
            N=0, dtype=torch.float32):
    """Width of the packed rank-space buffer (see kfused.triton_kernels.headwise_qkv)."""
    return _tk().qkv_zwidth(HQ, HV, head_dim, *_ranks(q_down, q_sdown, v_down, v_sdown),
                            device, fold, T, K, N, dtype)


def _fold_kept(HQ, HV, head_dim, q_down, q_sdown, v_down, v_sdown, device, fold, T, K, N,
               dtype):
    """Whether the forward returns its folded W' for the backward (qkv_fold_kept)."""
    return _tk().qkv_fold_kept(HQ, HV, head_dim, *_ranks(q_down, q_sdown, v_down, v_sdown),
                               device, fold, T, K, N, dtype)


@_qkv_fwd.register_fake
def _(x, w_q, w_k, w_v, b_q, b_k, b_v, q_down, q_zb, q_up, q_sdown, q_sup,
      v_down, v_zb, v_up, v_sdown, v_sup, head_dim, q_scale=1.0, v_scale=1.0, q_c=None,
      v_c=None, fold=0):
    T = x.shape[0]
    N = w_q.shape[0] + w_k.shape[0] + w_v.shape[0]
    M = _zwidth(w_q.shape[0] // head_dim, w_v.shape[0] // head_dim, head_dim, q_down, q_sdown,
                v_down, v_sdown, x.device, fold, T, x.shape[1], N, x.dtype)
    kept = T and N and _fold_kept(w_q.shape[0] // head_dim, w_v.shape[0] // head_dim, head_dim,
                                  q_down, q_sdown, v_down, v_sdown, x.device, fold, T,
                                  x.shape[1], N, x.dtype)
    return (x.new_empty(T, N), x.new_empty(T, M),
            x.new_empty(N, x.shape[1]) if kept else x.new_empty(0))


@custom_op("kfused::headwise_qkv_triton_bwd")
def _qkv_bwd(g: torch.Tensor, x: torch.Tensor,
             w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor,
             q_down: Optional[torch.Tensor], q_up: Optional[torch.Tensor],
             q_sdown: Optional[torch.Tensor], q_sup: Optional[torch.Tensor],
             v_down: Optional[torch.Tensor], v_up: Optional[torch.Tensor],
             v_sdown: Optional[torch.Tensor], v_sup: Optional[torch.Tensor],
             z: torch.Tensor, head_dim: int, need_dx: bool,
             need_factors: bool, q_scale: float = 1.0,
             v_scale: float = 1.0, q_db_dtype: Optional[torch.dtype] = None,
             v_db_dtype: Optional[torch.dtype] = None, fold: int = 0,
             w_fold: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    # *_db_dtype: the dtype of the section's column sums db (None: float32); fold: the
    # forward's, w_fold its kept W' (kfused.triton_kernels.headwise_qkv.headwise_qkv_backward)
    k = _tk()
    q = k.SectionFactors(q_down, None, q_up, q_sdown, q_sup, q_scale)
    v = k.SectionFactors(v_down, None, v_up, v_sdown, v_sup, v_scale)
    dx, gq, gv = k.headwise_qkv_backward(g, x, w_q, w_k, w_v, q, v, z, head_dim, need_dx,
                                         need_factors, (q_db_dtype, v_db_dtype), fold,
                                         w_fold)
    out = [dx if dx is not None else _empty(x)]
    for grads in (gq, gv):
        for key in _SEC_KEYS + ("db",):
            t = grads.get(key)
            out.append(t if t is not None else _empty(x))
    return out


@_qkv_bwd.register_fake
def _(g, x, w_q, w_k, w_v, q_down, q_up, q_sdown, q_sup, v_down, v_up, v_sdown,
      v_sup, z, head_dim, need_dx, need_factors, q_scale=1.0, v_scale=1.0, q_db_dtype=None,
      v_db_dtype=None, fold=0, w_fold=None):
    out = [torch.empty_like(x) if need_dx else x.new_empty(0)]
    for down, up, sdown, sup, w, db_dt in ((q_down, q_up, q_sdown, q_sup, w_q, q_db_dtype),
                                           (v_down, v_up, v_sdown, v_sup, w_v, v_db_dtype)):
        hw = need_factors and down is not None
        sh = need_factors and sdown is not None
        r = down.shape[1] if down is not None else 0
        rs = sdown.shape[0] if sdown is not None else 0
        N = w.shape[0]
        H = N // head_dim
        f32 = torch.float32
        out.append(torch.empty_like(down) if hw else x.new_empty(0))              # down
        out.append(x.new_empty(H, r, dtype=f32) if hw else x.new_empty(0))        # zb
        out.append(torch.empty_like(up) if hw else x.new_empty(0))                # up
        out.append(torch.empty_like(sdown) if sh else x.new_empty(0))             # sdown
        out.append(torch.empty_like(sup) if sh else x.new_empty(0))               # sup
        out.append(x.new_empty(N, dtype=db_dt or f32) if (hw or sh) else x.new_empty(0))  # db
    return out


def _qkv_setup(ctx, inputs, output):
    (x, w_q, w_k, w_v, b_q, b_k, b_v, q_down, q_zb, q_up, q_sdown, q_sup,
     v_down, v_zb, v_up, v_sdown, v_sup, head_dim, *rest) = inputs
    q_scale, v_scale, q_c, v_c, fold = tuple(rest) + (1.0, 1.0, None, None, 0)[len(rest):]
    ctx.save_for_backward(x, w_q, w_k, w_v, q_down, q_up, q_sdown, q_sup,
                          v_down, v_up, v_sdown, v_sup, output[1], output[2])
    ctx.head_dim = head_dim
    ctx.scales = (q_scale, v_scale)
    ctx.fold = fold
    ctx.has_b = (b_q is not None, b_k is not None, b_v is not None)
    ctx.b_dtypes = tuple(b.dtype if b is not None else None for b in (b_q, b_k, b_v))
    ctx.c_dtypes = tuple(c.dtype if c is not None else None for c in (q_c, v_c))
    ctx.mark_non_differentiable(output[1], output[2])
    # no zero gradients for the rank-space output and the kept W'
    ctx.set_materialize_grads(False)


def _qkv_backward(ctx, gY, gZ, gW=None):
    if gY is None:
        return (None,) * 23
    (x, w_q, w_k, w_v, q_down, q_up, q_sdown, q_sup,
     v_down, v_up, v_sdown, v_sup, z, w_fold) = ctx.saved_tensors
    need = ctx.needs_input_grad
    nx = need[0]
    need_f = any(need[7:17])
    need_c = (len(need) > 20 and need[20], len(need) > 21 and need[21])
    gY = gY.contiguous()

    def db_dtype(i, j):
        # a section's column sums db give its frozen bias's gradient (b index i) and its
        # per-head bias c's (section j)
        return _one_dtype(((ctx.b_dtypes[i], need[4 + i] and ctx.has_b[i]),
                           (ctx.c_dtypes[j], need_c[j])))

    res = kops.headwise_qkv_triton_bwd(
        gY, x, w_q, w_k, w_v, q_down, q_up, q_sdown, q_sup, v_down, v_up, v_sdown,
        v_sup, z, ctx.head_dim, nx, need_f or need[4] or need[6] or any(need_c), *ctx.scales,
        db_dtype(0, 0), db_dtype(2, 1), ctx.fold, w_fold)
    dx = res[0]
    # res: dx, then per section q, v the gradients of _SEC_KEYS and db (empty: none)
    dbq, dbv = _opt(res[6]), _opt(res[12])
    nq, nk = w_q.shape[0], w_k.shape[0]

    def g_of(i):
        return (gY[:, :nq], gY[:, nq:nq + nk], gY[:, nq + nk:])[i]

    def bias_grad(i, db):
        if not (need[4 + i] and ctx.has_b[i]):
            return None
        if db is not None:
            return db.to(ctx.b_dtypes[i])
        return g_of(i).sum(0, dtype=torch.float32).to(ctx.b_dtypes[i])

    # The frozen weights normally have no gradient; when they do it is one plain GEMM.
    dw = [torch.matmul(g_of(i).t(), x).to(w.dtype) if need[1 + i] else None
          for i, w in enumerate((w_q, w_k, w_v))]
    # (a factor that was None, e.g. the zero zb of a Kernel-wise-only section, gets None)
    fac = [_opt(res[j]) if need[7 + i] else None
           for i, j in enumerate((1, 2, 3, 4, 5, 7, 8, 9, 10, 11))]
    # the per-head biases c sit beside the frozen bias: the same column sums
    dc = [res[j].to(dt) if nc else None for j, nc, dt in zip((6, 12), need_c, ctx.c_dtypes)]
    return (dx if nx else None, dw[0], dw[1], dw[2], bias_grad(0, dbq), bias_grad(1, None),
            bias_grad(2, dbv), *fac, None, None, None, *dc, None)


register_autograd(_qkv_fwd, _qkv_backward, setup_context=_qkv_setup)
# (headwise_projection runs these ops too)
register_autograd(_qkv_bwd, no_double_backward("headwise_qkv / headwise_projection"))


def headwise_qkv(x: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor,
                 b_q: Optional[torch.Tensor] = None, b_k: Optional[torch.Tensor] = None,
                 b_v: Optional[torch.Tensor] = None, *, n_heads: int,
                 n_kv_heads: Optional[int] = None, q: Optional[HeadFactors] = None,
                 v: Optional[HeadFactors] = None, backend: Optional[str] = None,
                 fused_output: bool = False, exact: Optional[bool] = None):
    """Fused attention-input projection with docs/math.md §2 updates on q and v.

    ``Q = X W_qᵀ + b_q + ΔQ``, ``K = X W_kᵀ + b_k``, ``V = X W_vᵀ + b_v + ΔV`` where each Δ is
    any mix of the shared LoRA part, Kernel-wise (basis X) and Kernel-wise-lite (basis K, bias
    included) given by a :class:`HeadFactors`.

    Args:
        x: ``(..., d)``.
        w_q: ``(H·p, d)``; w_k, w_v: ``(H_kv·p, d)`` in nn.Linear (out, in) layout, any
            strides (for GPT-2's Conv1D ``c_attn`` pass ``weight[:, i*d:(i+1)*d].t()``: no copy).
        b_q, b_k, b_v: ``(out,)`` or None.
        n_heads: H (query heads); n_kv_heads: H_kv (defaults to H; grouped-query attention
            when smaller). Lite on q uses key head ``h // (H / H_kv)`` for query head h.
        q, v: factors (shapes in :class:`HeadFactors`; for v use H_kv heads).
        backend: "auto" | "triton" | "reference".
        exact: how the Triton backend applies the q and v updates (the rule of
            :func:`kfused.ops._fold.fold_decision`, shared with ``headwise_oproj`` and
            ``krona_linear``). True: the augmented GEMMs (``Y = X [W; D]ᵀ`` with the
            up-projections in the epilogue, ``dX = [dY | dZ]·[W; D]``), the update never
            rounded into a weight. False (16-bit only): fold the updates and the biases into
            a copy of the frozen weights, ``W' = [W_q + ΔW_q; W_k; W_v + ΔW_v]`` (one pass,
            rounded once to the input dtype), then ``Y = X W'ᵀ + b'`` and ``dX = dY W'``,
            frozen-shaped; the part of ΔW below half an ulp of W is rounded away in Y and dX
            (the factor gradients stay exact; Z is computed again from X in the backward).
            None (default): on float16/bfloat16 CUDA inputs with at least
            ``FOLD_MIN_TOKENS`` tokens, what the performance model predicts is faster
            (kfused.triton_kernels._headwise_common.fold_plan: both folds, dX's alone, or
            none; every benchmark preset folds both at 16k tokens, Llama-7B widths below ~8k
            tokens fold nothing); else exact. float32 never folds.

    Returns ``Q (..., H·p)``, ``K (..., H_kv·p)``, ``V (..., H_kv·p)``, or with
    ``fused_output=True`` the one tensor ``[Q | K | V] (..., (H + 2·H_kv)·p)`` the kernel
    writes (GPT-2's ``c_attn`` layout; no copy).

    Triton plan: one augmented GEMM per section reads X once per output tile for the frozen
    GEMM and the down-projections whose up-projection touches the tile (Kernel-wise A_h, lite
    bases A_h W_k^h precomputed per call, shared A_s; packed into one >= 16-wide block) and
    adds the up-projections and biases in its epilogue before writing Q and V. Backward: one
    rank pass over dQ and dV (dZ, up-projection and bias gradients), dX as one GEMM over
    [dQ | dK | dV | dZ], and the token reduction dZᵀ X for the down-projections. Folded
    (``exact``): one launch forms W' and b', the forward and dX are frozen-shaped GEMMs and
    the backward computes Z = X Dᵀ + zb again (one GEMM) for the rank pass.
    """
    _validate.check_tensor("x", x, min_ndim=1)
    H = _check_n_heads(n_heads)
    Hkv = n_kv_heads if n_kv_heads is not None else H
    _check_flag("fused_output", fused_output)
    check_exact(exact)
    if isinstance(Hkv, bool) or not isinstance(Hkv, int) or Hkv < 1 or H % Hkv != 0:
        raise ValueError(f"n_kv_heads={n_kv_heads!r} must be a positive int dividing "
                         f"n_heads={H}")
    d = x.shape[-1]
    ok = isinstance(w_q, torch.Tensor) and w_q.dim() == 2 and w_q.shape[0] % H == 0
    p = w_q.shape[0] // H if ok else 0
    nq, nkv = H * p, Hkv * p
    if not (ok and fits(w_q, (nq, d), x) and w_k is not None and
            fits(w_k, (nkv, d), x) and w_v is not None and fits(w_v, (nkv, d), x) and
            fits(b_q, (nq,), x) and fits(b_k, (nkv,), x) and fits(b_v, (nkv,), x)):
        # (the common case is accepted above: what these checks accept; they name a fault)
        _validate.check_tensor("w_q", w_q, ndim=2)
        _validate.check_tensor("w_k", w_k, ndim=2)
        _validate.check_tensor("w_v", w_v, ndim=2)
        _check_input_width("x", x, {"w_q": w_q, "w_k": w_k, "w_v": w_v})
        p = _head_width(n_heads, "w_q", w_q, "output rows", w_q.shape[0])
        _check_linear("w_q", w_q, H * p, d, x)
        _check_linear("w_k", w_k, Hkv * p, d, x)
        _check_linear("w_v", w_v, Hkv * p, d, x)
        for name, b, n in (("b_q", b_q, H * p), ("b_k", b_k, Hkv * p), ("b_v", b_v, Hkv * p)):
            if b is not None:
                _validate.check_tensor(name, b, ndim=1)
                _validate.check_same("x", x, **{name: b})
                _validate.check_shape(name, b, (n,), "bias of the projection")
    for name, f, Hs in (("q", q, H), ("v", v, Hkv)):
        if f is not None:
            if not isinstance(f, HeadFactors):
                raise TypeError(f"{name} must be a kfused HeadFactors or None, got "
                                f"{type(f).__name__}")
            _check_factors(name, f, Hs, p, d, x)
    q, v = _scalar_factors(q), _scalar_factors(v)
    be = select_backend("headwise_qkv", backend, [x], impls=IMPLS,
                        extra_unfit=_no_float64(x))
    # An empty input width or head width leaves nothing to fuse: every product is an empty
    # sum, and the reference gives the exact result (biases, c, lite's b_k A_hᵀ B_hᵀ).
    if be == "reference" or d == 0 or p == 0:
        out = headwise_qkv_ref(x, w_q, w_k, w_v, b_q, b_k, b_v, n_heads=H, n_kv_heads=Hkv,
                               q=q, v=v)
        return torch.cat(out, dim=-1) if fused_output else out
    Y = _qkv_call(x, w_q, w_k, w_v, b_q, b_k, b_v, H, Hkv, p, q, v, exact=exact)
    if fused_output:
        return Y
    return tuple(Y.split([H * p, Hkv * p, Hkv * p], dim=-1))


def _fold_mode(dtype: torch.dtype, tokens: int, exact: Optional[bool],
               device: torch.device) -> int:
    """The ops' ``fold`` for ``exact`` (kfused.triton_kernels.headwise_qkv): 0 exact; 1 fold
    where the performance model says it pays (exact=None where :func:`fold_decision` folds);
    2 fold (exact=False, 16-bit)."""
    if not fold_decision(dtype, tokens, exact, device.type == "cuda"):
        return 0
    return 2 if exact is False else 1


def _qkv_call(x, w_q, w_k, w_v, b_q, b_k, b_v, H, Hkv, p, q, v, key=None, exact=None):
    """Build the kernel-level factors and call the fused op; returns [Q | K | V] (..., N).

    key: ``(w_k, b_k, Hk)`` of the frozen key projection when it is not the op's own k
    section (single-projection use, where w_k / w_v are empty). exact: see
    :func:`headwise_qkv`."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    kw, kb, Hk = key if key is not None else (w_k, b_k, Hkv)
    qf, dcq, sq, lq = _section(q, H, Hk, p, d, kw, kb, x.dtype)
    vf, dcv, sv, lv = _section(v, Hkv, Hk, p, d, kw, kb, x.dtype)
    c = lambda t: t.contiguous() if t is not None else None  # noqa: E731
    Y = kops.headwise_qkv_triton_fwd(
        x2, w_q, w_k, w_v, c(b_q), c(b_k), c(b_v), *qf, *vf, p, sq, sv, c(dcq), c(dcv),
        _fold_mode(x2.dtype, x2.shape[0], exact, x2.device))[0]
    for lite, c0 in ((lq, 0), (lv, w_q.shape[0] + w_k.shape[0])):
        if lite is not None and lite[0].requires_grad and torch.is_grad_enabled():
            Y = LiteKeyGrad.apply(Y, lite[0], lite[1], x2.detach(), kw.detach(),
                                  kb.detach() if kb is not None else None, c0, Hk)
    return Y.reshape(*lead, Y.shape[-1])
