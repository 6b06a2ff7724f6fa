"""``krona_linear`` (docs/math.md §1): a frozen linear plus the Kronecker adapter,
``x Wᵀ + b + scale · (A ⊗ B) x`` — torch.library registrations, autograd and the public API.

Custom ops (each with a fake and an autograd registration): kfused::krona_linear_triton_fwd /
_bwd (factored) and kfused::krona_linear_folded_fwd / _bwd (W + s·A⊗B folded into the weight,
then cuBLAS); kfused::krona_linear_cuda_folded_fwd / _bwd (the same fold by the CUDA C++
extension, its factor gradients from the extension's kron_matvec backward).
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from kfused import _validate, cuda
from kfused.backends import select_backend
from kfused.ops._common import custom_op, kops, register_autograd
from kfused.ops._fold import FOLD_MIN_TOKENS, check_exact, fold_decision  # noqa: F401
from kfused.ops._krona_common import (check_factors, cuda_factor_kernel, dense,
                                      no_double_backward, rows)
from kfused.reference.krona import krona_linear_ref


def _tk():
    # Imported lazily: Triton decides at decoration time whether to interpret.
    from kfused.triton_kernels import krona_linear

    return krona_linear


@custom_op("kfused::krona_linear_triton_fwd")
def _krona_linear_triton_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                             A: torch.Tensor, B: torch.Tensor, scale: float) -> torch.Tensor:
    # The kernel reads x rows and the bias with unit stride (weight, A, B through their
    # strides): a strided or expanded bias read the wrong elements, or past its storage.
    return _tk().krona_linear_forward(rows(x), weight, dense(bias), A, B, scale)


def _krona_fwd_fake(x, weight, bias, A, B, scale):
    return x.new_empty(x.shape[0], weight.shape[0])


_krona_linear_triton_fwd.register_fake(_krona_fwd_fake)


@custom_op("kfused::krona_linear_triton_bwd")
def _krona_linear_triton_bwd(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                             A: torch.Tensor, B: torch.Tensor, scale: float,
                             need_dx: bool, need_dab: bool) -> List[torch.Tensor]:
    dx, dA, dB = _tk().krona_linear_backward(rows(g), rows(x), weight, A, B, scale,
                                             need_dx=need_dx, need_dab=need_dab)
    return [dx if need_dx else x.new_zeros(0), dA if need_dab else A.new_zeros(0),
            dB if need_dab else B.new_zeros(0)]


def _krona_bwd_fake(g, x, weight, A, B, scale, need_dx, need_dab, w_fold=None):
    return [torch.empty_like(x) if need_dx else x.new_empty(0),
            torch.empty_like(A) if need_dab else A.new_empty(0),
            torch.empty_like(B) if need_dab else B.new_empty(0)]


_krona_linear_triton_bwd.register_fake(_krona_bwd_fake)


def _krona_setup(ctx, inputs, output):
    x, weight, bias, A, B, scale = inputs
    ctx.save_for_backward(x, weight, A, B)
    ctx.scale = scale
    ctx.has_bias = bias is not None


def _krona_backward(bwd_op):
    """The autograd backward of a krona_linear forward op whose backward op is ``bwd_op``
    (a folded forward also saves its W', handed to ``bwd_op``; its own gradient is none)."""
    def backward(ctx, g):
        x, weight, A, B, *kept = ctx.saved_tensors
        nx, nw, nb, nA, nB, _ = ctx.needs_input_grad
        if isinstance(g, (list, tuple)):    # a folded op's outputs [y, W']: W' has no gradient
            g = g[0]
        if g is None:       # folded ops (no materialised grads): y unused
            return (None,) * 6
        g = g.contiguous()
        need_dab = nA or nB
        dx, dA, dB = bwd_op(g, x, weight, A, B, ctx.scale, nx, need_dab, *kept)
        # The frozen weight normally has no gradient; when it does, it is one plain GEMM.
        dW = torch.matmul(g.t(), x).to(weight.dtype) if nw else None
        db = g.sum(0) if (nb and ctx.has_bias) else None
        return (dx if nx else None, dW, db, dA if need_dab else None,
                dB if need_dab else None, None)
    return backward


register_autograd(_krona_linear_triton_fwd, 
    _krona_backward(kops.krona_linear_triton_bwd), setup_context=_krona_setup)
register_autograd(_krona_linear_triton_bwd, no_double_backward("krona_linear", "triton"))

# ------------------------------------------------------------------------------------------
# Triton: KronA linear with the adapter folded into the weight (W' = W + s·A⊗B, then cuBLAS)


# W' is kept from the forward for the backward's dx (one fold per step instead of two) when it
# is small beside x: at most 1/KEEP_FOLD_RATIO of x's elements (T >= 8·d_out tokens), i.e.
# at most 12.5 % more saved activation than the frozen linear's x; otherwise the backward
# folds again (one more d_out×d_in pass and launch). PREDICTED (kfused perf, H100, bf16,
# T = 16384): −3.8 µs of 77 µs at 768², where W' is 4.7 % of x.
KEEP_FOLD_RATIO = 8


def keeps_fold(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a folded forward keeps W' for its backward (see ``KEEP_FOLD_RATIO``)."""
    return KEEP_FOLD_RATIO * weight.numel() <= x.numel()


@custom_op("kfused::krona_linear_folded_fwd")
def _krona_linear_folded_fwd(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                             A: torch.Tensor, B: torch.Tensor, scale: float
                             ) -> List[torch.Tensor]:
    w_fold = _tk().fold_weight(weight, A, B, scale)
    y = torch.nn.functional.linear(x, w_fold, bias)
    return [y, w_fold if keeps_fold(x, weight) else x.new_empty(0)]


def _folded_fwd_fake(x, weight, bias, A, B, scale):
    keep = weight.new_empty(weight.shape) if keeps_fold(x, weight) else x.new_empty(0)
    return [x.new_empty(x.shape[0], weight.shape[0]), keep]


_krona_linear_folded_fwd.register_fake(_folded_fwd_fake)


@custom_op("kfused::krona_linear_folded_bwd")
def _krona_linear_folded_bwd(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                             A: torch.Tensor, B: torch.Tensor, scale: float,
                             need_dx: bool, need_dab: bool,
                             w_fold: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    k = _tk()
    g, x = rows(g), rows(x)   # the factor-gradient kernels read rows with unit stride
    if need_dx and (w_fold is None or w_fold.numel() == 0):
        w_fold = k.fold_weight(weight, A, B, scale)     # not kept by the forward: fold again
    if need_dx and need_dab and k.fused_dx_grad_applies(*A.shape, *B.shape, x.shape[0],
                                                         x.element_size()):
        # one pass over dy (KFUSED_KRONA_FOLDED_BWD=one-pass; the two passes below are the
        # measured default): dx = dy W' and the factor gradients in the same kernel (None:
        # the GPU could not load it at these factor shapes; the two passes below)
        res = k.krona_dx_and_factor_grads(g, x, w_fold, A, B, scale)
        if res is not None:
            return list(res)
    dx = torch.matmul(g, w_fold) if need_dx else x.new_zeros(0)
    _, dA, dB = k.krona_linear_backward(g, x, weight, A, B, scale, need_dx=False,
                                        need_dab=need_dab)
    return [dx, dA if need_dab else A.new_zeros(0), dB if need_dab else B.new_zeros(0)]


_krona_linear_folded_bwd.register_fake(_krona_bwd_fake)


def _folded_setup(ctx, inputs, output):
    """As :func:`_krona_setup`, plus the forward's W' (empty when not kept)."""
    x, weight, bias, A, B, scale = inputs
    ctx.save_for_backward(x, weight, A, B, output[1])
    ctx.scale = scale
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)    # no zero gradient for W'


register_autograd(_krona_linear_folded_fwd, 
    _krona_backward(kops.krona_linear_folded_bwd), setup_context=_folded_setup)
register_autograd(_krona_linear_folded_bwd, no_double_backward("krona_linear", "triton"))

# ------------------------------------------------------------------------------------------
# CUDA C++: the folded path on the extension (W' by its fold kernel, then cuBLAS; dA, dB from
# its kron_matvec backward without dx, scaled before their one rounding)


def _ext():
    return cuda.require("krona_linear")


@custom_op("kfused::krona_linear_cuda_folded_fwd")
def _krona_linear_cuda_folded_fwd(x: torch.Tensor, weight: torch.Tensor,
                                  bias: Optional[torch.Tensor], A: torch.Tensor, B: torch.Tensor,
                                  scale: float) -> List[torch.Tensor]:
    w_fold = _ext().krona_fold_fwd(weight, A, B, scale)
    y = torch.nn.functional.linear(x, w_fold, bias)
    return [y, w_fold if keeps_fold(x, weight) else x.new_empty(0)]


_krona_linear_cuda_folded_fwd.register_fake(_folded_fwd_fake)


@custom_op("kfused::krona_linear_cuda_folded_bwd")
def _krona_linear_cuda_folded_bwd(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                  A: torch.Tensor, B: torch.Tensor, scale: float,
                                  need_dx: bool, need_dab: bool,
                                  w_fold: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    ext = _ext()
    g = g.contiguous()          # the extension's kron_matvec_bwd requires contiguous g and x
    dx = x.new_zeros(0)
    if need_dx:
        if w_fold is None or w_fold.numel() == 0:    # not kept by the forward: fold again
            w_fold = ext.krona_fold_fwd(weight, A, B, scale)
        dx = torch.matmul(g, w_fold)
    if not need_dab:
        return [dx, A.new_zeros(0), B.new_zeros(0)]
    _, dA, dB = ext.kron_matvec_bwd(g, x.contiguous(), A.contiguous(), B.contiguous(),
                                    need_dx=False, scale=scale)
    return [dx, dA, dB]


_krona_linear_cuda_folded_bwd.register_fake(_krona_bwd_fake)


register_autograd(_krona_linear_cuda_folded_fwd, 
    _krona_backward(kops.krona_linear_cuda_folded_bwd), setup_context=_folded_setup)
register_autograd(_krona_linear_cuda_folded_bwd, no_double_backward("krona_linear", "cuda"))

# ------------------------------------------------------------------------------------------
# validation and the public API


def check_scale(scale) -> float:
    """The adapter scale as a float: a real Python/NumPy number, finite; TypeError/ValueError
    naming ``scale`` otherwise."""
    if isinstance(scale, torch.Tensor):
        raise TypeError("scale must be a Python float, got a torch.Tensor; use a module "
                        "parameter for a learned scale")
    return _validate.check_real("scale", scale)


def regime(tokens: int, dtype: torch.dtype, exact: Optional[bool], on_cuda: bool = True,
           factors: Optional[Tuple[int, int, int, int]] = None) -> str:
    """The regime a call is in for measured backend preferences (kfused.backends
    .measured_order): "folded" where it folds the adapter into the weight
    (:func:`kfused.ops._fold.fold_decision`; both backends then run cuBLAS on W'), else
    "exact"; with ``factors`` (a_out, a_in, b_out, b_in), "-narrow" appended where the CUDA
    extension's factor kernel is not its tensor-core one (:func:`cuda_factor_kernel`: the
    paper's 2×384 / 384×2 factors), so that a preference measured on balanced factors (where
    the two backends ran 798 µs and 1382 µs wall on the H100) never decides for the paper's
    factors (whose CUDA path ran 3807 µs against Triton's 1559 µs at 768→3072 there, before
    the narrow kernel): they are measured in their own regime."""
    base = "folded" if fold_decision(dtype, tokens, exact, on_cuda) else "exact"
    if factors is not None and cuda_factor_kernel(*factors) != "tensor-core":
        return base + "-narrow"
    return base


def use_folded_weight(x2: torch.Tensor, exact: Optional[bool]) -> bool:
    """Whether krona_linear folds the adapter into the weight (see its ``exact`` argument and
    :mod:`kfused.ops._fold`)."""
    return fold_decision(x2.dtype, x2.shape[0], exact, x2.device.type == "cuda")


def _krona_fits(x, weight, bias, A, B, scale) -> bool:
    """Whether krona_linear's checks accept these arguments with a numeric scale (asked
    first: the common case in one pass)."""
    if not (_validate.is_finite_number(scale) and isinstance(x, torch.Tensor) and x.dim() and
            isinstance(A, torch.Tensor) and A.dim() == 2 and isinstance(B, torch.Tensor) and
            B.dim() == 2 and weight is not None):
        return False
    (a_out, a_in), (b_out, b_in) = A.shape, B.shape
    return bool(a_out and a_in and b_out and b_in and x.shape[-1] == a_in * b_in and
                _validate.fits(A, A.shape, x) and _validate.fits(B, B.shape, x) and
                _validate.fits(weight, (a_out * b_out, a_in * b_in), x) and
                _validate.fits(bias, (a_out * b_out,), x))


def krona_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 A: torch.Tensor, B: torch.Tensor, scale: float = 1.0, *,
                 backend: Optional[str] = None, exact: Optional[bool] = None) -> torch.Tensor:
    """Frozen linear plus Kronecker adapter: ``x Wᵀ + b + scale · (A ⊗ B) x``, fused.

    Args:
        x: (..., d_in) with d_in = a_in * b_in.
        weight: (d_out, d_in) in nn.Linear layout (a transposed view of a Conv1D weight is
            fine: strides are honoured without a copy); d_out = a_out * b_out.
        bias: (d_out,) or None.
        A: (a_out, a_in).  B: (b_out, b_in).  scale: the adapter scale s.
        backend: "auto", "triton", "cuda" or "reference". "cuda" (the C++ extension): where
            the fold applies (below), its fold kernel then cuBLAS, dA and dB from its
            kron_matvec backward; otherwise ``F.linear`` plus its kron_matvec (unfused).
            "auto" prefers Triton, unless ``kfused bench --write-prefs`` measured the CUDA
            C++ path faster on this GPU model for the call's :func:`regime`.
        exact: how the Triton backend applies the adapter.
            False: fold it into the weight — ``W' = W + s·(A⊗B)`` (one d_out×d_in pass, each
            element rounded once to the weight dtype), then the frozen GEMM (cuBLAS) on W'
            for y and for dx; dA, dB from the factored tensor-core kernel. Fastest at large T,
            but in a 16-bit dtype the part of ``s·A⊗B`` below half an ulp of W is rounded
            away in the forward and dx (the factor gradients stay exact).
            True: the factored kernels — the adapter term is computed from A and B exactly
            as docs/math.md §1 writes it, never rounded into W.
            None (default): False for float16/bfloat16 CUDA inputs with at least
            ``FOLD_MIN_TOKENS`` tokens, True otherwise (small T, the interpreter).
            float32 inputs always take the exact path (the fold would not meet docs/math.md §4).
    Returns:
        (..., d_out). The factored kernel reads x once for the frozen GEMM and the adapter and
        its backward produces dx for both terms in one pass over dy.
    """
    if _krona_fits(x, weight, bias, A, B, scale):   # the common case, in one pass
        (a_out, a_in), (b_out, b_in) = A.shape, B.shape
        scale = float(scale)
    else:                                           # the checks that name a fault
        a_out, a_in, b_out, b_in = check_factors(x, A, B)
        _validate.check_tensor("weight", weight, ndim=2)
        _validate.check_same("x", x, weight=weight, bias=bias)
        _validate.check_shape("weight", weight, (a_out * b_out, a_in * b_in),
                              "(a_out*b_out, a_in*b_in) in nn.Linear (out, in) layout")
        if bias is not None:
            _validate.check_tensor("bias", bias, ndim=1)
            _validate.check_shape("bias", bias, (a_out * b_out,), "(d_out,)")
        scale = check_scale(scale)
    check_exact(exact)
    tokens = x.numel() // max(1, x.shape[-1])
    be = select_backend("krona_linear", backend, [x, weight, A, B], impls=("triton", "cuda"),
                        regime=regime(tokens, x.dtype, exact, x.device.type == "cuda",
                                      (a_out, a_in, b_out, b_in)))
    if be == "reference":
        return krona_linear_ref(x, weight, bias, A, B, scale)
    lead = x.shape[:-1]
    x2 = rows(x)
    if be == "cuda":
        if use_folded_weight(x2, exact):
            y = kops.krona_linear_cuda_folded_fwd(x2, weight, bias, A, B, scale)[0]
        else:
            from kfused.ops.kron_matvec import kron_matvec

            y = (torch.nn.functional.linear(x2, weight, bias)
                 + scale * kron_matvec(x2, A, B, backend="cuda"))
        return y.reshape(*lead, a_out * b_out)
    if use_folded_weight(x2, exact):
        y = kops.krona_linear_folded_fwd(x2, weight, bias, A, B, scale)[0]
    else:
        y = kops.krona_linear_triton_fwd(x2, weight, bias, A, B, scale)
    return y.reshape(*lead, a_out * b_out)
