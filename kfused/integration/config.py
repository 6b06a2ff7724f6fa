"""AdapterConfig: the one small dataclass that describes an injection, and named presets.

Everything here is JSON-serialisable (:meth:`AdapterConfig.to_dict` / :meth:`from_dict`), so the
config travels inside every adapter checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from kfused.modules._init import INITS

Rank = Union[int, Sequence[int]]


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
        scale: adapter output scale s for KronA / KronA^B / parallel adapters.
        a_shape, b_shape: KronA factor shapes (a_out, a_in) / (b_out, b_in); None: derived.
        init: how the adapter parameters start, one vocabulary for every method (defined in
            :mod:`kfused.modules._init`): "zero" (exact start: the adapted model equals the
            frozen one), "random" (every factor kaiming-uniform: a non-zero update) or "paper"
            (every tensor ``fmod(randn, 2)·0.01``, as the papers' released code). None: the
            method's default, "zero" where the method has an exact start, "random" for
            KronA^B_res and "paper" for prefix tuning, which have none. A method that cannot honour a value raises
            ValueError at inject (``kfused.integration.methods()[name].inits`` lists each
            method's values; a composite's parts can differ through ``options[part]``).
        dropout: adapter input dropout (LoRA).
        bias: block-parallel adapters get a learnable output bias (KronA^B).
        backend: kernel backend for the fused modules ("auto", "triton", "cuda", "reference";
            None: $KFUSED_BACKEND or auto).
        adapter_dtype: dtype of the adapter parameters ("float32" keeps them in float32 on a
            half-precision base; None: the base weights' dtype).
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
        if isinstance(self.targets, str):
            self.targets = [self.targets]
        if isinstance(self.exclude, str):
            self.exclude = [self.exclude]
        if self.targets is not None:
            self.targets = list(self.targets)
        for f in ("a_shape", "b_shape"):
            v = getattr(self, f)
            if v is not None:
                if len(v) != 2:
                    raise ValueError(f"{f} must be (out, in), got {v!r}")
                setattr(self, f, (int(v[0]), int(v[1])))
        if int(self.r) < 1:
            raise ValueError(f"r must be >= 1, got {self.r}")
        if self.init is not None and self.init not in INITS:
            raise ValueError(f"init={self.init!r} is not an init value; valid values: None (the "
                             "method's default); "
                             + "; ".join(f"{k!r} ({v})" for k, v in INITS.items()))

    def rank_for(self, role: Optional[str], name: str = "") -> Rank:
        """The rank for one target: ``ranks[role]``, else a ranks key that is a suffix of the
        module name, else ``r``."""
        if role is not None and role in self.ranks:
            return self.ranks[role]
        for k, v in self.ranks.items():
            if name == k or name.endswith("." + k):
                return v
        return self.r

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
