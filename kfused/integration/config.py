"""AdapterConfig: the one small dataclass that describes an injection, and named presets.

Everything here is JSON-serialisable (:meth:`AdapterConfig.to_dict` / :meth:`from_dict`), so the
config travels inside every adapter checkpoint.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from kfused import _validate
from kfused.modules._init import INITS

Rank = Union[int, Sequence[int]]


_RANK_KEYS_USED: List[set] = []   # one set per inject() in progress: the ranks keys looked up


_is_int, _is_real = _validate.is_int, _validate.is_real


@dataclasses.dataclass
class AdapterConfig:
    """What to inject and where.

    Attributes:
        method: a registered method name (``kfused.integration.methods()`` lists them): "lora",
            "krona", "krona_b", "krona_b_res", "parallel_adapter", "kernel_wise",
            "kernel_wise_lite", "kernel_mix", "kernel_mix_lite", "inducer", "inducer_lora",
            "mam_inducer", "prefix", "mam".
        targets: where to attach: role names ("q", "k", "v", "o", "qkv", "ffn_in", "ffn_out",
            "ffn", "attn"; see :mod:`kfused.integration.arch`) and/or regular expressions
            matched (``re.fullmatch``) against module names, or plain module-name suffixes.
            None: the method's default targets for the detected architecture.
        exclude: regular expressions of module names never to adapt.
        r: default rank / bottleneck width. ranks: per-role (or per-target string) overrides;
            values are ints or, for methods with several ranks per projection (Kernel-mix:
            (wise, shared)), tuples.
        alpha: LoRA numerator (scale = alpha / r); None: alpha = r.
        scale: adapter output scale s for KronA / KronA^B / parallel adapters and the
            per-head methods (Kernel-wise / Kernel-mix); LoRA scales by alpha / r instead.
        a_shape, b_shape: KronA factor shapes (a_out, a_in) / (b_out, b_in); None: derived.
        init: how the adapter parameters start, one vocabulary for every method (defined in
            :mod:`kfused.modules._init`): "zero" (exact start: the adapted model equals the
            frozen one), "random" (every factor kaiming-uniform: a non-zero update) or "paper"
            (every tensor ``fmod(randn, 2)·0.01``, as the papers' released code). None: the
            method's default, "zero" where the method has an exact start, "random" for
            KronA^B_res and "paper" for prefix tuning and the inducer with prefix columns
            (``options["prefix_len"]``), which have none. A method that cannot honour a value raises
            ValueError at inject (``kfused.integration.methods()[name].inits`` lists each
            method's values; a composite's parts can differ through ``options[part]``).
        dropout: adapter input dropout (LoRA; inject refuses a non-zero value for a method
            with no LoRA part).
        bias: block-parallel adapters get a learnable output bias (KronA^B).
        backend: kernel backend for the fused modules ("auto", "triton", "cuda", "reference";
            None: $KFUSED_BACKEND or auto).
        adapter_dtype: dtype of the adapter parameters ("float32" keeps them in float32 on a
            half-precision base; None: the base weights' dtype); a torch.dtype is kept by name.
        arch: architecture name (None: detected from ``model.config.model_type``).
        options: method-specific extras; for composite methods, ``options[part]`` holds field
            overrides for one part, e.g. ``{"lora": {"r": 8, "targets": ["q", "v"]}}``.
    """

    method: str = "lora"
    targets: Optional[List[str]] = None
    exclude: Optional[List[str]] = None
    r: int = 8
    ranks: Dict[str, Any] = dataclasses.field(default_factory=dict)
    alpha: Optional[float] = None
    scale: float = 1.0
    a_shape: Optional[Tuple[int, int]] = None
    b_shape: Optional[Tuple[int, int]] = None
    init: Optional[str] = None
    dropout: float = 0.0
    bias: bool = False
    backend: Optional[str] = None
    adapter_dtype: Optional[str] = "float32"
    arch: Optional[str] = None
    options: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.method, str):
            raise TypeError(f"AdapterConfig.method must be a method name (str), got "
                            f"{type(self.method).__name__} {self.method!r}")
        for f in ("targets", "exclude"):
            v = getattr(self, f)
            if isinstance(v, str):
                v = [v]
            if v is not None:
                if not isinstance(v, (list, tuple)) or not all(isinstance(t, str) for t in v):
                    raise TypeError(f"AdapterConfig.{f} must be a list of strings (role names, "
                                    f"module-name regexes or suffixes), got {v!r}")
                for t in v:
                    try:
                        re.compile(t)
                    except re.error as exc:
                        raise ValueError(f"AdapterConfig.{f}: {t!r} is not a valid regular "
                                         f"expression ({exc})") from exc
                v = list(v)
            setattr(self, f, v)
        for f in ("a_shape", "b_shape"):
            v = getattr(self, f)
            if v is not None:
                if not isinstance(v, (list, tuple)) or len(v) != 2 or not all(
                        _is_int(x) and x >= 1 for x in v):
                    raise ValueError(f"AdapterConfig.{f} must be (out, in), two positive "
                                     f"integers, got {v!r}")
                setattr(self, f, (int(v[0]), int(v[1])))
        if not _is_int(self.r) or self.r < 1:
            raise (ValueError if _is_int(self.r) else TypeError)(
                f"AdapterConfig.r must be an integer >= 1, got {self.r!r}")
        self.r = int(self.r)
        if not isinstance(self.ranks, dict):
            raise TypeError(f"AdapterConfig.ranks must be a dict of role or module name -> rank, "
                            f"got {type(self.ranks).__name__} {self.ranks!r}")
        for k, v in self.ranks.items():
            ok = (_is_int(v) and v >= 0) or (
                isinstance(v, (list, tuple)) and v and all(_is_int(x) and x >= 0 for x in v))
            if not isinstance(k, str) or not ok:
                raise ValueError(f"AdapterConfig.ranks[{k!r}] must be a non-negative integer (or "
                                 f"a tuple of them, e.g. Kernel-mix (wise, shared)), got {v!r}")
        if self.alpha is not None and not (_is_real(self.alpha) and self.alpha != 0):
            raise ValueError(f"AdapterConfig.alpha must be a finite non-zero number (scale = "
                             f"alpha / r) or None, got {self.alpha!r}")
        if not _is_real(self.scale):
            raise ValueError(f"AdapterConfig.scale must be a finite number, got {self.scale!r}")
        if not (_is_real(self.dropout) and 0.0 <= self.dropout < 1.0):
            raise ValueError(f"AdapterConfig.dropout must be a probability in [0, 1), got "
                             f"{self.dropout!r}")
        if not isinstance(self.bias, bool):
            raise TypeError(f"AdapterConfig.bias must be a bool, got {self.bias!r}")
        if self.backend is not None:
            from kfused.backends import BACKENDS

            if isinstance(self.backend, str):  # any case, as the ops and modules read it
                self.backend = self.backend.lower()
            if self.backend not in ("auto",) + BACKENDS:
                raise ValueError(f"AdapterConfig.backend={self.backend!r} is not a backend; "
                                 f"expected None, 'auto' or one of {', '.join(BACKENDS)}")
        if self.adapter_dtype is not None and not isinstance(self.adapter_dtype, str):
            import torch

            if not isinstance(self.adapter_dtype, torch.dtype):
                raise TypeError(f"AdapterConfig.adapter_dtype must be a dtype name (e.g. "
                                f"'float32'), a torch.dtype or None, got "
                                f"{type(self.adapter_dtype).__name__} {self.adapter_dtype!r}")
            # by name: the config is recorded as JSON (kfused.save)
            self.adapter_dtype = str(self.adapter_dtype).replace("torch.", "")
        if not isinstance(self.options, dict):
            raise TypeError(f"AdapterConfig.options must be a dict, got "
                            f"{type(self.options).__name__} {self.options!r}")
        if self.init is not None and self.init not in INITS:
            raise ValueError(f"init={self.init!r} is not an init value; valid values: None (the "
                             "method's default); "
                             + "; ".join(f"{k!r} ({v})" for k, v in INITS.items()))

    def rank_for(self, role: Optional[str], name: str = "", single: bool = False) -> Rank:
        """The rank for one target: ``ranks[role]``, else a ranks key that is a suffix of the
        module name, else ``r``. ``single``: the method takes one rank per target, and a
        tuple is refused (ValueError naming the key)."""
        if role is not None and role in self.ranks:
            return self._used(role, single)
        for k in self.ranks:
            if name == k or name.endswith("." + k):
                return self._used(k, single)
        return self.r

    def rank_of(self, key: str, single: bool = False) -> Rank:
        """``ranks[key]`` if given, else ``r`` (methods that look ranks up by their own keys,
        e.g. the per-head projections q, v, o); ``single`` as for :meth:`rank_for`."""
        return self._used(key, single) if key in self.ranks else self.r

    def _used(self, key: str, single: bool = False) -> Rank:
        for used in _RANK_KEYS_USED:  # inject() checks that every ranks key was used
            used.add(key)
        value = self.ranks[key]
        if single and not _is_int(value):
            raise ValueError(f"AdapterConfig.ranks[{key!r}] = {value!r}: method "
                             f"{self.method!r} takes one rank per target, an integer; tuples "
                             "are for methods with several ranks per projection (Kernel-mix: "
                             "(wise, shared))")
        return value

    def replace(self, **changes) -> "AdapterConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        for f in ("a_shape", "b_shape"):
            if d[f] is not None:
                d[f] = list(d[f])
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "AdapterConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown AdapterConfig fields {sorted(unknown)}; "
                             f"known: {sorted(known)}")
        return cls(**d)


# ------------------------------------------------------------------------------------------
# Presets named after the papers' configurations: the one preset table. Values are
# AdapterConfig keyword arguments; kfused.integration.headwise derives the Kernel-mix paper's
# HeadwiseConfig rows (and their closed-form parameter counts) from the same entries.

PRESETS: Dict[str, Dict[str, Any]] = {
    # LoRA paper (004), GPT-2 on E2E: r = 4, alpha = 32 on W_q, W_v.
    "lora-e2e": dict(method="lora", targets=["q", "v"], r=4, alpha=32),
    # Kernel-mix paper (000) table B.5 baseline: LoRA-4 on q and v.
    "lora-4": dict(method="lora", targets=["q", "v"], r=4),
    # KronA paper (003) tables 16-18 (GLUE, 768-wide models).
    "krona-glue": dict(method="krona", targets=["q", "v"], a_shape=(32, 24), b_shape=(24, 32),
                       scale=1.0),
    "krona-glue-2x384": dict(method="krona", targets=["q", "v"], a_shape=(2, 384),
                             b_shape=(384, 2), scale=1.0),
    "krona_b-glue": dict(method="krona_b", targets=["ffn"], a_shape=(32, 24), b_shape=(24, 32),
                         scale=16.0, bias=True),
    "krona_b_res-glue": dict(method="krona_b_res", targets=["ffn"], a_shape=(32, 24),
                             b_shape=(24, 32), scale=16.0, bias=True),
    # Kernel-mix paper (000) table B.5; ranks are (wise, shared) per projection. LoRA-54: the
    # table prints "0, 4"; its name and its 1.61 % budget mean rank 54 on q and v.
    "lora-54": dict(method="lora", targets=["q", "v"], r=54),
    "kernel-mix-lite-qv-tiny": dict(method="kernel_mix_lite", targets=["q", "v"],
                                    ranks={"q": (1, 1), "v": (1, 1)}),
    "kernel-mix-lite-qv-small": dict(method="kernel_mix_lite", targets=["q", "v"],
                                     ranks={"q": (2, 2), "v": (1, 2)}),
    "kernel-mix-qvo-intermediate": dict(method="kernel_mix", targets=["q", "v", "o"],
                                        ranks={"q": (3, 12), "v": (8, 8), "o": (8, 8)},
                                        options={"lite": ["v"]}),
    "kernel-wise-lite-qv": dict(method="kernel_wise_lite", targets=["q", "v"],
                                ranks={"q": 4, "v": 4}),
    "kernel-mix-qvo-roberta-0.5pct": dict(method="kernel_mix", targets=["q", "v", "o"],
                                          ranks={"q": (1, 2), "v": (2, 4), "o": (2, 4)},
                                          options={"lite": ["v"]}),
    # Kernel-mix paper (000) table 3 ablations (Kernel-wise only).
    "kernel-wise-mq": dict(method="kernel_wise", targets=["q", "v"], ranks={"q": 12, "v": 4}),
    "kernel-wise-mv": dict(method="kernel_wise", targets=["q", "v"], ranks={"q": 4, "v": 12}),
    "kernel-wise-qvo": dict(method="kernel_wise", targets=["q", "v", "o"],
                            ranks={"q": 5, "v": 10, "o": 10}, options={"lite": ["v"]}),
    # He et al. (002) §4.6: MAM adapter = prefix (l = 30) on attention + scaled parallel
    # adapter (r = 512, s = 4) on the FFN.
    "mam-adapter": dict(method="mam", options={"prefix": {"r": 30},
                                               "parallel_adapter": {"r": 512, "scale": 4.0}}),
    "prefix-30": dict(method="prefix", r=30),
    # Inducer-tuning (001): inducer on every self-attention; + LoRA on q, v; MAM variant.
    "inducer": dict(method="inducer", r=10),
    "inducer-lora": dict(method="inducer_lora", r=10,
                         options={"lora": {"r": 8, "targets": ["q", "v"]}}),
    "mam-inducer": dict(method="mam_inducer", r=10,
                        options={"parallel_adapter": {"r": 512, "scale": 4.0}}),
}


def preset(name: str, **overrides) -> AdapterConfig:
    """An AdapterConfig from a named preset (see ``PRESETS``), with field overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    kw = dict(PRESETS[name])
    kw.update(overrides)
    return AdapterConfig(**kw)
