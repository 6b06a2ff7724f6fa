"""One remembered result per call site, keyed on tensors' identity and version."""

from __future__ import annotations

import weakref
from typing import Callable, Optional, Sequence

import torch


class LastResult:
    """``memo(tensors, compute)`` returns ``compute()``, remembered for the last ``tensors``
    asked: the very same objects (or None), none changed in place since (their version
    counters). Every layer of one forward passes the same tensors, so a host read or check
    done for the first layer serves the rest. Nothing is kept alive but the result."""

    def __init__(self):
        self._refs: Optional[list] = None
        self._versions: Optional[list] = None
        self._value = None

    def __call__(self, tensors: Sequence[Optional[torch.Tensor]], compute: Callable):
        if self._refs is not None and len(self._refs) == len(tensors) and all(
                (r is None and t is None) or (r is not None and r() is t and t._version == v)
                for r, v, t in zip(self._refs, self._versions, tensors)):
            return self._value
        value = compute()                       # raises: nothing is remembered
        self._refs = [None if t is None else weakref.ref(t) for t in tensors]
        self._versions = [None if t is None else t._version for t in tensors]
        self._value = value
        return value
