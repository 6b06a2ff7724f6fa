"""Input checks shared by every op: errors name the argument, its shape and what was expected."""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence

import torch


def is_int(v) -> bool:
    """An integer value (Python or numpy integral), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_real(v) -> bool:
    """A finite real number (Python or NumPy), not a bool (what :func:`check_real` accepts)."""
    return (isinstance(v, numbers.Real) and not isinstance(v, bool)
            and math.isfinite(float(v)))


def check_tensor(name: str, t, *, ndim: Optional[int] = None, min_ndim: Optional[int] = None,
                 floating: bool = True) -> torch.Tensor:
    """Require a tensor (floating point by default), optionally of an exact or minimum rank."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if floating and not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(
            f"{name} must have at least {min_ndim} dimension(s), got shape {tuple(t.shape)}")
    return t


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int], what: str = "") -> None:
    if tuple(t.shape) != tuple(expected):
        hint = f" ({what})" if what else ""
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}, expected {tuple(expected)}{hint}")


def check_same(ref_name: str, ref: torch.Tensor, **others: Optional[torch.Tensor]) -> None:
    """Require every tensor in ``others`` to share ``ref``'s dtype and device."""
    for name, t in others.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if t.device != ref.device:
            raise ValueError(
                f"{name} is on {t.device} but {ref_name} is on {ref.device}; "
                "all inputs must be on one device")
        if t.dtype != ref.dtype:
            raise TypeError(
                f"{name} has dtype {t.dtype} but {ref_name} has dtype {ref.dtype}; "
                "all inputs must share one dtype")


def check_real(name: str, value) -> float:
    """``value`` as a float: a real Python/NumPy number (not a bool), finite. TypeError for a
    non-number, ValueError for NaN/inf, naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number (int or float), got "
                        f"{type(value).__name__} {value!r}")
    out = float(value)
    if not math.isfinite(out):
        raise ValueError(f"{name} must be finite, got {out}")
    return out


def fits(t, shape, ref: torch.Tensor) -> bool:
    """Whether ``t`` is None or a tensor of floating ``ref``'s dtype and device and of this
    shape: what the detailed checks of an op accept. Ops ask it first, for the common case,
    and run their detailed checks (which name the fault) only when it says no."""
    return t is None or (isinstance(t, torch.Tensor) and t.dtype == ref.dtype and
                         t.device == ref.device and t.shape == shape and
                         ref.is_floating_point())


def is_finite_number(v) -> bool:
    """A Python float or int (not a bool), finite: the common case of a scale, accepted
    without :func:`check_real`'s checks."""
    return (type(v) is float or type(v) is int) and math.isfinite(v)

