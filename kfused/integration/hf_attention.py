"""Hugging Face transformers integration of inducer attention (docs/math.md §3).

``register()`` adds the attention implementation ``"kfused_inducer"`` to transformers'
``AttentionInterface`` together with its mask function in ``AttentionMaskInterface``. The mask
function hands the attention the 2-D key padding mask (batch, kv_len) (or None when nothing is
padded) and the layer's own ``is_causal`` supplies causality, so padding is never dropped;
mask patterns the kernel cannot express (sliding window, chunked, custom 4-D masks) raise
instead of being ignored. With a cache of more slots than filled ones (transformers' static
cache) the mask function hands the attention the filled window's mask, narrower than the keys,
and the attention reads those keys only (its causality is aligned to the last key).

Padding-free training (packed sequences, transformers' ``DataCollatorWithFlattening``): when
transformers detects packing from ``position_ids`` its mask function keeps each sequence to
itself; the mask function recognises exactly that construction (over a causal or bidirectional
base) and hands the attention :class:`PackedSequences` instead, and the attention runs
:func:`kfused.ops.inducer_attention_varlen` over the packed tokens, paying for no padding.
flash-attention's keyword arguments ``cu_seq_lens_q`` / ``cu_seq_lens_k`` are honoured too.

``add_inducers(model, ...)`` attaches an :class:`~kfused.modules.inducer.InducerAttention` to
every self-attention block :func:`kfused.integration.arch.attention_blocks` finds (GPT-2,
RoBERTa/BERT, Llama-style), wraps the output projection for the "add" composition (one GEMM
over per-head ``[f_h | u_h]``), and switches the model to the implementation. Layers without an
adapter run plain flash attention through the same kernel. Models that add a learned bias to
the attention scores (T5) are refused: the kernel takes no such bias.

Prefix tuning keeps its prefix in place of the first positions when converted from PEFT:
:func:`add_position_offset` shifts the model's token positions to match.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Callable, List, Optional, Tuple

import torch
from torch import nn

try:   # torch >= 2.7: a data-dependent bool that export cannot decide reads as False
    from torch.fx.experimental.symbolic_shapes import guard_or_false
except ImportError:  # pragma: no cover
    guard_or_false = bool

from kfused._memo import LastResult
from kfused.integration.arch import (AttentionBlock, attention_blocks, describe_archs,
                                     detect_arch, model_type_of)
from kfused.modules._init import check_init
from kfused.modules._linear import autocast_input, is_conv1d, linear_dims
from kfused.modules.inducer import InducerAttention, InducerOutputProjection
from kfused.ops import inducer_attention, inducer_attention_varlen

ATTN_IMPLEMENTATION = "kfused_inducer"
ADAPTER_ATTR = "kfused_inducer"

_warned_dropout = [False]


class PackedSequences:
    """The "mask" of a packed batch: ``segments`` (B, T) sequence ids per row (transformers'
    packed-sequence mask: each row holds sequences one after another); ``causal``: the
    pattern within a sequence (the mask's base: causal or bidirectional)."""

    def __init__(self, segments: torch.Tensor, causal: bool):
        self.segments = segments
        self.causal = bool(causal)
        self._cu = None

    def cu_seqlens(self) -> Tuple[torch.Tensor, int]:
        """(int32 cumulative lengths over the flattened (B·T) tokens, longest length)."""
        if self._cu is None:
            if torch.compiler.is_exporting():
                # transformers marks every traced batch as packed (it cannot look at the
                # position ids there), and the number of sequences is data-dependent
                raise NotImplementedError(
                    f"{ATTN_IMPLEMENTATION}: torch.export of a model without an attention mask "
                    "(or with packed position ids) is not supported: under export transformers "
                    "treats the batch as packed sequences, whose count depends on the data. "
                    "Export with an attention mask instead, e.g. attention_mask="
                    "torch.ones_like(input_ids): the exported model then takes any padding mask")
            B, T = self.segments.shape
            flat = self.segments.reshape(-1)
            start = torch.ones_like(flat, dtype=torch.bool)
            start[1:] = flat[1:] != flat[:-1]
            start[::T] = True                                  # every row starts a sequence
            idx = start.nonzero().flatten().to(torch.int32)
            cu = torch.cat([idx, idx.new_tensor([B * T])])
            self._cu = (cu, int((cu[1:] - cu[:-1]).max()))
        return self._cu


def _packed_from_positions(position_ids, batch: int, n: int) -> Optional["PackedSequences"]:
    """The packed sequences of a one-row batch whose ``position_ids`` restart (transformers'
    ``DataCollatorWithFlattening``; causal within each), else None. Remembered for the last
    ``position_ids`` (same object, unchanged): every layer of a forward gets the same
    object, so the check and the lengths cost one device sync per forward, not per layer."""
    if (not isinstance(position_ids, torch.Tensor) or batch != 1 or n <= 1
            or position_ids.numel() != n):
        return None

    def packed():
        pos = position_ids.reshape(-1)
        start = torch.ones(n, dtype=torch.bool, device=pos.device)
        start[1:] = pos[1:] != pos[:-1] + 1
        return (PackedSequences(start.cumsum(0).reshape(1, n), True)
                if bool(start[1:].any()) else None)
    return _from_positions((position_ids,), packed)


_from_positions = LastResult()


def _packed_from_kwargs(cu_q: torch.Tensor, cu_k: Optional[torch.Tensor], max_q
                        ) -> Tuple[torch.Tensor, Optional[int]]:
    """(int32 cumulative lengths, longest) from flash-attention's varlen keyword arguments,
    remembered for the last ``cu_seq_lens_q`` (same object, unchanged): every layer of a
    forward gets the same tensors, so the check and the conversion happen once."""
    def packed():
        if cu_k is not None and cu_k is not cu_q and not torch.equal(cu_k, cu_q):
            raise ValueError(f"{ATTN_IMPLEMENTATION}: packed sequences with different query "
                             "and key lengths (cu_seq_lens_k != cu_seq_lens_q) are not "
                             "supported")
        return cu_q.to(torch.int32)
    # max_q outside the memo: it is not one of the remembered tensors (a call with a corrected
    # max_length_q got the first call's value back)
    return _from_kwargs((cu_q, cu_k), packed), None if max_q is None else int(max_q)


_from_kwargs = LastResult()


def _closure(fn) -> dict:
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    try:
        return {n: c.cell_contents for n, c in zip(code.co_freevars, cells)}
    except ValueError:                                         # an empty cell
        return {}


def _two_and_masks(mask_function) -> Optional[tuple]:
    """The two mask functions transformers' ``and_masks(f, g)`` combined, else None."""
    if getattr(mask_function, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return None
    parts = _closure(mask_function).get("mask_functions")
    return parts if isinstance(parts, tuple) and len(parts) == 2 else None


def packed_segments(mask_function) -> Optional[Tuple[torch.Tensor, object]]:
    """``(segments, base)`` when ``mask_function`` is transformers' packed-sequence mask
    (``and_masks`` of ``packed_sequence_mask_function(segments)`` and
    ``remap_positions_for_packed_sequence(base, position_ids)``, in either order: transformers
    5.x builds the remap first), else None. Anything else (an extra sliding window, offsets, a
    block overlay, a changed construction in a later transformers) is not recognised, and so
    refused."""
    parts = _two_and_masks(mask_function)
    if parts is None:
        return None
    by_name = {getattr(f, "__qualname__", ""): f for f in parts}
    seg_fn = by_name.get("packed_sequence_mask_function.<locals>.inner_mask")
    remap_fn = by_name.get("remap_positions_for_packed_sequence.<locals>.inner_mask")
    if seg_fn is None or remap_fn is None:
        return None
    segments = _closure(seg_fn).get("packed_sequence_mask")
    base = _closure(remap_fn).get("mask_function")
    if not isinstance(segments, torch.Tensor) or segments.dim() != 2:
        return None
    return segments, base


def sliding_window(mask_function) -> Optional[int]:
    """``W`` when ``mask_function`` is transformers' sliding-window causal mask (``and_masks``
    of ``sliding_window_overlay(W)`` and ``causal_mask_function``), else None."""
    parts = _two_and_masks(mask_function)
    if parts is None:
        return None
    from transformers import masking_utils as mu

    causal = getattr(mu, "causal_mask_function", None)
    overlay = [f for f in parts if f is not causal]
    if causal not in parts or len(overlay) != 1 or getattr(
            overlay[0], "__qualname__", "") != "sliding_window_overlay.<locals>.inner_mask":
        return None
    window = _closure(overlay[0]).get("sliding_window")
    return window if isinstance(window, int) and not isinstance(window, bool) else None


def _packed_call(fn, query, key, value, cu, max_len, **kw):
    """Run ``fn`` (inducer_attention_varlen or an adapter) over (B, H, T, p) tensors holding
    packed sequences; returns (out, u) as (B, T, H, ·)."""
    B, H, T, p = query.shape
    if key.shape[2] != T:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: packed sequences need as many keys as queries "
                         f"(no KV cache), got {T} queries and {key.shape[2]} keys")

    def flat(t):
        return t.transpose(1, 2).reshape(B * T, t.shape[1], p)
    out, u = fn(flat(query), flat(key), flat(value), cu, max_len, **kw)
    out = out.reshape(B, T, H, p)
    return out, (None if u is None else u.reshape(B, T, H, u.shape[-1]))


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
    for name, what in (("softcap", "attention-logit soft-capping (Gemma-2)"),
                       ("s_aux", "attention sinks (gpt-oss)")):
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"{ATTN_IMPLEMENTATION} does not support {name} ({what}): the kernel would drop "
                "it and give a wrong result, so it is refused")
    # under autocast the attention runs in the autocast dtype, as SDPA's and eager's matmuls
    # do: the kernels are opaque to autocast, and Llama-style rotary embeddings hand a float32
    # q and k beside a half-precision v (refused as mixed dtypes)
    query, key, value = (autocast_input(t) for t in (query, key, value))
    key_padding_mask = None
    packed = None
    if kwargs.get("cu_seq_lens_q") is not None:                # flash-attention's varlen kwargs
        packed = _packed_from_kwargs(kwargs["cu_seq_lens_q"], kwargs.get("cu_seq_lens_k"),
                                     kwargs.get("max_length_q"))
    elif isinstance(attention_mask, PackedSequences):
        packed = attention_mask.cu_seqlens()
        is_causal = attention_mask.causal
    elif attention_mask is None:
        # flash-attention-2's rule: one row, no mask, positions restarting = packed sequences
        # (transformers builds no packed mask when a KV cache object exists)
        from_positions = _packed_from_positions(kwargs.get("position_ids"), query.shape[0],
                                                query.shape[2])
        if from_positions is not None:
            packed = from_positions.cu_seqlens()
    elif attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"{ATTN_IMPLEMENTATION} takes a 2-D key padding mask (batch, kv_len), got a mask "
                f"of shape {tuple(attention_mask.shape)}; custom 4-D masks are not supported")
        if attention_mask.shape[1] < key.shape[2]:
            # the mask function's window of a cache with more slots than filled ones (a
            # static cache): keys [0, window) are the filled ones, the queries their last
            key = key[:, :, :attention_mask.shape[1]]
            value = value[:, :, :attention_mask.shape[1]]
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
    if packed is not None:
        if adapter is None:
            def run(q, k, v, cu, max_len, **kw):
                return inducer_attention_varlen(q, k, v, cu, None, max_len, max_len, **kw)
        else:
            def run(q, k, v, cu, max_len, **kw):
                return adapter(q, k, v, cu_seqlens=cu, max_seqlen=max_len, **kw)
        out, u = _packed_call(run, query, key, value, *packed, causal=bool(is_causal),
                              scale=scaling, backend=backend)
        if u is not None:
            out = torch.cat([out, u.to(out.dtype)], dim=-1)
        return out, None
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
    packed = packed_segments(mask_function)
    if packed is not None and packed[1] in allowed and attention_mask is None:
        # padding-free training: packed sequences, each attending only to itself
        return PackedSequences(packed[0], packed[1] is getattr(mu, "causal_mask_function", None))
    window = sliding_window(mask_function)
    if window is not None:
        # a sliding-window layer (Mistral, Gemma-2/3, ...): key kv_idx is seen by query q_idx
        # when q_idx - window < kv_idx <= q_idx. With at most `window` keys up to the last
        # query the window hides none of them: plain causal attention, which the kernel runs
        n_keys = int(q_offset) + q_length - int(kv_offset)
        if n_keys > window:
            raise NotImplementedError(
                f"{ATTN_IMPLEMENTATION}: this layer's sliding window of {window} keys would hide "
                f"some of the {n_keys} keys up to the last query; the kernel has no window, so "
                f"it is refused (sequences of at most {window} tokens run)")
        mask_function = mu.causal_mask_function
    if mask_function not in allowed:
        raise NotImplementedError(
            f"{ATTN_IMPLEMENTATION} supports causal or bidirectional attention with key padding; "
            f"mask function {getattr(mask_function, '__name__', mask_function)!r} (sliding "
            "window, chunked, or packed sequences combined with another pattern) would be "
            "dropped, so it is refused")
    causal = mask_function is getattr(mu, "causal_mask_function", None)
    n_keys = int(q_offset) + q_length - int(kv_offset)     # keys up to the last query
    if causal and q_length <= n_keys < kv_length:
        # more cache slots than filled ones (a static cache): the slots after the last query
        # are empty. The kernel aligns causality to the last key, so the attention reads the
        # filled window only: a mask of n_keys < kv_length columns says so (key j is column
        # kv_offset + j of the 2-D mask, missing columns are real keys of the new tokens)
        mask = (torch.ones(batch_size, n_keys, dtype=torch.bool, device=kwargs.get("device"))
                if attention_mask is None else attention_mask.to(torch.bool))
        end = int(kv_offset) + n_keys
        if mask.shape[1] < end:
            mask = torch.nn.functional.pad(mask, (0, end - mask.shape[1]), value=True)
        return mask[:, int(kv_offset):end]
    if attention_mask is None:
        return None
    attention_mask = attention_mask.to(torch.bool)
    if attention_mask.shape[1] < kv_length:
        # columns past the mask are padding, as transformers reads a short 2-D mask
        attention_mask = torch.nn.functional.pad(attention_mask,
                                                 (0, kv_length - attention_mask.shape[1]))
    attention_mask = attention_mask[:, -kv_length:]
    # no key padded: no mask. Where the answer is data-dependent (torch.export) the mask is
    # kept, which gives the same attention; bool() refused to export
    if attention_mask.shape[1] == kv_length and guard_or_false(attention_mask.all().item()):
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


