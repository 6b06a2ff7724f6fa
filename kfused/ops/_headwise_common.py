"""Pieces shared by the per-head low-rank ops (docs/math.md §2): argument checks and the
kernel-level factors of a section from the user's :class:`HeadFactors` (Kernel-wise and lite
down-projections stacked along the rank with the lite bases ``A_h W_k^h`` and ``b_k^h A_hᵀ``:
one kernel each way, :class:`LiteSection`; the per-head biases summed; a tensor scale folded
into ``B_s``), so the custom ops only see plain tensors.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch

from kfused import _validate
from kfused._validate import fits
from kfused.ops._common import custom_op, kops, no_double_backward  # noqa: F401 (re-exported)
from kfused.ops._common import dense as _dense
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
    """A scale is a finite real number, or a one-element floating tensor on ref's device (its
    value is not inspected: that would synchronise with the device). TypeError for anything
    else that is not a number, ValueError for NaN/inf or a tensor of several elements (the
    rule of :func:`kfused.ops.krona_linear.check_scale`)."""
    if isinstance(s, torch.Tensor):
        if not s.is_floating_point():
            raise TypeError(f"{name} must be a real number or a one-element floating-point "
                            f"tensor, got a {s.dtype} tensor of shape {tuple(s.shape)}")
        if s.numel() != 1:
            raise ValueError(f"{name} must be a real number or a one-element floating-point "
                             f"tensor, got a {s.dtype} tensor of shape {tuple(s.shape)}")
        if s.device != ref.device:
            raise ValueError(f"{name} is on {s.device} but the inputs are on {ref.device}")
        return
    _validate.check_real(name, s)


def _scalar(s):
    """A one-element tensor scale as a 0-d tensor (a (1, 1, 1) one would broadcast the
    factors it multiplies to three dimensions); numbers unchanged."""
    return s.reshape(()) if isinstance(s, torch.Tensor) and s.dim() else s


def _scalar_factors(f: Optional[HeadFactors]) -> Optional[HeadFactors]:
    if f is None or not isinstance(f.scale, torch.Tensor) or f.scale.dim() == 0:
        return f
    return dataclasses.replace(f, scale=_scalar(f.scale))


class _NoDoubleBackward(torch.autograd.Function):
    """Identity on tensors computed by kernels inside a backward that ran with
    ``create_graph=True``: ties them to the incoming gradients so that a second backward
    reaches this node and raises :func:`no_double_backward`'s error."""

    @staticmethod
    def forward(ctx, op, anchor, *outs):
        ctx.op = op
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        no_double_backward(ctx.op)(ctx, *grads)


def _one_dtype(uses) -> Optional[torch.dtype]:
    """The dtype a bias-gradient sum is written in: its uses' dtype when every use wanted
    ((dtype, wanted) pairs: the frozen bias's gradient, the per-head bias c's) shares one (no
    conversion kernel after), else None (float32)."""
    dts = {dt for dt, wanted in uses if wanted}
    return dts.pop() if len(dts) == 1 else None


def _empty(ref: torch.Tensor) -> torch.Tensor:
    return ref.new_empty(0)


def _opt(t: torch.Tensor) -> Optional[torch.Tensor]:
    return t if t is not None and t.numel() > 0 else None



def _factors_fit(f: HeadFactors, H: int, p: int, d: int, ref: torch.Tensor) -> bool:
    """Whether :func:`_check_factors` accepts ``f`` with a numeric scale (the common case,
    asked first; its detailed checks name a fault)."""
    if not _validate.is_finite_number(f.scale):
        return False
    for a, b, c, base, first in ((f.shared_A, f.shared_B, None, d, True),
                                 (f.wise_A, f.wise_B, f.wise_c, d, False),
                                 (f.lite_A, f.lite_B, f.lite_c, p, False)):
        if a is None:
            if b is not None or c is not None:
                return False
            continue
        if not isinstance(a, torch.Tensor) or a.dim() != (2 if first else 3):
            return False
        if first:     # shared: A (r_s, d), B (H·p, r_s)
            r = a.shape[0]
            if not (r and fits(a, (r, d), ref) and b is not None and
                    fits(b, (H * p, r), ref)):
                return False
        else:         # per head: A (H, r, d or p), B (H, p, r), c (H, p)
            r = a.shape[1]
            if not (r and fits(a, (H, r, base), ref) and b is not None and
                    fits(b, (H, p, r), ref) and fits(c, (H, p), ref)):
                return False
    return True


