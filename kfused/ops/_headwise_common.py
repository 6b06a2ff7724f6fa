"""Pieces shared by the per-head low-rank ops (docs/math.md §2): argument checks, the host-side
building of kernel-level factors from the user's :class:`HeadFactors` (differentiable torch ops
on tiny tensors: stack Kernel-wise and lite down-projections along the rank, the lite bases
``A_h W_k^h`` and ``b_k^h A_hᵀ``, the shared scale folded into ``B_s``, the per-head biases
folded into the frozen bias), so the custom ops only see plain tensors.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from kfused import _validate
from kfused.reference.headwise import HeadFactors

IMPLS = ("triton",)


def _no_float64(t: torch.Tensor):
    """The headwise kernels accumulate in float32 (rank-space buffers included): float64 runs
    the reference, even where the interpreter would accept it."""
    def unfit(name: str):
        if t.dtype == torch.float64:
            return "the headwise kernels compute in float32; float64 runs the reference"
        return None
    return unfit


def _check_int(name: str, v, *, lo: int = 1) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


def _check_n_heads(n_heads) -> int:
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"n_heads must be a positive int, got {n_heads!r}")
    return n_heads


def _head_width(n_heads, name: str, t: torch.Tensor, what: str, width: int) -> int:
    """The head width p when ``width`` (``what`` of tensor ``name``) holds ``n_heads`` heads;
    ValueError naming the argument otherwise."""
    _check_n_heads(n_heads)
    if width % n_heads != 0:
        raise ValueError(f"{name} has shape {tuple(t.shape)}: {what} = {width} does not split "
                         f"into n_heads={n_heads} heads")
    return width // n_heads


def _check_flag(name: str, v, optional: bool = False) -> None:
    if not (isinstance(v, bool) or (optional and v is None)):
        raise TypeError(f"{name} must be {'None or ' if optional else ''}a bool, got {v!r}")


def _check_scale(name: str, s, ref: torch.Tensor) -> None:
    """A scale is a finite real number, or a one-element floating tensor on ref's device."""
    import math
    import numbers

    if isinstance(s, torch.Tensor):
        if not s.is_floating_point() or s.numel() != 1:
            raise ValueError(f"{name} must be a real number or a one-element floating-point "
                             f"tensor, got a {s.dtype} tensor of shape {tuple(s.shape)}")
        if s.device != ref.device:
            raise ValueError(f"{name} is on {s.device} but the inputs are on {ref.device}")
        return
    if isinstance(s, bool) or not isinstance(s, numbers.Real) or not math.isfinite(float(s)):
        raise TypeError(f"{name} must be a finite real number, got {s!r}")


def _empty(ref: torch.Tensor) -> torch.Tensor:
    return ref.new_empty(0)


def _opt(t: torch.Tensor) -> Optional[torch.Tensor]:
    return t if t is not None and t.numel() > 0 else None



def _check_factors(name: str, f: HeadFactors, H: int, p: int, d: int,
                   ref: torch.Tensor) -> None:
    def chk(attr, shape, what):
        t = getattr(f, attr)
        if t is None:
            return
        _validate.check_tensor(f"{name}.{attr}", t, ndim=len(shape))
        _validate.check_same("x", ref, **{f"{name}.{attr}": t})
        _validate.check_shape(f"{name}.{attr}", t, shape, what)

    if (f.shared_A is None) != (f.shared_B is None):
        raise ValueError(f"{name}: shared_A and shared_B must be given together")
    _check_scale(f"{name}.scale", f.scale, ref)
    if (f.wise_A is None) != (f.wise_B is None):
        raise ValueError(f"{name}: wise_A and wise_B must be given together")
    if (f.lite_A is None) != (f.lite_B is None):
        raise ValueError(f"{name}: lite_A and lite_B must be given together")
    if f.wise_c is not None and f.wise_A is None:
        raise ValueError(f"{name}: wise_c needs wise_A and wise_B")
    if f.lite_c is not None and f.lite_A is None:
        raise ValueError(f"{name}: lite_c needs lite_A and lite_B")
    if f.shared_A is not None:
        _validate.check_tensor(f"{name}.shared_A", f.shared_A, ndim=2)
        rs = f.shared_A.shape[0]
        chk("shared_A", (rs, d), "(r_s, d_in)")
        chk("shared_B", (H * p, rs), "(H·p, r_s)")
    if f.wise_A is not None:
        _validate.check_tensor(f"{name}.wise_A", f.wise_A, ndim=3)
        r = f.wise_A.shape[1]
        chk("wise_A", (H, r, d), "(H, r, d_in)")
        chk("wise_B", (H, p, r), "(H, p, r)")
        chk("wise_c", (H, p), "(H, p)")
    if f.lite_A is not None:
        _validate.check_tensor(f"{name}.lite_A", f.lite_A, ndim=3)
        r = f.lite_A.shape[1]
        chk("lite_A", (H, r, p), "(H, r, p): lite uses the p-wide key head as basis")
        chk("lite_B", (H, p, r), "(H, p, r)")
        chk("lite_c", (H, p), "(H, p)")