def self_attention_blocks(model: nn.Module) -> List[AttentionBlock]:
    """The self-attention blocks of ``model`` (inducer and prefix adapt these only)."""
    return [b for b in attention_blocks(model) if not b.cross]


def attention_layers(model: nn.Module) -> List[Tuple[nn.Module, nn.Module, str, int, int]]:
    """``(attention module, output-projection parent, attribute, heads, head_dim)`` for every
    self-attention block: the module that runs attention and where its output projection is."""
    out = []
    for b in self_attention_blocks(model):
        parent, _, attr = b.layout.o.rpartition(".")
        out.append((b.get("attn"), b.module.get_submodule(parent) if parent else b.module, attr,
                    b.n_heads, b.head_dim))
    return out


def attach_inducer(attention: nn.Module, adapter: InducerAttention, proj_parent: nn.Module,
                   proj_attr: str) -> None:
    """Put ``adapter`` on one attention layer; for "add" wrap its output projection.

    The adapter is a submodule under one name only: the attention layer's ``kfused_inducer``,
    or for "add" its output projection's ``adapter`` (the layer then reaches it through a
    plain attribute). A module reachable under two names breaks torch.func.functional_call:
    it leaves the call's tensors in place of the parameters (pytorch/pytorch#164759), so the
    model silently stopped training its adapters after one call."""
    attention._modules.pop(ADAPTER_ATTR, None)
    attention.__dict__.pop(ADAPTER_ATTR, None)
    if adapter.inducer and adapter.composition == "add":
        base = getattr(proj_parent, proj_attr)
        if isinstance(base, InducerOutputProjection):
            base = base.base
        setattr(proj_parent, proj_attr, InducerOutputProjection(base, adapter))
        attention.__dict__[ADAPTER_ATTR] = adapter  # not registered: see above
    else:
        setattr(attention, ADAPTER_ATTR, adapter)


