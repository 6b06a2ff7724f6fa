"""Argument checks and layout shared by the KronA ops (kron_matvec, krona_linear)."""

from __future__ import annotations

from typing import Tuple

import torch

from kfused import _validate
from kfused.ops._common import dense, no_double_backward  # noqa: F401  (re-exported)


def check_factors(x: torch.Tensor, A, B, x_name: str = "x") -> Tuple[int, int, int, int]:
    _validate.check_tensor(x_name, x, min_ndim=1)
    _validate.check_tensor("A", A, ndim=2)
    _validate.check_tensor("B", B, ndim=2)
    _validate.check_same(x_name, x, A=A, B=B)
    a_out, a_in = A.shape
    b_out, b_in = B.shape
    if min(a_out, a_in, b_out, b_in) == 0:
        raise ValueError(f"A {tuple(A.shape)} and B {tuple(B.shape)} must have no empty dimension")
    if x.shape[-1] != a_in * b_in:
        raise ValueError(
            f"{x_name} has shape {tuple(x.shape)}: its last dimension must equal "
            f"a_in * b_in = {a_in} * {b_in} = {a_in * b_in} for A {tuple(A.shape)} and "
            f"B {tuple(B.shape)}")
    return a_out, a_in, b_out, b_in


def rows(x: torch.Tensor) -> torch.Tensor:
    """x as (T, d) rows with unit inner stride (no copy when it has one): the layout every
    KronA kernel reads (any row stride, 0 included)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()