def _check_factors(name: str, f: HeadFactors, H: int, p: int, d: int,
                   ref: torch.Tensor) -> None:
    if _factors_fit(f, H, p, d, ref):
        return
    dt, dev = ref.dtype, ref.device

    def chk(attr, shape, what):
        t = getattr(f, attr)
        if t is None:
            return
        if isinstance(t, torch.Tensor) and t.dtype == dt and t.device == dev and \
                t.shape == shape:
            return   # what the checks below accept (ref is floating): they name a fault
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
    def rank(attr, r):
        # a rank-0 part is no update, and the Triton backward cannot take it (a rank-0 wise
        # part crashed inside the unpack kernel)
        if r == 0:
            raise ValueError(f"{name}.{attr} has shape {tuple(getattr(f, attr).shape)}: rank 0 "
                             f"is no update; pass {attr} = None (and its partner) to leave that "
                             "part out")

    if f.shared_A is not None:
        _validate.check_tensor(f"{name}.shared_A", f.shared_A, ndim=2)
        rs = f.shared_A.shape[0]
        rank("shared_A", rs)
        chk("shared_A", (rs, d), "(r_s, d_in)")
        chk("shared_B", (H * p, rs), "(H·p, r_s)")
    if f.wise_A is not None:
        _validate.check_tensor(f"{name}.wise_A", f.wise_A, ndim=3)
        r = f.wise_A.shape[1]
        rank("wise_A", r)
        chk("wise_A", (H, r, d), "(H, r, d_in)")
        chk("wise_B", (H, p, r), "(H, p, r)")
        chk("wise_c", (H, p), "(H, p)")
    if f.lite_A is not None:
        _validate.check_tensor(f"{name}.lite_A", f.lite_A, ndim=3)
        r = f.lite_A.shape[1]
        rank("lite_A", r)
        chk("lite_A", (H, r, p), "(H, r, p): lite uses the p-wide key head as basis")
        chk("lite_B", (H, p, r), "(H, p, r)")
        chk("lite_c", (H, p), "(H, p)")


def _section_dims(wise_A, lite_A, split: bool):
    H, RL, P = lite_A.shape
    RW = wise_A.shape[1] if wise_A is not None else 0
    return H, P, RW, RL, RW + RL * (2 if split else 1)


