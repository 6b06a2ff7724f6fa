"""``inducer_attention`` (docs/math.md §3): inducer attention and prefix tuning — torch.library ops
and the functional API.

``inducer_attention(q, k, v, ...)`` is flash-style attention over (batch, heads, n, p) tensors
with three optional additions, all O(n) memory on the Triton backend:

* an *inducer*: per query a virtual key ``p_k,i = q_i + tanh(q_i Ak + ak) Bk + ck`` whose logit
  ``s0_i = τ ⟨q_i, p_k,i⟩`` joins the softmax as one extra never-masked column with weight
  ``λ_i = sigmoid(s0_i − LSE_i)``; composition ``"add"`` (default, the released code's extended
  value scope) returns ``u_i = λ_i tanh(q_i W1 + b1)`` for the output projection, ``"gate"``
  returns ``(1 − λ_i) f_i + λ_i (tanh(q_i W1 + b1) W2 + b2)``;
* ``l`` learned prefix keys/values per head in front of the sequence (prefix tuning, never
  masked, part of ordinary attention ``f`` and of ``LSE``);
* masks: causal (bottom-right aligned), key padding (boolean mask and/or sequence lengths).

Layers: the attention core is the custom op ``kfused::inducer_attention_triton_fwd`` (flash
forward with the per-row inducer MLP in its prologue and epilogue: f, u, LSE, λ) whose autograd
calls ``kfused::inducer_attention_triton_bwd`` (the MLP gradients in a kernel of their own,
then the flash dQ and dK/dV kernels with ``D − dLSE``; docs/math.md §3). ``"gate"`` composes ``(1 − λ) f + u W2 + λ b2`` in
PyTorch (O(n·r·p), autograd).
"""

from __future__ import annotations

import math
import numbers
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from kfused import _validate, cuda
from kfused._memo import LastResult
from kfused.backends import select_backend
from kfused.ops._common import custom_op, kops, no_double_backward, register_autograd
from kfused.reference.inducer import check_seq_lens, inducer_attention_ref

OP_NAME = "inducer_attention"
COMPOSITIONS = ("add", "gate")


def _empty(like: Tensor) -> Tensor:
    return like.new_empty((0,), dtype=torch.float32)


# ------------------------------------------------------------------------------------------
# custom ops (Triton backend)


