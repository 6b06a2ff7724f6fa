"""Output allocation for host functions.

With poisoning on (``KFUSED_POISON=1`` or :func:`kfused.testing.poisoned_outputs`), every
buffer a kernel is about to write is filled with NaN first, so an element the kernel forgets
to write shows up as NaN in the tests instead of as stale memory that happens to be right.
"""

from __future__ import annotations

import os

import torch

# on for 1/true/yes/on (any case), as Triton reads its TRITON_* flags; "false" is off
_POISON = [os.environ.get("KFUSED_POISON", "").strip().lower() in ("1", "true", "yes", "on")]


def poisoning() -> bool:
    return _POISON[0]


def set_poisoning(flag: bool) -> bool:
    old = _POISON[0]
    _POISON[0] = bool(flag)
    return old


def empty(*shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.empty(*shape, dtype=dtype, device=device)
    if _POISON[0] and t.is_floating_point():
        t.fill_(float("nan"))
    return t