def _section(f: Optional[HeadFactors], H: int, Hk: int, p: int, d: int,
             w_k: Optional[torch.Tensor], b_k: Optional[torch.Tensor],
             dtype: torch.dtype = torch.float32):
    """Kernel-level factors of one section with ``H`` heads and the bias delta (per-head c's),
    built with differentiable torch ops on the small factor tensors. Lite uses key head
    ``h // (H / Hk)`` of the frozen key projection ``w_k (Hk·p, d)``, ``b_k``.

    ``dtype``: the activations' dtype. For 16-bit activations the lite basis ``A_h W_k^h``
    (a product the same-precision torch path never rounds: it rounds ``K`` instead) is split
    into two rows ``hi = round(A_h W_k^h)`` and ``lo = round(A_h W_k^h - hi)`` sharing one
    up-projection, so the tensor-core dot ``X [hi; lo]ᵀ`` carries it to float32 accuracy.
    Rounding it once instead made Z's error scale with ``Σ_k |x_k (A W_k)_k|`` rather than
    ``|K A_hᵀ|``, which lost to torch whenever ``K`` cancels (fp16 lite gradients up to 2.3x
    torch's error in 9 of 64 fuzzed cases)."""
    if f is None or f.empty:
        return (None,) * 5, None, 1.0, None
    # Every launch here costs a few µs, as much as a kernel pass at GPT-2 widths,
    # so factors the kernels can read as they are (Kernel-wise A_h, B_h; shared A_s, B_s with
    # a numeric scale, which the pack kernel folds in float32) are passed in the user's dtype:
    # the pack kernel converts them to float32 and rounds the packed operands once, the
    # unpack kernel writes their gradients in their dtype from float32 sums — the same
    # values as casting to float32 here and back in autograd. Products that build factors
    # (lite bases, a tensor scale) are formed in float32, so nothing is rounded twice.
    mixed = f.has_wise and f.has_lite
    # float32: lite_A's gradient comes from :class:`LiteKeyGrad` after the op (float64,
    # see there), so the basis below is built from a detached lite_A.
    exact_lite = f.has_lite and dtype == torch.float32
    lite_grad = None
    if f.has_lite:
        # float32: lite factors (they build the lite basis) and, when Kernel-wise rows are
        # concatenated with them, Kernel-wise A and B. (wise_c is added to a float32 lite_c
        # or cast by _fold_bias.)
        fl = lambda t: t.float() if t is not None else None  # noqa: E731
        f = dataclasses.replace(f, lite_A=fl(f.lite_A), lite_B=fl(f.lite_B),
                                lite_c=fl(f.lite_c), wise_A=fl(f.wise_A), wise_B=fl(f.wise_B))
    # The frozen key projection is only needed (and cast: a full (H_k·p, d) copy) for lite.
    w_k = w_k.float() if (w_k is not None and f.has_lite) else None
    b_k = b_k.float() if (b_k is not None and f.has_lite) else None
    downs, zbs, ups, cs = [], [], [], []
    if f.has_wise:
        downs.append(f.wise_A)
        if mixed:   # Kernel-wise alone: no zb (the kernels read zero)
            zbs.append(f.wise_A.new_zeros(H, f.wise_A.shape[1]))
        ups.append(f.wise_B)
        if f.wise_c is not None:
            cs.append(f.wise_c)
    if f.has_lite:
        # Query head h = k·G + i uses key head k: batch over the key heads (no gather).
        rl = f.lite_A.shape[1]
        if exact_lite:
            lite_grad = (f.lite_A, f.lite_B.detach())
        la = (f.lite_A.detach() if exact_lite else f.lite_A).reshape(Hk, (H // Hk) * rl, p)
        lite = torch.matmul(la, w_k.reshape(Hk, p, d)).reshape(H, rl, d)
        split = dtype in (torch.float16, torch.bfloat16)
        if split:
            # Both rows see the same dZ, so d(hi) = d(lo) = the gradient of the basis: let it
            # flow through lo only (hi is a constant rounding of it).
            hi = lite.detach().to(dtype).float()
            downs += [hi, lite - hi]
        else:
            downs.append(lite)
        if b_k is not None:
            zbs.append(torch.matmul(la, b_k.reshape(Hk, p, 1)).reshape(H, rl))
        else:
            zbs.append(f.lite_A.new_zeros(H, rl))
        ups.append(f.lite_B)
        if split:
            zbs.append(f.lite_A.new_zeros(H, rl))
            ups.append(f.lite_B)
        if f.lite_c is not None:
            cs.append(f.lite_c)
    cat = lambda ts, dim: (ts[0] if len(ts) == 1 else torch.cat(ts, dim)).contiguous()  # noqa
    down = cat(downs, 1) if downs else None
    zb = cat(zbs, 1) if zbs else None
    up = cat(ups, 2) if ups else None
    sdown = f.shared_A.contiguous() if f.has_shared else None
    scale = 1.0
    sup = None
    if f.has_shared:
        if isinstance(f.scale, torch.Tensor):   # differentiable: fold it here, in float32
            sup = (f.shared_B.float() * f.scale).contiguous()
        else:
            sup, scale = f.shared_B.contiguous(), float(f.scale)
    dc = None
    for c in cs:
        dc = c.reshape(-1) if dc is None else dc + c.reshape(-1)
    return (down, zb, up, sdown, sup), dc, scale, lite_grad


class LiteKeyGrad(torch.autograd.Function):
    """Identity on the op's output ``Y (T, N)`` that gives a float32 Kernel-wise-lite factor
    its gradient ``dA_h = dZ_hᵀ K^h`` with ``dZ_h = dΔ_h B_h`` (see :func:`_section`).

    The float32 rule (docs/math.md §4) compares with torch's own float32 error, and
    ``dZᵀ K`` sums terms that cancel whenever ``K`` does: any float32 evaluation (the
    reference's, which rounds ``K`` first, or the basis path's ``(dZᵀ X) W_kᵀ``) then leaves
    an error of about ``eps · Σ_t |dZ_t| |K_t|`` whose size relative to ``dA`` is luck, so
    the comparison would be a lottery. The backward therefore forms it in float64 as
    ``(dZᵀ X) W_kᵀ + (Σ dZ) b_kᵀ`` (association is free in float64; the token reduction is
    only ``H·r`` wide) and rounds once. float32 only: the 16-bit speed path keeps the basis
    path, whose float32 sums are 2^-13 below the 16-bit rounding both paths share."""

    _CHUNK = 8192   # tokens per float64 step (bounds the float64 copy of x)

    @staticmethod
    def forward(ctx, Y, lite_A, lite_B, x, w_k, b_k, c0: int, Hk: int):
        ctx.c0, ctx.Hk = c0, Hk
        ctx.save_for_backward(lite_B, x, w_k, b_k)
        return Y.view_as(Y)

    @staticmethod
    def backward(ctx, gY):
        lite_B, x, w_k, b_k = ctx.saved_tensors
        H, p, r = lite_B.shape
        Hk, G = ctx.Hk, H // ctx.Hk
        f64 = torch.float64
        B = lite_B.to(f64)
        R = x.new_zeros(H, r, x.shape[1], dtype=f64)       # Σ_t dZ_t x_tᵀ
        s = x.new_zeros(H, r, dtype=f64)                    # Σ_t dZ_t
        for t0 in range(0, x.shape[0], LiteKeyGrad._CHUNK):
            t1 = min(t0 + LiteKeyGrad._CHUNK, x.shape[0])
            g = gY[t0:t1, ctx.c0:ctx.c0 + H * p].reshape(t1 - t0, H, p).to(f64)
            dz = torch.einsum("thp,hpr->thr", g, B)
            R += torch.einsum("thr,td->hrd", dz, x[t0:t1].to(f64))
            s += dz.sum(0)
        W = w_k.to(f64).reshape(Hk, p, -1)
        dA = torch.einsum("kgrd,kpd->kgrp", R.reshape(Hk, G, r, -1), W).reshape(H, r, p)
        if b_k is not None:
            dA += s.reshape(Hk, G, r, 1).mul(b_k.to(f64).reshape(Hk, 1, 1, p)).reshape(H, r, p)
        return gY, dA.to(lite_B.dtype), None, None, None, None, None, None


def _fold_bias(b: Optional[torch.Tensor], dc: Optional[torch.Tensor]):
    """Frozen bias + per-head biases, in float32 when folded (the kernel adds it in float32)."""
    if dc is None:
        return b.contiguous() if b is not None else None
    dc = dc.float()
    return dc.contiguous() if b is None else (b.float() + dc).contiguous()


def _check_linear(name: str, w: torch.Tensor, rows: int, d: int, ref: torch.Tensor):
    _validate.check_tensor(name, w, ndim=2)
    _validate.check_same("x", ref, **{name: w})
    _validate.check_shape(name, w, (rows, d), "(out, in) as in nn.Linear")