@custom_op("kfused::inducer_attention_triton_fwd")
def _triton_fwd(q: Tensor, k: Tensor, v: Tensor, Ak: Optional[Tensor], ak: Optional[Tensor],
                Bk: Optional[Tensor], ck: Optional[Tensor], W1: Optional[Tensor],
                b1: Optional[Tensor], prefix_k: Optional[Tensor], prefix_v: Optional[Tensor],
                key_mask: Optional[Tensor], causal: bool, scale: float, u_fp32: bool,
                save_lo: bool = False, cu_q: Optional[Tensor] = None,
                cu_k: Optional[Tensor] = None, max_q: int = 0,
                max_k: int = 0) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, u, lse, lam, stats, out_lo); the inducer MLP (Ak … b1, all or none) runs in the
    kernel; ``save_lo`` (a backward will follow): out_lo is the 16-bit output's rounding
    residue for the backward's D_i (empty otherwise). ``cu_q``/``cu_k`` (int32 cumulative
    lengths) and the longest lengths: a packed batch, q (total_q, H, p), per-row outputs
    (H, total_q)."""
    from kfused.triton_kernels.inducer_attention import inducer_attention_forward

    mlp = (Ak, ak, Bk, ck, W1, b1) if Ak is not None else None
    varlen = (cu_q, cu_k, max_q, max_k) if cu_q is not None else None
    return inducer_attention_forward(q, k, v, mlp, prefix_k, prefix_v, key_mask, causal, scale,
                                     torch.float32 if u_fp32 else None, save_lo, varlen)


def _row_shape(q: Tensor, packed: bool) -> Tuple[int, ...]:
    """Shape of the per-row outputs: (B, H, n_q), or (H, total_q) for a packed batch."""
    return (q.shape[1], q.shape[0]) if packed else tuple(q.shape[:3])


@_triton_fwd.register_fake
def _(q, k, v, Ak, ak, Bk, ck, W1, b1, prefix_k, prefix_v, key_mask, causal, scale, u_fp32,
      save_lo=False, cu_q=None, cu_k=None, max_q=0, max_k=0):
    rows = _row_shape(q, cu_q is not None)
    p = q.shape[-1]
    u_dtype = torch.float32 if u_fp32 else q.dtype
    out = q.new_empty(q.shape)
    lse = q.new_empty(rows, dtype=torch.float32)
    if Ak is not None:
        u = q.new_empty((*rows, W1.shape[2]), dtype=u_dtype)
        lam = q.new_empty((2, *rows), dtype=torch.float32)
    else:
        u = q.new_empty((0,), dtype=u_dtype)
        lam = _empty(q)
    stats = q.new_empty((2, *rows), dtype=torch.float32)
    lo = save_lo and q.dtype in (torch.float16, torch.bfloat16)
    out_lo = q.new_empty((*rows, p) if lo else (0,))
    return out, u, lse, lam, stats, out_lo


@custom_op("kfused::inducer_attention_triton_bwd")
def _triton_bwd(dout: Tensor, du: Optional[Tensor], dlam: Optional[Tensor],
                dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                lse: Tensor, stats: Tensor, lam: Tensor, Ak: Optional[Tensor],
                ak: Optional[Tensor], Bk: Optional[Tensor], ck: Optional[Tensor],
                W1: Optional[Tensor], b1: Optional[Tensor], prefix_k: Optional[Tensor],
                prefix_v: Optional[Tensor], key_mask: Optional[Tensor], causal: bool,
                scale: float, out_lo: Optional[Tensor] = None, cu_q: Optional[Tensor] = None,
                cu_k: Optional[Tensor] = None, max_q: int = 0,
                max_k: int = 0) -> List[Tensor]:
    """[dq, dk, dv, dAk, dak, dBk, dck, dW1, db1, dprefix_k, dprefix_v] (empty where absent)."""
    from kfused.triton_kernels.inducer_attention import inducer_attention_backward

    mlp = (Ak, ak, Bk, ck, W1, b1) if Ak is not None else None
    varlen = (cu_q, cu_k, max_q, max_k) if cu_q is not None else None
    dq, dk, dv, dmlp, dpk, dpv = inducer_attention_backward(
        dout, du, dlam, dlse, q, k, v, out, lse, stats, lam, mlp, prefix_k, prefix_v, key_mask,
        causal, scale, out_lo, varlen)
    dmlp = list(dmlp) if dmlp is not None else [_empty(q) for _ in range(6)]
    return [dq, dk, dv, *dmlp, dpk if dpk is not None else _empty(q),
            dpv if dpv is not None else _empty(q)]


@_triton_bwd.register_fake
def _(dout, du, dlam, dlse, q, k, v, out, lse, stats, lam, Ak, ak, Bk, ck, W1, b1, prefix_k,
      prefix_v, key_mask, causal, scale, out_lo=None, cu_q=None, cu_k=None, max_q=0, max_k=0):
    has_mlp = Ak is not None and lam.dim() > 1     # (2, *rows) with an inducer, even 0 rows
    has_prefix = prefix_k is not None and prefix_k.shape[1] > 0

    def like(t):
        return torch.empty_like(t, memory_format=torch.contiguous_format)

    mlp = [like(t) if has_mlp else _empty(q) for t in (Ak, ak, Bk, ck, W1, b1)]
    return [like(q), like(k), like(v), *mlp, like(prefix_k) if has_prefix else _empty(q),
            like(prefix_v) if has_prefix else _empty(q)]


def _setup_context(ctx, inputs, output):
    (q, k, v, Ak, ak, Bk, ck, W1, b1, prefix_k, prefix_v, key_mask, causal, scale,
     u_fp32, save_lo, cu_q, cu_k, max_q, max_k) = _all_fwd_inputs(inputs)
    out, u, lse, lam, stats, out_lo = output
    ctx.save_for_backward(q, k, v, out, lse, stats, lam, Ak, ak, Bk, ck, W1, b1, prefix_k,
                          prefix_v, key_mask, out_lo, cu_q, cu_k)
    ctx.has_mlp = Ak is not None
    ctx.causal = causal
    ctx.scale = scale
    ctx.max_qk = (max_q, max_k)
    # lse, lam, stats, out_lo are internal outputs (their gradients are almost always
    # absent): autograd would otherwise fill a zero tensor for each — out_lo is the size of
    # the output — and the backward would read the zero dLSE / dλ
    ctx.set_materialize_grads(False)


def _all_fwd_inputs(inputs):
    """The forward op's inputs with the trailing defaults filled in."""
    defaults = (False, None, None, 0, 0)           # save_lo, cu_q, cu_k, max_q, max_k
    return tuple(inputs) + defaults[len(inputs) - 15:]


def _backward(ctx, dout, du, dlse, dlam, dstats, dout_lo):
    (q, k, v, out, lse, stats, lam, Ak, ak, Bk, ck, W1, b1, prefix_k, prefix_v,
     key_mask, out_lo, cu_q, cu_k) = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    if not ctx.has_mlp:
        du = dlam = None
    grads = _triton_bwd(dout, du, dlam, dlse, q, k, v, out, lse, stats, lam, Ak, ak, Bk, ck,
                        W1, b1, prefix_k, prefix_v, key_mask, ctx.causal, ctx.scale, out_lo,
                        cu_q, cu_k, *ctx.max_qk)
    dq, dk, dv = grads[:3]
    dmlp = grads[3:9] if ctx.has_mlp else [None] * 6
    has_prefix = prefix_k is not None and prefix_k.shape[1] > 0
    return (dq, dk, dv, *dmlp, grads[9] if has_prefix else None,
            grads[10] if has_prefix else None, None, None, None, None, None, None, None,
            None, None)


