"""Hugging Face transformers integration of inducer attention (SPEC §3).

``register()`` adds the attention implementation ``"kfused_inducer"`` to transformers'
``AttentionInterface`` together with its mask function in ``AttentionMaskInterface``. The mask
function hands the attention the 2-D key padding mask (batch, kv_len) (or None when nothing is
padded) and the layer's own ``is_causal`` supplies causality, so padding is never dropped;
mask patterns the kernel cannot express (sliding window, chunked, packed sequences, custom 4-D
masks) raise instead of being ignored.

``add_inducers(model, ...)`` attaches an :class:`~kfused.modules.inducer.InducerAttention` to
every GPT-2, RoBERTa/BERT or Llama-style attention layer, wraps the output projection for the
"add" composition (one GEMM over per-head ``[f_h | u_h]``), and switches the model to the
implementation. Layers without an adapter run plain flash attention through the same kernel.
"""

from __future__ import annotations

import warnings
from typing import Callable, List, Optional, Tuple

import torch
from torch import nn

from kfused.modules.inducer import InducerAttention, InducerOutputProjection
from kfused.ops import inducer_attention

ATTN_IMPLEMENTATION = "kfused_inducer"
ADAPTER_ATTR = "kfused_inducer"

_warned_dropout = [False]


def kfused_inducer_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                                     value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                                     scaling: Optional[float] = None, dropout: float = 0.0,
                                     is_causal: Optional[bool] = None, **kwargs):
    """AttentionInterface entry: query (B, H, n_q, p), key/value (B, H_kv, n_k, p) ->
    ``(attn_output (B, n_q, H, p [+ r]), None)``.

    With an "add" adapter on the layer the output rows are per-head ``[f_h | u_h]``; the
    wrapped output projection (:class:`InducerOutputProjection`) consumes them.
    """
    # grouped-query attention (fewer kv heads) runs natively in the kernel: no repeat_kv copy
    key_padding_mask = None
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"{ATTN_IMPLEMENTATION} takes a 2-D key padding mask (batch, kv_len), got a mask "
                f"of shape {tuple(attention_mask.shape)}; custom 4-D masks are not supported")
        key_padding_mask = attention_mask[:, -key.shape[2]:].to(torch.bool)
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if dropout and dropout > 0 and not _warned_dropout[0]:
        _warned_dropout[0] = True
        warnings.warn(f"{ATTN_IMPLEMENTATION}: attention-probability dropout ({dropout}) is not "
                      "applied by the fused kernel; set the model's attention dropout to 0 to "
                      "silence this warning", stacklevel=2)
    adapter = getattr(module, ADAPTER_ATTR, None)
    backend = getattr(module, "kfused_backend", None)
    if adapter is None:
        out, u = inducer_attention(query, key, value, causal=bool(is_causal),
                                   key_padding_mask=key_padding_mask, scale=scaling,
                                   backend=backend)
    else:
        out, u = adapter(query, key, value, causal=bool(is_causal),
                         key_padding_mask=key_padding_mask, scale=scaling, backend=backend)
    if u is not None:
        out = torch.cat([out, u.to(out.dtype)], dim=-1)
    return out.transpose(1, 2), None


def kfused_inducer_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                        kv_offset: int = 0, mask_function: Optional[Callable] = None,
                        attention_mask: Optional[torch.Tensor] = None, **kwargs):
    """AttentionMaskInterface entry: the 2-D boolean key padding mask (batch, kv_length), or
    None when no key is padded. Causality comes from the attention layer's ``is_causal``."""
    from transformers import masking_utils as mu

    allowed = {getattr(mu, "causal_mask_function", None),
               getattr(mu, "bidirectional_mask_function", None), None}
    if mask_function not in allowed:
        raise NotImplementedError(
            f"{ATTN_IMPLEMENTATION} supports causal or bidirectional attention with key padding; "
            f"mask function {getattr(mask_function, '__name__', mask_function)!r} (sliding "
            "window, chunked or packed sequences) would be dropped, so it is refused")
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:].to(torch.bool)
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


_registered = [False]


def register() -> str:
    """Register ``"kfused_inducer"`` with transformers (idempotent); returns the name."""
    if _registered[0]:
        return ATTN_IMPLEMENTATION
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, kfused_inducer_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, kfused_inducer_mask)
    _registered[0] = True
    return ATTN_IMPLEMENTATION