# The section kernels as custom ops (opaque to torch.compile, with fake implementations), so
# that LiteSection traces with no graph break: dynamo cannot trace the interpreter's or the
# launcher's host code.
@custom_op("kfused::headwise_section_triton_fwd")
def _section_fwd(wise_A: Optional[torch.Tensor], wise_B: Optional[torch.Tensor],
                 lite_A: torch.Tensor, lite_B: torch.Tensor, w_k: torch.Tensor,
                 b_k: Optional[torch.Tensor], Hk: int, split: Optional[torch.dtype]
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from kfused.triton_kernels import headwise_section as tk

    return tk.section_forward(wise_A, wise_B, lite_A, lite_B, w_k, b_k, Hk, split)


@_section_fwd.register_fake
def _section_fwd_fake(wise_A, wise_B, lite_A, lite_B, w_k, b_k, Hk, split):
    H, P, _, _, R = _section_dims(wise_A, lite_A, split is not None)
    f = dict(dtype=torch.float32)
    return (lite_A.new_empty(H, R, w_k.shape[1], **f), lite_A.new_empty(H, R, **f),
            lite_A.new_empty(H, P, R, **f))


@custom_op("kfused::headwise_section_triton_bwd")
def _section_bwd(d_down: torch.Tensor, d_zb: torch.Tensor, d_up: torch.Tensor,
                 wise_A: Optional[torch.Tensor], wise_B: Optional[torch.Tensor],
                 lite_A: torch.Tensor, lite_B: torch.Tensor, w_k: torch.Tensor,
                 b_k: Optional[torch.Tensor], Hk: int, split: bool, need_lite_A: bool
                 ) -> List[torch.Tensor]:
    from kfused.triton_kernels import headwise_section as tk

    got = tk.section_backward(d_down, d_zb, d_up, wise_A, wise_B, lite_A, lite_B, w_k, b_k,
                              Hk, split, need_lite_A=need_lite_A)
    return [t if t is not None else lite_A.new_empty(0) for t in got]


@_section_bwd.register_fake
def _section_bwd_fake(d_down, d_zb, d_up, wise_A, wise_B, lite_A, lite_B, w_k, b_k, Hk, split,
                      need_lite_A):
    return [torch.empty_like(wise_A) if wise_A is not None else lite_A.new_empty(0),
            torch.empty_like(wise_B) if wise_B is not None else lite_A.new_empty(0),
            torch.empty_like(lite_A) if need_lite_A else lite_A.new_empty(0),
            torch.empty_like(lite_B)]


class LiteSection(torch.autograd.Function):
    """The float32 kernel-level factors of a section with lite heads — ``down (H, R, d)``,
    ``zb (H, R)``, ``up (H, p, R)`` (layout in :mod:`kfused.triton_kernels.headwise_section`)
    — from the user's factors in one kernel, their gradients in one more. ``split``: the
    16-bit activation dtype (hi/lo basis rows; the basis gradient flows through lo only, hi
    being a constant rounding of it) or None (float32: one basis row)."""

    @staticmethod
    def forward(ctx, wise_A, wise_B, lite_A, lite_B, w_k, b_k, Hk: int, split):
        ctx.Hk, ctx.split = Hk, split is not None
        ctx.save_for_backward(wise_A, wise_B, lite_A, lite_B, w_k, b_k)
        ctx.set_materialize_grads(False)
        return kops.headwise_section_triton_fwd(wise_A, wise_B, lite_A, lite_B, w_k, b_k, Hk,
                                                split)

    @staticmethod
    def backward(ctx, d_down, d_zb, d_up):
        wise_A, wise_B, lite_A, lite_B, w_k, b_k = ctx.saved_tensors
        need = ctx.needs_input_grad
        if d_down is None and d_zb is None and d_up is None:
            return (None,) * 8
        H, P, d = lite_A.shape[0], lite_A.shape[2], w_k.shape[1]
        width = (wise_A.shape[1] if wise_A is not None else 0) + lite_A.shape[1] * (
            2 if ctx.split else 1)
        z = lambda t, *shape: t.contiguous() if t is not None else lite_A.new_zeros(  # noqa
            *shape, dtype=torch.float32)
        d_down, d_zb, d_up = z(d_down, H, width, d), z(d_zb, H, width), z(d_up, H, P, width)
        dwa, dwb, dla, dlb = kops.headwise_section_triton_bwd(
            d_down, d_zb, d_up, wise_A, wise_B, lite_A, lite_B, w_k, b_k, ctx.Hk, ctx.split,
            need[2])
        dwa, dwb = (dwa, dwb) if wise_A is not None else (None, None)
        dla = dla if need[2] else None
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (d_down, d_zb, d_up)):
            # create_graph: the kernels' results carry no graph; a second backward through
            # them must raise, not drop their terms
            anchor = next(t for t in (d_down, d_zb, d_up) if t is not None and t.requires_grad)
            got = [t for t in (dwa, dwb, dla, dlb) if t is not None]
            wrapped = iter(_NoDoubleBackward.apply("headwise_qkv / headwise_projection",
                                                   anchor, *got))
            dwa, dwb, dla, dlb = (next(wrapped) if t is not None else None
                                  for t in (dwa, dwb, dla, dlb))
        dwk = dbk = None
        if need[4] or (b_k is not None and need[5]):
            # A trainable key projection (rare: it is frozen in every adapter method) also
            # gets the basis' share: dW_k^k = Σ_{h of k} A_hᵀ dBasis_h, db_k^k = Σ A_hᵀ dzb_h.
            Hk, RL = ctx.Hk, lite_A.shape[1]
            r0 = width - RL                         # the basis gradient: lo rows, or the row
            a = lite_A.float().reshape(Hk, -1, RL, P)
            if need[4]:
                db_ = d_down[:, r0:].reshape(Hk, -1, RL, d)
                dwk = torch.einsum("kgrp,kgrd->kpd", a, db_).reshape(-1, d).to(w_k.dtype)
            if b_k is not None and need[5]:
                dz_ = d_zb[:, width - RL * (2 if ctx.split else 1):][:, :RL].reshape(Hk, -1, RL)
                dbk = torch.einsum("kgrp,kgr->kp", a, dz_).reshape(-1).to(b_k.dtype)
        return dwa, dwb, dla, dlb, dwk, dbk, None, None


