"""Argument types shared by the ``kfused`` commands (argparse ``type=`` callables).

Each raises :class:`argparse.ArgumentTypeError`, so a bad value is a usage error naming the
option (``kfused demo: error: argument --steps: expected an integer >= 1, got '-1'``, exit
status 2) instead of a traceback or a run that silently ignores it. They return the parsed
value; :func:`device` returns the string as given (commands turn it into a
:class:`torch.device` themselves).
"""

from __future__ import annotations

import argparse
import math
from typing import Callable, Optional


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, except where the help already says its default (or the
    default is None, whose meaning the help gives): no "(default: None)" after "(default:
    each method's)"."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default" in text or action.default is None:
            return text
        return super()._get_help_string(action)


def _int(text: str) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def int_range(lo: Optional[int] = None, hi: Optional[int] = None) -> Callable[[str], int]:
    """An integer type accepting ``lo <= value <= hi`` (either bound may be None)."""

    def parse(text: str) -> int:
        value = _int(text)
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            want = (f"an integer in [{lo}, {hi}]" if lo is not None and hi is not None
                    else f"an integer >= {lo}" if lo is not None else f"an integer <= {hi}")
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return value

    return parse


positive_int = int_range(1)
positive_int.__name__ = "positive_int"
positive_int.__doc__ = "An integer >= 1."

nonnegative_int = int_range(0)
nonnegative_int.__name__ = "nonnegative_int"
nonnegative_int.__doc__ = "An integer >= 0."

# torch.manual_seed / torch.Generator.manual_seed take at most 2**64 - 1 (larger: an
# OverflowError deep inside the run); negative seeds are refused like numpy does.
seed_int = int_range(0, 2**64 - 1)
seed_int.__name__ = "seed_int"
seed_int.__doc__ = "A random seed: an integer in [0, 2**64 - 1]."


def finite_float(text: str) -> float:
    """Any finite number (not nan or inf)."""
    return _float(text)


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def nonnegative_float(text: str) -> float:
    """A finite number >= 0."""
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _check_device(text: str) -> str:
    import torch

    try:
        dev = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(
            f"invalid device {text!r}; expected cpu, cuda or cuda:N") from None
    if dev.type == "cpu":
        return text
    if dev.type != "cuda":
        raise argparse.ArgumentTypeError(
            f"device {text!r} is not supported; kfused runs on cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        built = "built without CUDA" if torch.version.cuda is None else "sees no CUDA device"
        raise argparse.ArgumentTypeError(
            f"device {text!r} needs CUDA, but torch.cuda.is_available() is False (torch "
            f"{torch.__version__} {built}); use --device cpu")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise argparse.ArgumentTypeError(
            f"device {text!r}: there {'is' if count == 1 else 'are'} only {count} CUDA "
            f"device{'' if count == 1 else 's'} (cuda:0 to cuda:{count - 1})")
    return text


def device(text: str) -> str:
    """A device string torch can use here: cpu, cuda or cuda:N (CUDA only where
    ``torch.cuda.is_available()``, N only below the device count)."""
    return _check_device(text)


def device_or_auto(text: str) -> str:
    """:func:`device`, or ``auto`` (the command picks CUDA when available, else the CPU)."""
    if text == "auto":
        return text
    try:
        return _check_device(text)
    except argparse.ArgumentTypeError as exc:
        msg = str(exc)
        if msg.startswith("invalid device"):
            msg = msg.replace("expected cpu", "expected auto, cpu")
        raise argparse.ArgumentTypeError(msg) from None
