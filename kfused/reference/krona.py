"""PyTorch reference for the Kronecker adapter (docs/math.md §1): the oracle and the CPU fallback.

Written with reshapes and matmuls (``Y[t] = A X[t] Bᵀ``); ``A ⊗ B`` is never formed except in
:func:`kron_delta_weight`, which exists for merge() and for tests.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def kron_matvec_ref(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``(A ⊗ B) x`` for every token.

    x: (..., a_in * b_in); A: (a_out, a_in); B: (b_out, b_in) -> (..., a_out * b_out).
    """
    a_out, a_in = A.shape
    b_out, b_in = B.shape
    lead = x.shape[:-1]
    X = x.reshape(-1, a_in, b_in)
    Y = torch.matmul(torch.matmul(A, X), B.transpose(0, 1))
    return Y.reshape(*lead, a_out * b_out)


def krona_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                     A: torch.Tensor, B: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``x Wᵀ + b + scale · (A ⊗ B) x``; weight (out, in) as in nn.Linear."""
    return F.linear(x, weight, bias) + scale * kron_matvec_ref(x, A, B)


def kron_delta_weight(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """The dense ``A ⊗ B`` of shape (a_out*b_out, a_in*b_in), for merging only."""
    return torch.kron(A, B)
