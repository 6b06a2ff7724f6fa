"""Triton host functions of the fused output projection ``headwise_oproj`` (docs/math.md §2):
``Y = O W_oᵀ + b + concat_h(O^h A_hᵀ) Bᵀ + O A_sᵀ U_sᵀ`` (see
:mod:`kfused.triton_kernels._headwise_common` for the design and the predicted roofline).
"""

from __future__ import annotations

import collections
import functools
import weakref
from typing import Optional

import torch

from kfused import _alloc
from kfused.triton_kernels._common import F32
from kfused.triton_kernels._headwise_common import _PACKED_MAX, gemm, reduce_tokens


# ------------------------------------------------------------------------------------------
# Fused output projection: Y = O W_oᵀ + b + concat_h(O^h A_hᵀ) Bᵀ + O A_sᵀ U_sᵀ


@functools.lru_cache(maxsize=64)
def _oproj_index(H: int, R: int, P: int, device: str) -> torch.Tensor:
    """Flat positions of A (H, R, P) in the dense block-diagonal D_o (H·R + R_s, H·P)."""
    h = torch.arange(H)[:, None, None]
    j = torch.arange(R)[None, :, None]
    c = torch.arange(P)[None, None, :]
    return ((h * R + j) * (H * P) + h * P + c).reshape(-1).to(device)


def _oproj_down(A, As, H: int, P: int, dtype) -> torch.Tensor:
    """Dense down-projection D_o (H·R + R_s, H·P) of the output projection, in ``dtype``
    (built in ``dtype`` directly: each entry is one factor entry rounded once, as a float32
    build then cast would give; three launches)."""
    R = A.shape[1] if A is not None else 0
    RS = As.shape[0] if As is not None else 0
    ref = A if A is not None else As
    Do = ref.new_zeros(H * R + RS, H * P, dtype=dtype)
    if A is not None:
        Do.view(-1)[_oproj_index(H, R, P, str(ref.device))] = A.reshape(-1).to(dtype)
    if As is not None:
        Do[H * R:] = As
    return Do


# D_o and [B | U_s] built by an output-projection forward, handed to its backward (same
# contract as _PACKED: keyed by the factors' storage, version, shape and strides, valid only
# for the very Z the forward returned; popped on use, bounded).
_OPACKED: "collections.OrderedDict" = collections.OrderedDict()


def _oproj_operands(A, Bw, As, Us, H: int, P: int, dtype, Z: torch.Tensor, keep: bool):
    key = (tuple(None if t is None else (t.data_ptr(), t._version, tuple(t.shape), t.stride(),
                                         t.dtype, str(t.device)) for t in (A, Bw, As, Us)),
           dtype, H)
    if not keep:
        rec = _OPACKED.pop(key, None)
        if rec is not None and rec[0]() is Z:
            return rec[1]
    Do = _oproj_down(A, As, H, P, dtype)
    parts = [t for t in (Bw, Us) if t is not None]
    Bcat = (parts[0].to(dtype) if len(parts) == 1 else torch.cat(parts, 1).to(dtype))
    out = (Do, Bcat.contiguous())
    if keep:
        _OPACKED.pop(key, None)
        _OPACKED[key] = (weakref.ref(Z), out)
        while len(_OPACKED) > _PACKED_MAX:
            _OPACKED.popitem(last=False)
    return out


def _thin(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = a @ b for a GEMM with a thin side that needs no fusion: cuBLAS for 16-bit on a
    GPU, the Triton GEMM otherwise (exact float32 dots)."""
    if out.device.type == "cuda" and a.dtype in (torch.float16, torch.bfloat16):
        return torch.matmul(a, b, out=out)
    if out.numel() == 0:
        return out
    if a.shape[1] == 0:
        return out.zero_()
    return gemm([(a, b)], out)


def headwise_oproj_forward(o: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                           A: Optional[torch.Tensor], Bw: Optional[torch.Tensor],
                           As: Optional[torch.Tensor], Us: Optional[torch.Tensor], H: int):
    """o (T, H·p) any strides; w (d, H·p) any strides; b (d,) (c folded in) or None;
    A (H, r, p), Bw (d, H·r), As (r_s, H·p), Us (d, r_s) (scale folded in) or None.

    Returns Y (T, d) and the rank-space Z (T, H·r + r_s) in o.dtype for the backward.
    """
    T, HP = o.shape
    N = w.shape[0]
    P = HP // H
    R = A.shape[1] if A is not None else 0
    RS = As.shape[0] if As is not None else 0
    dev = o.device
    Y = _alloc.empty(T, N, dtype=o.dtype, device=dev)
    Z = _alloc.empty(T, H * R + RS, dtype=o.dtype, device=dev)
    if T == 0 or N == 0:
        return Y, Z
    segs = [(o, w.t())]
    if R or RS:
        Do, Bcat = _oproj_operands(A, Bw, As, Us, H, P, o.dtype, Z, keep=True)
        _thin(o, Do.t(), Z)
        segs.append((Z, Bcat.t()))
    gemm(segs, Y, bias=b)
    return Y, Z


def headwise_oproj_backward(g: torch.Tensor, o: torch.Tensor, w: torch.Tensor,
                            A: Optional[torch.Tensor], Bw: Optional[torch.Tensor],
                            As: Optional[torch.Tensor], Us: Optional[torch.Tensor],
                            Z: torch.Tensor, H: int, need_do: bool = True,
                            need_factors: bool = True):
    """g (T, d) any strides. Returns (dO, dict of dA, dBw, dAs, dUs for present parts)."""
    T, HP = o.shape
    N = w.shape[0]
    P = HP // H
    R = A.shape[1] if A is not None else 0
    RS = As.shape[0] if As is not None else 0
    M = H * R + RS
    dev = o.device
    dt = o.dtype
    dO = _alloc.empty(T, HP, dtype=dt, device=dev) if need_do else None
    grads = {}
    if not M:
        if need_do:
            if T and N:
                gemm([(g, w)], dO)
            else:
                dO.zero_()
        return dO, grads
    Do, Bcat = _oproj_operands(A, Bw, As, Us, H, P, dt, Z, keep=False)
    dZ = _alloc.empty(T, M, dtype=dt, device=dev)
    _thin(g, Bcat, dZ)
    if need_do:
        if T:
            gemm([(g, w), (dZ, Do)], dO) if N else gemm([(dZ, Do)], dO)
    if need_factors:
        dB = reduce_tokens(g, Z)           # (d, M)
        dD = reduce_tokens(dZ, o)          # (M, H·p)
        # Fresh tensors for every output: a custom op's outputs may not alias (d_out = 1
        # made dB[:, :H·r] and dB[:, H·r:] "contiguous" views of one buffer).
        if R:
            grads["A"] = dD.reshape(-1)[_oproj_index(H, R, P, str(dev))].view(H, R, P) \
                .to(A.dtype)
            grads["Bw"] = dB[:, :H * R].to(Bw.dtype, copy=True)
        if RS:
            grads["As"] = dD[H * R:].to(As.dtype, copy=True)
            grads["Us"] = dB[:, H * R:].to(Us.dtype, copy=True)
        grads["db"] = g.sum(0, dtype=F32)
    return dO, grads
