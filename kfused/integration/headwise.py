"""Kernel-wise, Kernel-wise-lite, Kernel-mix, Kernel-mix-lite (docs/math.md §2) in Hugging Face models:
placing the headwise modules in every attention block, and the Kernel-mix paper's presets.

:func:`attach_headwise` adapts every block :func:`kfused.integration.arch.attention_blocks`
finds (GPT-2, BERT/RoBERTa, Llama-style, T5) according to a
:class:`~kfused.modules.headwise.HeadwiseConfig`:

* a fused q|k|v projection (GPT-2's ``c_attn``) becomes one
  :class:`~kfused.modules.headwise.HeadwiseQKV` (one kernel for Q, K, V);
* separate q and v projections become :class:`~kfused.modules.headwise.HeadwiseProjection`
  (Kernel-wise-lite uses the block's frozen k projection; GQA aware: v has n_kv_heads heads);
* the output projection becomes :class:`~kfused.modules.headwise.HeadwiseOutput`.

On BERT, Llama and T5 the model's own attention code calls q and v separately, so each runs its
own fused kernel (frozen GEMM + its updates in one pass over X); the all-in-one q|k|v kernel is
used where the model has one fused projection (GPT-2).

Cross-attention (T5's ``EncDecAttention``, BERT's ``crossattention``): q reads the decoder
states X while k and v read the encoder output. The updates keep docs/math.md §2's definitions with each
projection's own input as basis: Kernel-wise on q uses X; Kernel-wise on v uses the encoder
output; Kernel-wise-lite on v uses ``K^h`` = encoder output · W_k^h, which *is* the
cross-attention's key; o is adapted as in self-attention. Kernel-wise-lite on **q** is not
defined there (a decoder token has no K^h of its own to reuse), so q's lite part is left out in
cross-attention: with kernel_wise_lite q is not adapted there, with kernel_mix_lite only q's
shared LoRA part is. Every update stays a linear change of W_q / W_v / W_o, so merge()/unmerge()
are exact. T5 has no projection biases, so no per-head bias ``c`` is added unless
``head_bias=True`` (and then merge() refuses, as there is no bias to fold into).

Presets: the Kernel-mix paper's rows are entries of the one preset table
(``kfused.integration.config.PRESETS``); :data:`HEADWISE_PRESETS` holds them as
HeadwiseConfig, and :func:`headwise_parameter_count` gives their closed-form trainable counts
(``python -m kfused.integration.headwise`` prints them next to the paper's percentages).

Counting (per layer, d = H·p, per-head bias ``c`` included as in the released code):
    shared LoRA rank s        2·d·s
    Kernel-wise rank r (q/v)  H·r·d + H·p·r + c  =  r·d·(H + 1) + d
    Kernel-wise-lite rank r   H·r·p + H·p·r + c  =  2·r·d + d
    Kernel-wise on W_o rank r H·r·p + d·H·r + c  =  r·d·(H + 1) + d
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

from torch import nn

from kfused.integration.arch import (ArchSpec, AttentionBlock, attention_blocks,
                                     describe_archs)
from kfused.integration.config import AdapterConfig, preset
from kfused.modules._linear import is_conv1d
from kfused.modules.headwise import (HEADWISE_MODULES, HeadwiseConfig, HeadwiseOutput,
                                     HeadwiseProjection, HeadwiseQKV, ProjRanks)

__all__ = ["HEADWISE_METHODS", "headwise_config", "attach_headwise", "attach_headwise_block",
           "adapter_parameters", "mark_only_adapters_trainable", "headwise_parameter_count",
           "HEADWISE_PRESETS", "PAPER_PERCENT", "headwise_preset", "preset_table"]

HEADWISE_METHODS = ("kernel_wise", "kernel_wise_lite", "kernel_mix", "kernel_mix_lite")
_PROJS = ("q", "v", "o")


# ------------------------------------------------------------------------------------------
# AdapterConfig -> HeadwiseConfig


def _pair(value, default: int) -> Tuple[int, int]:
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ValueError(f"Kernel-mix ranks are (wise, shared) pairs, got {value!r}")
        return int(value[0]), int(value[1])
    return int(value), default


def headwise_config(cfg: AdapterConfig) -> HeadwiseConfig:
    """The HeadwiseConfig of an AdapterConfig with a headwise method (or "lora" on q, v, o,
    which is the headwise modules' shared part alone, scale alpha / r).

    Ranks (``cfg.ranks[proj]`` for proj in q, v, o; default ``r``):
        kernel_wise       int                -> per-head wise rank
        kernel_wise_lite  int                -> per-head lite rank (q, v only)
        kernel_mix        (wise, shared)     -> wise rank + shared LoRA rank
        kernel_mix_lite   (lite, shared)     -> lite rank + shared LoRA rank (q, v only)
        lora              int                -> shared LoRA rank
    ``options["lite"]`` lists projections whose per-head part is lite. ``cfg.init`` None
    keeps HeadwiseConfig's default.
    """
    method = cfg.method
    if method not in HEADWISE_METHODS + ("lora",):
        raise ValueError(f"method {method!r} has no headwise form; headwise methods: "
                         f"{HEADWISE_METHODS} (and 'lora' on q, v, o)")
    targets = cfg.targets if cfg.targets is not None else ["q", "v"]
    bad = [t for t in targets if t not in _PROJS]
    if bad:
        raise ValueError(f"{method}: targets must be among q, v, o (the per-head projections), "
                         f"got {bad}")
    lite = cfg.options.get("lite", [])
    if (not isinstance(lite, (list, tuple)) or not all(isinstance(t, str) for t in lite)
            or not set(lite) <= set(targets)):
        raise ValueError(f"{method}: options['lite'] must be a list of the adapted projections "
                         f"whose per-head part is lite (among targets {list(targets)}), got "
                         f"{lite!r}")
    lite_projs = set(lite)
    if method in ("kernel_wise_lite", "kernel_mix_lite"):
        lite_projs |= set(targets)
    ranks: Dict[str, ProjRanks] = {}
    for proj in targets:
        value = cfg.rank_of(proj, single=method == "lora" or method.startswith("kernel_wise"))
        if method == "lora":
            ranks[proj] = ProjRanks(shared=int(value))
            continue
        if method.startswith("kernel_wise"):
            wise, shared = int(value), 0
        else:
            wise, shared = _pair(value, cfg.r)
        lite = proj in lite_projs
        ranks[proj] = ProjRanks(wise=0 if lite else wise, lite=wise if lite else 0, shared=shared)
    scale = cfg.scale
    if method == "lora":
        scale = (cfg.alpha if cfg.alpha is not None else cfg.r) / cfg.r
    extra = {} if cfg.init is None else {"init": cfg.init}
    return HeadwiseConfig(**ranks, scale=scale, **extra)


# ------------------------------------------------------------------------------------------
# Placing the modules


def attach_headwise_block(block: AttentionBlock, config: HeadwiseConfig) -> Dict[str, nn.Module]:
    """Adapt one attention block in place; returns {qualified name: new module}."""
    kw = dict(scale=config.scale, head_bias=config.head_bias, init=config.init)
    H, Hkv = block.n_heads, block.n_kv_heads
    placed: Dict[str, nn.Module] = {}

    def put(role: str, new: nn.Module) -> None:
        placed[block.set(role, new)] = new

    def frozen(role: str, base: nn.Module) -> nn.Module:
        # a projection another adapter already wraps (an earlier part of a composite: LoRA,
        # KronA, the inducer's output projection) exposes its frozen layer's weight, which the
        # per-head module would read alone: that adapter's update silently left the forward
        if isinstance(base, nn.Linear) or is_conv1d(base):
            return base
        if isinstance(base, HEADWISE_MODULES):  # skipping it left this part out silently
            raise ValueError(f"{block.qualified(role)}: the {role} projection is already a "
                             f"{type(base).__name__} (an earlier per-head part); one per-head "
                             f"module per projection: give every per-head rank of q, v and o "
                             f"in one Kernel-wise/-mix part")
        order = (" (list the Kernel-wise/-mix part before the inducer: the inducer then wraps "
                 "the adapted projection)" if type(base).__name__ == "InducerOutputProjection"
                 else "")
        raise ValueError(f"{block.qualified(role)}: the {role} projection is a "
                         f"{type(base).__name__}, expected nn.Linear or transformers Conv1D: "
                         f"another adapter already wraps it, and a Kernel-wise/-mix module "
                         f"would run its frozen weight alone, dropping that adapter's update. "
                         f"Adapt each projection with one linear-site or per-head method"
                         f"{order}")

    if block.fused_qkv:
        fused = block.get("qkv")
        if config.q.active or config.v.active:
            put("qkv", HeadwiseQKV(fused=frozen("qkv", fused), n_heads=H, n_kv_heads=Hkv,
                                   q_ranks=config.q, v_ranks=config.v, **kw))
    else:
        q_ranks = config.q
        if block.cross and q_ranks.lite:  # no K^h for decoder tokens (module docstring)
            q_ranks = ProjRanks(wise=q_ranks.wise, lite=0, shared=q_ranks.shared)
        key = block.get("k")
        for role, ranks, heads in (("q", q_ranks, H), ("v", config.v, Hkv)):
            base = block.get(role)
            if ranks.active:
                put(role, HeadwiseProjection(frozen(role, base), heads, ranks, key=key,
                                             n_key_heads=Hkv, **kw))
    o = block.get("o")
    if config.o.active:
        put("o", HeadwiseOutput(frozen("o", o), H, config.o, **kw))
    return placed


def attach_headwise(model: nn.Module, config: HeadwiseConfig,
                    arch: Optional[ArchSpec] = None) -> Dict[str, nn.Module]:
    """Replace the attention projections of every attention block of ``model`` by headwise
    adapter modules (see the module docstring); ``arch`` defaults to the detected one.

    Returns {qualified name: new module}. The projections the new modules wrap are frozen
    (``requires_grad=False``, as LoRALinear and KronALinear freeze theirs); the model's other
    parameters are not touched: call :func:`mark_only_adapters_trainable` to freeze them.
    """
    replaced: Dict[str, nn.Module] = {}
    for block in attention_blocks(model, arch):
        replaced.update(attach_headwise_block(block, config))
    if not replaced and (config.q.active or config.v.active or config.o.active):
        raise ValueError(f"attach_headwise found no {describe_archs()} attention block in "
                         f"{type(model).__name__}")
    return replaced


def adapter_parameters(model: nn.Module) -> List[nn.Parameter]:
    """Every parameter owned by a headwise adapter module (not the frozen projections)."""
    params = []
    for mod in model.modules():
        if isinstance(mod, HEADWISE_MODULES):
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


def _backend_default(module: nn.Module, args, kwargs):
    """Forward pre-hook: the module's ``backend`` (AdapterConfig.backend, or what
    :func:`kfused.integration.set_backend` set) when the caller passes none."""
    backend = getattr(module, "backend", None)
    if backend is not None and len(args) < 2 and kwargs.get("backend") is None:
        kwargs = dict(kwargs, backend=backend)
    return args, kwargs


def use_module_backend(module: nn.Module, backend: Optional[str]) -> None:
    """The headwise modules take the backend per call and the model never passes one:
    remember ``backend`` on the module and supply it on every call."""
    module.backend = backend
    module.register_forward_pre_hook(_backend_default, with_kwargs=True)


# ------------------------------------------------------------------------------------------
# The Kernel-mix paper's presets and their closed-form counts

# Trainable share the paper reports (tables 1-3), and on which model; the keys are the
# paper's rows in PRESETS.
PAPER_PERCENT: Dict[str, tuple] = {
    "lora-4": (0.13, "gpt2"),
    "kernel-mix-lite-qv-tiny": (0.07, "gpt2"),
    "kernel-mix-lite-qv-small": (0.13, "gpt2"),
    "kernel-mix-qvo-intermediate": (1.61, "gpt2"),
    "kernel-wise-lite-qv": (0.13, "gpt2"),
    "kernel-mix-qvo-roberta-0.5pct": (0.5, "roberta-base"),
    "lora-54": (1.61, "gpt2"),
    "kernel-wise-mq": (1.56, "gpt2"),
    "kernel-wise-mv": (1.56, "gpt2"),
    "kernel-wise-qvo": (1.61, "gpt2"),
}

# Widths and total parameter counts of the models the paper used.
MODELS = {
    "gpt2": dict(d=768, H=12, layers=12, total=124_439_808),
    "roberta-base": dict(d=768, H=12, layers=12, total=124_645_632),
}


def headwise_preset(name: str, **overrides) -> HeadwiseConfig:
    """The HeadwiseConfig of preset ``name`` (a headwise or LoRA-on-q/v entry of PRESETS),
    optionally with HeadwiseConfig fields replaced (e.g. ``init="paper"``)."""
    cfg = headwise_config(preset(name))
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


HEADWISE_PRESETS: Dict[str, HeadwiseConfig] = {name: headwise_preset(name)
                                               for name in PAPER_PERCENT}


def headwise_parameter_count(cfg: HeadwiseConfig, d: int, H: int, layers: int = 1,
                             n_kv_heads: Optional[int] = None, head_bias: bool = True) -> int:
    """Trainable parameters of ``cfg`` on a model of width d, H heads, ``layers`` blocks.

    With grouped-query attention (``n_kv_heads < H``) the v projection has H_kv heads.
    """
    p = d // H
    Hkv = n_kv_heads or H

    def qv(r: ProjRanks, Hs: int) -> int:
        N = Hs * p
        n = r.shared * (d + N)
        n += r.wise * Hs * (d + p)
        n += r.lite * Hs * 2 * p
        if head_bias and (r.wise or r.lite):
            n += N
        return n

    o = cfg.o
    n_o = o.shared * (H * p + d) + o.wise * H * (p + d) + (d if (head_bias and o.wise) else 0)
    return layers * (qv(cfg.q, H) + qv(cfg.v, Hkv) + n_o)


def preset_table() -> str:
    """One row per paper preset: parameters and trainable share on the paper's model vs
    the paper's reported share."""
    rows = [f"{'preset':<30} {'model':<13} {'params':>10} {'share %':>8} {'paper %':>8}"]
    for name, cfg in HEADWISE_PRESETS.items():
        pct, model = PAPER_PERCENT[name]
        m = MODELS[model]
        n = headwise_parameter_count(cfg, m["d"], m["H"], m["layers"])
        rows.append(f"{name:<30} {model:<13} {n:>10,d} {100 * n / m['total']:>8.3f} {pct:>8.2f}")
    return "\n".join(rows)


if __name__ == "__main__":  # pragma: no cover
    print(preset_table())
