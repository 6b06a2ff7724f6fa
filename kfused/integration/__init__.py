"""Hugging Face integration: inject adapters, train, save, reload, merge.

    from kfused.integration import AdapterConfig, inject, save, load, merge
    inject(model, AdapterConfig(method="krona"))      # or inject(model, "lora-e2e")
    ... train ...; save(model, "ckpt/"); load(fresh_model, "ckpt/"); merge(model)

Methods are plugged in through :func:`register_method` (see :mod:`kfused.integration.registry`);
where a model keeps its projections and attention blocks: :mod:`kfused.integration.arch`.
"""

from kfused.integration.arch import (ARCHS, ArchSpec, AttentionBlock, AttentionLayout,
                                     attention_blocks, detect_arch, register_arch)
from kfused.integration.checkpoint import (CheckpointError, adapter_state_dict, load,
                                           read_checkpoint_config, save)
from kfused.integration.config import PRESETS, AdapterConfig, preset
from kfused.integration.inject import (InjectState, adapter_modules, count_parameters, merged_modules,
                                       get_state, inject, merge, merge_and_unload,
                                       print_trainable_parameters,
                                       set_backend, set_exact, unmerge, unwrap,
                                       use_backend)
from kfused.integration.registry import (MethodSpec, Target, get_method, is_mergeable, methods,
                                         register_method)

__all__ = [
    "AdapterConfig", "PRESETS", "preset", "inject", "save", "load", "merge", "unmerge", "merge_and_unload",
    "print_trainable_parameters", "count_parameters", "set_backend", "set_exact",
    "adapter_modules",
    "use_backend", "adapter_state_dict", "read_checkpoint_config", "get_state", "unwrap", "InjectState",
    "CheckpointError", "register_method", "get_method", "methods", "is_mergeable", "MethodSpec",
    "Target", "register_arch", "ArchSpec", "ARCHS", "detect_arch", "merged_modules",
    "AttentionLayout", "AttentionBlock", "attention_blocks",
]
