"""``headwise_oproj`` (docs/math.md §2): the fused output projection with per-head and shared
updates of W_o (basis O) — torch.library registrations, autograd and the public API.

    headwise_oproj(o, w_o, b_o, n_heads=, wise_A=, wise_B=, wise_c=, shared_A=, shared_B=,
                   scale=, exact=)                    -> Y

``backend="auto" | "triton" | "reference"``. Custom ops: kfused::headwise_oproj_triton_fwd / _bwd.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from kfused import _validate
from kfused._validate import fits
from kfused.backends import select_backend
from kfused.ops._common import custom_op, kops, register_autograd
from kfused.ops._fold import check_exact, fold_decision
from kfused.ops._headwise_common import (IMPLS, _check_scale, _dense, _empty,
                                         _head_width,
                                         _no_float64, _one_dtype, _opt, _scalar,
                                         no_double_backward)
from kfused.reference.headwise import headwise_oproj_ref


def _tk():
    # Imported lazily: Triton decides at decoration time whether to interpret.
    from kfused.triton_kernels import headwise_oproj

    return headwise_oproj

# ==========================================================================================
# Fused output projection


@custom_op("kfused::headwise_oproj_triton_fwd")
def _oproj_fwd(o: torch.Tensor, w_o: torch.Tensor, b_o: Optional[torch.Tensor],
               A: Optional[torch.Tensor], B: Optional[torch.Tensor],
               shared_A: Optional[torch.Tensor], shared_U: Optional[torch.Tensor],
               n_heads: int, scale: float = 1.0, c: Optional[torch.Tensor] = None,
               fold: bool = False) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # Returns Y, the rank-space Z and the folded operands the backward reuses (empty where
    # it folds again: kfused.triton_kernels.headwise_oproj.oproj_keeps_fold).
    # The GEMM epilogue reads b_o and c with unit stride (o, w_o and the factors via strides).
    return _tk().headwise_oproj_forward(o, w_o, _dense(b_o), A, B, shared_A, shared_U, n_heads,
                                        scale, _dense(c), fold)


@_oproj_fwd.register_fake
def _(o, w_o, b_o, A, B, shared_A, shared_U, n_heads, scale=1.0, c=None, fold=False):
    M = (A.shape[0] * A.shape[1] if A is not None else 0) + \
        (shared_A.shape[0] if shared_A is not None else 0)
    T, N, HP = o.shape[0], w_o.shape[0], o.shape[1]
    # (T stays symbolic under dynamic-shape tracing: a guard on the comparison)
    kept = bool(fold) and bool(M) and T != 0 and N != 0 and \
        _tk().oproj_keeps_fold(int(N), int(HP), int(M), T)
    return (o.new_empty(T, N), o.new_empty(T, M),
            o.new_empty(N + M, _tk().kept_width(int(HP), int(M))) if kept else o.new_empty(0))


@custom_op("kfused::headwise_oproj_triton_bwd")
def _oproj_bwd(g: torch.Tensor, o: torch.Tensor, w_o: torch.Tensor, A: Optional[torch.Tensor],
               B: Optional[torch.Tensor], shared_A: Optional[torch.Tensor],
               shared_U: Optional[torch.Tensor], z: torch.Tensor, n_heads: int,
               need_do: bool, need_factors: bool, scale: float = 1.0,
               fold: bool = False, db_dtype: Optional[torch.dtype] = None,
               w_fold: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    # db_dtype: the dtype of the bias gradient db (None: float32); w_fold: the forward's kept
    # folded operands (kfused.triton_kernels.headwise_oproj.headwise_oproj_backward)
    dO, gr = _tk().headwise_oproj_backward(g, o, w_o, A, B, shared_A, shared_U, z, n_heads,
                                           need_do, need_factors, scale, fold, db_dtype,
                                           w_fold)
    out = [dO if dO is not None else _empty(o)]
    for key in ("A", "Bw", "As", "Us", "db"):
        t = gr.get(key)
        out.append(t if t is not None else _empty(o))
    return out


@_oproj_bwd.register_fake
def _(g, o, w_o, A, B, shared_A, shared_U, z, n_heads, need_do, need_factors, scale=1.0,
      fold=False, db_dtype=None, w_fold=None):
    hw = need_factors and A is not None
    sh = need_factors and shared_A is not None
    e = o.new_empty(0)
    return [torch.empty_like(o) if need_do else e,
            torch.empty_like(A) if hw else e, torch.empty_like(B) if hw else e,
            torch.empty_like(shared_A) if sh else e, torch.empty_like(shared_U) if sh else e,
            o.new_empty(w_o.shape[0], dtype=db_dtype or torch.float32) if (hw or sh) else e]


def _oproj_setup(ctx, inputs, output):
    o, w_o, b_o, A, B, sA, sU, H, *rest = inputs
    scale, c, fold = tuple(rest) + (1.0, None, False)[len(rest):]
    ctx.save_for_backward(o, w_o, A, B, sA, sU, output[1], output[2])
    ctx.H, ctx.scale, ctx.fold = H, scale, fold
    ctx.has_b = b_o is not None
    ctx.b_dtype = b_o.dtype if b_o is not None else None
    ctx.c_dtype = c.dtype if c is not None else None
    ctx.mark_non_differentiable(output[1], output[2])
    # no zero gradients for the rank-space output and the kept folded operands
    ctx.set_materialize_grads(False)


def _oproj_backward(ctx, g, gz, gw=None):
    if g is None:
        return (None,) * 11
    o, w_o, A, B, sA, sU, z, w_fold = ctx.saved_tensors
    n_o, n_w, n_b, nA, nB, nsA, nsU = ctx.needs_input_grad[:7]
    n_c = len(ctx.needs_input_grad) > 9 and ctx.needs_input_grad[9]
    g = g.contiguous()
    need_f = nA or nB or nsA or nsU or n_b or n_c
    dO, dA, dB, dsA, dsU, db = kops.headwise_oproj_triton_bwd(
        g, o, w_o, A, B, sA, sU, z, ctx.H, n_o, need_f, ctx.scale, ctx.fold,
        _one_dtype(((ctx.b_dtype, n_b and ctx.has_b), (ctx.c_dtype, n_c))), w_fold)
    dw = torch.matmul(g.t(), o).to(w_o.dtype) if n_w else None
    if (n_b and ctx.has_b) or n_c:
        db = db if _opt(db) is not None else g.sum(0, dtype=torch.float32)
    # the per-head bias c sits beside the frozen bias: the same column sums
    dc = db.to(ctx.c_dtype) if n_c else None
    db = db.to(ctx.b_dtype) if n_b and ctx.has_b else None
    return (dO if n_o else None, dw, db, _opt(dA) if nA else None, _opt(dB) if nB else None,
            _opt(dsA) if nsA else None, _opt(dsU) if nsU else None, None, None, dc, None)


register_autograd(_oproj_fwd, _oproj_backward, setup_context=_oproj_setup)
register_autograd(_oproj_bwd, no_double_backward("headwise_oproj"))


def _oproj_fits(o, w_o, b_o, wise_A, wise_B, wise_c, shared_A, shared_B, scale, H: int,
                p: int) -> bool:
    """Whether :func:`_check_oproj` accepts these arguments with a numeric scale (asked first:
    the common case costs one pass)."""
    if not _validate.is_finite_number(scale):
        return False
    if not (isinstance(w_o, torch.Tensor) and w_o.dim() == 2):
        return False
    dout, HP = w_o.shape[0], H * p
    if not (fits(w_o, (dout, HP), o) and fits(b_o, (dout,), o)):
        return False
    if (wise_A is None) != (wise_B is None) or (shared_A is None) != (shared_B is None):
        return False
    if wise_A is None:
        if wise_c is not None:
            return False
    else:
        if not (isinstance(wise_A, torch.Tensor) and wise_A.dim() == 3):
            return False
        r = wise_A.shape[1]
        if not (fits(wise_A, (H, r, p), o) and fits(wise_B, (dout, H * r), o) and
                fits(wise_c, (dout,), o)):
            return False
    if shared_A is not None:
        if not (isinstance(shared_A, torch.Tensor) and shared_A.dim() == 2):
            return False
        rs = shared_A.shape[0]
        if not (fits(shared_A, (rs, HP), o) and fits(shared_B, (dout, rs), o)):
            return False
    return True


def _check_oproj(o, w_o, b_o, wise_A, wise_B, wise_c, shared_A, shared_B, scale, H: int,
                 p: int, exact) -> None:
    """The output projection's argument checks (ValueError/TypeError naming the argument)."""
    HP = o.shape[-1]
    _validate.check_tensor("w_o", w_o, ndim=2)
    for name, t, nd in (("b_o", b_o, 1), ("wise_A", wise_A, 3), ("wise_B", wise_B, 2),
                        ("wise_c", wise_c, 1), ("shared_A", shared_A, 2),
                        ("shared_B", shared_B, 2)):
        if t is not None:
            _validate.check_tensor(name, t, ndim=nd)
    _validate.check_same("o", o, w_o=w_o, b_o=b_o, wise_A=wise_A, wise_B=wise_B, wise_c=wise_c,
                         shared_A=shared_A, shared_B=shared_B)
    if w_o.shape[1] != HP:
        raise ValueError(f"w_o has shape {tuple(w_o.shape)}, expected (d_out, {HP}): its input "
                         f"width must equal the last dimension of o, which has shape "
                         f"{tuple(o.shape)}")
    dout = w_o.shape[0]
    if b_o is not None:
        _validate.check_shape("b_o", b_o, (dout,), "(d_out,)")
    if (wise_A is None) != (wise_B is None):
        raise ValueError("wise_A and wise_B must be given together")
    if wise_c is not None and wise_A is None:
        raise ValueError("wise_c needs wise_A and wise_B")
    if (shared_A is None) != (shared_B is None):
        raise ValueError("shared_A and shared_B must be given together")
    if wise_A is not None:
        _validate.check_tensor("wise_A", wise_A, ndim=3)
        r = wise_A.shape[1]
        _validate.check_shape("wise_A", wise_A, (H, r, p), "(H, r, p)")
        _validate.check_shape("wise_B", wise_B, (dout, H * r), "(d_out, H·r)")
        if wise_c is not None:
            _validate.check_shape("wise_c", wise_c, (dout,), "(d_out,)")
    _check_scale("scale", scale, o)
    check_exact(exact)
    if shared_A is not None:
        _validate.check_tensor("shared_A", shared_A, ndim=2)
        rs = shared_A.shape[0]
        _validate.check_shape("shared_A", shared_A, (rs, HP), "(r_s, H·p)")
        _validate.check_shape("shared_B", shared_B, (dout, rs), "(d_out, r_s)")