def _old_mask_interface() -> Optional[str]:
    """Why this transformers cannot run the kfused_inducer attention, or None: its mask
    interface must hand the queries as ``q_length`` / ``q_offset`` (transformers 5;
    transformers 4.x hands ``cache_position``, and its attention paths were never validated
    here, so it is refused rather than run)."""
    import transformers

    try:
        from transformers import masking_utils as mu
        takes = "q_length" in inspect.signature(mu.sdpa_mask).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        takes = False
    if takes:
        return None
    return (f"transformers {transformers.__version__} has the transformers 4.x attention-mask "
            "interface (no q_length); inducer attention and prefix tuning need transformers "
            ">= 5 (tested with 5.24). LoRA, KronA and the per-head methods run on 4.x")


def unsupported_reason(model: nn.Module) -> Optional[str]:
    """Why inducer attention / prefix tuning cannot run on ``model``, or None if it can.

    Models that add a learned bias to every attention score (T5's relative position bias, and
    no 1/√p scaling) cannot: the inducer kernel (docs/math.md §3) takes no additive score bias, so
    running it would silently drop the bias and change the model. They are refused instead.
    The architecture says so (``ArchSpec.score_bias``); a module with a
    ``relative_attention_bias`` marks a T5-family model of a type kfused has no layout for.
    Nor can models that soft-cap their attention scores (Gemma-2's
    ``config.attn_logit_softcapping``): the attention refuses the cap at every forward.
    """
    old = _old_mask_interface()
    if old is not None:
        return old
    arch = detect_arch(model)
    mt = model_type_of(model)
    score_bias = (arch.score_bias if arch is not None else False) or any(
        hasattr(m, "has_relative_attention_bias") or isinstance(
            getattr(m, "relative_attention_bias", None), nn.Module) for m in model.modules())
    if score_bias:
        return (f"{type(model).__name__} (model_type={mt!r}) is a T5-family model: T5's relative "
                "position bias is not supported by the inducer kernel (it adds a learned bias to "
                "every attention score, which the kernel would drop, giving a wrong result)")
    softcap = getattr(getattr(model, "config", None), "attn_logit_softcapping", None)
    if softcap is not None:
        # every forward would be refused (the attention receives softcap=): say so at inject
        return (f"{type(model).__name__} (model_type={mt!r}) soft-caps its attention scores "
                f"(config.attn_logit_softcapping={softcap!r}, Gemma-2), which the inducer kernel "
                "does not apply")
    return None


