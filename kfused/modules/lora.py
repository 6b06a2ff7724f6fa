"""Plain LoRA around a frozen linear layer, in plain torch ops.

``y = x Wᵀ + b + s · (x Aᵀ) Bᵀ`` with ``A ∈ R^{r × d_in}``, ``B ∈ R^{d_out × r}``, ``s = alpha / r``.
Two skinny GEMMs beside the frozen one are already what cuBLAS does best, so there is no fused
kernel; the module exists so that LoRA baselines and the composite methods (inducer + LoRA,
Kernel-mix's shared part) go through the same injection, checkpoint and merge code.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kfused import _validate
from kfused.modules._init import PAIR_INITS, check_init, init_pair_
from kfused.modules._linear import WrappedLinear, check_backend_name, check_rank, linear_dims


class LoRALinear(WrappedLinear):
    """LoRA around an nn.Linear or a transformers Conv1D (GPT-2), base parameters frozen.

    Args:
        base: the frozen layer (nn.Linear (out, in) weight, or Conv1D (in, out) weight).
        r: rank (>= 1). alpha: scaling numerator, ``s = alpha / r`` (default alpha = r, s = 1).
        dropout: dropout on the adapter's input only (as PEFT does).
        init: "zero" (A kaiming-uniform a=√5, B = 0: starts exactly at the frozen model) or
            "random" (both kaiming-uniform); see :mod:`kfused.modules._init`.
        backend: accepted for interface symmetry with the fused modules and ignored (a name
            that is not a backend is still refused, as by the other modules).
    """

    INITS = PAIR_INITS

    def __init__(self, base: nn.Module, r: int = 8, alpha: Optional[float] = None,
                 dropout: float = 0.0, init: str = "zero", backend: Optional[str] = None):
        r = check_rank("LoRA rank r", r)
        if alpha is not None:
            alpha = _validate.check_real("alpha", alpha)
        dropout = _validate.check_real("dropout", dropout)
        if not 0.0 <= dropout <= 1.0:
            raise ValueError(f"dropout must be a probability in [0, 1], got {dropout}")
        check_init(init, self.INITS, "LoRALinear")
        super().__init__(base)
        d_in, d_out = linear_dims(base)
        self.r = int(r)
        self.alpha = float(self.r if alpha is None else alpha)
        self.scale = self.alpha / self.r
        self.init = init
        self.backend = check_backend_name(backend)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        w = base.weight
        self.A = nn.Parameter(torch.empty(self.r, d_in, dtype=w.dtype, device=w.device))
        self.B = nn.Parameter(torch.empty(d_out, self.r, dtype=w.dtype, device=w.device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_pair_(self.A, self.B, self.init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.merged:
            return y
        A, B = self.A, self.B
        h = self.dropout(x)
        if h.dtype != A.dtype and not torch.is_autocast_enabled(h.device.type):
            A, B = A.to(h.dtype), B.to(h.dtype)  # float32 adapter on a half-precision base
        delta = F.linear(F.linear(h, A), B)
        return y + (self.scale * delta).to(y.dtype)

    def delta_weight(self) -> torch.Tensor:
        """``s · B A`` in (out, in) layout (for merge and inspection)."""
        return self.scale * (self.B @ self.A)

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}, scale={self.scale}, merged={self.merged}"
