"""``headwise_lowrank`` (docs/math.md §2): a per-head low-rank map of a user-given basis —
torch.library registrations, autograd and the public functional API.

    headwise_lowrank(basis, A, B, bias=None)          -> (..., H, p)

``backend="auto" | "triton" | "cuda" | "reference"`` ("cuda": the CUDA C++ extension's kernel
from csrc/headwise, tried after Triton by "auto"). Custom ops (each with a fake and, for the
forward, an autograd registration): kfused::headwise_lowrank_triton_fwd / _bwd,
kfused::headwise_lowrank_cuda_fwd / _bwd.

``headwise_lowrank`` is deliberately not wired into ``modules/`` or ``integration/``: every
module use (Kernel-wise on X, lite on K, the shared part) is a special case of the fused
projections, which read X once for the frozen GEMM and every down-projection; a module built
on ``headwise_lowrank`` would add passes over X (or K) and Y. It stays a public op (with its
Triton kernels, the CUDA C++ extension and their tests) for callers that hold a basis
themselves, e.g. an attention implementation that already computed K.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from kfused import _validate, cuda
from kfused.backends import select_backend
from kfused.ops._common import custom_op, kops, register_autograd
from kfused.ops._headwise_common import (_check_flag, _dense, _empty, _no_float64,
                                         no_double_backward)
from kfused.reference.headwise import headwise_lowrank_ref


def _tk():
    # Imported lazily: Triton decides at decoration time whether to interpret.
    from kfused.triton_kernels import headwise_lowrank

    return headwise_lowrank

# ==========================================================================================
# headwise_lowrank


@custom_op("kfused::headwise_lowrank_triton_fwd")
def _lowrank_fwd(basis: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                 bias: Optional[torch.Tensor], per_head: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    # the kernels index A, B and the bias as contiguous (the basis through its strides)
    return _tk().headwise_lowrank_forward(basis, A.contiguous(), B.contiguous(), _dense(bias),
                                          per_head)


@_lowrank_fwd.register_fake
def _(basis, A, B, bias, per_head):
    T = basis.shape[0]
    H, R, _ = A.shape
    return (basis.new_empty(T, H, B.shape[1]),
            basis.new_empty(T, H, R, dtype=torch.float32))


@custom_op("kfused::headwise_lowrank_triton_bwd")
def _lowrank_bwd(g: torch.Tensor, basis: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                 z: torch.Tensor, per_head: bool, need_basis: bool, need_factors: bool,
                 has_bias: bool) -> List[torch.Tensor]:
    dx, dA, dB, db = _tk().headwise_lowrank_backward(g.contiguous(), basis, A.contiguous(),
                                                     B.contiguous(), z.contiguous(), per_head,
                                                     need_basis, need_factors, has_bias)
    return [dx if dx is not None else _empty(basis), dA if dA is not None else _empty(A),
            dB if dB is not None else _empty(B), db if db is not None else _empty(B)]


@_lowrank_bwd.register_fake
def _(g, basis, A, B, z, per_head, need_basis, need_factors, has_bias):
    H, _, P = B.shape[0], None, B.shape[1]
    return [torch.empty_like(basis) if need_basis else basis.new_empty(0),
            torch.empty_like(A) if need_factors else A.new_empty(0),
            torch.empty_like(B) if need_factors else B.new_empty(0),
            B.new_empty(H, P) if (need_factors and has_bias) else B.new_empty(0)]


def _lowrank_setup(ctx, inputs, output):
    basis, A, B, bias, per_head = inputs
    ctx.save_for_backward(basis, A, B, output[1])
    ctx.per_head = per_head
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)    # no zero gradient for the rank-space output


def _lowrank_backward(ctx, g, gz):
    if g is None:
        return (None,) * 5
    basis, A, B, z = ctx.saved_tensors
    nx, nA, nB, nb, _ = ctx.needs_input_grad
    need_f = nA or nB or nb
    dx, dA, dB, db = kops.headwise_lowrank_triton_bwd(
        g.contiguous(), basis, A, B, z, ctx.per_head, nx, need_f, ctx.has_bias and nb)
    return (dx if nx else None, dA if nA else None, dB if nB else None,
            db if (nb and ctx.has_bias) else None, None)


register_autograd(_lowrank_fwd, _lowrank_backward, setup_context=_lowrank_setup)
register_autograd(_lowrank_bwd, no_double_backward("headwise_lowrank", "triton"))


# ------------------------------------------------------------------------------------------
# CUDA C++ extension (csrc/headwise/headwise_lowrank.cu): headwise_lowrank only. The kernel
# infers the basis kind from basis.dim() (2: shared, 3: per head), as the host passes it.


@custom_op("kfused::headwise_lowrank_cuda_fwd")
def _lowrank_cuda_fwd(basis: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                      bias: Optional[torch.Tensor],
                      save_u: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    ext = cuda.require("headwise_lowrank")
    return ext.headwise_lowrank_fwd(basis.contiguous(), A.contiguous(), B.contiguous(),
                                    bias.contiguous() if bias is not None else None, save_u)


# csrc/headwise/headwise_lowrank.cu kHwMaxN: the tensor-core path's largest rank
CUDA_HW_MAX_RANK = 64


def cuda_u_width(r: int) -> int:
    """Row length per head of the U the CUDA forward saves (csrc ``u_width``): r values, a
    column of ones at r (with a bias, dB's product then also yields dbias), zeros up to a
    multiple of 8."""
    return (r + 1 + 7) // 8 * 8


def _cuda_saves_u(basis: torch.Tensor, r: int, d_b: int, p: int, save_u: bool) -> bool:
    # the extension's shape rule: 16-bit, 1 <= r <= 64 (CUDA_HW_MAX_RANK), d_b and p >= 1
    return (save_u and basis.dtype in (torch.float16, torch.bfloat16)
            and 1 <= r <= CUDA_HW_MAX_RANK and d_b >= 1 and p >= 1)


@_lowrank_cuda_fwd.register_fake
def _(basis, A, B, bias, save_u=False):
    H, r, d_b = A.shape
    p = B.shape[1]
    out = basis.new_empty(basis.shape[0], H, p)
    if _cuda_saves_u(basis, r, d_b, p, save_u):
        return out, basis.new_empty(basis.shape[0], H, cuda_u_width(r))
    return out, basis.new_empty(0)


@custom_op("kfused::headwise_lowrank_cuda_bwd")
def _lowrank_cuda_bwd(g: torch.Tensor, basis: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                      has_bias: bool, U: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    ext = cuda.require("headwise_lowrank")
    dx, dA, dB, db = ext.headwise_lowrank_bwd(g.contiguous(), basis.contiguous(),
                                              A.contiguous(), B.contiguous(), has_bias,
                                              U if U is not None and U.numel() else None)
    return [dx, dA, dB, db]


@_lowrank_cuda_bwd.register_fake
def _(g, basis, A, B, has_bias, U=None):
    return [torch.empty_like(basis), torch.empty_like(A), torch.empty_like(B),
            B.new_empty(B.shape[0], B.shape[1]) if has_bias else B.new_empty(0)]


def _lowrank_cuda_setup(ctx, inputs, output):
    basis, A, B, bias, *_ = inputs
    ctx.save_for_backward(basis, A, B, output[1])
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)    # no zero gradient for U


def _lowrank_cuda_backward(ctx, g, gU):
    if g is None:
        return (None,) * 5
    basis, A, B, U = ctx.saved_tensors
    dx, dA, dB, db = kops.headwise_lowrank_cuda_bwd(g, basis, A, B, ctx.has_bias, U)
    return dx, dA, dB, (db if ctx.has_bias else None), None


register_autograd(_lowrank_cuda_fwd, _lowrank_cuda_backward, setup_context=_lowrank_cuda_setup)
register_autograd(_lowrank_cuda_bwd, no_double_backward("headwise_lowrank", "cuda"))


def _infer_per_head(basis: torch.Tensor, H: int, per_head: Optional[bool]) -> bool:
    if per_head is not None:
        return bool(per_head)
    return basis.dim() >= 3 and basis.shape[-2] == H


def headwise_lowrank(basis: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                     bias: Optional[torch.Tensor] = None, *, per_head: Optional[bool] = None,
                     backend: Optional[str] = None) -> torch.Tensor:
    """Per-head low-rank product ``out[..., h, :] = basis[..., (h,) :] A_hᵀ B_hᵀ + bias_h``.

    This is Kernel-wise (basis X, shared by the heads) and Kernel-wise-lite (basis K, one per
    head) of docs/math.md §2 as one op.

    Args:
        basis: ``(..., d_b)`` shared by all heads, or ``(..., H, d_b)`` one per head.
        A: ``(H, r, d_b)`` per-head down-projections.
        B: ``(H, p, r)`` per-head up-projections.
        bias: ``(H, p)`` per-head bias ``c`` or None.
        per_head: which basis kind; None infers "per head" when ``basis`` has at least 3
            dimensions and ``basis.shape[-2] == H`` (pass ``per_head=False`` for a shared
            ``(batch, seq, d_b)`` basis whose ``seq`` happens to equal ``H``; a 2-D basis is
            always shared unless ``per_head=True``).
        backend: "auto" (default: ``KFUSED_BACKEND``), "triton", "cuda" (the compiled
            extension; needs a GPU, so the CPU CI does not run it) or "reference".

    Returns ``(..., H, p)`` in the inputs' dtype. Float32, float16 and bfloat16 (Triton) and
    any floating dtype (reference).
    """
    _validate.check_tensor("basis", basis, min_ndim=1)
    _check_flag("per_head", per_head, optional=True)
    _validate.check_tensor("A", A, ndim=3)
    _validate.check_tensor("B", B, ndim=3)
    H, r, db_ = A.shape
    if r == 0:
        # (the Triton backward's bias sum ran no program at r = 0: bias.grad came back unset)
        raise ValueError(f"A has shape {tuple(A.shape)}: rank r = 0 is no update; r must be "
                         ">= 1 (leave the adapter out instead)")
    if bias is not None:
        _validate.check_tensor("bias", bias, ndim=2)
    _validate.check_same("basis", basis, A=A, B=B, bias=bias)
    ph = _infer_per_head(basis, H, per_head)
    if ph and (basis.dim() < 2 or basis.shape[-2] != H):
        raise ValueError(f"basis has shape {tuple(basis.shape)}, expected (..., H={H}, d_b) for "
                         "a per-head basis (H from A.shape[0])")
    if basis.shape[-1] != db_:
        raise ValueError(f"A has shape {tuple(A.shape)}, expected (H, r, d_b={basis.shape[-1]}) "
                         f"to match basis of shape {tuple(basis.shape)}")
    if B.shape[0] != H or B.shape[2] != r:
        raise ValueError(f"B has shape {tuple(B.shape)}, expected (H={H}, p, r={r}) to match "
                         f"A of shape {tuple(A.shape)}")
    p = B.shape[1]
    if bias is not None:
        _validate.check_shape("bias", bias, (H, p), "(H, p) per-head bias")
    be = select_backend("headwise_lowrank", backend, [basis, A, B], impls=("triton", "cuda"),
                        extra_unfit=_no_float64(basis))
    # an empty basis width: every head's map is an empty sum, the reference is exact (bias)
    if be == "reference" or db_ == 0:
        return headwise_lowrank_ref(basis, A, B, bias, per_head=ph)
    lead = basis.shape[:-2] if ph else basis.shape[:-1]
    flat = basis.reshape(-1, H, db_) if ph else basis.reshape(-1, db_)
    if be == "cuda":
        # U for the backward (saves it a pass over the basis and one over g) only when a
        # backward can follow
        save_u = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (basis, A, B, bias))
        out, _ = kops.headwise_lowrank_cuda_fwd(flat, A, B, bias, save_u)
        return out.reshape(*lead, H, p)
    out, _ = kops.headwise_lowrank_triton_fwd(
        flat, A.contiguous(), B.contiguous(), bias.contiguous() if bias is not None else None, ph)
    return out.reshape(*lead, H, p)