register_autograd(_triton_fwd, _backward, setup_context=_setup_context)
register_autograd(_triton_bwd, no_double_backward("inducer_attention"))


# ------------------------------------------------------------------------------------------
# validation


def _check_param(name: str, t: Optional[Tensor], shape: Sequence[int], what: str,
                 q: Tensor) -> None:
    if t is None:
        raise ValueError(f"{name} is required ({what}, shape {tuple(shape)})")
    _validate.check_tensor(name, t)
    _validate.check_shape(name, t, shape, what)
    _validate.check_same("q", q, **{name: t})


def _check_heads(q: Tensor, k: Tensor, v: Tensor, head_dim: int) -> None:
    """k and v share a head count that divides q's (grouped-query attention) and q's head
    width (dimension ``head_dim``; heads are dimension 1 in both layouts)."""
    H, p = q.shape[1], q.shape[head_dim]
    if k.shape[1] != v.shape[1] or k.shape[1] < 1 or H % k.shape[1] != 0:
        raise ValueError(
            f"head counts do not fit: q has {H} heads (shape {tuple(q.shape)}), k "
            f"{k.shape[1]}, v {v.shape[1]}; k and v need the same head count, one that divides "
            f"q's (grouped-query attention)")
    if k.shape[head_dim] != p or v.shape[head_dim] != p:
        raise ValueError(f"head widths differ: q {p}, k {k.shape[head_dim]}, "
                         f"v {v.shape[head_dim]}")


def check_scale(scale) -> Optional[float]:
    """``scale`` (the softmax scale τ): None (1/√p) or a finite positive real number, returned
    as a float (a symbolic one under torch.compile passes as it is)."""
    if scale is None:
        return None
    if isinstance(scale, (torch.SymFloat, torch.SymInt)):
        return scale
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        hint = " (pass float(scale))" if isinstance(scale, Tensor) else ""
        raise TypeError(f"scale must be None or a real number (the softmax scale, default "
                        f"1/sqrt(head_dim)), got {type(scale).__name__} {scale!r}{hint}")
    value = float(scale)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"scale must be a finite positive number (the softmax scale, default "
                         f"1/sqrt(head_dim)), got {value!r}")
    return value


def check_causal(causal) -> bool:
    """``causal`` must be a bool (a string such as "no" would otherwise read as True)."""
    if isinstance(causal, torch.SymBool):
        return causal
    if isinstance(causal, bool) or (type(causal).__module__ == "numpy"
                                    and type(causal).__name__ in ("bool", "bool_")):
        return bool(causal)
    raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")


def _check_seq_lens_values(seq_lens: Tensor, n_k: int) -> None:
    """Every entry of seq_lens in [0, n_k] (ValueError naming the first bad one). Read only
    where that costs no device sync: CPU tensors, outside torch.compile tracing (the
    reference checks on every device). CUDA tensors are not read here — that would add a
    device-to-host sync to every call — and the kernels stay in bounds whatever they hold
    (Triton: the key mask ``j < seq_lens[b]``, so a count above n_k reads as n_k and a
    negative one as 0; the CUDA kernel clamps the lengths to [0, n_k] the same way)."""
    if seq_lens.device.type == "cpu":
        check_seq_lens(seq_lens, n_k)


