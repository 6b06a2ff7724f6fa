"""Plugin: Kernel-wise, Kernel-wise-lite, Kernel-mix, Kernel-mix-lite (SPEC §2) for inject().

Maps an AdapterConfig onto the headwise modules' own ``HeadwiseConfig`` and calls their
``attach_headwise(model, cfg)`` (a model-level method). Imported by the registry the first time
one of these methods is injected; until ``kfused.modules.headwise`` lands the import fails and
inject raises NotImplementedError naming this module.

Ranks (``AdapterConfig.ranks[proj]`` for proj in q, v, o; default ``r``):
    kernel_wise       int                -> per-head wise rank
    kernel_wise_lite  int                -> per-head lite rank (q, v only)
    kernel_mix        (wise, shared)     -> wise rank + shared LoRA rank; ``options["lite"]``
                                            lists projections whose wise part is lite
    kernel_mix_lite   (lite, shared)     -> lite rank + shared LoRA rank (q, v only)
"""

from __future__ import annotations

from typing import Dict, Tuple

from torch import nn

from kfused.integration.config import AdapterConfig
from kfused.integration.registry import Target, register_method
from kfused.modules.headwise import HeadwiseConfig, ProjRanks, attach_headwise

_PROJS = ("q", "v", "o")


def _pair(value, default: int) -> Tuple[int, int]:
    if isinstance(value, (list, tuple)):
        if len(value) != 2:
            raise ValueError(f"Kernel-mix ranks are (wise, shared) pairs, got {value!r}")
        return int(value[0]), int(value[1])
    return int(value), default


def headwise_config(method: str, cfg: AdapterConfig) -> HeadwiseConfig:
    targets = cfg.targets if cfg.targets is not None else ["q", "v"]
    bad = [t for t in targets if t not in _PROJS]
    if bad:
        raise ValueError(f"{method}: targets must be among q, v, o (the per-head projections), "
                         f"got {bad}")
    lite_projs = set(cfg.options.get("lite", []))
    if method in ("kernel_wise_lite", "kernel_mix_lite"):
        lite_projs |= set(targets)
    ranks: Dict[str, ProjRanks] = {}
    for proj in targets:
        value = cfg.ranks.get(proj, cfg.r)
        if method.startswith("kernel_wise"):
            wise, shared = int(value), 0
        else:
            wise, shared = _pair(value, cfg.r)
        lite = proj in lite_projs
        ranks[proj] = ProjRanks(wise=0 if lite else wise, lite=wise if lite else 0, shared=shared)
    init = cfg.init if cfg.init in ("lora", "paper") else "lora"
    return HeadwiseConfig(**ranks, scale=cfg.scale, init=init)


def _backend_default(module: nn.Module, args, kwargs):
    """Forward pre-hook: the module's ``backend`` (AdapterConfig.backend, or what
    :func:`kfused.integration.set_backend` set) when the caller passes none."""
    backend = getattr(module, "backend", None)
    if backend is not None and len(args) < 2 and kwargs.get("backend") is None:
        kwargs = dict(kwargs, backend=backend)
    return args, kwargs


def _make(method: str):
    def apply(model: nn.Module, target: Target, cfg: AdapterConfig):
        new = attach_headwise(model, headwise_config(method, cfg))
        # The headwise modules take the backend per call and the model never passes one:
        # remember the configured backend on each module and supply it on every call.
        for mod in new.values():
            mod.backend = cfg.backend
            mod.register_forward_pre_hook(_backend_default, with_kwargs=True)
        return new

    return apply


for _name, _desc in [
        ("kernel_wise", "Kernel-wise: per-head low-rank updates (SPEC §2)"),
        ("kernel_wise_lite", "Kernel-wise-lite: per-head updates on the key basis (SPEC §2)"),
        ("kernel_mix", "Kernel-mix: shared LoRA + Kernel-wise (SPEC §2)"),
        ("kernel_mix_lite", "Kernel-mix-lite: shared LoRA + Kernel-wise-lite (SPEC §2)")]:
    register_method(_name, site="model", wrap=_make(_name), mergeable=True,
                    description=_desc, paper="000")