def check_supported(model: nn.Module) -> None:
    """Raise ValueError naming the reason if inducer/prefix attention cannot run on ``model``."""
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: cannot add inducer/prefix attention: {reason}")


def attach_inducer_block(block: AttentionBlock, *, key_bottleneck: int = 4,
                         value_bottleneck: int = 4, composition: str = "add",
                         prefix_len: int = 0, inducer: bool = True, init: str = "paper",
                         backend: Optional[str] = None) -> InducerAttention:
    """Put a new :class:`InducerAttention` on one self-attention block (float32 parameters on
    the block's device) and point the block's attention at ``backend``; returns it."""
    if block.cross:
        raise ValueError(f"{block.name}: inducer/prefix attention adapts self-attention only")
    attn = block.get("attn")
    if getattr(attn, ADAPTER_ATTR, None) is not None:  # replacing it dropped trained adapters
        raise ValueError(f"{block.name}: already has an inducer/prefix adapter "
                         f"({getattr(attn, ADAPTER_ATTR).extra_repr()}); a second one would "
                         "replace it. Add inducers once per model")
    o = block.get("o")
    if isinstance(o, InducerOutputProjection):
        o = o.base
    # an output projection another part of a composite already adapted (LoRA, KronA, Kernel-
    # mix on o): the frozen layer is its base; InducerOutputProjection maps f through the
    # adapted projection and u through W2 beside it
    while not isinstance(o, nn.Linear) and not is_conv1d(o) and isinstance(
            getattr(o, "base", None), nn.Module):
        o = o.base
    d_out = linear_dims(o)[1]
    ad = InducerAttention(block.n_heads, block.head_dim, d_model=d_out,
                          key_bottleneck=key_bottleneck, value_bottleneck=value_bottleneck,
                          composition=composition, prefix_len=prefix_len, inducer=inducer,
                          init=init, device=o.weight.device, dtype=torch.float32)
    parent, _, attr = block.layout.o.rpartition(".")
    attach_inducer(attn, ad, block.module.get_submodule(parent) if parent else block.module,
                   attr)
    if ad.inducer and composition == "add":
        _read_old_adapter_keys(block.module, block.layout.path("attn"), block.layout.o)
    attn.kfused_backend = backend
    if not any(isinstance(h, _RequireImplementation) for h in attn._forward_pre_hooks.values()):
        attn.register_forward_pre_hook(_RequireImplementation())
    return ad


