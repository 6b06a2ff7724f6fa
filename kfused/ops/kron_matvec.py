"""``kron_matvec`` (docs/math.md §1): ``(A ⊗ B) x`` per token — torch.library registrations, autograd
and the public API.

Custom ops (each with a fake and an autograd registration): kfused::kron_matvec_triton_fwd /
_bwd (the KronA Triton kernels) and kfused::kron_matvec_cuda_fwd / _bwd (the compiled
extension; see csrc/).
"""

from __future__ import annotations

from typing import List, Optional

import torch

from kfused import cuda
from kfused.backends import select_backend
from kfused.ops._common import custom_op, kops, register_autograd
from kfused.ops._krona_common import check_factors, no_double_backward, rows
from kfused.reference.krona import kron_matvec_ref


def _tk():
    # Imported lazily: Triton decides at decoration time whether to interpret.
    from kfused.triton_kernels import kron_matvec

    return kron_matvec


@custom_op("kfused::kron_matvec_triton_fwd")
def _kron_matvec_triton_fwd(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    return _tk().kron_matvec_forward(rows(x), A, B)     # x rows with unit stride, A, B any


@_kron_matvec_triton_fwd.register_fake
def _(x, A, B):
    return x.new_empty(x.shape[0], A.shape[0] * B.shape[0])


@custom_op("kfused::kron_matvec_triton_bwd")
def _kron_matvec_triton_bwd(g: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                            need_dab: bool, need_dx: bool = True) -> List[torch.Tensor]:
    dx, dA, dB = _tk().kron_matvec_backward(rows(g), rows(x), A, B, need_dab, need_dx)
    if not need_dx:
        dx = x.new_zeros(0)
    if not need_dab:
        dA, dB = A.new_zeros(0), B.new_zeros(0)
    return [dx, dA, dB]


@_kron_matvec_triton_bwd.register_fake
def _(g, x, A, B, need_dab, need_dx=True):
    dx = torch.empty_like(x) if need_dx else x.new_empty(0)
    if need_dab:
        return [dx, torch.empty_like(A), torch.empty_like(B)]
    return [dx, A.new_empty(0), B.new_empty(0)]


def _kron_setup(ctx, inputs, output):
    x, A, B = inputs
    ctx.save_for_backward(x, A, B)


def _kron_triton_backward(ctx, g):
    x, A, B = ctx.saved_tensors
    need_dx = ctx.needs_input_grad[0]
    need_dab = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
    # dx only when x needs it (a frozen input, e.g. KronA^B's first layer: no dx pass)
    dx, dA, dB = kops.kron_matvec_triton_bwd(g.contiguous(), x, A, B, need_dab, need_dx)
    return (dx if need_dx else None), (dA if need_dab else None), (dB if need_dab else None)


register_autograd(_kron_matvec_triton_fwd, _kron_triton_backward, setup_context=_kron_setup)
register_autograd(_kron_matvec_triton_bwd, no_double_backward("kron_matvec", "triton"))

# ------------------------------------------------------------------------------------------
# CUDA C++ extension


@custom_op("kfused::kron_matvec_cuda_fwd")
def _kron_matvec_cuda_fwd(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    # the extension requires a contiguous x (it checks) and reads A, B contiguous
    return cuda.require("kron_matvec").kron_matvec_fwd(x.contiguous(), A.contiguous(),
                                                       B.contiguous())


@_kron_matvec_cuda_fwd.register_fake
def _(x, A, B):
    return x.new_empty(x.shape[0], A.shape[0] * B.shape[0])


@custom_op("kfused::kron_matvec_cuda_bwd")
def _kron_matvec_cuda_bwd(g: torch.Tensor, x: torch.Tensor, A: torch.Tensor,
                          B: torch.Tensor) -> List[torch.Tensor]:
    dx, dA, dB = cuda.require("kron_matvec").kron_matvec_bwd(g.contiguous(), x.contiguous(),
                                                             A.contiguous(), B.contiguous())
    return [dx, dA, dB]


@_kron_matvec_cuda_bwd.register_fake
def _(g, x, A, B):
    return [torch.empty_like(x), torch.empty_like(A), torch.empty_like(B)]


def _kron_cuda_backward(ctx, g):
    x, A, B = ctx.saved_tensors
    dx, dA, dB = kops.kron_matvec_cuda_bwd(g.contiguous(), x, A, B)
    return dx, dA, dB


register_autograd(_kron_matvec_cuda_fwd, _kron_cuda_backward, setup_context=_kron_setup)
register_autograd(_kron_matvec_cuda_bwd, no_double_backward("kron_matvec", "cuda"))


def kron_matvec(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, *,
                backend: Optional[str] = None) -> torch.Tensor:
    """Kronecker matvec ``(A ⊗ B) x`` for every token, without forming ``A ⊗ B``.

    Args:
        x: (..., a_in * b_in) tokens; any leading shape, any strides.
        A: (a_out, a_in) left factor.  B: (b_out, b_in) right factor.
        backend: "auto" (default, or $KFUSED_BACKEND), "triton", "cuda" or "reference".
    Returns:
        (..., a_out * b_out) in x's dtype: row t is ``(A @ x[t].view(a_in, b_in) @ B.T).flatten()``.
    All inputs share one dtype and device; float32/float16/bfloat16 on the fused backends.
    """
    a_out, a_in, b_out, b_in = check_factors(x, A, B)
    be = select_backend("kron_matvec", backend, [x, A, B], impls=("triton", "cuda"))
    if be == "reference":
        return kron_matvec_ref(x, A, B)
    lead = x.shape[:-1]
    x2 = rows(x)
    if be == "triton":
        y = kops.kron_matvec_triton_fwd(x2, A, B)
    else:
        y = kops.kron_matvec_cuda_fwd(x2.contiguous(), A, B)
    return y.reshape(*lead, a_out * b_out)
