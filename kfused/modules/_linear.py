"""What every adapter around a frozen linear layer shares: nn.Linear / transformers Conv1D
handling, freezing, autocast of the activation, and merge/unmerge of ``delta_weight()``."""

from __future__ import annotations

from typing import Tuple

import torch
from torch import nn

def is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2): weight is (in, out) and y = x @ W + b."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def linear_dims(base: nn.Module) -> Tuple[int, int]:
    """(d_in, d_out) of an nn.Linear or a transformers Conv1D."""
    if isinstance(base, nn.Linear):
        return base.in_features, base.out_features
    if is_conv1d(base):
        return base.weight.shape[0], base.weight.shape[1]
    raise TypeError(f"expected nn.Linear or transformers Conv1D, got {type(base).__name__}")


def linear_weight(base: nn.Module) -> torch.Tensor:
    """The base weight in nn.Linear (out, in) layout (a view for Conv1D, no copy)."""
    return base.weight.t() if is_conv1d(base) else base.weight


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """Under autocast, cast the activation to the autocast dtype, as autocast does for a linear
    layer: the custom ops are opaque to autocast and would otherwise run in float32."""
    dev = x.device.type
    if x.is_floating_point() and torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        if x.dtype != dt:
            return x.to(dt)
    return x


class WrappedLinear(nn.Module):
    """Base of adapters around a frozen nn.Linear / Conv1D (``self.base``, frozen here).

    Subclasses define ``delta_weight()`` — the update in (out, in) layout — and get exact
    ``merge()`` / ``unmerge()`` (up to the float rounding of one add/sub pair).
    """

    def __init__(self, base: nn.Module):
        super().__init__()
        linear_dims(base)  # type check
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.merged = False

    @property
    def in_features(self) -> int:
        return linear_dims(self.base)[0]

    @property
    def out_features(self) -> int:
        return linear_dims(self.base)[1]

    def delta_weight(self) -> torch.Tensor:
        raise NotImplementedError

    @torch.no_grad()
    def merge(self) -> None:
        """Fold ``delta_weight()`` into the frozen weight; forward then runs the base alone."""
        if self.merged:
            return
        linear_weight(self.base).add_(self.delta_weight().to(self.base.weight.dtype))
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Subtract the update again."""
        if not self.merged:
            return
        linear_weight(self.base).sub_(self.delta_weight().to(self.base.weight.dtype))
        self.merged = False
