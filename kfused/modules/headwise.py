"""Adapter modules for the per-head low-rank updates of docs/math.md §2 (paper 000).

Each module wraps an existing frozen projection (``nn.Linear`` or Hugging Face's ``Conv1D``)
without copying its weight, owns only the adapter parameters, and calls the functional ops
of :mod:`kfused.ops`:

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
X, ``lite`` = Kernel-wise-lite rank with basis K, ``shared`` = LoRA rank), as in docs/math.md §2's
table. ``init`` takes the values of :mod:`kfused.modules._init`: "zero" (default: A
kaiming-uniform(a=√5) per head, B = 0, c = 0, so the adapted model starts exactly at the frozen
one), "random" (A and B kaiming-uniform, c = 0) or "paper" (``fmod(randn, 2)·0.01`` for A, B
and c, as the released code). The per-head part has scale 1; the shared part has scale
``scale`` (default 1).

Grouped-query attention (Llama with ``num_key_value_heads < num_attention_heads``): lite on q
uses, for query head h, the key head it attends with, ``h // (H / H_kv)``; lite on v (which
has H_kv heads) uses key head j for value head j. So with GQA, q-lite heads that share a key
head share the basis ``W_k^{g(h)}`` but keep their own A_h, B_h.

``merge()`` folds every update into the frozen weight and bias exactly (the dense ΔW is
formed once); ``unmerge()`` subtracts the same ΔW. While merged, the module runs the plain
frozen projection. Do not train while merged. A merged module's ``state_dict`` says so (one
more key, ``kfused_merged``), and ``load_state_dict`` restores the module that was saved
(:class:`kfused.modules._linear.MergedState`).

Placing these modules in a Hugging Face model: :func:`kfused.integration.headwise.attach_headwise`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch
from torch import nn

from kfused import _validate
from kfused.modules._init import check_init, init_pair_
from kfused.modules._linear import MergedState, autocast_dtype, autocast_input, is_conv1d
from kfused.ops import HeadFactors, headwise_oproj, headwise_projection, headwise_qkv
from kfused.reference.headwise import oproj_delta_weight, projection_delta_weight

__all__ = ["ProjRanks", "HeadwiseConfig", "HeadwiseProjection", "HeadwiseQKV",
           "HeadwiseOutput", "HEADWISE_MODULES"]

INITS = ("zero", "random", "paper")


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
            if isinstance(val, bool) or not isinstance(val, int) or val < 0:
                raise ValueError(f"ProjRanks.{name} must be a non-negative int, got {val!r}")

    @property
    def active(self) -> bool:
        return bool(self.wise or self.lite or self.shared)


@dataclasses.dataclass(frozen=True)
class HeadwiseConfig:
    """Which updates go where (docs/math.md §2 table). ``o.lite`` must be 0 (no lite form for W_o).

    head_bias: give every per-head part its bias ``c`` (the paper's released code does);
    None (default) = only where the frozen projection has a bias (GPT-2, BERT: yes; Llama:
    no), so that merge() can always fold ``c`` into it.
    """

    q: ProjRanks = ProjRanks()
    v: ProjRanks = ProjRanks()
    o: ProjRanks = ProjRanks()
    scale: float = 1.0
    init: str = "zero"
    head_bias: Optional[bool] = None

    def __post_init__(self):
        for name in ("q", "v", "o"):
            if not isinstance(getattr(self, name), ProjRanks):
                raise TypeError(f"HeadwiseConfig.{name} must be a ProjRanks, got "
                                f"{type(getattr(self, name)).__name__} {getattr(self, name)!r}")
        _check_scale_arg("HeadwiseConfig.scale", self.scale)
        if self.head_bias is not None and not isinstance(self.head_bias, bool):
            raise TypeError(f"HeadwiseConfig.head_bias must be None or a bool, got "
                            f"{self.head_bias!r}")
        if self.o.lite:
            raise ValueError("HeadwiseConfig.o.lite must be 0: Kernel-wise-lite is defined for "
                             "q and v only (docs/math.md §2)")
        check_init(self.init, INITS, "HeadwiseConfig")


# ------------------------------------------------------------------------------------------
# Frozen-weight access (no copies)


def _linear_weight(mod: nn.Module) -> torch.Tensor:
    """The module's weight as an (out, in) view."""
    return mod.weight.t() if is_conv1d(mod) else mod.weight


def _out_in(mod: nn.Module) -> Tuple[int, int]:
    w = _linear_weight(mod)
    return w.shape[0], w.shape[1]


_check_scale_arg = _validate.check_real  # TypeError / ValueError naming the argument


def _check_heads(name: str, n, optional: bool = False) -> Optional[int]:
    """A head count: a positive int (None allowed when ``optional``), ValueError otherwise."""
    if optional and n is None:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if optional else ''}, "
                         f"got {n!r}")
    return n