class _RequireImplementation:
    """Forward pre-hook on an adapted attention layer: refuses to run it under another
    attention implementation (``model.set_attn_implementation("sdpa")`` after inject), which
    never calls the adapter and so silently ran the unadapted model. A class, not a closure,
    so that the model still pickles."""

    def __call__(self, module, args) -> None:
        impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if impl is not None and impl != ATTN_IMPLEMENTATION:
            raise ValueError(
                f"{ATTN_IMPLEMENTATION}: this {type(module).__name__} carries an inducer/prefix "
                f"adapter, but the model's attention implementation is {impl!r}, which runs "
                "without it (the unadapted model); switch back with "
                f"model.set_attn_implementation({ATTN_IMPLEMENTATION!r})")


class _OldAdapterKeys:
    """Load-state-dict pre-hook: keys under ``old`` are read as keys under ``new``. A class,
    not a closure, so that a model holding it still pickles (torch.save of the whole model,
    copy by pickling)."""

    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def __call__(self, state_dict, prefix, *args) -> None:
        old, new = prefix + self.old, prefix + self.new
        for k in [k for k in state_dict if k.startswith(old)]:
            v = state_dict.pop(k)
            state_dict.setdefault(new + k[len(old):], v)


def _read_old_adapter_keys(module: nn.Module, attn_path: str, o_path: str) -> None:
    """A state_dict saved before the "add" adapter was registered under one name (a Trainer
    checkpoint holds it as ``<attention>.kfused_inducer.*``) loads into ``<o>.adapter.*``."""
    old = ".".join(p for p in (attn_path, ADAPTER_ATTR) if p) + "."
    module._register_load_state_dict_pre_hook(_OldAdapterKeys(old, o_path + ".adapter."))


