"""When an op folds its adapter into the frozen weight (``W' = W + ΔW``, rounded once to the
weight dtype, then the frozen-shaped GEMM): the rule ``krona_linear`` and ``headwise_oproj``
share for their ``exact`` argument.

Only 16-bit inputs fold: there the single rounding of W' costs no more than the roundings the
same-precision torch path makes anyway (it meets docs/math.md §4), but the part of ΔW below
half an ulp of W is rounded away in the forward and in dx (the factor gradients stay exact).
float32 never folds: W' rounded to float32 then one float32 GEMM misses the rule (KronA dx
3.5e-5 against a bound of 2.6e-5 at (24, 24, 32, 32)).
"""

from __future__ import annotations

from typing import Optional

import torch

# Tokens from which exact=None folds on a GPU: the fold is one d_out×d_in pass (plus one
# launch) per direction, under 5% of the frozen GEMM from here on.
FOLD_MIN_TOKENS = 1024


def fold_decision(dtype: torch.dtype, tokens: int, exact: Optional[bool],
                  on_cuda: bool) -> bool:
    """Whether ``tokens`` rows of ``dtype`` on a CUDA device (``on_cuda``) or not fold the
    adapter into the weight: never for float32 or ``exact=True``; always for 16-bit with
    ``exact=False``; with ``exact=None`` on CUDA from ``FOLD_MIN_TOKENS`` tokens. The static
    performance model (kfused.perf) evaluates it with ``on_cuda=True`` to follow the path a
    GPU takes although it traces CPU stand-in tensors."""
    if exact or dtype not in (torch.float16, torch.bfloat16):
        return False
    if exact is not None:
        return True
    return bool(on_cuda) and tokens >= FOLD_MIN_TOKENS


def check_exact(exact) -> Optional[bool]:
    if exact is not None and not isinstance(exact, bool):
        raise TypeError(f"exact must be True, False or None, got {type(exact).__name__} "
                        f"{exact!r}")
    return exact