def _validate_inputs(q, k, v, Ak, ak, Bk, ck, W1, b1, W2, b2, composition, key_padding_mask,
                     seq_lens, prefix_k, prefix_v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        _validate.check_tensor(name, t, ndim=4)
    _validate.check_same("q", q, k=k, v=v)
    B, H, n_q, p = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}; expected (batch, heads, n, head_dim) each")
    _check_heads(q, k, v, head_dim=3)
    if v.shape[2] != k.shape[2]:
        raise ValueError(f"k has {k.shape[2]} keys but v has {v.shape[2]} values")
    n_k = k.shape[2]
    if composition not in COMPOSITIONS:
        raise ValueError(f"composition must be one of {COMPOSITIONS}, got {composition!r}")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor):
            raise TypeError("key_padding_mask must be a torch.Tensor")
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(f"key_padding_mask must be a bool tensor (True = real key), got "
                            f"dtype {key_padding_mask.dtype}")
        _validate.check_shape("key_padding_mask", key_padding_mask, (B, n_k),
                              "(batch, n_keys), True = real key")
        if key_padding_mask.device != q.device:
            raise ValueError(f"key_padding_mask is on {key_padding_mask.device} but q is on "
                             f"{q.device}")
    if seq_lens is not None:
        if not isinstance(seq_lens, Tensor):
            raise TypeError("seq_lens must be a torch.Tensor")
        if seq_lens.is_floating_point() or seq_lens.dtype == torch.bool:
            raise TypeError(f"seq_lens must be an integer tensor, got dtype {seq_lens.dtype}")
        _validate.check_shape("seq_lens", seq_lens, (B,), "one key count per batch element")
        if seq_lens.device != q.device:
            raise ValueError(f"seq_lens is on {seq_lens.device} but q is on {q.device}")
        _check_seq_lens_values(seq_lens, n_k)
    if (prefix_k is None) != (prefix_v is None):
        raise ValueError("prefix_k and prefix_v must be given together")
    if prefix_k is not None:
        for name, t in (("prefix_k", prefix_k), ("prefix_v", prefix_v)):
            _validate.check_tensor(name, t, ndim=3)
            _validate.check_same("q", q, **{name: t})
        l = prefix_k.shape[1]
        _validate.check_shape("prefix_k", prefix_k, (H, l, p), "(heads, prefix_len, head_dim)")
        _validate.check_shape("prefix_v", prefix_v, (H, l, p), "(heads, prefix_len, head_dim)")
    key_side = (Ak, ak, Bk, ck)
    has_inducer = any(t is not None for t in key_side + (W1, b1))
    if has_inducer:
        if Ak is None:
            raise ValueError("Ak is required when any inducer parameter is given")
        _validate.check_tensor("Ak", Ak, ndim=3)
        L = Ak.shape[2]
        _check_param("Ak", Ak, (H, p, L), "(heads, head_dim, key_bottleneck)", q)
        _check_param("ak", ak, (H, L), "(heads, key_bottleneck)", q)
        _check_param("Bk", Bk, (H, L, p), "(heads, key_bottleneck, head_dim)", q)
        _check_param("ck", ck, (H, p), "(heads, head_dim)", q)
        if W1 is None:
            raise ValueError("W1 is required when the inducer is on (heads, head_dim, r)")
        _validate.check_tensor("W1", W1, ndim=3)
        r = W1.shape[2]
        _check_param("W1", W1, (H, p, r), "(heads, head_dim, value_bottleneck)", q)
        _check_param("b1", b1, (H, r), "(heads, value_bottleneck)", q)
        if composition == "gate":
            _check_param("W2", W2, (H, r, p), "'gate': (heads, value_bottleneck, head_dim)", q)
            _check_param("b2", b2, (H, p), "'gate': (heads, head_dim)", q)
        elif W2 is not None or b2 is not None:
            raise ValueError(
                "composition 'add' maps u to the output space outside the attention: pass W2 "
                "(heads, r, d) and b2 (d,) to inducer_output_projection, not to "
                "inducer_attention")
    elif W2 is not None or b2 is not None:
        raise ValueError("W2/b2 given without the inducer parameters Ak, ak, Bk, ck, W1, b1")
    return has_inducer


def _triton_unfit(p: int, dtype: torch.dtype):
    def unfit(name: str) -> Optional[str]:
        if name != "triton":
            return None
        if dtype == torch.float64:  # the CPU interpreter admits float64 (kfused.backends)
            return ("the Triton inducer kernels compute in float32 (their float64 results "
                    "would carry float32 error); float64 runs on the reference backend")
        # asked only once Triton is known to be importable
        from kfused.triton_kernels.inducer_attention import SUPPORTED_HEAD_DIMS

        if p not in SUPPORTED_HEAD_DIMS:
            return (f"head width {p} is not supported by the Triton kernel "
                    f"(supported: {SUPPORTED_HEAD_DIMS})")
        return None
    return unfit


def _combined_key_mask(key_padding_mask: Optional[Tensor], seq_lens: Optional[Tensor],
                       n_k: int, device) -> Optional[Tensor]:
    mask = key_padding_mask
    if seq_lens is not None:
        by_len = torch.arange(n_k, device=device)[None, :] < seq_lens[:, None]
        mask = by_len if mask is None else mask & by_len
    return mask


# ------------------------------------------------------------------------------------------
# CUDA C++ extension: forward only (the inference path: prefill and KV-cache decode)