def add_inducers(model: nn.Module, *, key_bottleneck: int = 4, value_bottleneck: int = 4,
                 composition: str = "add", prefix_len: int = 0, inducer: bool = True,
                 init: str = "paper", freeze_base: bool = True) -> List[InducerAttention]:
    """Attach an adapter to every self-attention layer and switch the model to
    ``"kfused_inducer"``. Returns the adapters (the trainable parameters).

    ``freeze_base`` (default True, like :func:`kfused.inject`): every parameter the model had
    before is set ``requires_grad=False``, so only the adapters train; pass False to keep the
    base's ``requires_grad`` flags as they were (full fine-tuning alongside the adapters).
    ``init``: "paper" or "zero" (:mod:`kfused.modules._init`; "zero" needs ``inducer`` and no
    prefix).

    Raises ValueError (before changing the model) for models the kernel cannot run exactly
    (T5's relative position bias, see :func:`unsupported_reason`) and for models with no
    self-attention block of a known architecture.
    """
    check_supported(model)
    from kfused.integration.inject import _follow_mode, get_state, restore, snapshot  # (inject
    # imports this module)

    state = get_state(model, required=False)
    if state is not None:
        # the injected adapters would be frozen with the base (freeze_base), and the inducers,
        # outside the record of what inject placed, left out of save / load (an adapted output
        # projection, wrapped again, made save fail on its attributes)
        raise ValueError(f"add_inducers: this model already has kfused adapters (method "
                         f"{state.config.method!r}, placed by inject / load / from_peft); "
                         "inducers added now would not be saved with them and freeze_base "
                         "would freeze them. Inject one config with an inducer part instead: "
                         "method 'inducer_lora' / 'mam_inducer', or a composite registered with "
                         "parts=[(method, targets), ('inducer', None)]")
    blocks = self_attention_blocks(model)
    if not blocks:
        raise ValueError(f"{ATTN_IMPLEMENTATION}: found no {describe_archs()} self-attention "
                         f"layer in {type(model).__name__}")
    check_init(init, InducerAttention.inits_for(inducer, prefix_len), "add_inducers")
    register()

    snap = snapshot(model)
    old_modules = {id(m) for m in model.modules()}
    try:  # an argument the adapter refuses (e.g. key_bottleneck=0) leaves the model as it was
        if freeze_base:
            for p in model.parameters():
                p.requires_grad_(False)
        adapters = [attach_inducer_block(b, key_bottleneck=key_bottleneck,
                                         value_bottleneck=value_bottleneck,
                                         composition=composition, prefix_len=prefix_len,
                                         inducer=inducer, init=init)
                    for b in blocks]
        # the placed modules take the mode of the module they sit in, as inject's do (an
        # eval-mode model kept its new wrappers and adapters in training mode)
        _follow_mode(model, old_modules)
    except BaseException:
        restore(snap)
        raise
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