def attention_layers(model: nn.Module) -> List[Tuple[nn.Module, nn.Module, str, int, int]]:
    """``(attention module, output-projection parent, attribute, heads, head_dim)`` for every
    self-attention layer of GPT-2, RoBERTa/BERT and Llama-style models."""
    found = []
    for mod in model.modules():
        name = type(mod).__name__
        if hasattr(mod, "c_proj") and hasattr(mod, "c_attn") and name.endswith("Attention"):
            if getattr(mod, "is_cross_attention", False):
                continue
            found.append((mod, mod, "c_proj", mod.num_heads, mod.head_dim))
        elif hasattr(mod, "self") and hasattr(mod, "output") and hasattr(mod.output, "dense") \
                and hasattr(mod.self, "num_attention_heads"):
            s = mod.self
            if not hasattr(s, "query") or "Cross" in type(s).__name__:
                continue                      # self-attention only (as for GPT-2 above)
            found.append((s, mod.output, "dense", s.num_attention_heads,
                          s.attention_head_size))
        elif hasattr(mod, "o_proj") and hasattr(mod, "q_proj") and hasattr(mod, "head_dim"):
            cfg = getattr(mod, "config", None)
            heads = (getattr(cfg, "num_attention_heads", None)
                     or mod.q_proj.out_features // mod.head_dim)
            found.append((mod, mod, "o_proj", heads, mod.head_dim))
    return found


def attach_inducer(attention: nn.Module, adapter: InducerAttention, proj_parent: nn.Module,
                   proj_attr: str) -> None:
    """Put ``adapter`` on one attention layer; for "add" wrap its output projection."""
    setattr(attention, ADAPTER_ATTR, adapter)
    if adapter.inducer and adapter.composition == "add":
        base = getattr(proj_parent, proj_attr)
        if isinstance(base, InducerOutputProjection):
            base = base.base
        setattr(proj_parent, proj_attr, InducerOutputProjection(base, adapter))


_T5_MODEL_TYPES = ("t5", "mt5", "umt5", "longt5", "switch_transformers")


def unsupported_reason(model: nn.Module) -> Optional[str]:
    """Why inducer attention / prefix tuning cannot run on ``model``, or None if it can.

    T5-family models add a learned relative position bias to every attention score (and use
    no 1/√p scaling); the inducer kernel (SPEC §3) takes no additive score bias, so running it
    would silently drop the bias and change the model. They are refused instead.
    """
    mt = getattr(getattr(model, "config", None), "model_type", None)
    t5_like = mt in _T5_MODEL_TYPES or any(
        hasattr(m, "has_relative_attention_bias") or isinstance(
            getattr(m, "relative_attention_bias", None), nn.Module) for m in model.modules())
    if t5_like:
        return (f"{type(model).__name__} (model_type={mt!r}) is a T5-family model: T5's relative "
                "position bias is not supported by the inducer kernel (it adds a learned bias to "
                "every attention score, which the kernel would drop, giving a wrong result)")
    return None


def check_supported(model: nn.Module) -> None:
    """Raise ValueError naming the reason if inducer/prefix attention cannot run on ``model``."""
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: cannot add inducer/prefix attention: {reason}")


def add_inducers(model: nn.Module, *, key_bottleneck: int = 4, value_bottleneck: int = 4,
                 composition: str = "add", prefix_len: int = 0, inducer: bool = True,
                 init: str = "paper", freeze_base: bool = True) -> List[InducerAttention]:
    """Attach an adapter to every self-attention layer and switch the model to
    ``"kfused_inducer"``. Returns the adapters (the trainable parameters).

    ``freeze_base`` (default True, like :func:`kfused.inject`): every parameter the model had
    before is set ``requires_grad=False``, so only the adapters train; pass False to keep the
    base's ``requires_grad`` flags as they were (full fine-tuning alongside the adapters).

    Raises ValueError (before changing the model) for models the kernel cannot run exactly
    (T5's relative position bias, see :func:`unsupported_reason`) and for models with no
    GPT-2, RoBERTa/BERT or Llama-style self-attention layer.
    """
    check_supported(model)
    layers = attention_layers(model)
    if not layers:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: found no GPT-2, RoBERTa/BERT or Llama-style "
                         f"self-attention layer in {type(model).__name__}")
    register()
    if freeze_base:
        for p in model.parameters():
            p.requires_grad_(False)
    adapters = []
    for attn, parent, attr, heads, hd in layers:
        w = getattr(parent, attr).weight
        d_out = w.shape[0] if isinstance(getattr(parent, attr), nn.Linear) else w.shape[1]
        ad = InducerAttention(heads, hd, d_model=d_out, key_bottleneck=key_bottleneck,
                              value_bottleneck=value_bottleneck, composition=composition,
                              prefix_len=prefix_len, inducer=inducer, init=init,
                              device=w.device, dtype=torch.float32)
        attach_inducer(attn, ad, parent, attr)
        adapters.append(ad)
    set_implementation(model)
    return adapters


def set_implementation(model: nn.Module) -> None:
    register()
    if hasattr(model, "set_attn_implementation"):
        try:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
            return
        except Exception:  # older versions or sub-configs: fall back to the config field
            pass
    model.config._attn_implementation = ATTN_IMPLEMENTATION


__all__ = ["ATTN_IMPLEMENTATION", "register", "add_inducers", "attach_inducer",
           "unsupported_reason", "check_supported",
           "attention_layers", "set_implementation", "kfused_inducer_attention_forward",
           "kfused_inducer_mask"]
