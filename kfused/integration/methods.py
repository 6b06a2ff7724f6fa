"""Every built-in method, registered with :func:`kfused.integration.registry.register_method`:
LoRA, KronA (linear sites), KronA^B, KronA^B_res, the scaled parallel adapter (block sites),
Kernel-wise/-lite and Kernel-mix/-lite, inducer and prefix (attention sites) and the
composites. ``_lora`` and ``_krona_b`` are complete examples of a method; the registry's
docstring gives the contract.

Each method's ``inits`` are what its modules honour (see :mod:`kfused.modules._init`).
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from kfused.integration.arch import AttentionBlock, attention_blocks
from kfused._validate import is_int
from kfused.integration.config import AdapterConfig
from kfused.integration.headwise import attach_headwise_block, headwise_config, use_module_backend
from kfused.integration.hf_attention import (add_position_offset, attach_inducer_block,
                                             check_position_offset, check_supported,
                                             register as register_attention,
                                             set_implementation)
from kfused.integration.registry import Target, register_method
from kfused.modules.headwise import INITS as HEADWISE_INITS
from kfused.modules.inducer import InducerAttention
from kfused.modules.krona import KronABlock, KronALinear, factors_for_budget
from kfused.modules.lora import LoRALinear
from kfused.modules.parallel_adapter import ScaledParallelAdapter

# ------------------------------------------------------------------------------------------
# linear sites


def _lora(module: nn.Module, target: Target, cfg: AdapterConfig) -> nn.Module:
    r = cfg.rank_for(target.role, target.name, single=True)
    return LoRALinear(module, r=int(r), alpha=cfg.alpha, dropout=cfg.dropout, init=cfg.init,
                      backend=cfg.backend)


def _krona_shapes(cfg: AdapterConfig) -> dict:
    """``options["krona_shapes"]``: per-module factor shapes, {module name: [a_shape,
    b_shape]} (e.g. from kfused.from_peft), each shape (out, in) of positive integers; as
    {name: ((a_out, a_in), (b_out, b_in))}, else TypeError / ValueError naming the option."""
    shapes = cfg.options.get("krona_shapes")
    if shapes is None:
        return {}
    if not isinstance(shapes, dict):
        raise TypeError(f"{cfg.method}: options['krona_shapes'] must be a dict of module name "
                        f"-> [a_shape, b_shape], got {type(shapes).__name__} {shapes!r}")
    out = {}
    for name, pair in shapes.items():
        ok = (isinstance(name, str) and isinstance(pair, (list, tuple)) and len(pair) == 2
              and all(isinstance(s, (list, tuple)) and len(s) == 2
                      and all(is_int(x) and x >= 1 for x in s) for s in pair))
        if not ok:
            raise ValueError(f"{cfg.method}: options['krona_shapes'][{name!r}] must be "
                             f"[a_shape, b_shape], each (out, in) of positive integers, e.g. "
                             f"[[2, 4], [48, 8]], got {pair!r}")
        out[name] = tuple((int(s[0]), int(s[1])) for s in pair)
    return out


def _krona_budget(cfg: AdapterConfig) -> Optional[int]:
    """``options["lora_rank_budget"]``: r, for factor shapes per layer with at most the
    parameters of a rank-r LoRA on that layer (:func:`kfused.modules.krona.factors_for_budget`;
    the KronA paper's comparison at equal trainable parameters). Not with a_shape / b_shape."""
    r = cfg.options.get("lora_rank_budget")
    if r is None:
        return None
    if not is_int(r) or r < 1:
        raise ValueError(f"{cfg.method}: options['lora_rank_budget'] must be an integer rank "
                         f">= 1, got {r!r}")
    if cfg.a_shape is not None or cfg.b_shape is not None:
        raise ValueError(f"{cfg.method}: options['lora_rank_budget'] chooses the factor shapes; "
                         f"give it or a_shape / b_shape, not both")
    return int(r)


def _krona(module: nn.Module, target: Target, cfg: AdapterConfig) -> nn.Module:
    a_shape, b_shape = cfg.a_shape, cfg.b_shape
    r = _krona_budget(cfg)
    if r is not None:
        a_shape, b_shape = factors_for_budget(target.d_out, target.d_in,
                                              r * (target.d_in + target.d_out))
    per_module = _krona_shapes(cfg).get(target.name)
    if per_module is not None:
        a_shape, b_shape = per_module
    return KronALinear(module, a_shape=a_shape, b_shape=b_shape, scale=cfg.scale,
                       init=cfg.init, backend=cfg.backend)


def _krona_finish(model: nn.Module, cfg: AdapterConfig) -> None:
    """Every ``options["krona_shapes"]`` name is a module this inject adapted: a misspelt or
    untargeted name would silently leave its module with the default shapes."""
    placed = {n for n, m in model.named_modules() if isinstance(m, KronALinear)}
    unmatched = sorted(n for n in _krona_shapes(cfg) if n not in placed)
    if unmatched:
        raise ValueError(f"{cfg.method}: options['krona_shapes'] names {unmatched}, which match "
                         f"no adapted module; its keys are the full names of targeted modules, "
                         f"adapted here: {sorted(placed)[:6]}"
                         + (" ..." if len(placed) > 6 else ""))


# ------------------------------------------------------------------------------------------
# block sites (parallel to the FFN)


def _block_dims(target: Target):
    if target.d_model is None:
        raise ValueError(f"{target.name}: cannot tell the block width (no hidden size in the "
                         "model config); block-parallel methods need it")
    return target.d_model


def _krona_b(module: nn.Module, target: Target, cfg: AdapterConfig, residual: bool = False):
    return KronABlock(module, d_in=_block_dims(target), a_shape=cfg.a_shape, b_shape=cfg.b_shape,
                      scale=cfg.scale, bias=cfg.bias, residual=residual, init=cfg.init,
                      backend=cfg.backend)


def _krona_b_res(module: nn.Module, target: Target, cfg: AdapterConfig):
    return _krona_b(module, target, cfg, residual=True)


def _parallel_adapter(module: nn.Module, target: Target, cfg: AdapterConfig):
    r = cfg.rank_for(target.role, target.name, single=True)
    return ScaledParallelAdapter(module, _block_dims(target), r=int(r), scale=cfg.scale,
                                 init=cfg.init, backend=cfg.backend)


# ------------------------------------------------------------------------------------------
# attention sites


def _headwise(block: AttentionBlock, target: Target, cfg: AdapterConfig):
    placed = attach_headwise_block(block, headwise_config(cfg))
    for mod in placed.values():
        use_module_backend(mod, cfg.backend)
    return list(placed.values())


def _int_option(cfg: AdapterConfig, key: str, default: int, minimum: int) -> int:
    """``cfg.options[key]`` (default ``default``): an integer >= ``minimum``, else ValueError
    naming it (never truncated: 1.5 or "3" are refused)."""
    value = cfg.options.get(key, default)
    if value is None:
        value = default
    if not is_int(value) or value < minimum:
        raise ValueError(f"{cfg.method}: options[{key!r}] must be an integer >= {minimum}, got "
                         f"{value!r}")
    return int(value)


def _inducer_options(cfg: AdapterConfig, inducer: bool) -> dict:
    if inducer:
        return dict(key_bottleneck=_int_option(cfg, "key_bottleneck", cfg.r, 1),
                    value_bottleneck=_int_option(cfg, "value_bottleneck", cfg.r, 1),
                    prefix_len=_int_option(cfg, "prefix_len", 0, 0), inducer=True)
    return dict(prefix_len=int(cfg.r), inducer=False)


def _inducer_wrap(inducer: bool):
    """inducer: key bottleneck L = ``options["key_bottleneck"]`` (default ``r``), value
    bottleneck ``options["value_bottleneck"]`` (default ``r``), ``options["prefix_len"]``
    prefix columns (default 0). prefix: ``r`` is the prefix length l. Both: composition =
    ``options["composition"]`` ("add" default, or "gate"); self-attention blocks only."""

    def wrap(block: AttentionBlock, target: Target, cfg: AdapterConfig):
        offset = _int_option(cfg, "position_offset", 0, 0)
        if offset and inducer:
            raise ValueError(f"{cfg.method}: options['position_offset'] shifts the positions of "
                             "a prefix-tuning model (method 'prefix'); the inducer does not use "
                             f"it, got {offset}")
        if offset:
            check_position_offset(getattr(target.model_config, "model_type", None), offset,
                                  target.model_config)
        if block.cross:
            return []
        register_attention()
        return [attach_inducer_block(block, composition=cfg.options.get("composition", "add"),
                                     init=cfg.init, backend=cfg.backend,
                                     **_inducer_options(cfg, inducer))]

    return wrap


def _unadapted_attention_backend(model: nn.Module, cfg: AdapterConfig) -> None:
    """The model now runs every attention layer through "kfused_inducer", also those left
    without an adapter (``exclude``, cross-attention): they take the config's backend as the
    adapted ones do (they ran "auto" whatever the config said, and set_backend missed them)."""
    for block in attention_blocks(model):
        attn = block.get("attn")
        if not hasattr(attn, "kfused_backend"):
            attn.kfused_backend = cfg.backend


def _inducer_finish(model: nn.Module, cfg: AdapterConfig) -> None:
    _unadapted_attention_backend(model, cfg)
    set_implementation(model)


def _prefix_finish(model: nn.Module, cfg: AdapterConfig) -> None:
    """``options["position_offset"]`` (GPT-2 / Llama-style models; checked by the wrap before
    any block changes) shifts the token positions by that many, as PEFT's prefix tuning does
    (see :func:`add_position_offset`)."""
    _unadapted_attention_backend(model, cfg)
    set_implementation(model)
    offset = _int_option(cfg, "position_offset", 0, 0)
    if offset:
        add_position_offset(model, offset)


def _inducer_default_init(cfg: AdapterConfig) -> str:
    """init=None for the inducer: "zero" (an exact start), "paper" with prefix columns, which
    take softmax weight from the first step (no exact start)."""
    return "paper" if cfg.options.get("prefix_len") not in (None, 0) else "zero"


def _inducer_check(model: nn.Module, arch) -> None:
    # T5's relative position bias is not an input of the inducer kernel: refuse, never drop it
    check_supported(model)


QV = {"gpt2": ["qkv"], "*": ["q", "v"]}
FFN = {"*": ["ffn"]}

register_method("lora", site="linear", wrap=_lora, default_targets=QV, mergeable=True,
                inits=LoRALinear.INITS, options=(), dropout=True,
                description="LoRA: x Wᵀ + b + (alpha/r)·(x Aᵀ) Bᵀ", paper="004")
register_method("krona", site="linear", wrap=_krona, default_targets=QV, mergeable=True,
                inits=KronALinear.INITS, options=("krona_shapes", "lora_rank_budget"), dropout=False,
                finish=_krona_finish,
                description="KronA: x Wᵀ + b + s·(A ⊗ B) x (fused with the frozen GEMM)",
                paper="003")
register_method("krona_b", site="block", wrap=_krona_b, default_targets=FFN,
                inits=KronABlock.inits_for(residual=False), options=(), dropout=False,
                description="KronA^B: FFN(x) + s·(A ⊗ B) x parallel to the FFN block",
                paper="003")
register_method("krona_b_res", site="block", wrap=_krona_b_res, default_targets=FFN,
                inits=KronABlock.inits_for(residual=True), default_init="random", options=(),
                dropout=False,
                description="KronA^B_res: KronA^B + learnable s_res·x", paper="003")
register_method("parallel_adapter", site="block", wrap=_parallel_adapter, default_targets=FFN,
                inits=ScaledParallelAdapter.INITS, options=(), dropout=False,
                description="scaled parallel adapter: FFN(x) + s·ReLU(x W_down) W_up",
                paper="002")

# Kernel-wise/-mix: cfg.targets are the projections of each block (q, v, o; default q, v) and
# cfg.ranks their ranks, see kfused.integration.headwise.headwise_config.
for _name, _desc in [
        ("kernel_wise", "Kernel-wise: per-head low-rank updates (docs/math.md §2)"),
        ("kernel_wise_lite", "Kernel-wise-lite: per-head updates on the key basis (docs/math.md §2)"),
        ("kernel_mix", "Kernel-mix: shared LoRA + Kernel-wise (docs/math.md §2)"),
        ("kernel_mix_lite", "Kernel-mix-lite: shared LoRA + Kernel-wise-lite (docs/math.md §2)")]:
    register_method(_name, site="attention", wrap=_headwise, mergeable=True,
                    inits=HEADWISE_INITS, description=_desc, paper="000", options=("lite",),
                    dropout=False)

register_method("inducer", site="attention", wrap=_inducer_wrap(True), paper="001",
                inits=InducerAttention.inits_for(True, 0), check=_inducer_check,
                options=("key_bottleneck", "value_bottleneck", "prefix_len", "composition",
                         "position_offset"), dropout=False,
                finish=_inducer_finish, default_init_for=_inducer_default_init,
                description="inducer attention: a per-query virtual key/value column (docs/math.md §3)")
register_method("prefix", site="attention", wrap=_inducer_wrap(False), paper="002",
                inits=InducerAttention.inits_for(False, 1), default_init="paper",
                options=("composition", "position_offset"), dropout=False,
                check=_inducer_check, finish=_prefix_finish,
                description="prefix tuning: l learned key/value columns per head (docs/math.md §3)")

# Composites: linear parts first, so the attention wrappers contain the adapted projections.
register_method("inducer_lora", site="composite",
                parts=[("lora", ["q", "v"]), ("inducer", None)], paper="001",
                description="inducer attention + LoRA on q, v")
register_method("mam_inducer", site="composite",
                parts=[("inducer", None), ("parallel_adapter", ["ffn"])], paper="001/002",
                description="MAM inducer: inducer attention + scaled parallel FFN adapter")
register_method("mam", site="composite",
                parts=[("prefix", None), ("parallel_adapter", ["ffn"])], paper="002",
                description="MAM adapter: prefix tuning + scaled parallel FFN adapter")
