"""Inducer-tuning and prefix-tuning adapters (docs/math.md §3): parameters only; math in kfused.ops.

``InducerAttention(num_heads, head_dim, d_model=..., key_bottleneck=L, value_bottleneck=r,
composition="add"|"gate", prefix_len=l, inducer=True, init="paper"|"zero")`` owns

    Ak (H, p, L), ak (H, L), Bk (H, L, p), ck (H, p)     key-side MLP (virtual key)
    W1 (H, p, r), b1 (H, r)                               value-side bottleneck
    W2 (H, r, d), b2 (d,)    for "add" (output space, joins the output projection's GEMM)
    W2 (H, r, p), b2 (H, p)  for "gate" (head space)
    prefix_k, prefix_v (H, l, p)                          prefix tuning, when prefix_len > 0

``forward(q, k, v, ...)`` on (B, H, n, p) tensors returns ``(out, u)`` exactly as
:func:`kfused.ops.inducer_attention.inducer_attention`; :meth:`output_projection` folds ``u`` into the
frozen output projection as one GEMM over ``[f | u]``.

Combining with Q-LoRA / per-head low-rank modules: the adapter consumes the query *as the
attention layer produced it*, so a low-rank module wrapping the q projection composes with no
change; for updates defined in head space, set ``query_hook`` to a callable
``q (B, H, n, p) -> q'`` that is applied before attention (and before the inducer MLP).
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import Tensor, nn

from kfused import _validate
from kfused.modules._init import check_init, paper_
from kfused.modules._linear import autocast_input, is_conv1d
from kfused.ops.inducer_attention import (COMPOSITIONS, inducer_attention,
                                          inducer_attention_varlen)
from kfused.ops.inducer_output_projection import inducer_output_projection

LAYOUTS = ("linear", "conv1d")


class InducerAttention(nn.Module):
    """Inducer attention (+ optional prefix tuning) adapter for one attention layer."""

    def __init__(self, num_heads: int, head_dim: int, *, d_model: Optional[int] = None,
                 key_bottleneck: int = 4, value_bottleneck: int = 4, composition: str = "add",
                 prefix_len: int = 0, inducer: bool = True, init: str = "paper",
                 device=None, dtype=None):
        super().__init__()
        if composition not in COMPOSITIONS:
            raise ValueError(f"composition must be one of {COMPOSITIONS}, got {composition!r}")
        check_init(init, self.inits_for(inducer, prefix_len),
                   f"InducerAttention(inducer={bool(inducer)}, prefix_len={prefix_len})")
        for name, value in (("num_heads", num_heads), ("head_dim", head_dim),
                            ("key_bottleneck", key_bottleneck),
                            ("value_bottleneck", value_bottleneck), ("prefix_len", prefix_len),
                            ("d_model", 1 if d_model is None else d_model)):
            if not _validate.is_int(value):  # a float such as 2.5 failed inside torch.empty
                raise TypeError(f"InducerAttention: {name} must be an int, got "
                                f"{type(value).__name__} {value!r}")
        if num_heads < 1 or head_dim < 1:
            raise ValueError(f"num_heads and head_dim must be >= 1, got {num_heads}, {head_dim}")
        if d_model is not None and d_model < 1:
            raise ValueError(f"d_model must be >= 1, got {d_model}")
        if prefix_len < 0:
            raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
        if inducer and (key_bottleneck < 1 or value_bottleneck < 1):
            raise ValueError("key_bottleneck and value_bottleneck must be >= 1 with the inducer")
        H, p = num_heads, head_dim
        d = d_model if d_model is not None else H * p
        self.num_heads, self.head_dim, self.d_model = H, p, d
        self.composition, self.init, self.inducer = composition, init, bool(inducer)
        self.key_bottleneck, self.value_bottleneck = key_bottleneck, value_bottleneck
        self.prefix_len = prefix_len
        self.query_hook: Optional[Callable[[Tensor], Tensor]] = None
        fk = dict(device=device, dtype=dtype)
        if self.inducer:
            L, r = key_bottleneck, value_bottleneck
            self.Ak = nn.Parameter(torch.empty(H, p, L, **fk))
            self.ak = nn.Parameter(torch.empty(H, L, **fk))
            self.Bk = nn.Parameter(torch.empty(H, L, p, **fk))
            self.ck = nn.Parameter(torch.empty(H, p, **fk))
            self.W1 = nn.Parameter(torch.empty(H, p, r, **fk))
            self.b1 = nn.Parameter(torch.empty(H, r, **fk))
            if composition == "add":
                self.W2 = nn.Parameter(torch.empty(H, r, d, **fk))
                self.b2 = nn.Parameter(torch.empty(d, **fk))
            else:
                self.W2 = nn.Parameter(torch.empty(H, r, p, **fk))
                self.b2 = nn.Parameter(torch.empty(H, p, **fk))
        if prefix_len > 0:
            self.prefix_k = nn.Parameter(torch.empty(H, prefix_len, p, **fk))
            self.prefix_v = nn.Parameter(torch.empty(H, prefix_len, p, **fk))
        self.reset_parameters()

    @staticmethod
    def inits_for(inducer: bool, prefix_len: int) -> Tuple[str, ...]:
        """The init values this adapter can honour: "zero" needs the inducer and no prefix
        (prefix columns take softmax weight from step 0, so there is no exact start)."""
        return ("zero", "paper") if inducer and prefix_len == 0 else ("paper",)

    def reset_parameters(self) -> None:
        """init="paper": fmod(randn, 2)·0.01 for every tensor (u ≈ 0 at the start);
        init="zero": the same, then W2 = b2 = 0, so the adapted layer starts exactly at the
        frozen one."""
        for name in ("Ak", "ak", "Bk", "ck", "W1", "b1", "W2", "b2", "prefix_k", "prefix_v"):
            paper_(getattr(self, name, None))
        if self.inducer and self.init == "zero":
            with torch.no_grad():
                self.W2.zero_()
                self.b2.zero_()

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, head_dim={self.head_dim}, d_model={self.d_model}, "
                f"inducer={self.inducer}, L={self.key_bottleneck}, r={self.value_bottleneck}, "
                f"composition={self.composition!r}, prefix_len={self.prefix_len}, "
                f"init={self.init!r}")

    def _p(self, name: str, dtype: torch.dtype) -> Optional[Tensor]:
        t = getattr(self, name, None)
        return None if t is None else t.to(dtype)

    def _check_heads(self, name: str, t, *, packed: bool = False) -> None:
        """``t`` (batch, heads, n, width), or packed (total, heads, width), with this
        adapter's head count and head width: a mismatch is named on the input and the
        module's configuration, not on whichever parameter shape disagrees first."""
        _validate.check_tensor(name, t, ndim=3 if packed else 4)
        what = "(total, heads, head_dim)" if packed else "(batch, heads, n, head_dim)"
        if t.shape[1] != self.num_heads:
            raise ValueError(f"{name} has {t.shape[1]} heads (shape {tuple(t.shape)}, {what}) "
                             f"but this InducerAttention was built for "
                             f"num_heads={self.num_heads}")
        if t.shape[-1] != self.head_dim:
            raise ValueError(f"{name} has head width {t.shape[-1]} (shape {tuple(t.shape)}, "
                             f"{what}) but this InducerAttention was built for "
                             f"head_dim={self.head_dim}")

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                key_padding_mask: Optional[Tensor] = None, seq_lens: Optional[Tensor] = None,
                scale: Optional[float] = None, backend: Optional[str] = None,
                cu_seqlens: Optional[Tensor] = None, max_seqlen: Optional[int] = None
                ) -> Tuple[Tensor, Optional[Tensor]]:
        """q (B, H, n_q, p), k/v (B, H, n_k, p) -> ``(out, u)`` (see inducer_attention).

        With ``cu_seqlens`` (cumulative lengths) the batch is packed instead: q, k, v
        (total, H, p), one sequence after another (see inducer_attention_varlen; no masks).
        q must have this adapter's ``num_heads`` heads of width ``head_dim`` (ValueError
        otherwise); k and v may have fewer heads (grouped-query attention).
        """
        self._check_heads("q", q, packed=cu_seqlens is not None)
        if self.query_hook is not None:
            if cu_seqlens is not None:       # the hook sees (1, H, total, p)
                q = self.query_hook(q.transpose(0, 1).unsqueeze(0))[0].transpose(0, 1)
            else:
                q = self.query_hook(q)
        dt = q.dtype
        ind = {}
        if self.inducer:
            ind = {n: self._p(n, dt) for n in ("Ak", "ak", "Bk", "ck", "W1", "b1")}
            if self.composition == "gate":
                ind.update(W2=self._p("W2", dt), b2=self._p("b2", dt))
        if cu_seqlens is not None:
            if key_padding_mask is not None or seq_lens is not None:
                raise ValueError("a packed batch (cu_seqlens) takes no key_padding_mask or "
                                 "seq_lens: the cumulative lengths are the mask")
            return inducer_attention_varlen(
                q, k, v, cu_seqlens, None, max_seqlen, max_seqlen, **ind,
                composition=self.composition, causal=causal,
                prefix_k=self._p("prefix_k", dt), prefix_v=self._p("prefix_v", dt),
                scale=scale, backend=backend)
        return inducer_attention(
            q, k, v, **ind, composition=self.composition, causal=causal,
            key_padding_mask=key_padding_mask, seq_lens=seq_lens,
            prefix_k=self._p("prefix_k", dt), prefix_v=self._p("prefix_v", dt), scale=scale,
            backend=backend)

    def _weight_in_out(self, weight: Tensor, layout: str) -> Tensor:
        """The frozen output projection as (H·p, d): ``weight`` is (d, H·p) for
        ``layout="linear"`` (nn.Linear) or (H·p, d) for ``"conv1d"`` (GPT-2's Conv1D)."""
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        _validate.check_tensor("weight", weight, ndim=2)
        H, p = self.num_heads, self.head_dim
        w_in_out = weight.transpose(0, 1) if layout == "linear" else weight
        if w_in_out.shape[0] != H * p:
            expected = f"(d, {H * p})" if layout == "linear" else f"({H * p}, d)"
            raise ValueError(f"output projection weight has shape {tuple(weight.shape)}; "
                             f"expected {expected} for layout={layout!r}: {H * p} inputs "
                             f"({H} heads of width {p})")
        return w_in_out

    def fused_output_weight(self, weight: Tensor, bias: Optional[Tensor], *,
                            layout: str = "linear") -> Tuple[Tensor, Optional[Tensor]]:
        """The output projection extended to per-head rows ``[f_h | u_h]``.

        weight: the frozen projection, ``(d, H·p)`` for ``layout="linear"`` (nn.Linear) or
        ``(H·p, d)`` for ``layout="conv1d"`` (GPT-2's Conv1D). Returns ``(W, b)`` with
        ``W (H·(p + r), d)`` so that ``y = x W + b`` for ``x = concat_h([f_h | u_h])``.
        """
        H, p = self.num_heads, self.head_dim
        w_in_out = self._weight_in_out(weight, layout)
        d = w_in_out.shape[1]
        if bias is not None:
            _validate.check_tensor("bias", bias, ndim=1)
            _validate.check_shape("bias", bias, (d,), "(d,): the output projection's bias")
        if not self.inducer or self.composition != "add":
            return w_in_out, bias
        if d != self.d_model:
            raise ValueError(f"output projection has {d} outputs but the adapter's W2 maps to "
                             f"d_model={self.d_model}")
        W2 = self.W2.to(w_in_out.dtype)
        W = torch.cat([w_in_out.reshape(H, p, d), W2], dim=1).reshape(H * (p + W2.shape[1]), d)
        b2 = self.b2.to(w_in_out.dtype)
        return W, (b2 if bias is None else bias + b2)

    def output_projection(self, f: Tensor, u: Optional[Tensor], weight: Tensor,
                          bias: Optional[Tensor] = None, *, layout: str = "linear") -> Tensor:
        """``y = concat_h(f) W_oᵀ + b_o + Σ_h u_h W2_h + b2`` as one GEMM. f (B, H, n, p),
        u (B, H, n, r) or None -> (B, n, d); weight as in :meth:`fused_output_weight`.

        The checks and the GEMM of :func:`kfused.ops.inducer_output_projection`, with this
        adapter's W2, b2; the weights are cast to f's dtype (as the wrapped projection of
        :class:`InducerOutputProjection` does, and as autocast would). u only from an adapter
        with composition "add" (a "gate" adapter's value path acts inside the attention: its
        u is None)."""
        self._check_heads("f", f)
        f = autocast_input(f)      # the op is opaque to autocast: its dtype, as a linear's
        if isinstance(u, Tensor):
            u = autocast_input(u)
        B, H, n, p = f.shape
        W_o = self._weight_in_out(weight, layout).transpose(0, 1)        # (d, H·p)
        if bias is not None:
            _validate.check_tensor("bias", bias, ndim=1)
        for name, t in (("weight", weight), ("bias", bias)):
            if t is not None and t.device != f.device:
                raise ValueError(f"{name} is on {t.device} but f is on {f.device}")
        W_o = W_o.to(f.dtype)
        bias = None if bias is None else bias.to(f.dtype)
        if u is None:
            return inducer_output_projection(f, None, W_o, bias)
        if not self.inducer or self.composition != "add":
            kind = (f"composition {self.composition!r}" if self.inducer else "inducer=False")
            got = tuple(u.shape) if isinstance(u, Tensor) else type(u).__name__
            raise ValueError(f"u was given ({got}) but this adapter ({kind}) has no "
                             f"output-space value path: its attention returns u = None; "
                             f"pass u=None")
        r = self.value_bottleneck
        _validate.check_tensor("u", u, ndim=4)
        _validate.check_shape("u", u, (B, H, n, r),
                              f"(batch, heads, n, value_bottleneck) like f {tuple(f.shape)}, "
                              f"r = {r}")
        if W_o.shape[0] != self.d_model:
            raise ValueError(f"output projection has {W_o.shape[0]} outputs but the adapter's "
                             f"W2 maps to d_model={self.d_model}")
        return inducer_output_projection(f, u, W_o, bias, self._p("W2", f.dtype),
                                         self._p("b2", f.dtype))