@custom_op("kfused::inducer_attention_cuda_fwd")
def _cuda_fwd(q: Tensor, k: Tensor, v: Tensor, s0: Optional[Tensor], prefix_k: Optional[Tensor],
              prefix_v: Optional[Tensor], key_lengths: Optional[Tensor], causal: bool,
              Ak: Optional[Tensor], ak: Optional[Tensor], Bk: Optional[Tensor],
              ck: Optional[Tensor], W1: Optional[Tensor], b1: Optional[Tensor],
              u_float: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(f, lse, λ, u) from the extension: the virtual key's logit s0 given, or (16-bit) the
    inducer MLP weights, from which the kernel computes s0 and u = λ tanh(q W1 + b1) itself
    (u float32 when ``u_float``, else q's dtype; empty without the MLP)."""
    ext = cuda.require("inducer_attention")
    f, lse, lam, u = ext.inducer_attention_fwd(q, k, v, s0, prefix_k, prefix_v, key_lengths,
                                               causal, Ak, ak, Bk, ck, W1, b1, u_float)
    return f, lse, lam, u


@_cuda_fwd.register_fake
def _(q, k, v, s0, prefix_k, prefix_v, key_lengths, causal, Ak, ak, Bk, ck, W1, b1, u_float):
    B, H, n_q, _ = q.shape
    stat = q.new_empty(B, H, n_q, dtype=torch.float32)
    u = (q.new_empty(B, H, n_q, W1.shape[-1], dtype=torch.float32 if u_float else q.dtype)
         if W1 is not None else q.new_empty(0))
    return torch.empty_like(q), stat, torch.empty_like(stat), u


def regime(n_q: int) -> str:
    """The regime a call is in for measured backend preferences (kfused.backends
    .measured_order): "decode" for few queries against a KV cache (n_q <= 16, the split-KV
    schedules of both kernels), else "prefill"."""
    return "decode" if n_q <= 16 else "prefill"


# csrc/inducer/inducer.cuh kMlpMaxCols: the in-kernel MLP's [Ak | W1 | Bkᵀ | ck] columns
CUDA_MLP_MAX_COLS = 64


def _cuda_unfit(q: Tensor, k: Tensor, key_padding_mask, scale: float, tensors,
                mlp_cols: int = 0):
    """The CUDA kernel is the inference path: no autograd, sequence lengths rather than a
    boolean mask, the default softmax scale; its in-kernel MLP (16-bit) takes 2L + r + 1 =
    ``mlp_cols`` <= CUDA_MLP_MAX_COLS. Grouped-query k/v are fine (it packs a kv head's
    query heads into one decode block)."""
    def unfit(name: str) -> Optional[str]:
        if name != "cuda":
            return None
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return ("the CUDA inducer kernel is forward-only (inference); train with the "
                    "triton backend or run under torch.no_grad()")
        if key_padding_mask is not None:
            return "the CUDA inducer kernel takes seq_lens, not a boolean key_padding_mask"
        if abs(scale - q.shape[-1] ** -0.5) > 1e-12:
            return "the CUDA inducer kernel uses the default scale 1/sqrt(head_dim)"
        if q.dtype != torch.float32 and mlp_cols > CUDA_MLP_MAX_COLS:
            return (f"the CUDA inducer kernel's MLP takes 2L + r + 1 <= {CUDA_MLP_MAX_COLS} "
                    f"columns, got {mlp_cols}")
        return None
    return unfit


# ------------------------------------------------------------------------------------------
# public API


def inducer_attention(
    q: Tensor, k: Tensor, v: Tensor,
    Ak: Optional[Tensor] = None, ak: Optional[Tensor] = None,
    Bk: Optional[Tensor] = None, ck: Optional[Tensor] = None,
    W1: Optional[Tensor] = None, b1: Optional[Tensor] = None,
    W2: Optional[Tensor] = None, b2: Optional[Tensor] = None,
    *, composition: str = "add", causal: bool = False,
    key_padding_mask: Optional[Tensor] = None, seq_lens: Optional[Tensor] = None,
    prefix_k: Optional[Tensor] = None, prefix_v: Optional[Tensor] = None,
    scale: Optional[float] = None, backend: Optional[str] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Inducer attention with optional prefix tuning (docs/math.md §3). Returns ``(out, u)``.

    Args (``B`` batch, ``H`` heads, ``p`` head width, ``L``/``r`` key/value bottlenecks):
        q: (B, H, n_q, p); k, v: (B, H_kv, n_k, p), H_kv dividing H (grouped-query
            attention: query head h reads kv head h // (H / H_kv)). One floating dtype.
        Ak (H, p, L), ak (H, L), Bk (H, L, p), ck (H, p): key-side MLP of the virtual key.
        W1 (H, p, r), b1 (H, r): value-side bottleneck.
        W2 (H, r, p), b2 (H, p): ``"gate"`` only (for ``"add"`` the output-space ``W2``
            (H, r, d), ``b2`` (d,) belong to :func:`inducer_output_projection`).
        composition: ``"add"`` or ``"gate"``.
        causal: query i sees keys j <= i + n_k − n_q (bottom-right; SDPA's is_causal when
            n_q == n_k). The virtual column and the prefix are never masked.
        key_padding_mask: (B, n_k) bool, True = real key. seq_lens: (B,) int, keys j < len
            are real. Both may be given (intersection).
        prefix_k, prefix_v: (H, l, p) prefix keys/values shared over the batch; l = 0 is none.
        scale: softmax scale τ, default 1/√p.
        backend: "auto" | "triton" | "cuda" | "reference" (default from ``KFUSED_BACKEND``).
            "cuda" is the CUDA C++ inference kernel (no autograd; seq_lens masks only;
            grouped-query k/v too); "auto" prefers Triton, unless backend preferences measured
            on this GPU model (``kfused bench inducer --write-prefs``) rank CUDA first for
            the call's regime ("prefill" / "decode").

    Returns:
        no inducer: ``(f, None)``, f (B, H, n_q, p) ordinary (prefix-)attention;
        ``"add"``: ``(f, u)``, u = λ · tanh(q W1 + b1) (B, H, n_q, r) in q's dtype;
        ``"gate"``: ``((1 − λ) f + λ (tanh(q W1 + b1) W2 + b2), None)``.
        A row with no visible key (and no prefix) has f = 0 and λ = 1, never NaN.
    """
    has_inducer = _validate_inputs(q, k, v, Ak, ak, Bk, ck, W1, b1, W2, b2, composition,
                                   key_padding_mask, seq_lens, prefix_k, prefix_v)
    causal = check_causal(causal)
    scale = check_scale(scale)
    p = q.shape[-1]
    if scale is None:
        scale = p ** -0.5
    tensors = [t for t in (q, k, v, Ak, ak, Bk, ck, W1, b1, W2, b2, prefix_k, prefix_v)
               if t is not None]
    tri_unfit = _triton_unfit(p, q.dtype)
    cu_unfit = _cuda_unfit(q, k, key_padding_mask, float(scale), tensors,
                           2 * Ak.shape[-1] + W1.shape[-1] + 1 if has_inducer else 0)
    chosen = select_backend(OP_NAME, backend, tensors, impls=("triton", "cuda"),
                            extra_unfit=lambda name: tri_unfit(name) or cu_unfit(name),
                            regime=regime(q.shape[2]))
    if chosen == "reference":
        return inducer_attention_ref(
            q, k, v, Ak, ak, Bk, ck, W1, b1, W2, b2, composition=composition, causal=causal,
            key_padding_mask=key_padding_mask, seq_lens=seq_lens, prefix_k=prefix_k,
            prefix_v=prefix_v, scale=scale)

    if prefix_k is not None and prefix_k.shape[1] == 0:
        prefix_k = prefix_v = None
    if chosen == "cuda":
        return _cuda_inference(q, k, v, Ak, ak, Bk, ck, W1, b1, W2, b2, composition, causal,
                               seq_lens, prefix_k, prefix_v, float(scale), has_inducer)
    key_mask = _combined_key_mask(key_padding_mask, seq_lens, k.shape[2], q.device)
    # the 16-bit output's rounding residue is kept only when a backward will follow
    save_lo = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if not has_inducer:
        f = _triton_fwd(q, k, v, None, None, None, None, None, None, prefix_k, prefix_v,
                        key_mask, bool(causal), float(scale), False, save_lo)[0]
        return f, None
    # The inducer MLP (s0, λ and u = λ tanh(q W1 + b1)) runs inside the kernel, in float32
    # (see kfused/triton_kernels/inducer_attention.py); "gate" composes f, λ and u in one precision
    # level above the inputs: (1 − λ) f + λ (tanh(q W1 + b1) W2 + b2) = (1 − λ) f + u W2 + λ b2.
    gate = composition == "gate"
    f, u, _, lam, _, _ = _triton_fwd(q, k, v, Ak, ak, Bk, ck, W1, b1, prefix_k, prefix_v,
                                     key_mask, bool(causal), float(scale), gate, save_lo)
    if not gate:
        return f, u
    return _gate_compose(f, u, lam, W2, b2), None


def _gate_compose(f: Tensor, u: Tensor, lam: Tensor, W2: Tensor, b2: Tensor) -> Tensor:
    """"gate": (1 − λ) f + u W2 + λ b2 in one precision level above f's, from f (B, H, n, p),
    u = λ tanh(q W1 + b1) (B, H, n, r) and lam = (λ, 1 − λ) (2, B, H, n)."""
    up = torch.float64 if f.dtype == torch.float32 else torch.float32
    lam, one_minus_lam = lam.unsqueeze(-1).to(up).unbind(0)   # λ and 1 − λ, each accurate
    pv = torch.matmul(u.to(up), W2.to(up)) + lam * b2.to(up)[:, None, :]
    return (one_minus_lam * f.to(up) + pv).to(f.dtype)


def _inducer_mlp_f32(qf: Tensor, Ak, ak, Bk, ck, W1, b1, scale: float):
    """The key logit s0 = τ⟨q, q + tanh(q Ak + ak) Bk + ck⟩ (B, H, n) and the value hidden
    tanh(q W1 + b1) (B, H, n, r) from float32 q in three passes over it (the docs/math.md §3
    formulas regrouped: ⟨q, h Bk⟩ = Σ_l h_l ⟨q, Bk_l⟩): the cast, one matmul against
    [Ak | W1 | Bkᵀ | ck], one ‖q‖², and the small (n × (2L + r + 1)) rest (the reference's
    formulas made ~15 float32 passes over q)."""
    up = torch.float32
    L, r = Ak.shape[-1], W1.shape[-1]
    cols = torch.cat([Ak.to(up), W1.to(up), Bk.to(up).transpose(-1, -2),
                      ck.to(up).unsqueeze(-1)], dim=-1)                 # (H, p, 2L + r + 1)
    proj = torch.matmul(qf, cols)
    hk = torch.tanh(proj[..., :L] + ak.to(up)[:, None, :])
    hidden = torch.tanh(proj[..., L:L + r] + b1.to(up)[:, None, :])
    qq = torch.linalg.vector_norm(qf, dim=-1).square()                # one read of q
    s0 = scale * (qq + (hk * proj[..., L + r:2 * L + r]).sum(-1) + proj[..., -1])
    return s0, hidden


def _cuda_inference(q, k, v, Ak, ak, Bk, ck, W1, b1, W2, b2, composition, causal, seq_lens,
                    prefix_k, prefix_v, scale, has_inducer, kernel=None):
    """The CUDA C++ path around the extension's flash kernel (``kernel``:
    kfused::inducer_attention_cuda_fwd; tests and the performance model pass a stand-in to
    check and cost the torch work around it). float16 / bfloat16: the inducer MLP runs inside
    the kernel (s0 from the q tile it holds, u = λ tanh(q W1 + b1) in its epilogue; "gate"
    adds (1 − λ) f + u W2 + λ b2 here in float32). float32 (the CUDA-core kernel): s0 and
    tanh(q W1 + b1) from :func:`_inducer_mlp_f32` here, λ from the kernel."""
    kernel = kernel or kops.inducer_attention_cuda_fwd
    up = torch.float32
    if seq_lens is not None and seq_lens.dtype not in (torch.int32, torch.int64):
        seq_lens = seq_lens.to(torch.int32)     # the extension takes int32 / int64 lengths
    pk = prefix_k.contiguous() if prefix_k is not None else None
    pv = prefix_v.contiguous() if prefix_v is not None else None
    gate = composition == "gate"
    if has_inducer and q.dtype != up:
        mlp = tuple(t.contiguous() for t in (Ak, ak, Bk, ck, W1, b1))
        f, _, lam, u = kernel(q, k, v, None, pk, pv, seq_lens, bool(causal), *mlp, gate)
        if not gate:
            return f, u
        lam = lam.unsqueeze(-1)
        return ((1.0 - lam) * f.to(up) + torch.matmul(u, W2.to(up))
                + lam * b2.to(up)[:, None, :]).to(q.dtype), None
    hidden = None
    if has_inducer:
        s0, hidden = _inducer_mlp_f32(q.to(up), Ak, ak, Bk, ck, W1, b1, scale)
    else:
        s0 = q.new_zeros(q.shape[:3], dtype=up)
    f, _, lam, _ = kernel(q, k, v, s0, pk, pv, seq_lens, bool(causal), *([None] * 6), False)
    if not has_inducer:
        return f, None
    lam = lam.unsqueeze(-1)
    if not gate:
        return f, (lam * hidden).to(q.dtype)
    pvh = torch.matmul(hidden, W2.to(up)) + b2.to(up)[:, None, :]
    return ((1.0 - lam) * f.to(up) + lam * pvh).to(q.dtype), None


# ------------------------------------------------------------------------------------------
# packed variable-length batches


_host_values = LastResult()


def host_values(t: Tensor) -> list:
    """``t.tolist()``, remembered for the last tensor asked (same object, unchanged since:
    version counter, data pointer, shape; :class:`kfused._memo.LastResult`): every layer of
    a packed forward passes the same cumulative lengths, and only the first call pays the
    device-to-host copy. Inference tensors are read on every call. A write that bypasses the
    version counter (``t.data[i] = x``, through ``t.numpy()``) is not seen: the values are
    stale, while the kernels read the tensor itself and stay in bounds whatever it holds."""
    return _host_values((t,), t.tolist)


def _check_cu_seqlens(name: str, cu: Tensor, total: int, total_name: str, q: Tensor) -> list:
    """Validate cumulative sequence lengths; returns them as a Python list."""
    if not isinstance(cu, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of cumulative sequence lengths, got "
                        f"{type(cu).__name__}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be an int32 or int64 tensor, got dtype {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with n_sequences + 1 >= 2 entries "
                         f"([0, len_0, len_0 + len_1, ...]), got shape {tuple(cu.shape)}")
    if cu.device != q.device:
        raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")
    vals = host_values(cu)
    if vals[0] != 0 or any(b < a for a, b in zip(vals, vals[1:])) or vals[-1] != total:
        raise ValueError(f"{name} must start at 0, never decrease and end at {total_name} = "
                         f"{total}; got {vals if len(vals) <= 12 else vals[:6] + ['...'] + vals[-3:]}")
    return vals


def _max_len(name: str, given: Optional[int], vals: list) -> int:
    longest = max(b - a for a, b in zip(vals, vals[1:]))
    if given is None:
        return longest
    if isinstance(given, bool) or not isinstance(given, int):
        raise TypeError(f"{name} must be an int, got {type(given).__name__}")
    if given < longest:
        raise ValueError(f"{name} = {given} is shorter than the longest sequence ({longest})")
    return given


def inducer_attention_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
    cu_seqlens_k: Optional[Tensor] = None, max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    Ak: Optional[Tensor] = None, ak: Optional[Tensor] = None,
    Bk: Optional[Tensor] = None, ck: Optional[Tensor] = None,
    W1: Optional[Tensor] = None, b1: Optional[Tensor] = None,
    W2: Optional[Tensor] = None, b2: Optional[Tensor] = None,
    *, composition: str = "add", causal: bool = False,
    prefix_k: Optional[Tensor] = None, prefix_v: Optional[Tensor] = None,
    scale: Optional[float] = None, backend: Optional[str] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Inducer attention over a packed batch of variable-length sequences (flash-attention's
    varlen layout): no padding is stored or computed. Returns ``(out, u)``.

    Args:
        q: (total_q, H, p), the sequences' queries one after another; k, v: (total_k, H_kv, p).
        cu_seqlens_q: (n_seq + 1,) int32/int64 cumulative lengths ``[0, n_0, n_0 + n_1, …]``:
            sequence b is ``q[cu[b]:cu[b+1]]``. cu_seqlens_k: the same for k/v (default:
            cu_seqlens_q, self-attention).
        max_seqlen_q, max_seqlen_k: the longest lengths (computed when None; a smaller value
            than the true longest is an error).
        Everything else as in :func:`inducer_attention`: the inducer and prefix act per
        sequence, ``causal`` is bottom-right aligned within each sequence; no key masks (the
        lengths are the mask). Sequences attend only to themselves.

    Returns ``out`` (total_q, H, p) and, for ``"add"``, ``u`` (total_q, H, r) (a view in the
    kernels' row layout), else None. Backends: "triton" and "reference"; the lengths are
    read on the host to check them and size the grid, once per tensor: the values are
    remembered for the last cumulative-lengths tensor seen (same object, same version
    counter), so the layers of one forward share one device-to-host copy.

    Changing the lengths in place in a way that bypasses the version counter (through
    ``cu.data``, ``cu.numpy()`` or another alias the autograd engine does not track) is not
    seen by that cache: the next call checks and sizes the grid from the old values and the
    result is undefined (not an error). Modify lengths with ordinary in-place ops, or pass a
    new tensor. Whatever the tensor holds, the kernels never touch memory outside q, k, v
    and their outputs: every sequence span is clamped to the tensors' token counts.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _validate.check_tensor(name, t, ndim=3)
    _validate.check_same("q", q, k=k, v=v)
    total_q, H, p = q.shape
    total_k = k.shape[0]
    if v.shape[0] != total_k:
        raise ValueError(f"k has {total_k} tokens but v has {v.shape[0]}; expected (total_k, "
                         f"kv_heads, head_dim) each")
    _check_heads(q, k, v, head_dim=2)
    cq = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, "total_q", q)
    if cu_seqlens_k is None:
        if total_k != total_q:
            raise ValueError(f"k has {total_k} tokens but q has {total_q}: pass cu_seqlens_k "
                             f"when keys and queries are packed differently")
        cu_seqlens_k, ckv = cu_seqlens_q, cq
    else:
        ckv = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, "total_k", q)
        if cu_seqlens_k.numel() != cu_seqlens_q.numel():
            raise ValueError(f"cu_seqlens_q describes {cu_seqlens_q.numel() - 1} sequences but "
                             f"cu_seqlens_k {cu_seqlens_k.numel() - 1}")
    max_q = _max_len("max_seqlen_q", max_seqlen_q, cq)
    max_k = _max_len("max_seqlen_k", max_seqlen_k, ckv)
    # the per-tensor checks of the batched op, on (1, heads, total, p) views
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    has_inducer = _validate_inputs(q4, k4, v4, Ak, ak, Bk, ck, W1, b1, W2, b2, composition,
                                   None, None, prefix_k, prefix_v)
    causal = check_causal(causal)
    scale = check_scale(scale)
    if scale is None:
        scale = p ** -0.5
    tensors = [t for t in (q, k, v, Ak, ak, Bk, ck, W1, b1, W2, b2, prefix_k, prefix_v)
               if t is not None]
    chosen = select_backend(OP_NAME, backend, tensors, impls=("triton",),
                            extra_unfit=_triton_unfit(p, q.dtype))
    if chosen == "reference":
        from kfused.reference.inducer import inducer_attention_varlen_ref

        return inducer_attention_varlen_ref(
            q, k, v, cu_seqlens_q, cu_seqlens_k, Ak, ak, Bk, ck, W1, b1, W2, b2,
            composition=composition, causal=causal, prefix_k=prefix_k, prefix_v=prefix_v,
            scale=scale)
    if prefix_k is not None and prefix_k.shape[1] == 0:
        prefix_k = prefix_v = None
    cu_q = cu_seqlens_q.to(torch.int32)
    cu_k = cu_q if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k.to(torch.int32)
    save_lo = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    mlp = (Ak, ak, Bk, ck, W1, b1) if has_inducer else (None,) * 6
    gate = has_inducer and composition == "gate"
    f, u, _, lam, _, _ = _triton_fwd(q, k, v, *mlp, prefix_k, prefix_v, None, bool(causal),
                                     float(scale), gate, save_lo, cu_q, cu_k, max_q, max_k)
    if not has_inducer:
        return f, None
    if not gate:
        return f, u.transpose(0, 1)             # (H, total_q, r) -> (total_q, H, r)
    # the batched composition on (1, H, total_q, ·) views of the packed rows
    out = _gate_compose(f.transpose(0, 1)[None], u[None], lam[:, None], W2, b2)
    return out[0].transpose(0, 1), None
