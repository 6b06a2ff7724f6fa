"""Per-head low-rank update ops (SPEC §2, paper 000): torch.library registrations, autograd
and the public functional API.

Public functions (each with ``backend="auto" | "triton" | "reference"``; headwise_lowrank also
takes "cuda": the CUDA C++ extension's kernel from csrc/headwise, tried after Triton by "auto"):

    headwise_lowrank(basis, A, B, bias=None)          -> (..., H, p)
    headwise_qkv(x, w_q, w_k, w_v, b_q, b_k, b_v, n_heads=, n_kv_heads=, q=, v=)
                                                      -> Q, K, V  (fused attention input)
    headwise_projection(x, weight, bias, n_heads=, factors=, w_k=, b_k=)
                                                      -> one adapted q or v projection
    headwise_oproj(o, w_o, b_o, n_heads=, wise_A=, wise_B=, wise_c=, shared_A=, shared_B=,
                   scale=)                            -> Y        (fused output projection)

Custom ops (each with a fake and, for the forward, an autograd registration):
    kfused::headwise_lowrank_triton_fwd / _bwd, kfused::headwise_lowrank_cuda_fwd / _bwd
    kfused::headwise_qkv_triton_fwd / _bwd
    kfused::headwise_oproj_triton_fwd / _bwd

``headwise_lowrank`` is deliberately not wired into ``modules/`` or ``integration/``: every
module use (Kernel-wise on X, lite on K, the shared part) is a special case of the fused
projections, which read X once for the frozen GEMM and every down-projection; a module built
on ``headwise_lowrank`` would add passes over X (or K) and Y. It stays a public op (with its
Triton kernels, the CUDA C++ extension and their tests) for callers that hold a basis
themselves, e.g. an attention implementation that already computed K.

The fused projections take the user's factors (:class:`HeadFactors`), build the kernel-level
factors on the host with differentiable torch ops on tiny tensors (stack Kernel-wise and lite
down-projections along the rank, the lite bases ``A_h W_k^h`` and ``b_k^h A_hᵀ``, fold the
shared scale into ``B_s`` and the per-head biases into the frozen bias), then call one custom
op. Autograd maps the kernel-level gradients back to the factors, so the custom ops only see
plain tensors.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch

from kfused import _validate
from kfused.backends import select_backend
from kfused.reference.headwise import (HeadFactors, headwise_lowrank_ref, headwise_oproj_ref,
                                       headwise_qkv_ref, kv_group_index, projection_delta_ref)

__all__ = ["headwise_lowrank", "headwise_qkv", "headwise_projection", "headwise_oproj",
           "HeadFactors"]

_IMPLS = ("triton",)


def _tk():
    # Imported lazily: Triton decides at decoration time whether to interpret.
    from kfused.triton_kernels import headwise

    return headwise


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


# ==========================================================================================
# headwise_lowrank


@torch.library.custom_op("kfused::headwise_lowrank_triton_fwd", mutates_args=())
def _lowrank_fwd(basis: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                 bias: Optional[torch.Tensor], per_head: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    return _tk().headwise_lowrank_forward(basis, A, B, bias, per_head)


@_lowrank_fwd.register_fake
def _(basis, A, B, bias, per_head):
    T = basis.shape[0]
    H, R, _ = A.shape
    return (basis.new_empty(T, H, B.shape[1]),
            basis.new_empty(T, H, R, dtype=torch.float32))


@torch.library.custom_op("kfused::headwise_lowrank_triton_bwd", mutates_args=())
def _lowrank_bwd(g: torch.Tensor, basis: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                 z: torch.Tensor, per_head: bool, need_basis: bool, need_factors: bool,
                 has_bias: bool) -> List[torch.Tensor]:
    dx, dA, dB, db = _tk().headwise_lowrank_backward(g, basis, A, B, z, per_head, need_basis,
                                                     need_factors, has_bias)
    return [dx if dx is not None else _empty(basis), dA if dA is not None else _empty(A),
            dB if dB is not None else _empty(B), db if db is not None else _empty(B)]


@_lowrank_bwd.register_fake
def _(g, basis, A, B, z, per_head, need_basis, need_factors, has_bias):
    H, _, P = B.shape[0], None, B.shape[1]
    return [torch.empty_like(basis) if need_basis else basis.new_empty(0),
            torch.empty_like(A) if need_factors else A.new_empty(0),
            torch.empty_like(B) if need_factors else B.new_empty(0),
            B.new_empty(H, P) if (need_factors and has_bias) else B.new_empty(0)]


def _lowrank_setup(ctx, inputs, output):
    basis, A, B, bias, per_head = inputs
    ctx.save_for_backward(basis, A, B, output[1])
    ctx.per_head = per_head
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(output[1])


def _lowrank_backward(ctx, g, gz):
    basis, A, B, z = ctx.saved_tensors
    nx, nA, nB, nb, _ = ctx.needs_input_grad
    need_f = nA or nB or nb
    dx, dA, dB, db = torch.ops.kfused.headwise_lowrank_triton_bwd(
        g.contiguous(), basis, A, B, z, ctx.per_head, nx, need_f, ctx.has_bias and nb)
    return (dx if nx else None, dA if nA else None, dB if nB else None,
            db if (nb and ctx.has_bias) else None, None)


_lowrank_fwd.register_autograd(_lowrank_backward, setup_context=_lowrank_setup)


# ------------------------------------------------------------------------------------------
# CUDA C++ extension (csrc/headwise/headwise_lowrank.cu): headwise_lowrank only. The kernel
# infers the basis kind from basis.dim() (2: shared, 3: per head), as the host passes it.


def _ext():
    from kfused import cuda

    mod = cuda.extension()
    if mod is None:
        raise RuntimeError(cuda.unavailable_reason("headwise_lowrank"))
    return mod


@torch.library.custom_op("kfused::headwise_lowrank_cuda_fwd", mutates_args=())
def _lowrank_cuda_fwd(basis: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                      bias: Optional[torch.Tensor]) -> torch.Tensor:
    return _ext().headwise_lowrank_fwd(basis.contiguous(), A.contiguous(), B.contiguous(),
                                       bias.contiguous() if bias is not None else None)


@_lowrank_cuda_fwd.register_fake
def _(basis, A, B, bias):
    return basis.new_empty(basis.shape[0], A.shape[0], B.shape[1])


@torch.library.custom_op("kfused::headwise_lowrank_cuda_bwd", mutates_args=())
def _lowrank_cuda_bwd(g: torch.Tensor, basis: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                      has_bias: bool) -> List[torch.Tensor]:
    dx, dA, dB, db = _ext().headwise_lowrank_bwd(g.contiguous(), basis.contiguous(),
                                                 A.contiguous(), B.contiguous(), has_bias)
    return [dx, dA, dB, db]


@_lowrank_cuda_bwd.register_fake
def _(g, basis, A, B, has_bias):
    return [torch.empty_like(basis), torch.empty_like(A), torch.empty_like(B),
            B.new_empty(B.shape[0], B.shape[1]) if has_bias else B.new_empty(0)]


def _lowrank_cuda_setup(ctx, inputs, output):
    basis, A, B, bias = inputs
    ctx.save_for_backward(basis, A, B)
    ctx.has_bias = bias is not None


def _lowrank_cuda_backward(ctx, g):
    basis, A, B = ctx.saved_tensors
    dx, dA, dB, db = torch.ops.kfused.headwise_lowrank_cuda_bwd(g, basis, A, B, ctx.has_bias)
    return dx, dA, dB, (db if ctx.has_bias else None)


_lowrank_cuda_fwd.register_autograd(_lowrank_cuda_backward, setup_context=_lowrank_cuda_setup)


def _infer_per_head(basis: torch.Tensor, H: int, per_head: Optional[bool]) -> bool:
    if per_head is not None:
        return bool(per_head)
    return basis.dim() >= 3 and basis.shape[-2] == H


def headwise_lowrank(basis: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                     bias: Optional[torch.Tensor] = None, *, per_head: Optional[bool] = None,
                     backend: Optional[str] = None) -> torch.Tensor:
    """Per-head low-rank product ``out[..., h, :] = basis[..., (h,) :] A_hᵀ B_hᵀ + bias_h``.

    This is Kernel-wise (basis X, shared by the heads) and Kernel-wise-lite (basis K, one per
    head) of SPEC §2 as one op.

    Args:
        basis: ``(..., d_b)`` shared by all heads, or ``(..., H, d_b)`` one per head.
        A: ``(H, r, d_b)`` per-head down-projections.
        B: ``(H, p, r)`` per-head up-projections.
        bias: ``(H, p)`` per-head bias ``c`` or None.
        per_head: which basis kind; None infers "per head" when ``basis`` has at least 3
            dimensions and ``basis.shape[-2] == H`` (pass ``per_head=False`` for a shared
            ``(batch, seq, d_b)`` basis whose ``seq`` happens to equal ``H``; a 2-D basis is
            always shared unless ``per_head=True``).
        backend: "auto" (default: ``KFUSED_BACKEND``), "triton", "cuda" (the compiled
            extension; not run in this branch's CPU CI) or "reference".

    Returns ``(..., H, p)`` in the inputs' dtype. Float32, float16 and bfloat16 (Triton) and
    any floating dtype (reference).
    """
    _validate.check_tensor("basis", basis, min_ndim=1)
    _check_flag("per_head", per_head, optional=True)
    _validate.check_tensor("A", A, ndim=3)
    _validate.check_tensor("B", B, ndim=3)
    H, r, db_ = A.shape
    if bias is not None:
        _validate.check_tensor("bias", bias, ndim=2)
    _validate.check_same("basis", basis, A=A, B=B, bias=bias)
    ph = _infer_per_head(basis, H, per_head)
    if ph and (basis.dim() < 2 or basis.shape[-2] != H):
        raise ValueError(f"basis has shape {tuple(basis.shape)}, expected (..., H={H}, d_b) for "
                         "a per-head basis (H from A.shape[0])")
    if basis.shape[-1] != db_:
        raise ValueError(f"A has shape {tuple(A.shape)}, expected (H, r, d_b={basis.shape[-1]}) "
                         f"to match basis of shape {tuple(basis.shape)}")
    if B.shape[0] != H or B.shape[2] != r:
        raise ValueError(f"B has shape {tuple(B.shape)}, expected (H={H}, p, r={r}) to match "
                         f"A of shape {tuple(A.shape)}")
    p = B.shape[1]
    if bias is not None:
        _validate.check_shape("bias", bias, (H, p), "(H, p) per-head bias")
    be = select_backend("headwise_lowrank", backend, [basis, A, B], impls=("triton", "cuda"),
                        extra_unfit=_no_float64(basis))
    if be == "reference":
        return headwise_lowrank_ref(basis, A, B, bias, per_head=ph)
    lead = basis.shape[:-2] if ph else basis.shape[:-1]
    flat = basis.reshape(-1, H, db_) if ph else basis.reshape(-1, db_)
    if be == "cuda":
        out = torch.ops.kfused.headwise_lowrank_cuda_fwd(flat, A, B, bias)
        return out.reshape(*lead, H, p)
    out, _ = torch.ops.kfused.headwise_lowrank_triton_fwd(
        flat, A.contiguous(), B.contiguous(), bias.contiguous() if bias is not None else None, ph)
    return out.reshape(*lead, H, p)


# ==========================================================================================
# Fused attention-input projection


_SEC_KEYS = ("down", "zb", "up", "sdown", "sup")


@torch.library.custom_op("kfused::headwise_qkv_triton_fwd", mutates_args=())
def _qkv_fwd(x: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor,
             b_q: Optional[torch.Tensor], b_k: Optional[torch.Tensor],
             b_v: Optional[torch.Tensor],
             q_down: Optional[torch.Tensor], q_zb: Optional[torch.Tensor],
             q_up: Optional[torch.Tensor], q_sdown: Optional[torch.Tensor],
             q_sup: Optional[torch.Tensor],
             v_down: Optional[torch.Tensor], v_zb: Optional[torch.Tensor],
             v_up: Optional[torch.Tensor], v_sdown: Optional[torch.Tensor],
             v_sup: Optional[torch.Tensor], head_dim: int, q_scale: float = 1.0,
             v_scale: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor]:
    k = _tk()
    q = k.SectionFactors(q_down, q_zb, q_up, q_sdown, q_sup, q_scale)
    v = k.SectionFactors(v_down, v_zb, v_up, v_sdown, v_sup, v_scale)
    return k.headwise_qkv_forward(x, w_q, w_k, w_v, b_q, b_k, b_v, q, v, head_dim)


def _zwidth(HQ, HV, head_dim, q_down, q_sdown, v_down, v_sdown, device):
    """Width of the packed rank-space buffer (see kfused.triton_kernels.headwise)."""
    rq = q_down.shape[1] if q_down is not None else 0
    rsq = q_sdown.shape[0] if q_sdown is not None else 0
    rv = v_down.shape[1] if v_down is not None else 0
    rsv = v_sdown.shape[0] if v_sdown is not None else 0
    return _tk().qkv_zwidth(HQ, HV, head_dim, (rq, rsq), (rv, rsv), device)


@_qkv_fwd.register_fake
def _(x, w_q, w_k, w_v, b_q, b_k, b_v, q_down, q_zb, q_up, q_sdown, q_sup,
      v_down, v_zb, v_up, v_sdown, v_sup, head_dim, q_scale=1.0, v_scale=1.0):
    T = x.shape[0]
    M = _zwidth(w_q.shape[0] // head_dim, w_v.shape[0] // head_dim, head_dim, q_down, q_sdown,
                v_down, v_sdown, x.device)
    return (x.new_empty(T, w_q.shape[0] + w_k.shape[0] + w_v.shape[0]), x.new_empty(T, M))


@torch.library.custom_op("kfused::headwise_qkv_triton_bwd", mutates_args=())
def _qkv_bwd(g: torch.Tensor, x: torch.Tensor,
             w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor,
             q_down: Optional[torch.Tensor], q_up: Optional[torch.Tensor],
             q_sdown: Optional[torch.Tensor], q_sup: Optional[torch.Tensor],
             v_down: Optional[torch.Tensor], v_up: Optional[torch.Tensor],
             v_sdown: Optional[torch.Tensor], v_sup: Optional[torch.Tensor],
             z: torch.Tensor, head_dim: int, need_dx: bool,
             need_factors: bool, q_scale: float = 1.0,
             v_scale: float = 1.0) -> List[torch.Tensor]:
    k = _tk()
    q = k.SectionFactors(q_down, None, q_up, q_sdown, q_sup, q_scale)
    v = k.SectionFactors(v_down, None, v_up, v_sdown, v_sup, v_scale)
    dx, gq, gv = k.headwise_qkv_backward(g, x, w_q, w_k, w_v, q, v, z, head_dim, need_dx,
                                         need_factors)
    out = [dx if dx is not None else _empty(x)]
    for grads in (gq, gv):
        for key in _SEC_KEYS + ("db",):
            t = grads.get(key)
            out.append(t if t is not None else _empty(x))
    return out


@_qkv_bwd.register_fake
def _(g, x, w_q, w_k, w_v, q_down, q_up, q_sdown, q_sup, v_down, v_up, v_sdown,
      v_sup, z, head_dim, need_dx, need_factors, q_scale=1.0, v_scale=1.0):
    out = [torch.empty_like(x) if need_dx else x.new_empty(0)]
    for down, up, sdown, sup, w in ((q_down, q_up, q_sdown, q_sup, w_q),
                                    (v_down, v_up, v_sdown, v_sup, w_v)):
        hw = need_factors and down is not None
        sh = need_factors and sdown is not None
        r = down.shape[1] if down is not None else 0
        rs = sdown.shape[0] if sdown is not None else 0
        N = w.shape[0]
        H = N // head_dim
        f32 = torch.float32
        out.append(torch.empty_like(down) if hw else x.new_empty(0))              # down
        out.append(x.new_empty(H, r, dtype=f32) if hw else x.new_empty(0))        # zb
        out.append(torch.empty_like(up) if hw else x.new_empty(0))                # up
        out.append(torch.empty_like(sdown) if sh else x.new_empty(0))             # sdown
        out.append(torch.empty_like(sup) if sh else x.new_empty(0))               # sup
        out.append(x.new_empty(N, dtype=f32) if (hw or sh) else x.new_empty(0))   # db
    return out


def _qkv_setup(ctx, inputs, output):
    (x, w_q, w_k, w_v, b_q, b_k, b_v, q_down, q_zb, q_up, q_sdown, q_sup,
     v_down, v_zb, v_up, v_sdown, v_sup, head_dim, *scales) = inputs
    ctx.save_for_backward(x, w_q, w_k, w_v, q_down, q_up, q_sdown, q_sup,
                          v_down, v_up, v_sdown, v_sup, output[1])
    ctx.head_dim = head_dim
    ctx.scales = tuple(scales) + (1.0,) * (2 - len(scales))
    ctx.has_b = (b_q is not None, b_k is not None, b_v is not None)
    ctx.b_dtypes = tuple(b.dtype if b is not None else None for b in (b_q, b_k, b_v))
    ctx.mark_non_differentiable(output[1])


def _qkv_backward(ctx, gY, gZ):
    (x, w_q, w_k, w_v, q_down, q_up, q_sdown, q_sup,
     v_down, v_up, v_sdown, v_sup, z) = ctx.saved_tensors
    need = ctx.needs_input_grad
    nx = need[0]
    need_f = any(need[7:17])
    gY = gY.contiguous()
    res = torch.ops.kfused.headwise_qkv_triton_bwd(
        gY, x, w_q, w_k, w_v, q_down, q_up, q_sdown, q_sup, v_down, v_up, v_sdown,
        v_sup, z, ctx.head_dim, nx, need_f or need[4] or need[6], *ctx.scales)
    dx = res[0]
    gq = dict(zip(_SEC_KEYS + ("db",), res[1:7]))
    gv = dict(zip(_SEC_KEYS + ("db",), res[7:13]))
    nq, nk = w_q.shape[0], w_k.shape[0]
    gs = (gY[:, :nq], gY[:, nq:nq + nk], gY[:, nq + nk:])

    def bias_grad(i, sec):
        if not (need[4 + i] and ctx.has_b[i]):
            return None
        if sec is not None and _opt(sec["db"]) is not None:
            return sec["db"].to(ctx.b_dtypes[i])
        return gs[i].sum(0, dtype=torch.float32).to(ctx.b_dtypes[i])

    # The frozen weights normally have no gradient; when they do it is one plain GEMM.
    dw = [torch.matmul(gs[i].t(), x).to(w.dtype) if need[1 + i] else None
          for i, w in enumerate((w_q, w_k, w_v))]
    # (a factor that was None, e.g. the zero zb of a Kernel-wise-only section, gets None)
    fac = [_opt(sec[key]) if need[7 + i] else None
           for i, (sec, key) in enumerate((sec, key) for sec in (gq, gv) for key in _SEC_KEYS)]
    return (dx if nx else None, dw[0], dw[1], dw[2], bias_grad(0, gq), bias_grad(1, None),
            bias_grad(2, gv), *fac, None, None, None)


_qkv_fwd.register_autograd(_qkv_backward, setup_context=_qkv_setup)


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
    ``|K A_hᵀ|``, which lost to torch whenever ``K`` cancels (issue 13 item 10: fp16 lite
    gradients up to 2.3x torch's error, 9 of 64 fuzzed cases)."""
    if f is None or f.empty:
        return (None,) * 5, None, 1.0
    # Every launch here costs a few µs, as much as a kernel pass at GPT-2 widths (issue 12),
    # so factors the kernels can read as they are (Kernel-wise A_h, B_h; shared A_s, B_s with
    # a numeric scale, which the pack kernel folds in float32) are passed in the user's dtype:
    # the pack kernel converts them to float32 and rounds the packed operands once, the
    # unpack kernel writes their gradients in their dtype from float32 sums — the same
    # values as casting to float32 here and back in autograd. Products that build factors
    # (lite bases, a tensor scale) are formed in float32, so nothing is rounded twice.
    mixed = f.has_wise and f.has_lite
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
        la = f.lite_A.reshape(Hk, (H // Hk) * rl, p)
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
    return (down, zb, up, sdown, sup), dc, scale


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


def headwise_qkv(x: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, w_v: torch.Tensor,
                 b_q: Optional[torch.Tensor] = None, b_k: Optional[torch.Tensor] = None,
                 b_v: Optional[torch.Tensor] = None, *, n_heads: int,
                 n_kv_heads: Optional[int] = None, q: Optional[HeadFactors] = None,
                 v: Optional[HeadFactors] = None, backend: Optional[str] = None,
                 fused_output: bool = False):
    """Fused attention-input projection with SPEC §2 updates on q and v.

    ``Q = X W_qᵀ + b_q + ΔQ``, ``K = X W_kᵀ + b_k``, ``V = X W_vᵀ + b_v + ΔV`` where each Δ is
    any mix of the shared LoRA part, Kernel-wise (basis X) and Kernel-wise-lite (basis K, bias
    included) given by a :class:`HeadFactors`.

    Args:
        x: ``(..., d)``.
        w_q: ``(H·p, d)``; w_k, w_v: ``(H_kv·p, d)`` in nn.Linear (out, in) layout, any
            strides (for GPT-2's Conv1D ``c_attn`` pass ``weight[:, i*d:(i+1)*d].t()``: no copy).
        b_q, b_k, b_v: ``(out,)`` or None.
        n_heads: H (query heads); n_kv_heads: H_kv (defaults to H; grouped-query attention
            when smaller). Lite on q uses key head ``h // (H / H_kv)`` for query head h.
        q, v: factors (shapes in :class:`HeadFactors`; for v use H_kv heads).
        backend: "auto" | "triton" | "reference".

    Returns ``Q (..., H·p)``, ``K (..., H_kv·p)``, ``V (..., H_kv·p)``, or with
    ``fused_output=True`` the one tensor ``[Q | K | V] (..., (H + 2·H_kv)·p)`` the kernel
    writes (GPT-2's ``c_attn`` layout; no copy).

    Triton plan: one augmented GEMM per section reads X once per output tile for the frozen
    GEMM and the down-projections whose up-projection touches the tile (Kernel-wise A_h, lite
    bases A_h W_k^h precomputed per call, shared A_s; packed into one >= 16-wide block) and
    adds the up-projections and biases in its epilogue before writing Q and V. Backward: one
    rank pass over dQ and dV (dZ, up-projection and bias gradients), dX as one GEMM over
    [dQ | dK | dV | dZ], and the token reduction dZᵀ X for the down-projections.
    """
    _validate.check_tensor("x", x, min_ndim=1)
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"n_heads must be a positive int, got {n_heads!r}")
    H = n_heads
    Hkv = n_kv_heads if n_kv_heads is not None else H
    _check_flag("fused_output", fused_output)
    if isinstance(Hkv, bool) or not isinstance(Hkv, int) or Hkv < 1 or H % Hkv != 0:
        raise ValueError(f"n_kv_heads={n_kv_heads!r} must be a positive int dividing "
                         f"n_heads={H}")
    d = x.shape[-1]
    _validate.check_tensor("w_q", w_q, ndim=2)
    if w_q.shape[0] % H != 0:
        raise ValueError(f"w_q has shape {tuple(w_q.shape)}: its {w_q.shape[0]} output rows do "
                         f"not split into n_heads={H} heads")
    p = w_q.shape[0] // H
    _check_linear("w_q", w_q, H * p, d, x)
    _check_linear("w_k", w_k, Hkv * p, d, x)
    _check_linear("w_v", w_v, Hkv * p, d, x)
    for name, b, n in (("b_q", b_q, H * p), ("b_k", b_k, Hkv * p), ("b_v", b_v, Hkv * p)):
        if b is not None:
            _validate.check_tensor(name, b, ndim=1)
            _validate.check_same("x", x, **{name: b})
            _validate.check_shape(name, b, (n,), "bias of the projection")
    for name, f, Hs in (("q", q, H), ("v", v, Hkv)):
        if f is not None:
            if not isinstance(f, HeadFactors):
                raise TypeError(f"{name} must be a kfused HeadFactors or None, got "
                                f"{type(f).__name__}")
            _check_factors(name, f, Hs, p, d, x)
    be = select_backend("headwise_qkv", backend, [x], impls=_IMPLS,
                        extra_unfit=_no_float64(x))
    if be == "reference":
        out = headwise_qkv_ref(x, w_q, w_k, w_v, b_q, b_k, b_v, n_heads=H, n_kv_heads=Hkv,
                               q=q, v=v)
        return torch.cat(out, dim=-1) if fused_output else out
    Y = _qkv_call(x, w_q, w_k, w_v, b_q, b_k, b_v, H, Hkv, p, q, v)
    if fused_output:
        return Y
    return tuple(Y.split([H * p, Hkv * p, Hkv * p], dim=-1))


def _qkv_call(x, w_q, w_k, w_v, b_q, b_k, b_v, H, Hkv, p, q, v, key=None):
    """Build the kernel-level factors and call the fused op; returns [Q | K | V] (..., N).

    key: ``(w_k, b_k, Hk)`` of the frozen key projection when it is not the op's own k
    section (single-projection use, where w_k / w_v are empty)."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    kw, kb, Hk = key if key is not None else (w_k, b_k, Hkv)
    qf, dcq, sq = _section(q, H, Hk, p, d, kw, kb, x.dtype)
    vf, dcv, sv = _section(v, Hkv, Hk, p, d, kw, kb, x.dtype)
    Y, _ = torch.ops.kfused.headwise_qkv_triton_fwd(
        x2, w_q, w_k, w_v, _fold_bias(b_q, dcq), b_k.contiguous() if b_k is not None else None,
        _fold_bias(b_v, dcv), *qf, *vf, p, sq, sv)
    return Y.reshape(*lead, Y.shape[-1])


def headwise_projection(x: torch.Tensor, weight: torch.Tensor,
                        bias: Optional[torch.Tensor] = None, *, n_heads: int,
                        factors: Optional[HeadFactors] = None,
                        w_k: Optional[torch.Tensor] = None, b_k: Optional[torch.Tensor] = None,
                        n_key_heads: Optional[int] = None,
                        backend: Optional[str] = None) -> torch.Tensor:
    """One adapted q or v projection, ``X Wᵀ + b + Δ`` (SPEC §2), fused like
    :func:`headwise_qkv` but for a single projection (the frozen GEMM and every
    down-projection in one pass over X, up-projections in the epilogue).

    x (..., d); weight (H·p, d) any strides; bias (H·p,) or None; factors for H heads;
    w_k (H_k·p, d), b_k: the frozen key projection, required when ``factors`` has a lite
    part (head h uses key head ``h // (H / H_k)``; ``n_key_heads`` defaults to
    ``w_k.shape[0] // p``). Returns (..., H·p).
    """
    _validate.check_tensor("x", x, min_ndim=1)
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"n_heads must be a positive int, got {n_heads!r}")
    H = n_heads
    d = x.shape[-1]
    _validate.check_tensor("weight", weight, ndim=2)
    if weight.shape[0] % H != 0:
        raise ValueError(f"weight has shape {tuple(weight.shape)}: its {weight.shape[0]} output "
                         f"rows do not split into n_heads={H} heads")
    p = weight.shape[0] // H
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
    be = select_backend("headwise_projection", backend, [x], impls=_IMPLS,
                        extra_unfit=_no_float64(x))
    if be == "reference":
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
                     key=key)


# ==========================================================================================
# Fused output projection


@torch.library.custom_op("kfused::headwise_oproj_triton_fwd", mutates_args=())
def _oproj_fwd(o: torch.Tensor, w_o: torch.Tensor, b_o: Optional[torch.Tensor],
               A: Optional[torch.Tensor], B: Optional[torch.Tensor],
               shared_A: Optional[torch.Tensor], shared_U: Optional[torch.Tensor],
               n_heads: int) -> Tuple[torch.Tensor, torch.Tensor]:
    return _tk().headwise_oproj_forward(o, w_o, b_o, A, B, shared_A, shared_U, n_heads)


@_oproj_fwd.register_fake
def _(o, w_o, b_o, A, B, shared_A, shared_U, n_heads):
    M = (A.shape[0] * A.shape[1] if A is not None else 0) + \
        (shared_A.shape[0] if shared_A is not None else 0)
    return o.new_empty(o.shape[0], w_o.shape[0]), o.new_empty(o.shape[0], M)


@torch.library.custom_op("kfused::headwise_oproj_triton_bwd", mutates_args=())
def _oproj_bwd(g: torch.Tensor, o: torch.Tensor, w_o: torch.Tensor, A: Optional[torch.Tensor],
               B: Optional[torch.Tensor], shared_A: Optional[torch.Tensor],
               shared_U: Optional[torch.Tensor], z: torch.Tensor, n_heads: int,
               need_do: bool, need_factors: bool) -> List[torch.Tensor]:
    dO, gr = _tk().headwise_oproj_backward(g, o, w_o, A, B, shared_A, shared_U, z, n_heads,
                                           need_do, need_factors)
    out = [dO if dO is not None else _empty(o)]
    for key in ("A", "Bw", "As", "Us", "db"):
        t = gr.get(key)
        out.append(t if t is not None else _empty(o))
    return out


@_oproj_bwd.register_fake
def _(g, o, w_o, A, B, shared_A, shared_U, z, n_heads, need_do, need_factors):
    hw = need_factors and A is not None
    sh = need_factors and shared_A is not None
    e = o.new_empty(0)
    return [torch.empty_like(o) if need_do else e,
            torch.empty_like(A) if hw else e, torch.empty_like(B) if hw else e,
            torch.empty_like(shared_A) if sh else e, torch.empty_like(shared_U) if sh else e,
            o.new_empty(w_o.shape[0], dtype=torch.float32) if (hw or sh) else e]


def _oproj_setup(ctx, inputs, output):
    o, w_o, b_o, A, B, sA, sU, H = inputs
    ctx.save_for_backward(o, w_o, A, B, sA, sU, output[1])
    ctx.H = H
    ctx.has_b = b_o is not None
    ctx.b_dtype = b_o.dtype if b_o is not None else None
    ctx.mark_non_differentiable(output[1])


def _oproj_backward(ctx, g, gz):
    o, w_o, A, B, sA, sU, z = ctx.saved_tensors
    n_o, n_w, n_b, nA, nB, nsA, nsU, _ = ctx.needs_input_grad
    g = g.contiguous()
    need_f = nA or nB or nsA or nsU or n_b
    dO, dA, dB, dsA, dsU, db = torch.ops.kfused.headwise_oproj_triton_bwd(
        g, o, w_o, A, B, sA, sU, z, ctx.H, n_o, need_f)
    dw = torch.matmul(g.t(), o).to(w_o.dtype) if n_w else None
    if n_b and ctx.has_b:
        db = (db if _opt(db) is not None else g.sum(0, dtype=torch.float32)).to(ctx.b_dtype)
    else:
        db = None
    return (dO if n_o else None, dw, db, _opt(dA) if nA else None, _opt(dB) if nB else None,
            _opt(dsA) if nsA else None, _opt(dsU) if nsU else None, None)


_oproj_fwd.register_autograd(_oproj_backward, setup_context=_oproj_setup)


def headwise_oproj(o: torch.Tensor, w_o: torch.Tensor, b_o: Optional[torch.Tensor] = None, *,
                   n_heads: int, wise_A: Optional[torch.Tensor] = None,
                   wise_B: Optional[torch.Tensor] = None, wise_c: Optional[torch.Tensor] = None,
                   shared_A: Optional[torch.Tensor] = None,
                   shared_B: Optional[torch.Tensor] = None, scale: float = 1.0,
                   backend: Optional[str] = None) -> torch.Tensor:
    """Fused output projection with the SPEC §2 updates of W_o (basis O).

    ``Y = O W_oᵀ + b_o + concat_h(O^h A_hᵀ) Bᵀ + c + scale · O A_sᵀ B_sᵀ``.

    Args:
        o: ``(..., H·p)`` concatenated head outputs.
        w_o: ``(d, H·p)`` nn.Linear layout, any strides (GPT-2 Conv1D: ``weight.t()``).
        b_o: ``(d,)`` or None.
        wise_A ``(H, r, p)``, wise_B ``(d, H·r)``, wise_c ``(d,)``: Kernel-wise on W_o (a
            rank-r update of each row block W_o^h).
        shared_A ``(r_s, H·p)``, shared_B ``(d, r_s)``, scale: the shared LoRA part.

    Triton plan: Z = O D_oᵀ (D_o: block-diagonal A_h and A_s; a thin GEMM, cuBLAS for 16-bit
    on a GPU), then Y = [O | Z]·[W_o | B]ᵀ + b as one two-segment GEMM. Backward: dZ = dY B,
    dO = [dY | dZ]·[W_o; D_o] (one GEMM), token reductions dYᵀ Z and dZᵀ O.
    """
    _validate.check_tensor("o", o, min_ndim=1)
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"n_heads must be a positive int, got {n_heads!r}")
    H = n_heads
    HP = o.shape[-1]
    if HP % H != 0:
        raise ValueError(f"o has shape {tuple(o.shape)}: its last dim {HP} does not split into "
                         f"n_heads={H} heads")
    p = HP // H
    _validate.check_tensor("w_o", w_o, ndim=2)
    for name, t, nd in (("b_o", b_o, 1), ("wise_A", wise_A, 3), ("wise_B", wise_B, 2),
                        ("wise_c", wise_c, 1), ("shared_A", shared_A, 2),
                        ("shared_B", shared_B, 2)):
        if t is not None:
            _validate.check_tensor(name, t, ndim=nd)
    _validate.check_same("o", o, w_o=w_o, b_o=b_o, wise_A=wise_A, wise_B=wise_B, wise_c=wise_c,
                         shared_A=shared_A, shared_B=shared_B)
    if w_o.shape[1] != HP:
        raise ValueError(f"w_o has shape {tuple(w_o.shape)}, expected (d_out, {HP})")
    dout = w_o.shape[0]
    if b_o is not None:
        _validate.check_shape("b_o", b_o, (dout,), "(d_out,)")
    if (wise_A is None) != (wise_B is None):
        raise ValueError("wise_A and wise_B must be given together")
    if wise_c is not None and wise_A is None:
        raise ValueError("wise_c needs wise_A and wise_B")
    if (shared_A is None) != (shared_B is None):
        raise ValueError("shared_A and shared_B must be given together")
    if wise_A is not None:
        _validate.check_tensor("wise_A", wise_A, ndim=3)
        r = wise_A.shape[1]
        _validate.check_shape("wise_A", wise_A, (H, r, p), "(H, r, p)")
        _validate.check_shape("wise_B", wise_B, (dout, H * r), "(d_out, H·r)")
        if wise_c is not None:
            _validate.check_shape("wise_c", wise_c, (dout,), "(d_out,)")
    _check_scale("scale", scale, o)
    if shared_A is not None:
        _validate.check_tensor("shared_A", shared_A, ndim=2)
        rs = shared_A.shape[0]
        _validate.check_shape("shared_A", shared_A, (rs, HP), "(r_s, H·p)")
        _validate.check_shape("shared_B", shared_B, (dout, rs), "(d_out, r_s)")
    be = select_backend("headwise_oproj", backend, [o], impls=_IMPLS,
                        extra_unfit=_no_float64(o))
    if be == "reference":
        return headwise_oproj_ref(o, w_o, b_o, n_heads=H, wise_A=wise_A, wise_B=wise_B,
                                  wise_c=wise_c, shared_A=shared_A, shared_B=shared_B,
                                  scale=scale)
    lead = o.shape[:-1]
    o2 = o.reshape(-1, HP).contiguous()
    b = _fold_bias(b_o, wise_c)
    sU = (shared_B.float() * scale).contiguous() if shared_A is not None else None
    Y, _ = torch.ops.kfused.headwise_oproj_triton_fwd(
        o2, w_o, b, wise_A.contiguous() if wise_A is not None else None,
        wise_B.contiguous() if wise_B is not None else None,
        shared_A.contiguous() if shared_A is not None else None, sU, H)
    return Y.reshape(*lead, dout)


# ==========================================================================================
# Cases for `kfused check` (registered from kfused/checks.py)


def check_cases(device: torch.device):
    """Every headwise kernel on a few odd shapes against the float64 reference (SPEC §4)."""
    from kfused.checks import CheckCase

    device = torch.device(device)
    g = torch.Generator().manual_seed(0)
    T = 1000 if device.type == "cuda" else 37
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    cases = []
    for H, Hkv, p in ((12, 12, 64), (8, 2, 80), (3, 1, 13)):
        d = H * p if device.type == "cuda" else min(H * p, 96)
        label = f"T={T} d={d} H={H} H_kv={Hkv} p={p}"
        q = dict(shared_A=r(4, d), shared_B=r(H * p, 4), wise_A=r(H, 3, d), wise_B=r(H, p, 3),
                 wise_c=r(H, p), lite_A=r(H, 2, p), lite_B=r(H, p, 2))
        v = dict(shared_A=r(2, d), shared_B=r(Hkv * p, 2), lite_A=r(Hkv, 5, p),
                 lite_B=r(Hkv, p, 5), lite_c=r(Hkv, p))
        inputs = dict(x=r(T, d), w_q=r(H * p, d) / d ** 0.5, w_k=r(Hkv * p, d) / d ** 0.5,
                      w_v=r(Hkv * p, d) / d ** 0.5, b_q=r(H * p), b_k=r(Hkv * p),
                      b_v=r(Hkv * p), **{f"q_{k}": t for k, t in q.items()},
                      **{f"v_{k}": t for k, t in v.items()})

        def qkv(backend, H=H, Hkv=Hkv):
            def fn(x, w_q, w_k, w_v, b_q, b_k, b_v, **kw):
                fq = HeadFactors(scale=0.5, **{k[2:]: t for k, t in kw.items() if k[0] == "q"})
                fv = HeadFactors(scale=0.5, **{k[2:]: t for k, t in kw.items() if k[0] == "v"})
                return headwise_qkv(x, w_q, w_k, w_v, b_q, b_k, b_v, n_heads=H, n_kv_heads=Hkv,
                                    q=fq, v=fv, backend=backend)
            return fn

        grads = [k for k in inputs if k.startswith(("x", "q_", "v_"))]
        cases.append(CheckCase("headwise_qkv", label, "triton", qkv("triton"), qkv("reference"),
                               inputs, grads))
        o_in = dict(o=r(T, H * p), w_o=r(d, H * p) / (H * p) ** 0.5, b_o=r(d),
                    wise_A=r(H, 2, p), wise_B=r(d, H * 2), wise_c=r(d), shared_A=r(3, H * p),
                    shared_B=r(d, 3))

        def oproj(backend, H=H):
            return lambda **kw: headwise_oproj(**kw, n_heads=H, scale=0.5, backend=backend)

        cases.append(CheckCase("headwise_oproj", label, "triton", oproj("triton"),
                               oproj("reference"), o_in,
                               ["o", "wise_A", "wise_B", "wise_c", "shared_A", "shared_B"]))
        lr_in = dict(basis=r(T, H, p), A=r(H, 3, p), B=r(H, p, 3), bias=r(H, p))

        def lowrank(backend):
            return lambda **kw: headwise_lowrank(**kw, per_head=True, backend=backend)

        for be in ("triton", "cuda"):
            cases.append(CheckCase("headwise_lowrank", label, be, lowrank(be),
                                   lowrank("reference"), lr_in))
    return cases
