"""Adapter modules for the per-head low-rank updates of SPEC §2 (paper 000).

Each module wraps an existing frozen projection (``nn.Linear`` or Hugging Face's ``Conv1D``)
without copying its weight, owns only the adapter parameters, and calls the functional ops
of :mod:`kfused.ops.headwise`:

* :class:`HeadwiseProjection` — one q or v projection (BERT/RoBERTa ``query``/``value``,
  Llama ``q_proj``/``v_proj``, T5 ``q``/``v``) with any mix of shared LoRA, Kernel-wise and
  Kernel-wise-lite (the latter needs the frozen key projection, passed as ``key=``).
* :class:`HeadwiseQKV` — the fused attention-input projection: GPT-2's ``c_attn`` (a Conv1D
  whose 3·d output columns are q | k | v) or three separate linears; one kernel computes
  [Q | K | V] with the q and v updates. ``forward`` returns the fused (..., Nq + 2·Nkv) tensor,
  a drop-in for ``c_attn``; :meth:`HeadwiseQKV.forward_split` returns (Q, K, V).
* :class:`HeadwiseOutput` — the output projection (GPT-2 ``c_proj``, BERT
  ``attention.output.dense``, Llama ``o_proj``, T5 ``o``) with Kernel-wise on W_o's row blocks
  (basis O) and a shared LoRA part.

Ranks are given per projection with :class:`ProjRanks` (``wise`` = Kernel-wise rank with basis
X, ``lite`` = Kernel-wise-lite rank with basis K, ``shared`` = LoRA rank), as in SPEC §2's
table. ``init="lora"`` (default: A kaiming-uniform(a=√5) per head, B = 0, c = 0, so the
adapted model starts exactly at the frozen one) or ``init="paper"`` (``fmod(randn, 2)·0.01``
for A, B and c, as the released code). The per-head part has scale 1; the shared part has
scale ``scale`` (default 1).

Grouped-query attention (Llama with ``num_key_value_heads < num_attention_heads``): lite on q
uses, for query head h, the key head it attends with, ``h // (H / H_kv)``; lite on v (which
has H_kv heads) uses key head j for value head j. So with GQA, q-lite heads that share a key
head share the basis ``W_k^{g(h)}`` but keep their own A_h, B_h.

``merge()`` folds every update into the frozen weight and bias exactly (the dense ΔW is
formed once); ``unmerge()`` subtracts the same ΔW. While merged, the module runs the plain
frozen projection. Do not train while merged.

Hugging Face: :func:`attach_headwise` replaces the projections of every attention block of a
GPT-2, BERT/RoBERTa, Llama-style or T5 model according to a :class:`HeadwiseConfig` and freezes
nothing else by itself (use :func:`mark_only_adapters_trainable`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from kfused.ops import (HeadFactors, headwise_oproj, headwise_projection,
                        headwise_qkv)
from kfused.reference.headwise import oproj_delta_weight, projection_delta_weight

__all__ = ["ProjRanks", "HeadwiseConfig", "HeadwiseProjection", "HeadwiseQKV",
           "HeadwiseOutput", "attach_headwise", "mark_only_adapters_trainable",
           "adapter_parameters"]

INITS = ("lora", "paper")


@dataclasses.dataclass(frozen=True)
class ProjRanks:
    """Ranks of one projection's update: Kernel-wise (basis X), Kernel-wise-lite (basis K)
    and the shared LoRA part. All zero means "not adapted"."""

    wise: int = 0
    lite: int = 0
    shared: int = 0

    def __post_init__(self):
        for name in ("wise", "lite", "shared"):
            val = getattr(self, name)
            if not isinstance(val, int) or val < 0:
                raise ValueError(f"ProjRanks.{name} must be a non-negative int, got {val!r}")

    @property
    def active(self) -> bool:
        return bool(self.wise or self.lite or self.shared)


@dataclasses.dataclass(frozen=True)
class HeadwiseConfig:
    """Which updates go where (SPEC §2 table). ``o.lite`` must be 0 (no lite form for W_o).

    head_bias: give every per-head part its bias ``c`` (the paper's released code does);
    None (default) = only where the frozen projection has a bias (GPT-2, BERT: yes; Llama:
    no), so that merge() can always fold ``c`` into it.
    """

    q: ProjRanks = ProjRanks()
    v: ProjRanks = ProjRanks()
    o: ProjRanks = ProjRanks()
    scale: float = 1.0
    init: str = "lora"
    head_bias: Optional[bool] = None

    def __post_init__(self):
        if self.o.lite:
            raise ValueError("HeadwiseConfig.o.lite must be 0: Kernel-wise-lite is defined for "
                             "q and v only (SPEC §2)")
        if self.init not in INITS:
            raise ValueError(f"init={self.init!r}; expected one of {INITS}")


# ------------------------------------------------------------------------------------------
# Frozen-weight access (no copies)


def _is_conv1d(mod: nn.Module) -> bool:
    # transformers.pytorch_utils.Conv1D: weight (in, out), y = x @ W + b.
    return type(mod).__name__ == "Conv1D" and hasattr(mod, "nf")


def _linear_weight(mod: nn.Module) -> torch.Tensor:
    """The module's weight as an (out, in) view."""
    return mod.weight.t() if _is_conv1d(mod) else mod.weight


def _out_in(mod: nn.Module) -> Tuple[int, int]:
    w = _linear_weight(mod)
    return w.shape[0], w.shape[1]


def _add_to_weight(mod: nn.Module, dW: torch.Tensor, rows: slice = slice(None)) -> None:
    """Add an (out, in) update to rows ``rows`` of the module's (out, in) weight, in place."""
    if _is_conv1d(mod):
        mod.weight.data[:, rows] += dW.t().to(mod.weight.dtype)
    else:
        mod.weight.data[rows] += dW.to(mod.weight.dtype)


def _init_factors(init: str, A: Optional[nn.Parameter], B: Optional[nn.Parameter],
                  c: Optional[nn.Parameter]) -> None:
    with torch.no_grad():
        if init == "lora":
            if A is not None:
                fan_in = A.shape[-1]
                bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform(a=√5) of each (r, d_in) block
                A.uniform_(-bound, bound)
            if B is not None:
                B.zero_()
            if c is not None:
                c.zero_()
        else:
            for t in (A, B, c):
                if t is not None:
                    t.copy_(torch.fmod(torch.randn_like(t), 2) * 0.01)


class _QVFactors(nn.Module):
    """Parameters of one q/v projection's update (H heads of width p, input width d)."""

    def __init__(self, ranks: ProjRanks, H: int, p: int, d: int, *, scale: float,
                 head_bias: bool, init: str, dtype, device):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.ranks = ranks
        self.scale = float(scale)
        self.n_heads, self.head_dim = H, p
        P = lambda *s: nn.Parameter(torch.empty(*s, **kw))  # noqa: E731
        self.shared_A = P(ranks.shared, d) if ranks.shared else None
        self.shared_B = P(H * p, ranks.shared) if ranks.shared else None
        self.wise_A = P(H, ranks.wise, d) if ranks.wise else None
        self.wise_B = P(H, p, ranks.wise) if ranks.wise else None
        self.lite_A = P(H, ranks.lite, p) if ranks.lite else None
        self.lite_B = P(H, p, ranks.lite) if ranks.lite else None
        has_head = ranks.wise or ranks.lite
        self.c = P(H, p) if (head_bias and has_head) else None
        self.reset_parameters(init)

    def reset_parameters(self, init: str = "lora") -> None:
        if init not in INITS:
            raise ValueError(f"init={init!r}; expected one of {INITS}")
        _init_factors(init, self.shared_A, self.shared_B, None)
        _init_factors(init, self.wise_A, self.wise_B, None)
        _init_factors(init, self.lite_A, self.lite_B, None)
        _init_factors(init, None, None, self.c)

    def factors(self) -> HeadFactors:
        wise = self.wise_A is not None
        return HeadFactors(shared_A=self.shared_A, shared_B=self.shared_B, scale=self.scale,
                           wise_A=self.wise_A, wise_B=self.wise_B,
                           wise_c=self.c if wise else None,
                           lite_A=self.lite_A, lite_B=self.lite_B,
                           lite_c=None if wise else self.c)


class _FoldsIntoBase:
    """merge()/unmerge() for an adapter of one frozen projection ``self.base``: folds
    ``delta_weight() -> (dW, db)`` in (exact float round trip: the same delta is added, then
    subtracted). Subclasses say with ``_active()`` whether any update exists."""

    def _active(self) -> bool:
        raise NotImplementedError

    @torch.no_grad()
    def _fold(self, sign: float) -> None:
        if self._active():
            dW, db = self.delta_weight()
            _add_to_weight(self.base, sign * dW)
            _add_bias(self.base, sign * db if db is not None else None)

    def merge(self) -> None:
        if not self.merged:
            self._fold(1.0)
            self.merged = True

    def unmerge(self) -> None:
        if self.merged:
            self.merged = False
            self._fold(-1.0)


class HeadwiseProjection(_FoldsIntoBase, nn.Module):
    """One adapted q or v projection (SPEC §2), wrapping a frozen nn.Linear / Conv1D.

    Args:
        base: the frozen projection (output H·p, heads contiguous as in every HF model).
        n_heads: H, the number of heads of *this* projection (H_kv for Llama's v_proj).
        ranks: :class:`ProjRanks` (wise, lite, shared).
        key: the frozen key projection (required when ``ranks.lite > 0``); kept as a plain
            reference, not registered as a submodule.
        n_key_heads: heads of ``key`` (default: inferred from its output width / p).
        scale, head_bias, init: see the module docstring.

    forward(x (..., d)) -> (..., H·p).
    """

    def __init__(self, base: nn.Module, n_heads: int, ranks: ProjRanks, *,
                 key: Optional[nn.Module] = None, n_key_heads: Optional[int] = None,
                 scale: float = 1.0, head_bias: Optional[bool] = None, init: str = "lora"):
        super().__init__()
        out, d = _out_in(base)
        if head_bias is None:
            head_bias = getattr(base, "bias", None) is not None
        if out % n_heads != 0:
            raise ValueError(f"base projection has {out} outputs, which do not split into "
                             f"n_heads={n_heads} heads")
        p = out // n_heads
        if ranks.lite and key is None:
            raise ValueError("ranks.lite > 0 needs the frozen key projection (key=...)")
        if key is not None:
            kout, kd = _out_in(key)
            if kd != d or kout % p != 0:
                raise ValueError(f"key projection of shape (out={kout}, in={kd}) does not match "
                                 f"heads of width {p} over input width {d}")
            n_key_heads = n_key_heads or kout // p
            if n_key_heads * p != kout or n_heads % n_key_heads != 0:
                raise ValueError(f"n_key_heads={n_key_heads} must divide n_heads={n_heads} and "
                                 f"match the key projection's {kout} outputs")
        self.base = base
        self._key = (key,)  # a tuple: not registered, so its weight is not duplicated
        self.n_heads, self.head_dim, self.in_features = n_heads, p, d
        self.n_key_heads = n_key_heads
        w = _linear_weight(base)
        self.adapter = _QVFactors(ranks, n_heads, p, d, scale=scale, head_bias=head_bias,
                                  init=init, dtype=w.dtype, device=w.device)
        self.merged = False

    @property
    def key(self) -> Optional[nn.Module]:
        return self._key[0]

    def _kw(self):
        k = self.key
        if k is None:
            return None, None
        return _linear_weight(k), getattr(k, "bias", None)

    def forward(self, x: torch.Tensor, backend: Optional[str] = None) -> torch.Tensor:
        if self.merged or not self.adapter.ranks.active:
            return self.base(x)
        wk, bk = self._kw()
        return headwise_projection(x, _linear_weight(self.base), getattr(self.base, "bias", None),
                                   n_heads=self.n_heads, factors=self.adapter.factors(),
                                   w_k=wk, b_k=bk, n_key_heads=self.n_key_heads, backend=backend)

    def delta_weight(self) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Dense (ΔW (out, in), Δb (out,) or None) of the update, in float64-safe torch ops."""
        wk, bk = self._kw()
        return projection_delta_weight(self.adapter.factors(), self.n_heads, wk, bk,
                                       self.n_key_heads)

    def _active(self) -> bool:
        return self.adapter.ranks.active


def _add_bias(mod: nn.Module, db: Optional[torch.Tensor], rows: slice = slice(None)) -> None:
    if db is None:
        return
    if getattr(mod, "bias", None) is None:
        raise ValueError("this update has a bias term but the frozen projection has no bias; "
                         "construct the adapter with head_bias=False or merge into a biased "
                         "projection")
    mod.bias.data[rows] += db.to(mod.bias.dtype)


class HeadwiseQKV(nn.Module):
    """Fused attention-input projection with updates on q and v (SPEC §2).

    Give either ``fused`` (GPT-2's ``c_attn``: one Conv1D/Linear whose outputs are
    [q | k | v]) or ``q``, ``k``, ``v`` (three frozen linears, Llama/BERT style).

    Args:
        n_heads: H (query heads); n_kv_heads: H_kv (default H; GQA when smaller).
        q_ranks, v_ranks: :class:`ProjRanks` of the q and v updates (v uses H_kv heads).
        scale, head_bias, init: see the module docstring.

    forward(x (..., d)) -> fused [Q | K | V] (..., H·p + 2·H_kv·p) (drop-in for ``c_attn``);
    forward_split(x) -> (Q, K, V).
    """

    def __init__(self, *, fused: Optional[nn.Module] = None, q: Optional[nn.Module] = None,
                 k: Optional[nn.Module] = None, v: Optional[nn.Module] = None, n_heads: int,
                 n_kv_heads: Optional[int] = None, q_ranks: ProjRanks = ProjRanks(),
                 v_ranks: ProjRanks = ProjRanks(), scale: float = 1.0,
                 head_bias: Optional[bool] = None, init: str = "lora"):
        super().__init__()
        if (fused is None) == (q is None or k is None or v is None):
            raise ValueError("give either fused= (one q|k|v projection) or all of q=, k=, v=")
        H = n_heads
        Hkv = n_kv_heads or H
        if H % Hkv != 0:
            raise ValueError(f"n_kv_heads={Hkv} must divide n_heads={H}")
        if fused is not None:
            out, d = _out_in(fused)
            if out % (H + 2 * Hkv) != 0:
                raise ValueError(f"fused projection has {out} outputs; expected (n_heads + 2 * "
                                 f"n_kv_heads) * head_dim with n_heads={H}, n_kv_heads={Hkv}")
            p = out // (H + 2 * Hkv)
            self.fused = fused
            self.q = self.k = self.v = None
        else:
            (nq, d), (nk, dk), (nv, dv) = _out_in(q), _out_in(k), _out_in(v)
            if nq % H != 0:
                raise ValueError(f"q projection has {nq} outputs, not divisible by n_heads={H}")
            p = nq // H
            if nk != Hkv * p or nv != Hkv * p or dk != d or dv != d:
                raise ValueError(f"k/v projections of shapes ({nk}, {dk}), ({nv}, {dv}) do not "
                                 f"match n_kv_heads={Hkv} heads of width {p} over input {d}")
            self.fused = None
            self.q, self.k, self.v = q, k, v
        self.n_heads, self.n_kv_heads, self.head_dim, self.in_features = H, Hkv, p, d
        w, _, _, bq, _, bv = self._weights()
        if head_bias is None:
            head_bias = bq is not None and bv is not None
        mk = lambda r, Hs: _QVFactors(r, Hs, p, d, scale=scale, head_bias=head_bias,  # noqa
                                      init=init, dtype=w.dtype, device=w.device)
        self.q_adapter = mk(q_ranks, H)
        self.v_adapter = mk(v_ranks, Hkv)
        self.merged = False

    def _splits(self) -> Tuple[slice, slice, slice]:
        p, H, Hkv = self.head_dim, self.n_heads, self.n_kv_heads
        a, b = H * p, (H + Hkv) * p
        return slice(0, a), slice(a, b), slice(b, b + Hkv * p)

    def _weights(self):
        if self.fused is not None:
            W = _linear_weight(self.fused)
            bias = getattr(self.fused, "bias", None)
            sq, sk, sv = self._splits()
            ws = (W[sq], W[sk], W[sv])
            bs = (bias[sq], bias[sk], bias[sv]) if bias is not None else (None,) * 3
            return (*ws, *bs)
        ws = tuple(_linear_weight(m) for m in (self.q, self.k, self.v))
        bs = tuple(getattr(m, "bias", None) for m in (self.q, self.k, self.v))
        return (*ws, *bs)

    def _frozen(self, x):
        if self.fused is not None:
            return self.fused(x)
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)

    def forward(self, x: torch.Tensor, backend: Optional[str] = None) -> torch.Tensor:
        if self.merged:
            return self._frozen(x)
        return self._run(x, backend, fused_output=True)

    def forward_split(self, x: torch.Tensor, backend: Optional[str] = None
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.merged:
            Y = self._frozen(x)
            return tuple(Y.split([s.stop - s.start for s in self._splits()], dim=-1))
        return self._run(x, backend, fused_output=False)

    def _run(self, x, backend, fused_output):
        wq, wk, wv, bq, bk, bv = self._weights()
        qa, va = self.q_adapter, self.v_adapter
        return headwise_qkv(x, wq, wk, wv, bq, bk, bv, n_heads=self.n_heads,
                            n_kv_heads=self.n_kv_heads,
                            q=qa.factors() if qa.ranks.active else None,
                            v=va.factors() if va.ranks.active else None, backend=backend,
                            fused_output=fused_output)

    def delta_weights(self):
        """[(ΔW, Δb, target slice) for q and v] in (out, in) layout of the fused weight."""
        wq, wk, wv, bq, bk, bv = self._weights()
        out = []
        sq, _, sv = self._splits()
        for ad, Hs, sl in ((self.q_adapter, self.n_heads, sq), (self.v_adapter, self.n_kv_heads,
                                                                   sv)):
            if ad.ranks.active:
                dW, db = projection_delta_weight(ad.factors(), Hs, wk, bk, self.n_kv_heads)
                out.append((dW, db, sl, ad))
        return out

    @torch.no_grad()
    def _fold(self, sign: float) -> None:
        deltas = self.delta_weights()  # computed before any weight changes (W_k is untouched)
        for dW, db, sl, ad in deltas:
            mod = self.fused if self.fused is not None else (self.q if ad is self.q_adapter
                                                              else self.v)
            rows = sl if self.fused is not None else slice(None)
            _add_to_weight(mod, sign * dW, rows)
            _add_bias(mod, sign * db if db is not None else None, rows)

    def merge(self) -> None:
        if not self.merged:
            self._fold(1.0)
            self.merged = True

    def unmerge(self) -> None:
        if self.merged:
            self.merged = False
            self._fold(-1.0)


class HeadwiseOutput(_FoldsIntoBase, nn.Module):
    """Adapted output projection (SPEC §2, basis O), wrapping a frozen nn.Linear / Conv1D.

    Args:
        base: frozen W_o (in = H·p, out = d).
        n_heads: H.
        ranks: :class:`ProjRanks` with ``wise`` (rank of each row block) and ``shared``.

    forward(o (..., H·p)) -> (..., d).
    """

    def __init__(self, base: nn.Module, n_heads: int, ranks: ProjRanks, *, scale: float = 1.0,
                 head_bias: Optional[bool] = None, init: str = "lora"):
        super().__init__()
        if head_bias is None:
            head_bias = getattr(base, "bias", None) is not None
        if ranks.lite:
            raise ValueError("ranks.lite must be 0 for the output projection")
        dout, din = _out_in(base)
        if din % n_heads != 0:
            raise ValueError(f"output projection has {din} inputs, which do not split into "
                             f"n_heads={n_heads} heads")
        p = din // n_heads
        self.base = base
        self.ranks = ranks
        self.n_heads, self.head_dim, self.out_features = n_heads, p, dout
        self.scale = float(scale)
        w = _linear_weight(base)
        kw = dict(dtype=w.dtype, device=w.device)
        P = lambda *s: nn.Parameter(torch.empty(*s, **kw))  # noqa: E731
        H, r, rs = n_heads, ranks.wise, ranks.shared
        self.wise_A = P(H, r, p) if r else None
        self.wise_B = P(dout, H * r) if r else None
        self.c = P(dout) if (r and head_bias) else None
        self.shared_A = P(rs, din) if rs else None
        self.shared_B = P(dout, rs) if rs else None
        self.reset_parameters(init)
        self.merged = False

    def reset_parameters(self, init: str = "lora") -> None:
        if init not in INITS:
            raise ValueError(f"init={init!r}; expected one of {INITS}")
        _init_factors(init, self.wise_A, self.wise_B, self.c)
        _init_factors(init, self.shared_A, self.shared_B, None)

    def forward(self, o: torch.Tensor, backend: Optional[str] = None) -> torch.Tensor:
        if self.merged or not self.ranks.active:
            return self.base(o)
        return headwise_oproj(o, _linear_weight(self.base), getattr(self.base, "bias", None),
                              n_heads=self.n_heads, wise_A=self.wise_A, wise_B=self.wise_B,
                              wise_c=self.c, shared_A=self.shared_A, shared_B=self.shared_B,
                              scale=self.scale, backend=backend)

    def delta_weight(self):
        return oproj_delta_weight(self.n_heads, self.wise_A, self.wise_B, self.c,
                                  self.shared_A, self.shared_B, self.scale)

    def _active(self) -> bool:
        return self.ranks.active


# ------------------------------------------------------------------------------------------
# Hugging Face attachment


def _heads_of(attn: nn.Module) -> Tuple[int, int]:
    cfg = getattr(attn, "config", None)
    for name in ("num_heads", "num_attention_heads"):
        if isinstance(getattr(attn, name, None), int):
            H = getattr(attn, name)
            break
    else:
        H = getattr(cfg, "num_attention_heads", None)
    if H is None:
        raise ValueError(f"cannot find the number of heads of {type(attn).__name__}")
    Hkv = getattr(attn, "num_key_value_heads", None)
    if not isinstance(Hkv, int):
        Hkv = getattr(cfg, "num_key_value_heads", None) or H
    return H, Hkv


def _is_t5_attention(mod: nn.Module) -> bool:
    """T5Attention and forks: bias-free q, k, v, o plus ``n_heads`` / ``key_value_proj_dim``."""
    return (all(isinstance(getattr(mod, a, None), nn.Module) for a in ("q", "k", "v", "o"))
            and isinstance(getattr(mod, "n_heads", None), int)
            and isinstance(getattr(mod, "key_value_proj_dim", None), int))


def attach_headwise(model: nn.Module, config: HeadwiseConfig) -> Dict[str, nn.Module]:
    """Replace the attention projections of every block by headwise adapter modules.

    Recognised layouts (by attribute names, so subclasses and forks work):
      * GPT-2: an attention module with ``c_attn`` (fused q|k|v Conv1D) and ``c_proj``
        -> ``c_attn`` becomes :class:`HeadwiseQKV` (one fused kernel for Q, K, V) and
        ``c_proj`` :class:`HeadwiseOutput`. Cross-attention blocks (``q_attn``) are skipped.
      * BERT/RoBERTa: a self-attention with ``query``/``key``/``value`` -> ``query``/``value``
        become :class:`HeadwiseProjection` (lite uses ``key``); the sibling
        ``attention.output.dense`` becomes :class:`HeadwiseOutput`.
      * Llama-style: ``q_proj``/``k_proj``/``v_proj``/``o_proj`` (GQA aware) -> q/v become
        :class:`HeadwiseProjection`, ``o_proj`` :class:`HeadwiseOutput`.
      * T5 (``T5Attention``: bias-free ``q``/``k``/``v``/``o``, ``n_heads`` heads of width
        ``key_value_proj_dim`` = d_kv; the inner width H·d_kv may differ from d_model) -> q/v
        become :class:`HeadwiseProjection` (lite uses ``k``), ``o`` :class:`HeadwiseOutput`, in
        the encoder self-attention, the decoder self-attention and the decoder cross-attention
        (``EncDecAttention``). T5 has no projection biases, so no per-head bias ``c`` is added
        unless ``head_bias=True`` (and then merge() refuses, as there is no bias to fold into).

        Cross-attention: ``q`` reads the decoder states X, while ``k`` and ``v`` both read the
        encoder output. The updates keep SPEC §2's definitions with each projection's own input
        as basis: Kernel-wise on q uses X = decoder states; Kernel-wise on v uses the encoder
        output (v's input); Kernel-wise-lite on v uses ``K^h`` = encoder output · W_k^h, which
        *is* the cross-attention's key (k and v read the same states, exactly as in
        self-attention); o is adapted as in self-attention. Kernel-wise-lite on **q** is not
        defined there (the keys belong to the encoder tokens, so a decoder token has no K^h to
        reuse), so q's lite part is left out in cross-attention: with kernel_wise_lite q is
        not adapted there, with kernel_mix_lite only q's shared LoRA part is. Every update
        stays a linear change of W_q / W_v / W_o, so merge()/unmerge() are exact.

    On BERT and Llama the q and v projections are called separately by the model's own
    attention code, so each runs its own fused kernel (frozen GEMM + its updates in one pass
    over X); the all-in-one q|k|v kernel is used where the model has one fused projection
    (GPT-2) or through :class:`HeadwiseQKV` / ``kfused.ops.headwise.headwise_qkv`` directly.

    Returns {qualified name: new module}. Parameters of the frozen model are not touched;
    call :func:`mark_only_adapters_trainable` to freeze everything else.
    """
    cfgkw = dict(scale=config.scale, head_bias=config.head_bias, init=config.init)
    replaced: Dict[str, nn.Module] = {}
    todo = []
    # T5's cross-attention is the child "EncDecAttention" of a T5LayerCrossAttention
    cross = {id(getattr(m, "EncDecAttention")) for m in model.modules()
             if isinstance(getattr(m, "EncDecAttention", None), nn.Module)}
    for name, mod in model.named_modules():
        if isinstance(mod, (HeadwiseQKV, HeadwiseProjection, HeadwiseOutput)):
            continue
        if _is_t5_attention(mod):
            todo.append(("t5-cross" if id(mod) in cross else "t5", name, mod))
        elif hasattr(mod, "c_attn") and hasattr(mod, "c_proj") and not hasattr(mod, "q_attn"):
            todo.append(("gpt2", name, mod))
        elif all(hasattr(mod, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj")):
            todo.append(("llama", name, mod))
        elif all(hasattr(mod, a) for a in ("query", "key", "value")):
            todo.append(("bert", name, mod))
        elif (hasattr(mod, "self") and hasattr(mod, "output")
              and hasattr(getattr(mod, "output"), "dense")
              and all(hasattr(mod.self, a) for a in ("query", "key", "value"))):
            todo.append(("bert-out", name, mod))
    prefix = lambda n: f"{n}." if n else ""  # noqa: E731
    for kind, name, mod in todo:
        if kind == "gpt2":
            H, _ = _heads_of(mod)
            if config.q.active or config.v.active:
                if isinstance(mod.c_attn, HeadwiseQKV):
                    continue
                mod.c_attn = HeadwiseQKV(fused=mod.c_attn, n_heads=H, q_ranks=config.q,
                                         v_ranks=config.v, **cfgkw)
                replaced[prefix(name) + "c_attn"] = mod.c_attn
            if config.o.active and not isinstance(mod.c_proj, HeadwiseOutput):
                mod.c_proj = HeadwiseOutput(mod.c_proj, H, config.o, **cfgkw)
                replaced[prefix(name) + "c_proj"] = mod.c_proj
        elif kind == "llama":
            H, Hkv = _heads_of(mod)
            for attr, ranks, Hs in (("q_proj", config.q, H), ("v_proj", config.v, Hkv)):
                if ranks.active and not isinstance(getattr(mod, attr), HeadwiseProjection):
                    new = HeadwiseProjection(getattr(mod, attr), Hs, ranks, key=mod.k_proj,
                                             n_key_heads=Hkv, **cfgkw)
                    setattr(mod, attr, new)
                    replaced[prefix(name) + attr] = new
            if config.o.active and not isinstance(mod.o_proj, HeadwiseOutput):
                mod.o_proj = HeadwiseOutput(mod.o_proj, H, config.o, **cfgkw)
                replaced[prefix(name) + "o_proj"] = mod.o_proj
        elif kind in ("t5", "t5-cross"):
            H = int(mod.n_heads)
            q_ranks = config.q
            if kind == "t5-cross" and q_ranks.lite:
                # no K^h for decoder tokens in cross-attention (see the docstring)
                q_ranks = ProjRanks(wise=q_ranks.wise, lite=0, shared=q_ranks.shared)
            for attr, ranks in (("q", q_ranks), ("v", config.v)):
                if ranks.active and not isinstance(getattr(mod, attr), HeadwiseProjection):
                    new = HeadwiseProjection(getattr(mod, attr), H, ranks, key=mod.k,
                                             n_key_heads=H, **cfgkw)
                    setattr(mod, attr, new)
                    replaced[prefix(name) + attr] = new
            if config.o.active and not isinstance(mod.o, HeadwiseOutput):
                mod.o = HeadwiseOutput(mod.o, H, config.o, **cfgkw)
                replaced[prefix(name) + "o"] = mod.o
        elif kind == "bert":
            H, _ = _heads_of(mod)
            for attr, ranks in (("query", config.q), ("value", config.v)):
                if ranks.active and not isinstance(getattr(mod, attr), HeadwiseProjection):
                    new = HeadwiseProjection(getattr(mod, attr), H, ranks, key=mod.key,
                                             n_key_heads=H, **cfgkw)
                    setattr(mod, attr, new)
                    replaced[prefix(name) + attr] = new
        elif kind == "bert-out":
            H, _ = _heads_of(mod.self)
            if config.o.active and not isinstance(mod.output.dense, HeadwiseOutput):
                mod.output.dense = HeadwiseOutput(mod.output.dense, H, config.o, **cfgkw)
                replaced[prefix(name) + "output.dense"] = mod.output.dense
    if not replaced and (config.q.active or config.v.active or config.o.active):
        raise ValueError(f"attach_headwise found no GPT-2, BERT/RoBERTa, Llama-style or T5 "
                         f"attention block in {type(model).__name__}")
    return replaced


def adapter_parameters(model: nn.Module) -> List[nn.Parameter]:
    """Every parameter owned by a headwise adapter module (not the frozen projections)."""
    params = []
    for mod in model.modules():
        if isinstance(mod, (HeadwiseProjection, HeadwiseQKV, HeadwiseOutput)):
            for n, prm in mod.named_parameters():
                if not n.startswith(("base.", "fused.", "q.", "k.", "v.")):
                    params.append(prm)
    return params


def mark_only_adapters_trainable(model: nn.Module) -> int:
    """Freeze every parameter except the headwise adapters'; returns the trainable count."""
    keep = {id(p) for p in adapter_parameters(model)}
    n = 0
    for prm in model.parameters():
        prm.requires_grad_(id(prm) in keep)
        n += prm.numel() if id(prm) in keep else 0
    return n
