"""Per-architecture knowledge: where each projection lives in a transformers model.

A *role* names a site in every layer: ``q k v o`` (attention projections; GPT-2 keeps them in one
fused Conv1D, role ``qkv``, and maps ``q``/``k``/``v`` onto it), ``ffn_in`` / ``ffn_out`` (the FFN's
linear layers), ``ffn`` (the whole FFN block, for block-parallel adapters) and ``attn`` (the
attention module, for methods that change attention itself: inducer, prefix).

Each role is a regular expression matched with ``re.fullmatch`` against ``model.named_modules()``
names. New architectures: add an :class:`ArchSpec` with :func:`register_arch`.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from torch import nn

# How a block-parallel adapter is attached to an "ffn" site:
#   "call":        the site is a module computing FFN(x) from x alone -> wrap it.
#   "bert_output": BERT/RoBERTa `XOutput(h, x) = LN(dropout(dense(h)) + x)`: the FFN's input x
#                  is the second argument and the adapter term is added before the LayerNorm.
BLOCK_KINDS = ("call", "bert_output")


@dataclasses.dataclass(frozen=True)
class ArchSpec:
    name: str
    model_types: Tuple[str, ...]
    roles: Dict[str, str]
    ffn_kind: str = "call"
    aliases: Dict[str, str] = dataclasses.field(default_factory=dict)

    def role_regex(self, role: str) -> Optional[str]:
        role = self.aliases.get(role, role)
        return self.roles.get(role)

    def canonical(self, role: str) -> str:
        return self.aliases.get(role, role)


ARCHS: Dict[str, ArchSpec] = {}


def register_arch(spec: ArchSpec) -> ArchSpec:
    ARCHS[spec.name] = spec
    return spec


register_arch(ArchSpec(
    name="gpt2", model_types=("gpt2",),
    roles={
        "qkv": r"(.*\.)?h\.\d+\.attn\.c_attn",
        "o": r"(.*\.)?h\.\d+\.attn\.c_proj",
        "ffn_in": r"(.*\.)?h\.\d+\.mlp\.c_fc",
        "ffn_out": r"(.*\.)?h\.\d+\.mlp\.c_proj",
        "ffn": r"(.*\.)?h\.\d+\.mlp",
        "attn": r"(.*\.)?h\.\d+\.attn",
    },
    # GPT-2 computes q, k, v in one Conv1D (PEFT adapts the whole c_attn for "q, v" too).
    aliases={"q": "qkv", "k": "qkv", "v": "qkv"},
))
register_arch(ArchSpec(
    name="llama",
    model_types=("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo", "phi3"),
    roles={
        "q": r"(.*\.)?layers\.\d+\.self_attn\.q_proj",
        "k": r"(.*\.)?layers\.\d+\.self_attn\.k_proj",
        "v": r"(.*\.)?layers\.\d+\.self_attn\.v_proj",
        "o": r"(.*\.)?layers\.\d+\.self_attn\.o_proj",
        "ffn_in": r"(.*\.)?layers\.\d+\.mlp\.(gate_proj|up_proj)",
        "ffn_out": r"(.*\.)?layers\.\d+\.mlp\.down_proj",
        "ffn": r"(.*\.)?layers\.\d+\.mlp",
        "attn": r"(.*\.)?layers\.\d+\.self_attn",
    },
))
register_arch(ArchSpec(
    name="bert", model_types=("bert", "roberta", "xlm-roberta", "camembert"),
    roles={
        "q": r"(.*\.)?layer\.\d+\.attention\.self\.query",
        "k": r"(.*\.)?layer\.\d+\.attention\.self\.key",
        "v": r"(.*\.)?layer\.\d+\.attention\.self\.value",
        "o": r"(.*\.)?layer\.\d+\.attention\.output\.dense",
        "ffn_in": r"(.*\.)?layer\.\d+\.intermediate\.dense",
        "ffn_out": r"(.*\.)?layer\.\d+\.output\.dense",
        "ffn": r"(.*\.)?layer\.\d+\.output",
        "attn": r"(.*\.)?layer\.\d+\.attention\.self",
    },
    ffn_kind="bert_output",
))
register_arch(ArchSpec(
    name="t5", model_types=("t5", "mt5", "umt5"),
    roles={
        "q": r"(.*\.)?block\.\d+\.layer\.\d+\.(SelfAttention|EncDecAttention)\.q",
        "k": r"(.*\.)?block\.\d+\.layer\.\d+\.(SelfAttention|EncDecAttention)\.k",
        "v": r"(.*\.)?block\.\d+\.layer\.\d+\.(SelfAttention|EncDecAttention)\.v",
        "o": r"(.*\.)?block\.\d+\.layer\.\d+\.(SelfAttention|EncDecAttention)\.o",
        "ffn_in": r"(.*\.)?block\.\d+\.layer\.\d+\.DenseReluDense\.(wi|wi_0|wi_1)",
        "ffn_out": r"(.*\.)?block\.\d+\.layer\.\d+\.DenseReluDense\.wo",
        "ffn": r"(.*\.)?block\.\d+\.layer\.\d+\.DenseReluDense",
        "attn": r"(.*\.)?block\.\d+\.layer\.\d+\.(SelfAttention|EncDecAttention)",
    },
))


def model_type_of(model: nn.Module) -> Optional[str]:
    cfg = getattr(model, "config", None)
    return getattr(cfg, "model_type", None)


def detect_arch(model: nn.Module, name: Optional[str] = None) -> Optional[ArchSpec]:
    """The ArchSpec for ``model`` (by ``model.config.model_type``), or for an explicit name."""
    if name is not None:
        if name not in ARCHS:
            raise ValueError(f"unknown architecture {name!r}; known: {', '.join(sorted(ARCHS))}")
        return ARCHS[name]
    mt = model_type_of(model)
    for spec in ARCHS.values():
        if mt in spec.model_types:
            return spec
    return None


def model_dims(model: nn.Module) -> Dict[str, Optional[int]]:
    """d_model, n_heads and head_dim from a transformers config (None where unknown)."""
    cfg = getattr(model, "config", None)

    def first(*names):
        for n in names:
            v = getattr(cfg, n, None)
            if v is not None:
                return int(v)
        return None

    d = first("hidden_size", "n_embd", "d_model")
    h = first("num_attention_heads", "n_head", "num_heads")
    hd = first("head_dim", "d_kv")
    if hd is None and d is not None and h:
        hd = d // h
    return {"d_model": d, "n_heads": h, "head_dim": hd}
