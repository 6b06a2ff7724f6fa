"""The method registry: the one place where an adapter method is plugged into kfused.inject.

A method is a :class:`MethodSpec`. Most methods need one function,

    wrap(site, target: Target, cfg: AdapterConfig) -> replacement or placed modules

that receives what inject found at a target site. The framework finds the sites (through
:mod:`kfused.integration.arch`), calls ``wrap``, swaps modules in place, freezes the base, makes
the new parameters trainable (in ``cfg.adapter_dtype``), and saves, loads, merges and reports
them — a method never deals with checkpoints or freezing. ``cfg.init`` reaches ``wrap``
resolved: the method's ``default_init`` for None, and always one of the method's ``inits``
(inject raises ValueError otherwise, naming the value and the accepted ones).

Sites:
    "linear"    nn.Linear / transformers Conv1D (roles q k v o qkv ffn_in ffn_out); ``wrap``
                gets the frozen module and returns its replacement (which owns the original as
                a submodule and the new adapter parameters).
    "block"     a whole block for block-parallel adapters (role ffn); ``wrap`` returns a module
                called as ``m(x, *args, **kw)`` computing ``block(x) + Δ(x)``. For BERT's
                ``XOutput(h, x)`` the framework hands ``wrap`` a zero block and adds the
                returned module's output before the LayerNorm (see ``_BertOutputParallel``).
    "attention" every attention block (:func:`kfused.integration.arch.attention_blocks`), for
                methods that adapt several projections of a block together (Kernel-wise/-mix)
                or attention itself (inducer, prefix). ``wrap`` gets the
                :class:`~kfused.integration.arch.AttentionBlock` (projections, head counts,
                head width, cross-attention) and a Target with the block's name, changes the
                block in place and returns the adapter modules it placed (a list; may be
                empty for a block the method leaves alone). ``finish(model, cfg)``, if given,
                runs once after every block (e.g. to switch the attention implementation);
                on the linear and block sites, once after every target is wrapped (e.g. to
                check an option that names modules).
    "model"     the whole model, for third-party methods with their own attach function.
                ``wrap`` gets the model, a Target with ``name=""`` and the config, changes the
                model in place and returns the adapter modules it placed, as ``{name: module}``
                or a list of modules (names are then looked up). New parameters are found by
                identity, so the apply function may create them anywhere.
    Composite methods list ``parts``: ``(method, default_targets or None)`` applied in order
    (linear parts first is best: later attention/block wrappers then contain the adapted
    linears). Per-part overrides come from ``cfg.options[part]``.

A method names the ``cfg.options`` keys it reads (``options=``); inject refuses any other key
by name before it changes the model. A composite passes each part the shared keys that part
reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from torch import nn

from kfused.integration.arch import ArchSpec
from kfused.integration.config import AdapterConfig
from kfused.modules._init import INITS, check_init

SITES = ("linear", "block", "attention", "model", "composite")


@dataclasses.dataclass
class Target:
    """One site found in the model, handed to a method's ``wrap``."""

    name: str                      # full module name, e.g. "transformer.h.0.attn.c_attn"
    role: Optional[str]            # canonical role ("qkv", "v", "ffn", ...) or None (regex target)
    site: str                      # "linear" | "block" | "attention" | "model"
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
    # the init values the method honours (see kfused.modules._init) and the one None means;
    # a composite honours the values every part honours, and each part resolves None itself
    inits: Tuple[str, ...] = tuple(INITS)
    default_init: Optional[str] = "zero"
    # finish(model, cfg) runs once after wrap has seen every block / target (not "model")
    finish: Optional[Callable[[nn.Module, AdapterConfig], None]] = None
    # check(model, arch) raises ValueError if the method cannot run on this model; inject calls
    # it for every part before changing the model (so a refused composite leaves no residue)
    check: Optional[Callable[[nn.Module, Optional[ArchSpec]], None]] = None
    # default_init_for(cfg): the init None means for this config, where it depends on the
    # config (the inducer with prefix columns has no exact start); else default_init
    default_init_for: Optional[Callable[[AdapterConfig], str]] = None
    # the ``cfg.options`` keys the method reads; inject refuses any other key. None: not
    # declared (a plugin registered without ``options=``), every key is passed on unchecked.
    # A composite reads its parts' keys (each part gets the shared keys it reads) and the
    # per-part override dicts named by its parts.
    options: Optional[Tuple[str, ...]] = None
    # whether the method applies cfg.dropout; None: not declared (unchecked). inject refuses a
    # dropout that no part of the method applies
    dropout: Optional[bool] = None

    def targets_for(self, arch: Optional[ArchSpec]) -> Optional[List[str]]:
        if arch is not None and arch.name in self.default_targets:
            return list(self.default_targets[arch.name])
        if "*" in self.default_targets:
            return list(self.default_targets["*"])
        return None

    def resolve_init(self, init: Optional[str], cfg: Optional[AdapterConfig] = None) -> str:
        """``init`` (None: the default, for ``cfg`` where it depends on it) if this method
        honours it, else ValueError."""
        if init is None:
            init = (self.default_init_for(cfg) if self.default_init_for is not None
                    and cfg is not None else self.default_init)
        return check_init(init, self.inits, f"method {self.name!r}")