def _head_width(width: int, n_heads: int, what: str, heads: str = "n_heads") -> int:
    """The head width p of ``width`` features split into ``n_heads`` heads (ValueError if
    they do not split)."""
    if n_heads < 1 or width % n_heads != 0:
        raise ValueError(f"{what} has {width} features, which do not split into "
                         f"{heads}={n_heads} heads")
    return width // n_heads


def _amp(x: torch.Tensor):
    """``(x, cast)`` for a forward: under autocast, x in the autocast dtype and ``cast`` taking
    a frozen weight, bias or factor to it (the custom ops are opaque to autocast: without this
    they ran in float32, and a half-precision activation met float32 weights); outside
    autocast, x and ``cast`` to x's dtype (float32 factors on a half-precision base, the
    default ``adapter_dtype``, were refused as mixed dtypes; KronALinear and LoRALinear cast)."""
    dt = autocast_dtype(x)
    if dt is None:
        dt = x.dtype
    else:
        x = autocast_input(x)
    return x, lambda t: t if t is None or t.dtype == dt else t.to(dt)


def _add_to_weight(mod: nn.Module, dW: torch.Tensor, rows: slice = slice(None)) -> None:
    """Add an (out, in) update to rows ``rows`` of the module's (out, in) weight, in place."""
    if is_conv1d(mod):
        mod.weight.data[:, rows] += dW.t().to(mod.weight.dtype)
    else:
        mod.weight.data[rows] += dW.to(mod.weight.dtype)


def _key_for(f: HeadFactors, wk: Optional[torch.Tensor], bk: Optional[torch.Tensor]):
    """The frozen key weight and bias in the dtype of the lite factors of ``f``: a merge
    computes the update in the adapter's dtype, as LoRA's and KronA's ``delta_weight`` do
    (the add casts it to the frozen weight's); float32 factors on a bfloat16 base, the default
    ``adapter_dtype``, had met a bfloat16 W_k in one einsum."""
    if f.lite_A is None:
        return wk, bk
    dt = f.lite_A.dtype
    return tuple(t if t is None or t.dtype == dt else t.to(dt) for t in (wk, bk))


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

    def reset_parameters(self, init: Optional[str] = None) -> None:
        """Initialise the factors by ``init`` (None: the module's own, as constructed; the
        meta-device recipe ``to_empty`` + ``reset_parameters()`` gave "zero" whatever it was)."""
        init = getattr(self, "init", "zero") if init is None else init
        check_init(init, INITS, "headwise q/v adapter")
        self.init = init
        init_pair_(self.shared_A, self.shared_B, init)
        init_pair_(self.wise_A, self.wise_B, init)
        init_pair_(self.lite_A, self.lite_B, init)
        init_pair_(None, None, init, bias=self.c)

    def factors(self) -> HeadFactors:
        wise = self.wise_A is not None
        return HeadFactors(shared_A=self.shared_A, shared_B=self.shared_B, scale=self.scale,
                           wise_A=self.wise_A, wise_B=self.wise_B,
                           wise_c=self.c if wise else None,
                           lite_A=self.lite_A, lite_B=self.lite_B,
                           lite_c=None if wise else self.c)