def headwise_oproj(o: torch.Tensor, w_o: torch.Tensor, b_o: Optional[torch.Tensor] = None, *,
                   n_heads: int, wise_A: Optional[torch.Tensor] = None,
                   wise_B: Optional[torch.Tensor] = None, wise_c: Optional[torch.Tensor] = None,
                   shared_A: Optional[torch.Tensor] = None,
                   shared_B: Optional[torch.Tensor] = None, scale: float = 1.0,
                   backend: Optional[str] = None, exact: Optional[bool] = None) -> torch.Tensor:
    """Fused output projection with the docs/math.md §2 updates of W_o (basis O).

    ``Y = O W_oᵀ + b_o + concat_h(O^h A_hᵀ) Bᵀ + c + scale · O A_sᵀ B_sᵀ``.

    Args:
        o: ``(..., H·p)`` concatenated head outputs.
        w_o: ``(d, H·p)`` nn.Linear layout, any strides (GPT-2 Conv1D: ``weight.t()``).
        b_o: ``(d,)`` or None.
        wise_A ``(H, r, p)``, wise_B ``(d, H·r)``, wise_c ``(d,)``: Kernel-wise on W_o (a
            rank-r update of each row block W_o^h).
        shared_A ``(r_s, H·p)``, shared_B ``(d, r_s)``, scale: the shared LoRA part.
        backend: "auto" | "triton" | "reference".
        exact: how the Triton backend applies the update (the rule of
            :func:`kfused.ops._fold.fold_decision`, shared with ``krona_linear``).
            True: Y = [O | Z]·[W_o | B]ᵀ, the update never rounded into W_o.
            False (16-bit only): fold it into the weight, ``W' = W_o + B D_o`` (one d×H·p
            pass, rounded once to the weight dtype), then the frozen-shaped GEMM for Y and for
            dO; the part of the update below half an ulp of W_o is rounded away there (the
            factor gradients stay exact).
            None (default): False for float16/bfloat16 CUDA inputs with at least
            ``FOLD_MIN_TOKENS`` tokens, True otherwise. float32 never folds.

    Triton plan: Z = O D_oᵀ (D_o: block-diagonal A_h and A_s; a thin GEMM, cuBLAS for 16-bit
    on a GPU), then Y = [O | Z]·[W_o | B]ᵀ + b as one two-segment GEMM; folded: Y = O W'ᵀ + b
    and Z = O D_oᵀ, two frozen-shaped GEMMs (cuBLAS on a GPU) over one folded buffer.
    Backward: dZ = dY B, dO = [dY | dZ]·[W_o; D_o] (folded: dO = dY W' and dZ = dY B, cuBLAS
    again), token reductions dYᵀ Z and dZᵀ O.
    """
    _validate.check_tensor("o", o, min_ndim=1)
    HP = o.shape[-1]
    p = _head_width(n_heads, "o", o, "last dim", HP)
    H = n_heads
    args = (o, w_o, b_o, wise_A, wise_B, wise_c, shared_A, shared_B, scale, H, p)
    if _oproj_fits(*args):     # the common case, accepted first (the checks name a fault)
        check_exact(exact)
    else:
        _check_oproj(*args, exact)
    scale = _scalar(scale)
    be = select_backend("headwise_oproj", backend, [o], impls=IMPLS,
                        extra_unfit=_no_float64(o))
    # an empty input width (H·p = 0): nothing to fuse, the reference is exact (b_o + c)
    if be == "reference" or HP == 0:
        return headwise_oproj_ref(o, w_o, b_o, n_heads=H, wise_A=wise_A, wise_B=wise_B,
                                  wise_c=wise_c, shared_A=shared_A, shared_B=shared_B,
                                  scale=scale)
    lead = o.shape[:-1]
    o2 = o.reshape(-1, HP).contiguous()
    sB, s = shared_B, 1.0
    if shared_A is not None:
        if isinstance(scale, torch.Tensor):     # differentiable: fold it here, in float32
            sB = shared_B.float() * scale
        else:                                   # the pack kernel folds it in float32
            s = float(scale)
    # contiguous factors (no copy when they are): the backward's fake outputs (empty_like)
    # then have the strides the real ones have
    c = lambda t: t.contiguous() if t is not None else None  # noqa: E731
    fold = fold_decision(o2.dtype, o2.shape[0], exact, o2.device.type == "cuda")
    Y = kops.headwise_oproj_triton_fwd(
        o2, w_o, c(b_o), c(wise_A), c(wise_B), c(shared_A), c(sB), H, s, c(wise_c), fold)[0]
    return Y.reshape(*lead, w_o.shape[0])
