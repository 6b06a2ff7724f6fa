"""``headwise_projection`` (docs/math.md §2): one adapted q or v projection (any attention
projection with per-head / shared updates), run by the fused q|k|v custom op with the
projection in the q slot.

    headwise_projection(x, weight, bias, n_heads=, factors=, w_k=, b_k=)
"""

from __future__ import annotations

from typing import Optional

import torch

from kfused import _validate
from kfused.backends import select_backend
from kfused.ops._fold import check_exact
from kfused.ops._headwise_common import (IMPLS, _check_factors, _check_input_width, _check_int,
                                         _check_linear, _head_width, _no_float64,
                                         _scalar_factors)
from kfused.ops.headwise_qkv import _qkv_call
from kfused.reference.headwise import HeadFactors, kv_group_index, projection_delta_ref


def headwise_projection(x: torch.Tensor, weight: torch.Tensor,
                        bias: Optional[torch.Tensor] = None, *, n_heads: int,
                        factors: Optional[HeadFactors] = None,
                        w_k: Optional[torch.Tensor] = None, b_k: Optional[torch.Tensor] = None,
                        n_key_heads: Optional[int] = None,
                        backend: Optional[str] = None,
                        exact: Optional[bool] = None) -> torch.Tensor:
    """One adapted q or v projection, ``X Wᵀ + b + Δ`` (docs/math.md §2), fused like
    :func:`headwise_qkv` but for a single projection (the frozen GEMM and every
    down-projection in one pass over X, up-projections in the epilogue).

    x (..., d); weight (H·p, d) any strides; bias (H·p,) or None; factors for H heads;
    w_k (H_k·p, d), b_k: the frozen key projection, required when ``factors`` has a lite
    part (head h uses key head ``h // (H / H_k)``; ``n_key_heads`` defaults to
    ``w_k.shape[0] // p``). exact: how the Triton backward forms dX, as in
    :func:`headwise_qkv` (None: fold the update into W for dX on 16-bit CUDA inputs when it
    pays; False: fold; True: never). Returns (..., H·p).
    """
    _validate.check_tensor("x", x, min_ndim=1)
    d = x.shape[-1]
    _validate.check_tensor("weight", weight, ndim=2)
    _check_input_width("x", x, {"weight": weight})
    check_exact(exact)
    p = _head_width(n_heads, "weight", weight, "output rows", weight.shape[0])
    H = n_heads
    _check_linear("weight", weight, H * p, d, x)
    if bias is not None:
        _validate.check_tensor("bias", bias, ndim=1)
        _validate.check_same("x", x, bias=bias)
        _validate.check_shape("bias", bias, (H * p,), "bias of the projection")
    Hk = None
    if factors is not None:
        if not isinstance(factors, HeadFactors):
            raise TypeError(f"factors must be a kfused HeadFactors or None, got "
                            f"{type(factors).__name__}")
        _check_factors("factors", factors, H, p, d, x)
        if factors.has_lite:
            if w_k is None:
                raise ValueError("factors has a Kernel-wise-lite part: pass the frozen key "
                                 "projection as w_k (and b_k)")
            _validate.check_tensor("w_k", w_k, ndim=2)
            if n_key_heads is not None:
                _check_int("n_key_heads", n_key_heads)
            if n_key_heads is None and (w_k.shape[0] < p or w_k.shape[0] % p != 0):
                raise ValueError(f"w_k has shape {tuple(w_k.shape)}: expected (H_k*{p}, {d}), "
                                 f"a whole number of key heads of width {p} (pass "
                                 f"n_key_heads to say how many)")
            Hk = n_key_heads if n_key_heads is not None else w_k.shape[0] // p
            if Hk < 1 or H % Hk != 0:
                raise ValueError(f"n_key_heads={Hk} must be a positive divisor of n_heads={H}")
            _check_linear("w_k", w_k, Hk * p, d, x)
            if b_k is not None:
                _validate.check_tensor("b_k", b_k, ndim=1)
                _validate.check_same("x", x, b_k=b_k)
                _validate.check_shape("b_k", b_k, (Hk * p,), "bias of the key projection")
    factors = _scalar_factors(factors)
    be = select_backend("headwise_projection", backend, [x], impls=IMPLS,
                        extra_unfit=_no_float64(x))
    # an empty input width or head width: nothing to fuse, the reference is exact
    if be == "reference" or d == 0 or p == 0:
        out = torch.nn.functional.linear(x, weight, bias)
        if factors is None or factors.empty:
            return out
        kh = None
        if factors.has_lite:
            K = torch.nn.functional.linear(x, w_k, b_k)
            kh = K.reshape(*K.shape[:-1], Hk, p)
            if Hk != H:
                kh = kh.index_select(-2, kv_group_index(H, Hk, x.device))
        return out + projection_delta_ref(x, kh, factors, H)
    empty = weight.new_empty(0, d)
    key = (w_k, b_k, Hk) if Hk is not None else (None, None, H)
    return _qkv_call(x, weight, empty, empty, bias, None, None, H, 0, p, factors, None,
                     key=key, exact=exact)
