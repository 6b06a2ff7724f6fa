"""kfused: fused Triton and CUDA C++ kernels for kernel-view adapters.

Functional ops (each takes ``backend="auto" | "triton" | "cuda" | "reference"``; the default
comes from $KFUSED_BACKEND, else "auto"):

    kron_matvec(x, A, B)                            (A ⊗ B) x per token       docs/math.md §1
    krona_linear(x, weight, bias, A, B, scale)      x Wᵀ + b + s (A ⊗ B) x    docs/math.md §1
    headwise_lowrank(basis, A, B, bias)             per-head low-rank product  docs/math.md §2
    headwise_qkv / headwise_projection / headwise_oproj   fused attention projections with
                                                    Kernel-wise(-lite) + shared LoRA updates
    inducer_attention(q, k, v, ...)                 flash inducer attention + prefix tuning  docs/math.md §3
    inducer_attention_varlen(q, k, v, cu_seqlens_q, ...)   the same over packed sequences

Integration (Hugging Face models): inject, save, load, merge, unmerge, AdapterConfig, preset;
PEFT interop: from_peft (PEFT LoRA / LoKr -> kfused layers), to_peft (-> PEFT adapter folder).
Modules: :mod:`kfused.modules`. References (float64 oracles, CPU fallback):
:mod:`kfused.reference`. The docs/math.md §4 comparison: :mod:`kfused.testing`.
"""

from kfused import reference
from kfused.backends import BackendError, available_backends
from kfused.modules.krona import KronABlock, KronALinear, factorize
from kfused.ops import (HeadFactors, headwise_lowrank, headwise_oproj, headwise_projection,
                        headwise_qkv, inducer_attention, inducer_attention_varlen,
                        inducer_output_projection, kron_matvec, krona_linear)
from kfused.modules.inducer import InducerAttention, InducerOutputProjection
from kfused.modules.headwise import (HeadwiseConfig, HeadwiseOutput, HeadwiseProjection,
                                     HeadwiseQKV, ProjRanks)
from kfused.integration.headwise import attach_headwise
from kfused.integration import (AdapterConfig, inject, load, merge, merge_and_unload, preset,
                                print_trainable_parameters, register_method, save, unmerge)
from kfused.modules.lora import LoRALinear
from kfused.integration.peft_interop import PeftConversionError, from_peft, to_peft

__version__ = "0.1.0"

__all__ = [
    "BackendError", "available_backends", "reference", "__version__",
    "kron_matvec", "krona_linear", "KronALinear", "KronABlock", "factorize",
    "HeadFactors", "headwise_lowrank", "headwise_qkv", "headwise_projection", "headwise_oproj",
    "HeadwiseConfig", "HeadwiseOutput", "HeadwiseProjection", "HeadwiseQKV", "ProjRanks",
    "attach_headwise", "inducer_attention", "inducer_attention_varlen",
    "inducer_output_projection", "InducerAttention",
    "InducerOutputProjection",
    "AdapterConfig", "inject", "save", "load", "merge", "unmerge", "merge_and_unload",
    "print_trainable_parameters", "preset", "register_method", "LoRALinear",
    "from_peft", "to_peft", "PeftConversionError",
]
