"""Plugin: inducer attention and prefix tuning (SPEC §3) for inject().

Calls the inducer modules' own ``add_inducers(model, ...)`` (a model-level method: it attaches
an adapter to every self-attention and switches the model to the "kfused_inducer" attention
implementation). Imported by the registry the first time "inducer" or "prefix" is injected;
until ``kfused.integration.hf_attention`` lands, inject raises NotImplementedError naming it.

AdapterConfig mapping: key bottleneck L = ``options["key_bottleneck"]`` (default ``r``), value
bottleneck = ``options["value_bottleneck"]`` (default ``r``), composition =
``options["composition"]`` ("add" default, or "gate"); init "lora" (kfused's exact-start
default) maps to the inducer's "zero", "paper" and "zero" pass through. Prefix tuning: ``r`` is
the prefix length l; ``options["position_offset"]`` (GPT-2 / Llama-style models) shifts the
token positions by that many, as PEFT's prefix tuning does (see :func:`add_position_offset`).

T5-family models are refused with a ValueError (by inject before any part of a composite such
as inducer_lora changes the model, and by ``add_inducers`` itself): T5 adds a learned relative
position bias to the attention scores, which the inducer kernel does not take.
"""

from __future__ import annotations

from torch import nn

from kfused.integration.config import AdapterConfig
from kfused.integration.hf_attention import add_inducers, attention_layers, check_supported
from kfused.integration.registry import Target, register_method


def _init(cfg: AdapterConfig) -> str:
    return {"lora": "zero", "random": "paper"}.get(cfg.init, cfg.init)


def _set_backend(model: nn.Module, cfg: AdapterConfig):
    # The attention forward reads the backend from the attention layer (``kfused_backend``);
    # without this, AdapterConfig.backend would be ignored and the environment would decide.
    for attn, *_ in attention_layers(model):
        attn.kfused_backend = cfg.backend


def _inducer(model: nn.Module, target: Target, cfg: AdapterConfig):
    o = cfg.options
    # inject() freezes the base itself (and must not freeze a composite's other parts here)
    out = add_inducers(model, key_bottleneck=int(o.get("key_bottleneck", cfg.r)),
                       value_bottleneck=int(o.get("value_bottleneck", cfg.r)),
                       composition=o.get("composition", "add"),
                       prefix_len=int(o.get("prefix_len", 0)), inducer=True, init=_init(cfg),
                       freeze_base=False)
    _set_backend(model, cfg)
    return out


def _prefix(model: nn.Module, target: Target, cfg: AdapterConfig):
    offset = int(cfg.options.get("position_offset", 0) or 0)
    if offset:
        _check_position_offset(model, offset)
    placed = add_inducers(model, prefix_len=int(cfg.r), inducer=False,
                          composition=cfg.options.get("composition", "add"), init=_init(cfg),
                          freeze_base=False)
    _set_backend(model, cfg)
    if offset:
        add_position_offset(model, offset)
    return placed


# ``options["position_offset"] = l`` (set by kfused.from_peft for PEFT prefix-tuning adapters):
# PEFT keeps its prefix in the key/value cache, so the real tokens sit at positions l..l+n-1.
# A forward pre-hook on the model gives kfused's prefix model the same positions. Only for models
# whose default positions are ``arange(past, past + n)`` (GPT-2 and Llama-style causal LMs).
POSITION_OFFSET_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")


def _check_position_offset(model: nn.Module, offset: int) -> None:
    mt = getattr(getattr(model, "config", None), "model_type", None)
    if offset < 0:
        raise ValueError(f"options['position_offset'] must be >= 0, got {offset}")
    if mt not in POSITION_OFFSET_MODEL_TYPES:
        raise ValueError(f"options['position_offset'] is supported for model types "
                         f"{POSITION_OFFSET_MODEL_TYPES} (positions arange(past, past + n)); "
                         f"this model is {mt!r}")


def add_position_offset(model: nn.Module, offset: int):
    """Shift the model's token positions by ``offset``: a forward pre-hook that passes
    ``position_ids = arange(offset + past, offset + past + n)`` when none are given and adds
    ``offset`` to explicit ones (as PEFT's prefix tuning does). Returns the hook handle."""
    import torch

    def hook(module, args, kwargs):
        pos = kwargs.get("position_ids")
        if pos is not None:
            kwargs["position_ids"] = pos + offset
            return args, kwargs
        ref = kwargs.get("input_ids", args[0] if args else None)
        if ref is None:
            ref = kwargs.get("inputs_embeds")
        if ref is None:
            return None
        past = kwargs.get("past_key_values")
        start = int(past.get_seq_length()) if hasattr(past, "get_seq_length") else 0
        n = ref.shape[1]
        pos = torch.arange(offset + start, offset + start + n, device=ref.device)
        kwargs["position_ids"] = pos.unsqueeze(0).expand(ref.shape[0], -1)
        return args, kwargs

    return model.register_forward_pre_hook(hook, with_kwargs=True)


def _check(model: nn.Module, arch) -> None:
    # T5's relative position bias is not an input of the inducer kernel: refuse, never drop it
    check_supported(model)


register_method("inducer", site="model", wrap=_inducer, paper="001", check=_check,
                description="inducer attention: a per-query virtual key/value column (SPEC §3)")
register_method("prefix", site="model", wrap=_prefix, paper="002", check=_check,
                description="prefix tuning: l learned key/value columns per head (SPEC §3)")