class InducerOutputProjection(nn.Module):
    """Wraps a frozen output projection (nn.Linear or GPT-2 Conv1D) so that it also accepts
    per-head ``[f_h | u_h]`` rows of width ``H·(p + r)`` (what the ``kfused_inducer``
    attention implementation returns for composition "add") and maps both in one GEMM.
    Inputs of the original width pass straight to the base layer. A base that is itself an
    adapter around the projection (LoRALinear, KronALinear, HeadwiseOutput, ...) maps f with
    its own forward and u with W2 beside it (two GEMMs)."""

    def __init__(self, base: nn.Module, adapter: InducerAttention):
        super().__init__()
        self.base = base
        self.adapter = adapter
        # None: the base is not a bare layer (an adapter around the projection, e.g.
        # LoRALinear, KronALinear, HeadwiseOutput): its weight alone is not the map it
        # computes, so f goes through its forward and u through W2 beside it. (Read as
        # "conv1d", a square wrapped nn.Linear was applied transposed and without its update.)
        self.layout = ("linear" if isinstance(base, nn.Linear) else
                       "conv1d" if is_conv1d(base) else None)

    def forward(self, x: Tensor) -> Tensor:
        a = self.adapter
        _validate.check_tensor("x", x, min_ndim=1)
        x = autocast_input(x)      # under autocast, the fused GEMM in its dtype, as the base's
        plain = a.num_heads * a.head_dim
        if x.shape[-1] == plain:
            return self.base(x)
        adds_u = a.inducer and a.composition == "add"
        width = a.num_heads * (a.head_dim + a.value_bottleneck) if adds_u else plain
        if x.shape[-1] != width:
            fused = (f" or H·(p + r) = {width} (per-head [f_h | u_h] rows of the "
                     f"'add' inducer, r = {a.value_bottleneck})" if adds_u else
                     f" (this adapter, composition {a.composition!r}, inducer={a.inducer}, "
                     f"adds no u columns)")
            raise ValueError(f"output projection input x has shape {tuple(x.shape)}: width "
                             f"{x.shape[-1]}, expected H·p = {plain} ({a.num_heads} heads of "
                             f"width {a.head_dim}){fused}")
        if self.layout is None:
            return self._wrapped(x)
        W, b = a.fused_output_weight(self.base.weight, self.base.bias, layout=self.layout)
        if x.device != W.device:
            raise ValueError(f"output projection input x is on {x.device} but the projection's "
                             f"weight is on {W.device}")
        y = torch.matmul(x, W.to(x.dtype))
        return y if b is None else y + b.to(x.dtype)

    def _wrapped(self, x: Tensor) -> Tensor:
        """``base(concat_h f_h) + Σ_h u_h W2_h + b2`` for a base that is not a bare layer."""
        a = self.adapter
        H, p = a.num_heads, a.head_dim
        rows = x.reshape(*x.shape[:-1], H, p + a.value_bottleneck)
        f = rows[..., :p].reshape(*x.shape[:-1], H * p)
        u = rows[..., p:].reshape(*x.shape[:-1], -1)
        y = self.base(f)
        if not isinstance(y, Tensor) or y.shape[-1] != a.d_model:
            got = tuple(y.shape) if isinstance(y, Tensor) else type(y).__name__
            raise ValueError(f"the output projection {type(self.base).__name__} returned "
                             f"{got} for f of shape {tuple(f.shape)}, but the adapter's W2 "
                             f"maps to d_model={a.d_model}")
        W2 = a.W2.reshape(-1, a.d_model).to(y.dtype)
        return y + (torch.matmul(u.to(y.dtype), W2) + a.b2.to(y.dtype))


__all__ = ["InducerAttention", "InducerOutputProjection"]