# ------------------------------------------------------------------------------------------
# Token positions for prefixes converted from PEFT

# ``options["position_offset"] = l`` (set by kfused.from_peft for PEFT prefix-tuning adapters):
# PEFT keeps its prefix in the key/value cache, so the real tokens sit at positions l..l+n-1.
# A forward pre-hook on the model gives kfused's prefix model the same positions. Only for models
# whose default positions are ``arange(past, past + n)`` (GPT-2 and Llama-style causal LMs).
POSITION_OFFSET_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")
# those whose positions index a learned table of config.max_position_embeddings rows (the
# rotary ones have no table to run past)
LEARNED_POSITION_MODEL_TYPES = ("gpt2",)


def check_position_offset(mt: Optional[str], offset: int, config=None) -> None:
    """ValueError unless positions of model type ``mt`` can be shifted by ``offset``; with the
    model's ``config``, also unless the shifted first position is inside a learned position
    table (GPT-2: ``n_positions``)."""
    if offset < 0:
        raise ValueError(f"options['position_offset'] must be >= 0, got {offset}")
    if mt not in POSITION_OFFSET_MODEL_TYPES:
        raise ValueError(f"options['position_offset'] is supported for model types "
                         f"{POSITION_OFFSET_MODEL_TYPES} (positions arange(past, past + n)); "
                         f"this model is {mt!r}")
    limit = (getattr(config, "max_position_embeddings", None)
             if mt in LEARNED_POSITION_MODEL_TYPES else None)
    if isinstance(limit, int) and offset >= limit:
        raise ValueError(f"options['position_offset']={offset} is at or past the end of this "
                         f"{mt!r} model's {limit} learned positions "
                         f"(config.max_position_embeddings): every token would index past the "
                         f"position table; it must be < {limit} (and offset + sequence length "
                         f"<= {limit})")


class _PositionOffset:
    """The forward pre-hook of :func:`add_position_offset` (a class, not a closure, so that a
    model holding it still pickles: torch.save of the whole model)."""

    def __init__(self, offset: int):
        self.offset = offset

    def __call__(self, module, args, kwargs):
        offset = self.offset
        pos = kwargs.get("position_ids")
        if pos is not None:
            kwargs["position_ids"] = pos + offset
            return args, kwargs
        ref = kwargs.get("input_ids", args[0] if args else None)
        if ref is None:
            ref = kwargs.get("inputs_embeds")
        if ref is None:
            return None
        # the KV cache: ``cache`` (transformers 5.x) or its deprecated name ``past_key_values``
        past = kwargs.get("cache")
        if past is None:
            past = kwargs.get("past_key_values")
        start = int(past.get_seq_length()) if hasattr(past, "get_seq_length") else 0
        n = ref.shape[1]
        pos = torch.arange(offset + start, offset + start + n, device=ref.device)
        kwargs["position_ids"] = pos.unsqueeze(0).expand(ref.shape[0], -1)
        return args, kwargs


def add_position_offset(model: nn.Module, offset: int):
    """Shift the model's token positions by ``offset``: a forward pre-hook that passes
    ``position_ids = arange(offset + past, offset + past + n)`` when none are given and adds
    ``offset`` to explicit ones (as PEFT's prefix tuning does). Returns the hook handle."""
    return model.register_forward_pre_hook(_PositionOffset(offset), with_kwargs=True)


__all__ = ["ATTN_IMPLEMENTATION", "register", "add_inducers", "attach_inducer",
           "attach_inducer_block", "unsupported_reason", "check_supported",
           "self_attention_blocks", "attention_layers", "set_implementation",
           "kfused_inducer_attention_forward", "kfused_inducer_mask", "add_position_offset",
           "check_position_offset", "POSITION_OFFSET_MODEL_TYPES",
           "LEARNED_POSITION_MODEL_TYPES"]
