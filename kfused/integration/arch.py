"""Per-architecture knowledge: where each projection and attention block lives in a
transformers model. This is the one place that knows it; every method finds its sites here.

An :class:`ArchSpec` names a model family and gives

* ``attention``: an :class:`AttentionLayout`, where the attention blocks are (a regex over
  module names) and where, inside one block, the q, k, v (or one fused q|k|v) and o
  projections and the module running softmax attention are; which blocks are cross-attention.
  :func:`attention_blocks` turns it, with the head counts of the model config, into one
  :class:`AttentionBlock` per block. Kernel-wise/-mix and inducer/prefix adapt these blocks.
* ``roles``: the other sites as regexes matched with ``re.fullmatch`` against
  ``model.named_modules()`` names: ``ffn_in`` / ``ffn_out`` (the FFN's linear layers) and
  ``ffn`` (the whole FFN block, for block-parallel adapters).

Role names for the linear-layer methods (LoRA, KronA): ``q k v o`` (GPT-2 keeps q, k, v in one
fused Conv1D, role ``qkv``, and maps ``q``/``k``/``v`` onto it), ``qkv``, ``attn`` (the module
running attention) and the roles above; :meth:`ArchSpec.role_regex` derives the attention
roles from the layout. New architectures: add an :class:`ArchSpec` with :func:`register_arch`.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Optional, Tuple

from torch import nn

# How a block-parallel adapter is attached to an "ffn" site:
#   "call":        the site is a module computing FFN(x) from x alone -> wrap it.
#   "bert_output": BERT/RoBERTa `XOutput(h, x) = LN(dropout(dense(h)) + x)`: the FFN's input x
#                  is the second argument and the adapter term is added before the LayerNorm.
BLOCK_KINDS = ("call", "bert_output")

ATTENTION_ROLES = ("q", "k", "v", "qkv", "o", "attn")


@dataclasses.dataclass(frozen=True)
class AttentionLayout:
    """Where one architecture keeps its attention projections.

    block: regex (``re.fullmatch``) of the attention blocks' module names.
    q, k, v: paths of the projections inside a block, or None with a fused ``qkv``.
    qkv: path of one fused q|k|v projection (GPT-2's Conv1D ``c_attn``: outputs [q | k | v]).
    o: path of the output projection inside the block.
    attn: path of the submodule that runs softmax attention (the module transformers'
        attention interface receives); "" when it is the block itself.
    cross: regex of the blocks that are cross-attention (q reads the decoder, k and v the
        encoder output); None when the architecture has none.
    """

    block: str
    o: str
    q: Optional[str] = None
    k: Optional[str] = None
    v: Optional[str] = None
    qkv: Optional[str] = None
    attn: str = ""
    cross: Optional[str] = None

    def __post_init__(self):
        if (self.qkv is None) == (self.q is None or self.k is None or self.v is None):
            raise ValueError("AttentionLayout: give either qkv (one fused projection) or all "
                             "of q, k, v")

    def path(self, role: str) -> Optional[str]:
        """The path of ``role`` (q, k, v, qkv, o, attn) inside a block; None if absent."""
        if role not in ATTENTION_ROLES:
            raise ValueError(f"unknown attention role {role!r}; roles: {ATTENTION_ROLES}")
        return getattr(self, role)


@dataclasses.dataclass(frozen=True)
class ArchSpec:
    name: str
    model_types: Tuple[str, ...]
    attention: AttentionLayout
    roles: Dict[str, str] = dataclasses.field(default_factory=dict)
    title: str = ""                # how messages name the family ("GPT-2"); default: name
    ffn_kind: str = "call"
    # a learned bias added to every attention score (T5's relative position bias)
    score_bias: bool = False

    @property
    def aliases(self) -> Dict[str, str]:
        """Role aliases: q, k, v -> qkv where the layout fuses them."""
        if self.attention.qkv is None:
            return {}
        return {"q": "qkv", "k": "qkv", "v": "qkv"}

    def canonical(self, role: str) -> str:
        return self.aliases.get(role, role)

    def role_regex(self, role: str) -> Optional[str]:
        role = self.canonical(role)
        if role in ATTENTION_ROLES:
            path = self.attention.path(role)
            if path is None:
                return None
            return self.attention.block + "".join(r"\." + re.escape(part)
                                                  for part in path.split(".") if part)
        return self.roles.get(role)

    def all_roles(self) -> Dict[str, str]:
        """Every role with its regex (attention roles derived from the layout)."""
        out = {r: self.role_regex(r) for r in ATTENTION_ROLES}
        out.update(self.roles)
        return {r: rx for r, rx in out.items() if rx is not None}


ARCHS: Dict[str, ArchSpec] = {}


def register_arch(spec: ArchSpec) -> ArchSpec:
    ARCHS[spec.name] = spec
    return spec


register_arch(ArchSpec(
    name="gpt2", model_types=("gpt2",), title="GPT-2",
    # GPT-2's cross-attention blocks (``crossattention``: q_attn + a fused k|v c_attn) are a
    # different layout and are not adapted.
    attention=AttentionLayout(block=r"(.*\.)?h\.\d+\.attn", qkv="c_attn", o="c_proj"),
    roles={
        "ffn_in": r"(.*\.)?h\.\d+\.mlp\.c_fc",
        "ffn_out": r"(.*\.)?h\.\d+\.mlp\.c_proj",
        "ffn": r"(.*\.)?h\.\d+\.mlp",
    },
))
register_arch(ArchSpec(
    name="llama", title="Llama-style",
    model_types=("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo"),
    attention=AttentionLayout(block=r"(.*\.)?layers\.\d+\.self_attn", q="q_proj", k="k_proj",
                              v="v_proj", o="o_proj"),
    roles={
        "ffn_in": r"(.*\.)?layers\.\d+\.mlp\.(gate_proj|up_proj)",
        "ffn_out": r"(.*\.)?layers\.\d+\.mlp\.down_proj",
        "ffn": r"(.*\.)?layers\.\d+\.mlp",
    },
))
register_arch(ArchSpec(
    # Phi-3: a Llama-style block with one fused q|k|v Linear ``qkv_proj`` (outputs
    # [q (H·p) | k (H_kv·p) | v (H_kv·p)]) and one fused gate|up Linear ``gate_up_proj``
    name="phi3", model_types=("phi3",), title="Phi-3",
    attention=AttentionLayout(block=r"(.*\.)?layers\.\d+\.self_attn", qkv="qkv_proj",
                              o="o_proj"),
    roles={
        "ffn_in": r"(.*\.)?layers\.\d+\.mlp\.gate_up_proj",
        "ffn_out": r"(.*\.)?layers\.\d+\.mlp\.down_proj",
        "ffn": r"(.*\.)?layers\.\d+\.mlp",
    },
))
register_arch(ArchSpec(
    name="bert", model_types=("bert", "roberta", "xlm-roberta", "camembert"), title="BERT/RoBERTa",
    attention=AttentionLayout(block=r"(.*\.)?layer\.\d+\.(attention|crossattention)",
                              q="self.query", k="self.key", v="self.value", o="output.dense",
                              attn="self", cross=r"(.*\.)?layer\.\d+\.crossattention"),
    roles={
        "ffn_in": r"(.*\.)?layer\.\d+\.intermediate\.dense",
        "ffn_out": r"(.*\.)?layer\.\d+\.output\.dense",
        "ffn": r"(.*\.)?layer\.\d+\.output",
    },
    ffn_kind="bert_output",
))
register_arch(ArchSpec(
    name="t5", model_types=("t5", "mt5", "umt5"), title="T5",
    attention=AttentionLayout(
        block=r"(.*\.)?block\.\d+\.layer\.\d+\.(SelfAttention|EncDecAttention)",
        q="q", k="k", v="v", o="o", cross=r"(.*\.)?block\.\d+\.layer\.\d+\.EncDecAttention"),
    roles={
        "ffn_in": r"(.*\.)?block\.\d+\.layer\.\d+\.DenseReluDense\.(wi|wi_0|wi_1)",
        "ffn_out": r"(.*\.)?block\.\d+\.layer\.\d+\.DenseReluDense\.wo",
        "ffn": r"(.*\.)?block\.\d+\.layer\.\d+\.DenseReluDense",
    },
    score_bias=True,
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
    """d_model, n_heads, n_kv_heads and head_dim from a transformers config (None where
    unknown; n_kv_heads defaults to n_heads)."""
    cfg = getattr(model, "config", None)

    def first(*names):
        for n in names:
            v = getattr(cfg, n, None)
            if v is not None:
                return int(v)
        return None

    d = first("hidden_size", "n_embd", "d_model")
    h = first("num_attention_heads", "n_head", "num_heads")
    hkv = first("num_key_value_heads") or h
    hd = first("head_dim", "d_kv")
    if hd is None and d is not None and h:
        hd = d // h
    return {"d_model": d, "n_heads": h, "n_kv_heads": hkv, "head_dim": hd}


@dataclasses.dataclass(frozen=True)
class AttentionBlock:
    """One attention block of a model, as :func:`attention_blocks` finds it.

    name: the block's module name; module: the block. n_heads: query heads H; n_kv_heads: key
    and value heads (< H with grouped-query attention); head_dim: p. cross: q reads the
    decoder states and k, v the encoder output. score_bias: the model adds a learned bias to
    the attention scores (T5). layout: where the projections are inside the block.
    """

    name: str
    module: nn.Module
    layout: AttentionLayout
    n_heads: int
    n_kv_heads: int
    head_dim: int
    cross: bool = False
    score_bias: bool = False

    @property
    def fused_qkv(self) -> bool:
        """q, k and v come from one projection (``get("qkv")``)."""
        return self.layout.qkv is not None

    def qualified(self, role: str) -> Optional[str]:
        """The module name of ``role`` (q, k, v, qkv, o, attn) in the model; None if absent."""
        path = self.layout.path(role)
        if path is None:
            return None
        return ".".join(p for p in (self.name, path) if p)

    def get(self, role: str) -> Optional[nn.Module]:
        path = self.layout.path(role)
        if path is None:
            return None
        return self.module.get_submodule(path) if path else self.module

    def set(self, role: str, new: nn.Module) -> str:
        """Put ``new`` in place of ``role``'s module; returns its qualified name."""
        path = self.layout.path(role)
        if not path:
            raise ValueError(f"{self.name}: role {role!r} cannot be replaced inside the block")
        parent, _, attr = path.rpartition(".")
        setattr(self.module.get_submodule(parent) if parent else self.module, attr, new)
        return self.qualified(role)


def attention_blocks(model: nn.Module, arch: Optional[ArchSpec] = None
                     ) -> List[AttentionBlock]:
    """Every attention block of ``model`` (self- and cross-attention), in module order.

    ``arch``: the architecture (default: detected from ``model.config.model_type``); none
    detected gives an empty list. Head counts and width come from the model config.
    """
    arch = arch or detect_arch(model)
    if arch is None:
        return []
    dims = model_dims(model)
    H, Hkv, p = dims["n_heads"], dims["n_kv_heads"], dims["head_dim"]
    if not (H and Hkv and p):
        raise ValueError(f"{type(model).__name__}: the model config gives no head count or head "
                         f"width (n_heads={H}, n_kv_heads={Hkv}, head_dim={p})")
    layout = arch.attention
    block_rx = re.compile(layout.block)
    cross_rx = re.compile(layout.cross) if layout.cross else None
    blocks = [AttentionBlock(name=name, module=mod, layout=layout, n_heads=H, n_kv_heads=Hkv,
                             head_dim=p, cross=bool(cross_rx and cross_rx.fullmatch(name)),
                             score_bias=arch.score_bias)
              for name, mod in model.named_modules() if block_rx.fullmatch(name)]
    for b in blocks:  # a block of another layout (an explicit arch= that does not fit)
        for role in ATTENTION_ROLES:
            path = layout.path(role)
            try:
                if path:
                    b.module.get_submodule(path)
            except AttributeError:
                raise ValueError(
                    f"{type(model).__name__} (model_type={model_type_of(model)!r}): attention "
                    f"block {b.name!r} ({type(b.module).__name__}) has no {path!r}, where the "
                    f"{arch.title or arch.name} layout (arch {arch.name!r}) keeps its {role!r} "
                    "projection; this model does not have that layout") from None
    return blocks


def describe_archs() -> str:
    """The known families for error messages: "GPT-2, Llama-style, BERT/RoBERTa or T5"."""
    titles = [a.title or a.name for a in ARCHS.values()]
    return titles[0] if len(titles) == 1 else ", ".join(titles[:-1]) + " or " + titles[-1]
