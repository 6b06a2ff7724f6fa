"""What every adapter around a frozen linear layer shares: nn.Linear / transformers Conv1D
handling, freezing, autocast of the activation, and merge/unmerge of ``delta_weight()``."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import nn

from kfused import _validate
from kfused.backends import BACKENDS, BackendError

# The state_dict key (under the module's prefix) that marks a merged adapter: a 0-d bool
# tensor, present only while merged, so that unmerged state_dicts keep their keys.
MERGED_KEY = "kfused_merged"


class MergedState:
    """Mixin for mergeable adapters (``self.merged``, ``merge()``, ``unmerge()``): the
    state_dict records whether the frozen weights it holds already contain the update, and
    ``load_state_dict`` restores exactly that module.

    A merged module's state_dict has one more entry, ``<prefix>kfused_merged`` (a 0-d bool
    tensor ``True``); an unmerged one has exactly the keys of the module's parameters and
    buffers. Loading a dict that holds the frozen weights (see :meth:`_frozen_children`) sets
    ``merged`` from that entry (present: the loaded weights contain the update; absent: they do
    not), so a merged dict loaded into a fresh module does not add the update twice and an
    unmerged dict loaded into a merged module leaves it unmerged. A dict without the frozen
    weights (an adapter-only, ``strict=False`` load) keeps the module's own frozen weights: a
    merged module is unmerged first when the dict replaces its adapter parameters (the update
    folded in its weights is that of the old ones), and stays unmerged.
    """

    def _frozen_children(self) -> Tuple[str, ...]:
        """Names of the child modules holding the frozen weights that merge() changes."""
        return ("base",)

    def _frozen_state_keys(self, prefix: str):
        keys = []
        for child in self._frozen_children():
            mod = getattr(self, child, None)
            if isinstance(mod, nn.Module):
                keys += [prefix + child + "." + k for k, _ in mod.named_parameters()]
                keys += [prefix + child + "." + k for k, _ in mod.named_buffers()]
        return keys

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if getattr(self, "merged", False):
            destination[prefix + MERGED_KEY] = torch.tensor(True)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + MERGED_KEY
        flag = state_dict.pop(key, None)   # load_state_dict passes a copy: the caller's is kept
        if flag is not None and not (isinstance(flag, bool) or (
                isinstance(flag, torch.Tensor) and flag.numel() == 1)):
            error_msgs.append(f"{key} must be a bool or a one-element tensor, got "
                              f"{type(flag).__name__}")
            flag = None
        saved_merged = bool(flag) if flag is not None else False
        frozen = self._frozen_state_keys(prefix)
        frozen_prefixes = tuple(prefix + c + "." for c in self._frozen_children())
        if frozen and any(k in state_dict for k in frozen):
            # the dict brings the frozen weights: they hold the update iff it was merged
            self.merged = saved_merged
        elif self.merged and any(k.startswith(prefix) and not k.startswith(frozen_prefixes)
                                 for k in state_dict):
            # new adapter parameters for a merged module whose own frozen weights stay: take
            # the current update out of them first (computed from the current parameters)
            self.unmerge()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)


def check_backend_name(backend) -> Optional[str]:
    """A module's ``backend`` argument: None or one of "auto", "triton", "cuda", "reference"
    (any case, as :func:`kfused.backends.select_backend` reads it); refused at construction
    rather than at the first forward. Whether the backend fits the inputs is decided per call."""
    if backend is None:
        return None
    if not isinstance(backend, str):
        raise TypeError(f"backend must be None or a str, got {type(backend).__name__} "
                        f"{backend!r}")
    if backend.lower() != "auto" and backend.lower() not in BACKENDS:
        raise BackendError(f"backend={backend!r} is not a backend; expected one of auto, "
                           f"{', '.join(BACKENDS)}")
    return backend


def check_rank(name: str, r) -> int:
    """An adapter rank / bottleneck width: an int >= 1 (TypeError / ValueError naming it; a
    float such as 2.5 was truncated before)."""
    if not _validate.is_int(r):
        raise TypeError(f"{name} must be an int, got {type(r).__name__} {r!r}")
    if r < 1:
        raise ValueError(f"{name} must be >= 1, got {r}")
    return int(r)


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


def check_block_widths(block: nn.Module, d_in: int, d_out: int, given: str) -> None:
    """A block-parallel adapter's block, when it is a linear layer, must map d_in to d_out
    (its widths are known at construction); any other block's output is checked per call.
    ValueError naming both, ``given`` saying what the adapter was given."""
    try:
        widths = linear_dims(block)
    except TypeError:
        return
    if widths != (d_in, d_out):
        raise ValueError(f"block is a linear layer of (in, out) = {widths}, but {given}")


def linear_weight(base: nn.Module) -> torch.Tensor:
    """The base weight in nn.Linear (out, in) layout (a view for Conv1D, no copy)."""
    return base.weight.t() if is_conv1d(base) else base.weight


def autocast_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The autocast dtype that applies to the floating-point tensor ``x`` (None: not under
    autocast for its device type, or a device type autocast does not know, e.g. meta)."""
    dev = x.device.type
    if not x.is_floating_point():
        return None
    try:
        on = torch.is_autocast_enabled(dev)
    except RuntimeError:  # "unknown device type for autocast" (meta, ...)
        return None
    return torch.get_autocast_dtype(dev) if on else None


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """Under autocast, cast the activation to the autocast dtype, as autocast does for a linear
    layer: the custom ops are opaque to autocast and would otherwise run in float32."""
    dt = autocast_dtype(x)
    if dt is not None and x.dtype != dt:
        return x.to(dt)
    return x


class WrappedLinear(MergedState, nn.Module):
    """Base of adapters around a frozen nn.Linear / Conv1D (``self.base``, frozen here).

    Subclasses define ``delta_weight()`` — the update in (out, in) layout — and get exact
    ``merge()`` / ``unmerge()`` (up to the float rounding of one add/sub pair); the state_dict
    records ``merged`` (:class:`MergedState`).
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

    @property
    def weight(self) -> torch.Tensor:
        """The frozen base weight (as PEFT's layers expose it): models read it from the layer
        they call, e.g. T5's feed-forward casts to ``self.wo.weight.dtype``."""
        return self.base.weight

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return self.base.bias

    def __setattr__(self, name: str, value) -> None:
        # assigning weight / bias sets the base layer's (transformers' tie_weights does
        # ``lm_head.weight = wte.weight``): nn.Module would register a parameter of the same
        # name beside the read-only property above and fail ("attribute 'weight' already
        # exists"), or before the property, shadow the base's weight with an unused one
        if name in ("weight", "bias") and "base" in self.__dict__.get("_modules", {}):
            setattr(self.base, name, value)
            return
        super().__setattr__(name, value)

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