_METHODS: Dict[str, MethodSpec] = {}


def register_method(name: str, *, site: str, wrap: Optional[WrapFn] = None,
                    default_targets: Optional[Dict[str, Sequence[str]]] = None,
                    mergeable: bool = False,
                    parts: Sequence[Tuple[str, Optional[Sequence[str]]]] = (),
                    description: str = "", paper: str = "",
                    inits: Sequence[str] = tuple(INITS), default_init: str = "zero",
                    finish: Optional[Callable[[nn.Module, AdapterConfig], None]] = None,
                    check: Optional[Callable[[nn.Module, Optional[ArchSpec]], None]] = None,
                    default_init_for: Optional[Callable[[AdapterConfig], str]] = None,
                    options: Optional[Sequence[str]] = None,
                    dropout: Optional[bool] = None,
                    replace: bool = True) -> MethodSpec:
    """Register (or replace) an adapter method. See the module docstring for the contract.

    Args:
        name: the ``AdapterConfig.method`` value.
        site: "linear", "block", "attention", "model" or "composite".
        wrap: the module factory (None for composites).
        default_targets: arch name ("gpt2", "llama", "bert", "t5", or "*" for any) -> roles.
        mergeable: the method's modules implement ``merge()`` / ``unmerge()`` exactly.
        parts: for composites, ``(method, targets or None)`` in application order.
        inits: the init values (:mod:`kfused.modules._init`) the method honours; default_init:
            the one ``init=None`` means. Composites: both derived (the values every part
            honours; each part resolves None to its own default).
        finish: ``finish(model, cfg)`` after every attention block / linear or block target
            is adapted (not for the "model" site); raising there undoes the inject.
        check: ``check(model, arch)`` raising ValueError (with the reason) when the method
            cannot run on ``model``; called by inject before any part changes the model.
        default_init_for: ``default_init_for(cfg)``, the init ``init=None`` means for a
            config, where that depends on the config (one of ``inits``); else default_init.
        options: the ``AdapterConfig.options`` keys the method reads; inject refuses a config
            with any other key (a misspelt option is an error, never silently dropped). None
            (the default): unchecked. Composites: derived from their parts.
        dropout: whether the method applies ``AdapterConfig.dropout``; inject refuses a
            non-zero dropout that no part applies. None (the default): unchecked.
    """
    if site not in SITES:
        raise ValueError(f"site must be one of {SITES}, got {site!r}")
    if site == "composite" and not parts:
        raise ValueError(f"composite method {name!r} needs parts")
    if site != "composite" and wrap is None:
        raise ValueError(f"method {name!r} needs a wrap function")
    if site == "composite":
        inits = tuple(i for i in INITS
                      if all(p not in _METHODS or i in _METHODS[p].inits for p, _ in parts))
        default_init = None
        part_opts = [_METHODS[p].options if p in _METHODS else None for p, _ in parts]
        options = (None if any(o is None for o in part_opts)
                   else tuple(sorted({k for o in part_opts for k in o})))
    else:
        for value in (*inits, default_init):
            check_init(value, tuple(INITS), f"method {name!r}")
        if default_init not in inits:
            raise ValueError(f"method {name!r}: default_init={default_init!r} is not among its "
                             f"inits {tuple(inits)}")
    if not replace and name in _METHODS:
        raise ValueError(f"method {name!r} is already registered")
    spec = MethodSpec(
        name=name, site=site, wrap=wrap,
        default_targets={k: list(v) for k, v in (default_targets or {}).items()},
        mergeable=mergeable,
        parts=tuple((p, list(t) if t is not None else None) for p, t in parts),
        description=description, paper=paper, inits=tuple(inits), default_init=default_init,
        finish=finish, check=check, default_init_for=default_init_for,
        options=tuple(options) if options is not None else None, dropout=dropout)
    _METHODS[name] = spec
    return spec


def get_method(name: str) -> MethodSpec:
    """The spec registered as ``name``."""
    if name not in _METHODS:
        raise ValueError(f"unknown adapter method {name!r}; "
                         f"registered: {', '.join(sorted(_METHODS))}")
    return _METHODS[name]


def is_mergeable(name: str) -> bool:
    spec = _METHODS[name]
    if spec.site == "composite":
        return all(is_mergeable(p) for p, _ in spec.parts)
    return spec.mergeable


def methods() -> Dict[str, MethodSpec]:
    """Every registered method by name."""
    return dict(_METHODS)
