"""Pieces every op family's custom ops share."""

from __future__ import annotations

from typing import Optional

import torch


def dense(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``t`` contiguous (no copy when it is; None stays None): for the vectors and factors a
    kernel indexes without strides (biases, per-head c)."""
    return t.contiguous() if t is not None else None


def no_double_backward(op: str, backend: str = "triton"):
    """The autograd formula of a backward custom op: its kernels have no derivative of their
    own, so a second backward through it (``create_graph=True``, then the gradient of a
    gradient) raises this error instead of torch's generic "no autograd formula" (or, for an
    autograd.Function whose backward ran kernels, a silently missing term). The first
    backward is unaffected (it runs the op below autograd)."""
    def backward(ctx, *grads):
        raise RuntimeError(
            f"double backward is not supported by kfused.{op} (backend={backend!r}): its "
            "backward is a fused kernel with no derivative of its own; use "
            "backend='reference' for higher-order gradients")
    return backward