class _FoldsIntoBase(MergedState):
    """merge()/unmerge(): ``_fold(+1)`` adds the update to the frozen weights, ``_fold(-1)``
    subtracts the same update (an exact float round trip). The default ``_fold`` folds
    ``delta_weight() -> (dW, db)`` into one frozen projection ``self.base`` when ``_active()``;
    modules over several projections override ``_fold`` (and ``_frozen_children``). The
    state_dict records ``merged`` (:class:`kfused.modules._linear.MergedState`)."""

    def _active(self) -> bool:
        raise NotImplementedError

    def _freeze_base(self) -> None:
        """The wrapped projections are frozen (``requires_grad=False``), as KronALinear and
        LoRALinear freeze theirs, so ``optimizer(module.parameters())`` trains the adapter
        alone; set ``requires_grad`` back on a projection to train it too (its gradient is
        exact either way)."""
        for child in self._frozen_children():
            mod = getattr(self, child, None)
            if isinstance(mod, nn.Module):
                for prm in mod.parameters():
                    prm.requires_grad_(False)

    @torch.no_grad()
    def _fold(self, sign: float) -> None:
        if self._active():
            dW, db = self.delta_weight()
            _check_bias_target(self.base, db)   # before any weight changes
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
    """One adapted q or v projection (docs/math.md §2), wrapping a frozen nn.Linear / Conv1D.

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

    # exact= of the op (None: its default; kfused.integration.set_exact sets it)
    exact: Optional[bool] = None

    def __init__(self, base: nn.Module, n_heads: int, ranks: ProjRanks, *,
                 key: Optional[nn.Module] = None, n_key_heads: Optional[int] = None,
                 scale: float = 1.0, head_bias: Optional[bool] = None, init: str = "zero"):
        super().__init__()
        _check_heads("n_heads", n_heads)
        _check_heads("n_key_heads", n_key_heads, optional=True)
        if not isinstance(ranks, ProjRanks):
            raise TypeError(f"ranks must be a ProjRanks, got {type(ranks).__name__}")
        scale = _check_scale_arg("scale", scale)
        out, d = _out_in(base)
        if head_bias is None:
            head_bias = getattr(base, "bias", None) is not None
        p = _head_width(out, n_heads, "base projection")
        if ranks.lite and key is None:
            raise ValueError("ranks.lite > 0 needs the frozen key projection (key=...)")
        if key is not None:
            kout, kd = _out_in(key)
            if kd != d or kout % p != 0:
                raise ValueError(f"key projection of shape (out={kout}, in={kd}) does not match "
                                 f"heads of width {p} over input width {d}")
            n_key_heads = n_key_heads if n_key_heads is not None else kout // p
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
        self._freeze_base()

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
        x, cast = _amp(x)
        wk, bk = self._kw()
        return headwise_projection(x, cast(_linear_weight(self.base)),
                                   cast(getattr(self.base, "bias", None)),
                                   n_heads=self.n_heads, factors=self.adapter.factors().map(cast),
                                   w_k=cast(wk), b_k=cast(bk), n_key_heads=self.n_key_heads,
                                   backend=backend, exact=self.exact)

    def delta_weight(self) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Dense (ΔW (out, in), Δb (out,) or None) of the update, in float64-safe torch ops."""
        f = self.adapter.factors()
        wk, bk = _key_for(f, *self._kw())
        return projection_delta_weight(f, self.n_heads, wk, bk, self.n_key_heads)

    def _active(self) -> bool:
        return self.adapter.ranks.active


