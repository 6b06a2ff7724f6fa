"""Plugin: inducer attention and prefix tuning (SPEC §3) for inject().

Calls the inducer modules' own ``add_inducers(model, ...)`` (a model-level method: it attaches
an adapter to every self-attention and switches the model to the "kfused_inducer" attention
implementation). Imported by the registry the first time "inducer" or "prefix" is injected;
until ``kfused.integration.hf_attention`` lands, inject raises NotImplementedError naming it.

AdapterConfig mapping: key bottleneck L = ``options["key_bottleneck"]`` (default ``r``), value
bottleneck = ``options["value_bottleneck"]`` (default ``r``), composition =
``options["composition"]`` ("add" default, or "gate"); init "lora" (kfused's exact-start
default) maps to the inducer's "zero", "paper" and "zero" pass through. Prefix tuning: ``r`` is
the prefix length l.

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
    out = add_inducers(model, prefix_len=int(cfg.r), inducer=False,
                       composition=cfg.options.get("composition", "add"), init=_init(cfg),
                       freeze_base=False)
    _set_backend(model, cfg)
    return out


def _check(model: nn.Module, arch) -> None:
    # T5's relative position bias is not an input of the inducer kernel: refuse, never drop it
    check_supported(model)


register_method("inducer", site="model", wrap=_inducer, paper="001", check=_check,
                description="inducer attention: a per-query virtual key/value column (SPEC §3)")
register_method("prefix", site="model", wrap=_prefix, paper="002", check=_check,
                description="prefix tuning: l learned key/value columns per head (SPEC §3)")
