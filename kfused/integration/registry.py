"""The method registry: the one place where an adapter method is plugged into kfused.inject.

A method is a :class:`MethodSpec`. Most methods need one function,

    wrap(module: nn.Module, target: Target, cfg: AdapterConfig) -> nn.Module

that receives the frozen module found at a target site and returns its replacement (the
replacement owns the original as a submodule and the new adapter parameters). The framework
finds the sites, calls ``wrap``, swaps the module in place, freezes the base, makes the new
parameters trainable (in ``cfg.adapter_dtype``), and saves, loads, merges and reports them —
a method never deals with checkpoints or freezing.

Sites:
    "linear"    nn.Linear / transformers Conv1D (roles q k v o qkv ffn_in ffn_out).
    "block"     a whole block for block-parallel adapters (role ffn); ``wrap`` returns a module
                called as ``m(x, *args, **kw)`` computing ``block(x) + Δ(x)``. For BERT's
                ``XOutput(h, x)`` the framework hands ``wrap`` a zero block and adds the
                returned module's output before the LayerNorm (see ``_BertOutputParallel``).
    "attention" the attention module (role attn) for methods that change attention itself
                (inducer, prefix). ``wrap`` gets the HF attention module and ``target`` (with
                d_model, n_heads, head_dim, arch) and returns a drop-in replacement that keeps
                the original's forward signature.
    "model"     the whole model, for methods whose own attach function walks the model (e.g.
                ``attach_headwise(model, cfg)``, ``add_inducers(model, ...)``). ``wrap`` gets
                the model, a Target with ``name=""`` and the config, changes the model in place
                and returns the adapter modules it placed, as ``{name: module}`` or a list of
                modules (names are then looked up). New parameters are found by identity, so
                the apply function may create them anywhere.
    Composite methods list ``parts``: ``(method, default_targets or None)`` applied in order
    (linear parts first is best: later attention/block wrappers then contain the adapted
    linears). Per-part overrides come from ``cfg.options[part]``.

Methods whose modules are not installed yet are *declared* with ``plugin="module.path"``: the
first inject() with that method imports the module, which must call :func:`register_method`
for it (replacing the declaration). Until then inject raises NotImplementedError naming it.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from torch import nn

from kfused.integration.arch import ArchSpec
from kfused.integration.config import AdapterConfig

SITES = ("linear", "block", "attention", "model", "composite")


@dataclasses.dataclass
class Target:
    """One site found in the model, handed to a method's ``wrap``."""

    name: str                      # full module name, e.g. "transformer.h.0.attn.c_attn"
    role: Optional[str]            # canonical role ("qkv", "v", "ffn", ...) or None (regex target)
    site: str                      # "linear" | "block" | "attention"
    arch: Optional[ArchSpec]
    d_model: Optional[int]
    n_heads: Optional[int]
    head_dim: Optional[int]
    model_config: Any = None       # the transformers config (read-only)
    d_in: Optional[int] = None     # for linear sites
    d_out: Optional[int] = None


WrapFn = Callable[[nn.Module, Target, AdapterConfig], nn.Module]


@dataclasses.dataclass
class MethodSpec:
    name: str
    site: str
    wrap: Optional[WrapFn] = None
    default_targets: Dict[str, List[str]] = dataclasses.field(default_factory=dict)
    mergeable: bool = False
    parts: Tuple[Tuple[str, Optional[List[str]]], ...] = ()
    description: str = ""
    paper: str = ""
    plugin: Optional[str] = None   # module that registers the real implementation on import
    # check(model, arch) raises ValueError if the method cannot run on this model; inject calls
    # it for every part before changing the model (so a refused composite leaves no residue)
    check: Optional[Callable[[nn.Module, Optional[ArchSpec]], None]] = None

    def targets_for(self, arch: Optional[ArchSpec]) -> Optional[List[str]]:
        if arch is not None and arch.name in self.default_targets:
            return list(self.default_targets[arch.name])
        if "*" in self.default_targets:
            return list(self.default_targets["*"])
        return None

    @property
    def available(self) -> bool:
        return self.site == "composite" or self.wrap is not None


_METHODS: Dict[str, MethodSpec] = {}


def register_method(name: str, *, site: str, wrap: Optional[WrapFn] = None,
                    default_targets: Optional[Dict[str, Sequence[str]]] = None,
                    mergeable: bool = False,
                    parts: Sequence[Tuple[str, Optional[Sequence[str]]]] = (),
                    description: str = "", paper: str = "", plugin: Optional[str] = None,
                    check: Optional[Callable[[nn.Module, Optional[ArchSpec]], None]] = None,
                    replace: bool = True) -> MethodSpec:
    """Register (or replace) an adapter method. See the module docstring for the contract.

    Args:
        name: the ``AdapterConfig.method`` value.
        site: "linear", "block", "attention" or "composite".
        wrap: the module factory (None for composites and for plugin declarations).
        default_targets: arch name ("gpt2", "llama", "bert", "t5", or "*" for any) -> roles.
        mergeable: the method's modules implement ``merge()`` / ``unmerge()`` exactly.
        parts: for composites, ``(method, targets or None)`` in application order.
        plugin: import path of the module that registers the implementation.
        check: ``check(model, arch)`` raising ValueError (with the reason) when the method
            cannot run on ``model``; called by inject before any part changes the model.
    """
    if site not in SITES:
        raise ValueError(f"site must be one of {SITES}, got {site!r}")
    if site == "composite" and not parts:
        raise ValueError(f"composite method {name!r} needs parts")
    if not replace and name in _METHODS:
        raise ValueError(f"method {name!r} is already registered")
    spec = MethodSpec(
        name=name, site=site, wrap=wrap,
        default_targets={k: list(v) for k, v in (default_targets or {}).items()},
        mergeable=mergeable,
        parts=tuple((p, list(t) if t is not None else None) for p, t in parts),
        description=description, paper=paper, plugin=plugin, check=check)
    _METHODS[name] = spec
    return spec


def get_method(name: str) -> MethodSpec:
    """The spec for ``name``, importing its plugin first if it is only declared."""
    if name not in _METHODS:
        raise ValueError(f"unknown adapter method {name!r}; "
                         f"registered: {', '.join(sorted(_METHODS))}")
    spec = _METHODS[name]
    if not spec.available and spec.plugin:
        try:
            importlib.import_module(spec.plugin)
        except ImportError as exc:
            raise NotImplementedError(
                f"adapter method {name!r} is declared but not installed: importing its plugin "
                f"{spec.plugin!r} failed ({exc}). It lands with the {spec.description or name} "
                "modules; the plugin must call kfused.integration.register_method("
                f"{name!r}, site=..., wrap=...).") from exc
        spec = _METHODS[name]
    if not spec.available:
        raise NotImplementedError(
            f"adapter method {name!r} is declared but has no implementation registered"
            + (f" (plugin {spec.plugin!r} did not register it)" if spec.plugin else ""))
    return spec


def is_mergeable(name: str) -> bool:
    spec = _METHODS[name]
    if spec.site == "composite":
        return all(is_mergeable(p) for p, _ in spec.parts)
    return spec.mergeable


def methods() -> Dict[str, MethodSpec]:
    """Every registered or declared method by name."""
    return dict(_METHODS)
