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

from kfused.modules._init import check_init, paper_
from kfused.ops.inducer_attention import (COMPOSITIONS, inducer_attention,
                                          inducer_attention_varlen)


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
        if num_heads < 1 or head_dim < 1:
            raise ValueError(f"num_heads and head_dim must be >= 1, got {num_heads}, {head_dim}")
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

    def forward(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                key_padding_mask: Optional[Tensor] = None, seq_lens: Optional[Tensor] = None,
                scale: Optional[float] = None, backend: Optional[str] = None,
                cu_seqlens: Optional[Tensor] = None, max_seqlen: Optional[int] = None
                ) -> Tuple[Tensor, Optional[Tensor]]:
        """q (B, H, n_q, p), k/v (B, H, n_k, p) -> ``(out, u)`` (see inducer_attention).

        With ``cu_seqlens`` (cumulative lengths) the batch is packed instead: q, k, v
        (total, H, p), one sequence after another (see inducer_attention_varlen; no masks).
        """
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

    def fused_output_weight(self, weight: Tensor, bias: Optional[Tensor], *,
                            layout: str = "linear") -> Tuple[Tensor, Optional[Tensor]]:
        """The output projection extended to per-head rows ``[f_h | u_h]``.

        weight: the frozen projection, ``(d, H·p)`` for ``layout="linear"`` (nn.Linear) or
        ``(H·p, d)`` for ``layout="conv1d"`` (GPT-2's Conv1D). Returns ``(W, b)`` with
        ``W (H·(p + r), d)`` so that ``y = x W + b`` for ``x = concat_h([f_h | u_h])``.
        """
        H, p = self.num_heads, self.head_dim
        w_in_out = weight.transpose(0, 1) if layout == "linear" else weight
        if w_in_out.shape[0] != H * p:
            raise ValueError(f"output projection weight has shape {tuple(weight.shape)}; "
                             f"expected {H * p} inputs ({H} heads of width {p})")
        d = w_in_out.shape[1]
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
        u (B, H, n, r) or None -> (B, n, d)."""
        B, H, n, p = f.shape
        if u is None:
            x = f.transpose(1, 2).reshape(B, n, H * p)
            W, b = (weight.transpose(0, 1) if layout == "linear" else weight), bias
        else:
            x = torch.cat([f, u], dim=-1).transpose(1, 2).reshape(B, n, -1)
            W, b = self.fused_output_weight(weight, bias, layout=layout)
        y = torch.matmul(x, W)
        return y if b is None else y + b


class InducerOutputProjection(nn.Module):
    """Wraps a frozen output projection (nn.Linear or GPT-2 Conv1D) so that it also accepts
    per-head ``[f_h | u_h]`` rows of width ``H·(p + r)`` (what the ``kfused_inducer``
    attention implementation returns for composition "add") and maps both in one GEMM.
    Inputs of the original width pass straight to the base layer."""

    def __init__(self, base: nn.Module, adapter: InducerAttention):
        super().__init__()
        self.base = base
        self.adapter = adapter
        self.layout = "linear" if isinstance(base, nn.Linear) else "conv1d"

    def forward(self, x: Tensor) -> Tensor:
        a = self.adapter
        if x.shape[-1] == a.num_heads * a.head_dim:
            return self.base(x)
        W, b = a.fused_output_weight(self.base.weight, self.base.bias, layout=self.layout)
        if x.shape[-1] != W.shape[0]:
            raise ValueError(f"output projection got width {x.shape[-1]}, expected "
                             f"{a.num_heads * a.head_dim} or {W.shape[0]}")
        y = torch.matmul(x, W.to(x.dtype))
        return y if b is None else y + b.to(x.dtype)


__all__ = ["InducerAttention", "InducerOutputProjection"]