def _check_bias_target(mod: nn.Module, db: Optional[torch.Tensor]) -> None:
    """A bias update needs a frozen bias to fold into (ValueError otherwise). Checked before a
    merge changes any weight: a refused merge had already added ΔW, leaving an unmerged
    module whose frozen weight held the update (applied twice from then on)."""
    if db is not None and getattr(mod, "bias", None) is None:
        raise ValueError("this update has a bias term but the frozen projection has no bias; "
                         "construct the adapter with head_bias=False or merge into a biased "
                         "projection")


def _add_bias(mod: nn.Module, db: Optional[torch.Tensor], rows: slice = slice(None)) -> None:
    if db is None:
        return
    _check_bias_target(mod, db)
    mod.bias.data[rows] += db.to(mod.bias.dtype)


class HeadwiseQKV(_FoldsIntoBase, nn.Module):
    """Fused attention-input projection with updates on q and v (docs/math.md §2).

    Give either ``fused`` (GPT-2's ``c_attn``: one Conv1D/Linear whose outputs are
    [q | k | v]) or ``q``, ``k``, ``v`` (three frozen linears, Llama/BERT style).

    Args:
        n_heads: H (query heads); n_kv_heads: H_kv (default H; GQA when smaller).
        q_ranks, v_ranks: :class:`ProjRanks` of the q and v updates (v uses H_kv heads).
        scale, head_bias, init: see the module docstring.

    forward(x (..., d)) -> fused [Q | K | V] (..., H·p + 2·H_kv·p) (drop-in for ``c_attn``);
    forward_split(x) -> (Q, K, V).
    """

    # exact= of the op (None: its default; kfused.integration.set_exact sets it)
    exact: Optional[bool] = None

    def __init__(self, *, fused: Optional[nn.Module] = None, q: Optional[nn.Module] = None,
                 k: Optional[nn.Module] = None, v: Optional[nn.Module] = None, n_heads: int,
                 n_kv_heads: Optional[int] = None, q_ranks: ProjRanks = ProjRanks(),
                 v_ranks: ProjRanks = ProjRanks(), scale: float = 1.0,
                 head_bias: Optional[bool] = None, init: str = "zero"):
        super().__init__()
        if (fused is None) == (q is None or k is None or v is None):
            raise ValueError("give either fused= (one q|k|v projection) or all of q=, k=, v=")
        H = _check_heads("n_heads", n_heads)
        Hkv = _check_heads("n_kv_heads", n_kv_heads, optional=True)
        Hkv = H if Hkv is None else Hkv
        for name, r in (("q_ranks", q_ranks), ("v_ranks", v_ranks)):
            if not isinstance(r, ProjRanks):
                raise TypeError(f"{name} must be a ProjRanks, got {type(r).__name__}")
        scale = _check_scale_arg("scale", scale)
        if H % Hkv != 0:
            raise ValueError(f"n_kv_heads={Hkv} must divide n_heads={H}")
        if fused is not None:
            out, d = _out_in(fused)
            p = _head_width(out, H + 2 * Hkv, "fused q|k|v projection",
                            heads=f"n_heads + 2 * n_kv_heads = {H} + 2 * {Hkv}, in all")
            self.fused = fused
            self.q = self.k = self.v = None
        else:
            (nq, d), (nk, dk), (nv, dv) = _out_in(q), _out_in(k), _out_in(v)
            p = _head_width(nq, H, "q projection")
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
        self._freeze_base()

    def _frozen_children(self) -> Tuple[str, ...]:
        return ("fused",) if self.fused is not None else ("q", "k", "v")

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
        x, cast = _amp(x)
        wq, wk, wv, bq, bk, bv = (cast(t) for t in self._weights())
        qa, va = self.q_adapter, self.v_adapter
        return headwise_qkv(x, wq, wk, wv, bq, bk, bv, n_heads=self.n_heads,
                            n_kv_heads=self.n_kv_heads,
                            q=qa.factors().map(cast) if qa.ranks.active else None,
                            v=va.factors().map(cast) if va.ranks.active else None,
                            backend=backend,
                            fused_output=fused_output, exact=self.exact)

    def delta_weights(self):
        """[(ΔW, Δb, target slice) for q and v] in (out, in) layout of the fused weight."""
        wq, wk, wv, bq, bk, bv = self._weights()
        out = []
        sq, _, sv = self._splits()
        for ad, Hs, sl in ((self.q_adapter, self.n_heads, sq), (self.v_adapter, self.n_kv_heads,
                                                                   sv)):
            if ad.ranks.active:
                f = ad.factors()
                dW, db = projection_delta_weight(f, Hs, *_key_for(f, wk, bk), self.n_kv_heads)
                out.append((dW, db, sl, ad))
        return out

    @torch.no_grad()
    def _fold(self, sign: float) -> None:
        deltas = self.delta_weights()  # computed before any weight changes (W_k is untouched)
        mods = [self.fused if self.fused is not None else (self.q if ad is self.q_adapter
                                                           else self.v)
                for _, _, _, ad in deltas]
        for (_, db, _, _), mod in zip(deltas, mods):
            _check_bias_target(mod, db)       # every section before any weight changes
        for (dW, db, sl, ad), mod in zip(deltas, mods):
            rows = sl if self.fused is not None else slice(None)
            _add_to_weight(mod, sign * dW, rows)
            _add_bias(mod, sign * db if db is not None else None, rows)


