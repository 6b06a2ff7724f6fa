"""Scaled parallel adapter (He et al., paper 002, §3.3 / table 1) around a frozen block.

``y = block(x) + s · (ReLU(x W_downᵀ + b_down) W_upᵀ + b_up)`` (``s`` scales the up
projection's bias too) — the FFN half of the MAM adapter.
Plain torch ops: two GEMMs with a ReLU between them gain nothing from fusion on their own.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kfused import _validate
from kfused.modules._init import PAIR_INITS, check_init, init_pair_
from kfused.modules._linear import check_backend_name, check_block_widths, check_rank


class ScaledParallelAdapter(nn.Module):
    """A bottleneck adapter parallel to a frozen block (e.g. the FFN), output scaled by ``s``.

    Args:
        block: the frozen module, called as ``block(x, *args, **kwargs)``.
        d_model: input and output width of the block. r: bottleneck width.
        scale: s (the paper uses 4 for the FFN adapter of the MAM adapter).
        init: "zero" (down kaiming-uniform a=√5, up = 0: exact start, as the paper's released
            code does for its "lora" init) or "random".
    """

    INITS = PAIR_INITS

    def __init__(self, block: nn.Module, d_model: int, r: int = 64, scale: float = 4.0,
                 init: str = "zero", dtype: Optional[torch.dtype] = None, device=None,
                 backend: Optional[str] = None):
        super().__init__()
        r = check_rank("adapter bottleneck r", r)
        d_model = check_rank("d_model", d_model)
        scale = _validate.check_real("scale", scale)
        backend = check_backend_name(backend)
        check_block_widths(block, d_model, d_model,
                           f"the ScaledParallelAdapter maps d_model={d_model} to d_model (a "
                           "parallel adapter needs a block of equal input and output width)")
        self.d_model = d_model
        self.block = block
        for p in block.parameters():
            p.requires_grad_(False)
        ref = next(iter(block.parameters()), None)
        dtype = dtype or (ref.dtype if ref is not None else torch.get_default_dtype())
        device = device or (ref.device if ref is not None else None)
        self.r, self.scale, self.backend = int(r), float(scale), backend
        self.init = check_init(init, self.INITS, "ScaledParallelAdapter")
        self.down = nn.Parameter(torch.empty(self.r, d_model, dtype=dtype, device=device))
        self.down_bias = nn.Parameter(torch.zeros(self.r, dtype=dtype, device=device))
        self.up = nn.Parameter(torch.empty(d_model, self.r, dtype=dtype, device=device))
        self.up_bias = nn.Parameter(torch.zeros(d_model, dtype=dtype, device=device))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # the biases too (zero): after the meta-device recipe (to_empty, reset_parameters())
        # they held uninitialised memory
        init_pair_(self.down, self.up, self.init, bias=self.up_bias)
        with torch.no_grad():
            self.down_bias.zero_()

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        params = (self.down, self.down_bias, self.up, self.up_bias)
        if x.dtype != self.down.dtype and not torch.is_autocast_enabled(x.device.type):
            params = tuple(p.to(x.dtype) for p in params)
        wd, bd, wu, bu = params
        return self.scale * F.linear(F.relu(F.linear(x, wd, bd)), wu, bu)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        _validate.check_tensor("x", x, min_ndim=1)   # (a 0-d x raised IndexError)
        if x.shape[-1] != self.d_model:
            raise ValueError(f"ScaledParallelAdapter: x has shape {tuple(x.shape)}, expected a "
                             f"last dimension of d_model={self.d_model}")
        y = self.block(x, *args, **kwargs)
        if tuple(y.shape) != tuple(x.shape):
            # never broadcast: a mis-shaped block output would silently take the adapter's shape
            raise ValueError(f"ScaledParallelAdapter: the block returned shape "
                             f"{tuple(y.shape)} for x of shape {tuple(x.shape)}, expected "
                             f"{tuple(x.shape)} (d_model={self.d_model})")
        return y + self.delta(x).to(y.dtype)

    def extra_repr(self) -> str:
        return f"r={self.r}, scale={self.scale}"
