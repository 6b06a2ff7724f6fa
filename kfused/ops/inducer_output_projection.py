"""``inducer_output_projection`` (docs/math.md §3): the attention output projection with the inducer's
value path folded in, ``y = concat_h(f^h) W_oᵀ + b_o + Σ_h u^h W2_h + b2`` as one GEMM (plain
torch: no kernel of its own; autograd gives the backward).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from kfused import _validate


def inducer_output_projection(f: Tensor, u: Optional[Tensor], W_o: Tensor,
                              b_o: Optional[Tensor] = None, W2: Optional[Tensor] = None,
                              b2: Optional[Tensor] = None) -> Tensor:
    """``y = concat_h(f^h) W_oᵀ + b_o + Σ_h u^h W2_h + b2`` as one GEMM over ``[f | u]``.

    f (B, H, n, p), u (B, H, n, r) or None, W_o (d, H·p) (nn.Linear layout), b_o (d,),
    W2 (H, r, d), b2 (d,) -> (B, n, d). ``W2``/``b2`` belong to ``u`` and need it; every tensor
    shares f's dtype and device (no broadcasting of wrongly shaped biases).
    """
    _validate.check_tensor("f", f, ndim=4)
    B, H, n, p = f.shape
    _validate.check_tensor("W_o", W_o, ndim=2)
    _validate.check_same("f", f, W_o=W_o)
    if W_o.shape[1] != H * p:
        raise ValueError(f"W_o has shape {tuple(W_o.shape)}, expected (d, {H * p}) for "
                         f"{H} heads of width {p}")
    d = W_o.shape[0]
    if b_o is not None:
        _validate.check_tensor("b_o", b_o, ndim=1)
        _validate.check_shape("b_o", b_o, (d,), "(d,): the output projection's bias")
        _validate.check_same("f", f, b_o=b_o)
    if u is None:
        if W2 is not None or b2 is not None:
            raise ValueError("W2/b2 map the inducer's u to the output space: they were given "
                             "but u is None (pass u from inducer_attention(..., "
                             "composition='add'))")
    x = f.transpose(1, 2).reshape(B, n, H * p)
    weight = W_o.transpose(0, 1)
    bias = b_o
    if u is not None:
        _validate.check_tensor("u", u, ndim=4)
        _validate.check_same("f", f, u=u)
        r = u.shape[-1]
        _validate.check_shape("u", u, (B, H, n, r), "(batch, heads, n, r)")
        if W2 is None:
            raise ValueError(f"W2 ({H}, {r}, {d}) is required when u is given")
        _validate.check_tensor("W2", W2, ndim=3)
        _validate.check_shape("W2", W2, (H, r, d), "(heads, value_bottleneck, d)")
        _validate.check_same("f", f, W2=W2)
        x = torch.cat([x, u.transpose(1, 2).reshape(B, n, H * r)], dim=-1)
        weight = torch.cat([weight, W2.reshape(H * r, d)], dim=0)
        if b2 is not None:
            _validate.check_tensor("b2", b2, ndim=1)
            _validate.check_shape("b2", b2, (d,), "(d,): the inducer value path's bias")
            _validate.check_same("f", f, b2=b2)
            bias = b2 if bias is None else bias + b2
    y = torch.matmul(x, weight)
    return y if bias is None else y + bias
