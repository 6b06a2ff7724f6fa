"""Built-in methods (LoRA, KronA, KronA^B, KronA^B_res, scaled parallel adapter) and the
declarations of the methods whose modules land separately (Kernel-wise/-mix, inducer, prefix).

To plug one of the declared methods in, create the plugin module named below (for example
``kfused/integration/methods_headwise.py``) containing one ``wrap`` function per method and a
``register_method(...)`` call; see :mod:`kfused.integration.registry` for the contract and
``_lora`` / ``_krona_b`` below for complete examples.
"""

from __future__ import annotations

from torch import nn

from kfused.integration.config import AdapterConfig
from kfused.integration.registry import Target, register_method
from kfused.modules.krona import KronABlock, KronALinear
from kfused.modules.lora import LoRALinear
from kfused.modules.parallel_adapter import ScaledParallelAdapter

# ------------------------------------------------------------------------------------------
# linear sites


def _lora(module: nn.Module, target: Target, cfg: AdapterConfig) -> nn.Module:
    r = cfg.rank_for(target.role, target.name)
    return LoRALinear(module, r=int(r), alpha=cfg.alpha, dropout=cfg.dropout, init=cfg.init,
                      backend=cfg.backend)


def _krona(module: nn.Module, target: Target, cfg: AdapterConfig) -> nn.Module:
    a_shape, b_shape = cfg.a_shape, cfg.b_shape
    # per-module factor shapes, {module name: [a_shape, b_shape]} (e.g. from kfused.from_peft)
    per_module = (cfg.options.get("krona_shapes") or {}).get(target.name)
    if per_module is not None:
        a_shape, b_shape = tuple(per_module[0]), tuple(per_module[1])
    return KronALinear(module, a_shape=a_shape, b_shape=b_shape, scale=cfg.scale,
                       init=cfg.init, backend=cfg.backend)


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
    r = cfg.rank_for(target.role, target.name)
    return ScaledParallelAdapter(module, _block_dims(target), r=int(r), scale=cfg.scale,
                                 init=cfg.init, backend=cfg.backend)


QV = {"gpt2": ["qkv"], "*": ["q", "v"]}
FFN = {"*": ["ffn"]}
ATTN = {"*": ["attn"]}

register_method("lora", site="linear", wrap=_lora, default_targets=QV, mergeable=True,
                description="LoRA: x Wᵀ + b + (alpha/r)·(x Aᵀ) Bᵀ", paper="004")
register_method("krona", site="linear", wrap=_krona, default_targets=QV, mergeable=True,
                description="KronA: x Wᵀ + b + s·(A ⊗ B) x (fused with the frozen GEMM)",
                paper="003")
register_method("krona_b", site="block", wrap=_krona_b, default_targets=FFN,
                description="KronA^B: FFN(x) + s·(A ⊗ B) x parallel to the FFN block",
                paper="003")
register_method("krona_b_res", site="block", wrap=_krona_b_res, default_targets=FFN,
                description="KronA^B_res: KronA^B + learnable s_res·x", paper="003")
register_method("parallel_adapter", site="block", wrap=_parallel_adapter, default_targets=FFN,
                description="scaled parallel adapter: FFN(x) + s·ReLU(x W_down) W_up",
                paper="002")

# ------------------------------------------------------------------------------------------
# declared: implementations register themselves from these plugin modules when they land.

_HEADWISE = "kfused.integration.methods_headwise"
_INDUCER = "kfused.integration.methods_inducer"

for _name, _desc in [
        ("kernel_wise", "Kernel-wise: per-head low-rank updates (SPEC §2)"),
        ("kernel_wise_lite", "Kernel-wise-lite: per-head updates on the key basis (SPEC §2)"),
        ("kernel_mix", "Kernel-mix: shared LoRA + Kernel-wise (SPEC §2)"),
        ("kernel_mix_lite", "Kernel-mix-lite: shared LoRA + Kernel-wise-lite (SPEC §2)")]:
    register_method(_name, site="model", default_targets={"*": ["q", "v"]},
                    description=_desc, paper="000", plugin=_HEADWISE)

register_method("inducer", site="model", default_targets=ATTN, paper="001",
                description="inducer attention: a per-query virtual key/value column (SPEC §3)",
                plugin=_INDUCER)
register_method("prefix", site="model", default_targets=ATTN, paper="002",
                description="prefix tuning: l learned key/value columns per head (SPEC §3)",
                plugin=_INDUCER)

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