def _section(f: Optional[HeadFactors], H: int, Hk: int, p: int, d: int,
             w_k: Optional[torch.Tensor], b_k: Optional[torch.Tensor],
             dtype: torch.dtype = torch.float32):
    """Kernel-level factors of one section with ``H`` heads and the bias delta (per-head c's,
    added beside the frozen bias in the GEMM's epilogue). Lite uses key head
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
    # (lite bases in LiteSection's kernel, a tensor scale) are formed in float32, so nothing
    # is rounded twice.
    # float32: lite_A's gradient comes from :class:`LiteKeyGrad` after the op (float64,
    # see there), so the basis is built from a detached lite_A.
    exact_lite = f.has_lite and dtype == torch.float32
    lite_grad = None
    down = zb = up = None
    cs = [c for c in (f.wise_c, f.lite_c) if c is not None]
    if f.has_lite:
        # One kernel builds [wise A | basis hi | basis lo] rows, their zb and [wise B | lite B
        # | lite B] in float32 (:class:`LiteSection`). Query head h = k·G + i uses key head k.
        if exact_lite:
            lite_grad = (f.lite_A, f.lite_B.detach())
        split = dtype if dtype in (torch.float16, torch.bfloat16) else None
        down, zb, up = LiteSection.apply(
            f.wise_A, f.wise_B, f.lite_A.detach() if exact_lite else f.lite_A, f.lite_B,
            w_k, b_k, Hk, split)
    elif f.has_wise:     # Kernel-wise alone: no zb (the kernels read zero)
        down, up = f.wise_A.contiguous(), f.wise_B.contiguous()
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


_LITE_CHUNK = 8192   # tokens per float64 step of LiteKeyGrad (bounds the float64 copy of x)


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
        T = x.shape[0]
        # one step when the tokens fit: no Python loop over the token count, which
        # torch.compile would have to specialise (mark_dynamic on the tokens refused)
        spans = ([(0, T)] if T <= _LITE_CHUNK else
                 [(t0, min(t0 + _LITE_CHUNK, T)) for t0 in range(0, T, _LITE_CHUNK)])
        for t0, t1 in spans:
            g = gY[t0:t1, ctx.c0:ctx.c0 + H * p].reshape(t1 - t0, H, p).to(f64)
            dz = torch.einsum("thp,hpr->thr", g, B)
            R += torch.einsum("thr,td->hrd", dz, x[t0:t1].to(f64))
            s += dz.sum(0)
        W = w_k.to(f64).reshape(Hk, p, -1)
        dA = torch.einsum("kgrd,kpd->kgrp", R.reshape(Hk, G, r, -1), W).reshape(H, r, p)
        if b_k is not None:
            dA += s.reshape(Hk, G, r, 1).mul(b_k.to(f64).reshape(Hk, 1, 1, p)).reshape(H, r, p)
        return gY, dA.to(lite_B.dtype), None, None, None, None, None, None


def _check_input_width(x_name: str, x: torch.Tensor, weights: dict) -> None:
    """When every weight (nn.Linear layout (out, in)) agrees on the input width and ``x``'s
    last dimension differs, the error names ``x`` (the weights' own shape checks follow)."""
    ins = {int(w.shape[1]) for w in weights.values()}
    if len(ins) == 1 and int(x.shape[-1]) not in ins:   # int: a traced size is a tensor
        (d_w,) = ins
        shapes = ", ".join(f"{n} {tuple(w.shape)}" for n, w in weights.items())
        raise ValueError(f"{x_name} has shape {tuple(x.shape)}: its last dimension "
                         f"{x.shape[-1]} must equal the input width {d_w} of the weights "
                         f"({shapes}; (out, in) as in nn.Linear)")


def _check_linear(name: str, w: torch.Tensor, rows: int, d: int, ref: torch.Tensor):
    if w is not None and fits(w, (rows, d), ref):
        return   # what the checks below accept: they name a fault
    _validate.check_tensor(name, w, ndim=2)
    _validate.check_same("x", ref, **{name: w})
    _validate.check_shape(name, w, (rows, d), "(out, in) as in nn.Linear")
