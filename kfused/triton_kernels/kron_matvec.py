"""Triton host functions of ``kron_matvec`` (docs/math.md §1): ``(A ⊗ B) x`` per token without
forming ``A ⊗ B``. It is ``krona_linear`` without the frozen weight, so it runs the KronA
kernels of :mod:`kfused.triton_kernels.krona_linear` (their HAS_W=False variants).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from kfused.triton_kernels.krona_linear import kron_factor_grads, krona_linear_forward


def kron_matvec_forward(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """y (T, a_out*b_out) = (A ⊗ B) x for x (T, a_in*b_in) with unit inner stride."""
    return krona_linear_forward(x, None, None, A, B, 1.0)


def kron_matvec_backward(g: torch.Tensor, x: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                         need_dab: bool = True, need_dx: bool = True
                         ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor],
                                    Optional[torch.Tensor]]:
    """(dx, dA, dB) of kron_matvec given its upstream gradient g, in one pass over (x, g)
    (dA, dB None when need_dab is False; dx None when need_dx is False)."""
    return kron_factor_grads(g, x, A, B, 1.0, compute_dx=need_dx, compute_dab=need_dab)