class HeadwiseOutput(_FoldsIntoBase, nn.Module):
    """Adapted output projection (docs/math.md §2, basis O), wrapping a frozen nn.Linear / Conv1D.

    Args:
        base: frozen W_o (in = H·p, out = d).
        n_heads: H.
        ranks: :class:`ProjRanks` with ``wise`` (rank of each row block) and ``shared``.

    forward(o (..., H·p)) -> (..., d).
    """

    # exact= of the op (None: its default; kfused.integration.set_exact sets it)
    exact: Optional[bool] = None

    def __init__(self, base: nn.Module, n_heads: int, ranks: ProjRanks, *, scale: float = 1.0,
                 head_bias: Optional[bool] = None, init: str = "zero"):
        super().__init__()
        _check_heads("n_heads", n_heads)
        if not isinstance(ranks, ProjRanks):
            raise TypeError(f"ranks must be a ProjRanks, got {type(ranks).__name__}")
        scale = _check_scale_arg("scale", scale)
        if head_bias is None:
            head_bias = getattr(base, "bias", None) is not None
        if ranks.lite:
            raise ValueError("ranks.lite must be 0 for the output projection")
        dout, din = _out_in(base)
        p = _head_width(din, n_heads, "output projection (its input)")
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
        self._freeze_base()

    def reset_parameters(self, init: Optional[str] = None) -> None:
        """As :meth:`_QVFactors.reset_parameters` (None: the module's own init)."""
        init = getattr(self, "init", "zero") if init is None else init
        check_init(init, INITS, "HeadwiseOutput")
        self.init = init
        init_pair_(self.wise_A, self.wise_B, init, bias=self.c)
        init_pair_(self.shared_A, self.shared_B, init)

    def forward(self, o: torch.Tensor, backend: Optional[str] = None) -> torch.Tensor:
        if self.merged or not self.ranks.active:
            return self.base(o)
        o, cast = _amp(o)
        return headwise_oproj(o, cast(_linear_weight(self.base)),
                              cast(getattr(self.base, "bias", None)), n_heads=self.n_heads,
                              wise_A=cast(self.wise_A), wise_B=cast(self.wise_B),
                              wise_c=cast(self.c), shared_A=cast(self.shared_A),
                              shared_B=cast(self.shared_B), scale=self.scale, backend=backend,
                              exact=self.exact)

    def delta_weight(self):
        return oproj_delta_weight(self.n_heads, self.wise_A, self.wise_B, self.c,
                                  self.shared_A, self.shared_B, self.scale)

    def _active(self) -> bool:
        return self.ranks.active


HEADWISE_MODULES = (HeadwiseProjection, HeadwiseQKV, HeadwiseOutput)
