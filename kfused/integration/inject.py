"""kfused.inject: attach adapters to a transformers (or any torch) model in place.

    model = AutoModelForCausalLM.from_config(cfg)
    kfused.integration.inject(model, AdapterConfig(method="krona"))   # base frozen, adapters trainable
    ... train ...; save(model, "out/"); merge(model)

The injected model carries a :class:`InjectState` (``model.kfused_state``) recording the config,
the architecture and the names of the adapter modules, parameters and buffers; checkpoints,
merge and the trainable-parameter report all read it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from kfused.distributed import parallel_wrapper
from kfused.integration import methods as _builtin_methods  # noqa: F401  (registers builtins)
from kfused.integration.arch import (ArchSpec, attention_blocks, describe_archs, detect_arch,
                                     model_dims, model_type_of)
from kfused.integration.config import _RANK_KEYS_USED, AdapterConfig, preset
from kfused.integration.registry import MethodSpec, Target, get_method, is_mergeable, methods
from kfused.modules._linear import is_conv1d as _is_conv1d, linear_dims

_SITE_ORDER = {"linear": 0, "block": 1, "attention": 2, "model": 2}
_REGEX_CHARS = set("\\*+?[](){}|^$")


@dataclasses.dataclass
class InjectState:
    config: AdapterConfig
    arch: Optional[str]
    model_type: Optional[str]
    model_class: str
    adapter_modules: List[str]
    param_names: List[str]
    buffer_names: List[str]


# ------------------------------------------------------------------------------------------
# finding and replacing sites


def unwrap(model: nn.Module) -> nn.Module:
    """The underlying model of a torch.compile / DistributedDataParallel wrapper."""
    seen = 0
    while seen < 8:
        seen += 1
        if hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            break
    return model


def refuse_wrapped(model: nn.Module, fn: str = "inject") -> None:
    """ValueError when ``model`` is already wrapped for multi-process training: the wrapper's
    gradient sync covers only the parameters it was given, so adapters added now would train
    on each rank alone."""
    wrapper = parallel_wrapper(model)
    if wrapper is not None:
        raise ValueError(f"{fn}: this model is already wrapped for multi-process training "
                         f"({wrapper}), which synchronises only the parameters it had then: "
                         "adapters added now would train on each rank alone. Add the adapters "
                         "(inject, load into a model without adapters, from_peft) before "
                         "kfused.distributed.wrap_model.")


def get_state(model: nn.Module, required: bool = True) -> Optional[InjectState]:
    state = getattr(unwrap(model), "kfused_state", None)
    if state is None and required:
        raise ValueError("this model has no kfused adapters: call kfused.integration.inject(model, "
                         "config) first (or load(model, dir), which injects from the checkpoint)")
    return state


class _ZeroBlock(nn.Module):
    """Stands in for BERT's FFN inside a block-parallel adapter: the adapter's delta is then
    ``wrapper(x) - 0``, added by :class:`_BertOutputParallel` before the LayerNorm."""

    def forward(self, x, *args, **kwargs):
        return torch.zeros_like(x)


class _BertOutputParallel(nn.Module):
    """BERT/RoBERTa ``XOutput(h, x) = LN(dropout(dense(h)) + x)`` with a block-parallel adapter
    on the FFN: ``LN(dropout(dense(h)) + Δ(x) + x)`` — the adapter sees the FFN's input x."""

    def __init__(self, output: nn.Module, adapter: nn.Module):
        super().__init__()
        for attr in ("dense", "dropout", "LayerNorm"):
            if not hasattr(output, attr):
                raise TypeError(f"{type(output).__name__} has no {attr}: not a BERT-style output")
        self.output = output
        self.adapter = adapter

    def forward(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
        h = self.output.dropout(self.output.dense(hidden_states))
        h = h + self.adapter(input_tensor).to(h.dtype)
        return self.output.LayerNorm(h + input_tensor)


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def _resolve_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    if name is None:
        return None
    dt = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
        raise ValueError(f"adapter_dtype must name a floating dtype (e.g. 'float32'), got {name!r}")
    return dt


def _match_targets(model: nn.Module, targets: List[str], arch: Optional[ArchSpec],
                   exclude: Optional[List[str]], method: str
                   ) -> List[Tuple[str, nn.Module, Optional[str]]]:
    patterns = []
    for t in targets:
        if arch is not None and arch.role_regex(t) is not None:
            patterns.append(("regex", re.compile(arch.role_regex(t)), arch.canonical(t), t))
        elif any(c in _REGEX_CHARS for c in t):
            patterns.append(("regex", re.compile(t), None, t))
        elif arch is None and t in ("q", "k", "v", "o", "qkv", "ffn", "ffn_in", "ffn_out", "attn"):
            raise ValueError(
                f"target {t!r} is a role name, but the model's architecture is unknown "
                f"(model_type={model_type_of(model)!r}); pass AdapterConfig(arch=...) or use "
                "module-name regexes as targets")
        else:
            patterns.append(("suffix", t, None, t))
    excl = [re.compile(e) for e in (exclude or [])]
    found: Dict[str, Tuple[nn.Module, Optional[str]]] = {}
    for name, mod in model.named_modules():
        if not name or any(e.fullmatch(name) for e in excl):
            continue
        for kind, pat, role, _ in patterns:
            hit = (pat.fullmatch(name) if kind == "regex"
                   else (name == pat or name.endswith("." + pat)))
            if hit:
                if role is None and arch is not None:  # infer the role so per-role ranks apply
                    role = next((r for r, rx in arch.all_roles().items()
                                 if re.fullmatch(rx, name)), None)
                found.setdefault(name, (mod, role))
                break
    if not found:
        raise ValueError(
            f"method {method!r}: no module of this model matched targets {targets}"
            + (f" (architecture {arch.name!r})" if arch else " (architecture unknown)")
            + "; targets are roles (q, k, v, o, qkv, ffn_in, ffn_out, ffn, attn), regexes over "
            "module names, or module-name suffixes")
    return [(n, m, r) for n, (m, r) in found.items()]


def _check_option_keys(spec: MethodSpec, cfg: AdapterConfig) -> None:
    """Refuse ``cfg.options`` keys that ``spec`` does not read (a misspelt key would be dropped)."""
    if spec.options is None:
        return
    allowed = set(spec.options) | {p for p, _ in spec.parts}
    unknown = sorted(str(k) for k in cfg.options if k not in allowed)
    if unknown:
        reads = (f"it reads {sorted(allowed)}" if allowed else "it reads no options")
        raise ValueError(f"method {spec.name!r}: unknown key(s) {unknown} in "
                         f"AdapterConfig.options; {reads}")


def _expand(spec: MethodSpec, cfg: AdapterConfig) -> List[Tuple[MethodSpec, AdapterConfig]]:
    _check_option_keys(spec, cfg)
    if spec.site != "composite":
        return [(spec, cfg)]
    if cfg.targets is not None:
        raise ValueError(
            f"{spec.name!r} is a composite of {[p for p, _ in spec.parts]}: give each part's "
            "targets in options, e.g. options={'lora': {'targets': ['q', 'v']}}")
    from kfused.integration.registry import methods

    shared_opts = {k: v for k, v in cfg.options.items() if k not in methods()}
    plan = []
    for part, part_targets in spec.parts:
        over = cfg.options.get(part, {})
        if not isinstance(over, dict):
            raise TypeError(f"method {spec.name!r}: options[{part!r}] holds part {part!r}'s "
                            f"overrides and must be a dict, got {type(over).__name__} {over!r}")
        over = dict(over)
        fields = {f.name for f in dataclasses.fields(AdapterConfig)} - {"method"}
        bad = sorted(str(k) for k in over if k not in fields)
        if bad:
            raise ValueError(f"method {spec.name!r}: options[{part!r}] overrides part {part!r}'s "
                             f"AdapterConfig fields; {bad} are not among them "
                             f"({', '.join(sorted(fields))})")
        own = over.pop("options", {})
        if not isinstance(own, dict):
            raise TypeError(f"method {spec.name!r}: options[{part!r}]['options'] holds part "
                            f"{part!r}'s own options and must be a dict, got "
                            f"{type(own).__name__} {own!r}")
        reads = get_method(part).options
        # each part gets the shared keys it reads (all of them if it does not declare)
        shared = {k: v for k, v in shared_opts.items() if reads is None or k in reads}
        sub = cfg.replace(method=part, targets=over.pop("targets", part_targets),
                          options={**shared, **own})
        if over:
            sub = sub.replace(**over)
        plan.extend(_expand(get_method(part), sub))
    return plan


def _place_new_params(module: nn.Module, before, adapter_dtype, ref) -> None:
    for p in module.parameters():
        if id(p) in before:
            continue
        want_dtype = adapter_dtype or (ref.dtype if ref is not None else p.dtype)
        want_dev = ref.device if ref is not None else p.device
        if p.dtype != want_dtype or p.device != want_dev:
            p.data = p.data.to(device=want_dev, dtype=want_dtype)
    for b in module.buffers():
        if id(b) not in before and ref is not None and b.device != ref.device:
            b.data = b.data.to(ref.device)


def _target(model, name, role, site, arch, dims, heads=None, head_dim=None) -> Target:
    return Target(name=name, role=role, site=site, arch=arch, d_model=dims["d_model"],
                  n_heads=heads or dims["n_heads"], head_dim=head_dim or dims["head_dim"],
                  model_config=getattr(model, "config", None))


def _apply_attention(model, part, cfg, arch, dims, exclude) -> list:
    """Call the method's wrap on every attention block; returns the modules it placed."""
    excl = [re.compile(e) for e in (exclude or [])]
    blocks = [b for b in attention_blocks(model, arch)
              if not any(e.fullmatch(b.name) for e in excl)]
    if not blocks:
        raise ValueError(f"method {part.name!r} adapts attention blocks, but found no "
                         f"{describe_archs()} attention block in {type(model).__name__} "
                         f"(model_type={model_type_of(model)!r}); pass AdapterConfig(arch=...) "
                         "for a model of a known layout")
    placed = []
    for block in blocks:
        target = _target(model, block.name, "attn", "attention", arch, dims, block.n_heads,
                         block.head_dim)
        placed.extend(part.wrap(block, target, cfg) or [])
    if part.finish is not None:
        part.finish(model, cfg)
    return placed


def _apply_whole(model, part, cfg, arch, dims, before, adapter_dtype, exclude) -> List[str]:
    """The attention and model sites: the method places modules itself; they are named here
    (by identity) and their new parameters moved to the base's device and adapter dtype."""
    ref = next(iter(model.parameters()), None)
    if part.site == "attention":
        placed = _apply_attention(model, part, cfg, arch, dims, exclude)
    else:
        placed = part.wrap(model, _target(model, "", None, "model", arch, dims), cfg)
    if isinstance(placed, dict):
        names = list(placed)
    else:
        ids = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        names = []
        for m in placed or []:
            if id(m) not in ids:
                raise ValueError(f"method {part.name!r} returned a module that is not in the model")
            names.append(ids[id(m)])
    if not names:
        raise ValueError(f"method {part.name!r} placed no adapter in this model")
    for n in names:
        _place_new_params(model.get_submodule(n), before, adapter_dtype, ref)
    return names


def snapshot(model: nn.Module):
    """What :func:`restore` needs to undo changes made to a model in place (an injection that
    failed part way, PEFT's loading): every module's attributes and the contents of its
    dict/set attributes (submodule, parameter, buffer and hook tables), the HF config's
    attributes and every parameter's ``requires_grad``."""
    def record(obj):
        attrs = dict(vars(obj))
        return obj, attrs, {k: v.copy() for k, v in attrs.items() if isinstance(v, (dict, set))}

    cfg = getattr(model, "config", None)
    objs = [record(m) for m in model.modules()]
    if cfg is not None and hasattr(cfg, "__dict__") and not isinstance(cfg, nn.Module):
        objs.append(record(cfg))
    return objs, [(p, p.requires_grad) for p in model.parameters()]


def restore(snap) -> None:
    """Put a model back as :func:`snapshot` saw it: attributes added since are removed, the
    recorded ones (and the contents of its tables) put back, so modules placed since are
    dropped."""
    objs, grads = snap
    for obj, attrs, contents in objs:
        d = vars(obj)
        for k in [k for k in d if k not in attrs]:
            del d[k]
        d.update(attrs)
        for k, v in contents.items():
            attrs[k].clear()
            attrs[k].update(v)
    for p, flag in grads:
        p.requires_grad_(flag)


def _follow_mode(model: nn.Module, old_modules: set) -> None:
    """New modules start in training mode (nn.Module's default): every module inject placed
    (the adapters and any wrapper around them, e.g. the inducer's output-projection wrapper)
    takes the mode of the nearest enclosing module that was there before, so an eval-mode
    model stays in eval mode (its adapters' dropout off) and a training one trains."""
    mode = {"": model.training}
    for name, sub in model.named_modules():
        if name:
            if id(sub) in old_modules:
                mode[name] = sub.training
            else:
                mode[name] = sub.training = mode[name.rpartition(".")[0]]


def _check_ranks_used(ranks, used: set, adapted: List[str],
                      where: str = "AdapterConfig.ranks") -> None:
    unused = sorted(set(ranks) - used)
    if unused:
        raise ValueError(
            f"{where} keys {unused} match no adapted target: a key is a role of the "
            "target (e.g. 'qkv' for GPT-2's fused c_attn, 'q'/'v'/'o' for the per-head methods) "
            f"or a module-name suffix; adapted here: {adapted[:6]}"
            + (" ..." if len(adapted) > 6 else ""))


# ------------------------------------------------------------------------------------------
# public API


def inject(model: nn.Module, config: Union[AdapterConfig, str, None] = None, **fields) -> nn.Module:
    """Attach adapters to ``model`` in place and return it.

    Every parameter that existed before is frozen (``requires_grad=False``); only the new adapter
    parameters train (kept in ``config.adapter_dtype``, float32 by default, on the base's device).
    The adapters take the mode (train / eval) of the module they are placed in.

    Args:
        model: a transformers model (GPT-2, BERT/RoBERTa, Llama-style, T5 have per-architecture
            defaults) or any module when targets are regexes.
        config: an :class:`AdapterConfig`, a preset name (see ``kfused.integration.PRESETS``),
            or None to build one from ``fields`` (e.g. ``inject(model, method="lora", r=4)``).
    Raises:
        ValueError: unknown method, no matching module, wrong module type, already injected,
            a model already wrapped by DDP / FSDP2 (inject before wrapping).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"inject: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(config, str):
        config = preset(config, **fields)
    elif config is None:
        config = AdapterConfig(**fields)
    elif not isinstance(config, AdapterConfig):
        raise TypeError(f"inject: config must be an AdapterConfig, a preset name or None, got "
                        f"{type(config).__name__} {config!r}")
    elif fields:
        config = config.replace(**fields)
    target_model = unwrap(model)
    if get_state(target_model, required=False) is not None:
        raise ValueError("model already has kfused adapters; inject once per model "
                         "(use a composite method to combine adapters)")
    refuse_wrapped(model)
    from kfused.integration.hf_attention import ADAPTER_ATTR

    added = [n for n, m in target_model.named_modules()
             if getattr(m, ADAPTER_ATTR, None) is not None]
    if added:
        # inject would freeze them with the base, and save (which reads inject's record) would
        # leave them out: a loaded model lacked them
        raise ValueError(f"inject: {added[0]} already has an inducer/prefix adapter placed "
                         f"by add_inducers ({len(added)} layer(s)), outside kfused's record of "
                         "adapters: inject would freeze it and save / load would leave it out. "
                         "Inject one config with an inducer part instead: method "
                         "'inducer_lora' / 'mam_inducer', or a composite registered with "
                         "parts=[(method, targets), ('inducer', None)]")
    spec = get_method(config.method)
    arch = detect_arch(target_model, config.arch)
    dims = model_dims(target_model)
    adapter_dtype = _resolve_dtype(config.adapter_dtype)
    before = {id(t) for t in target_model.parameters()} | {id(t) for t in target_model.buffers()}
    old_modules = {id(m) for m in target_model.modules()}

    plan = sorted(((part, cfg.replace(init=part.resolve_init(cfg.init, cfg)))
                   for part, cfg in _expand(spec, config)),
                  key=lambda pc: _SITE_ORDER[pc[0].site])
    if config.dropout and all(part.dropout is False for part, _ in plan):
        raise ValueError(f"method {config.method!r} has no adapter dropout (dropout={config.dropout}"
                         " would be ignored); it applies to LoRA's input (lora, inducer_lora)")
    for part, _ in plan:  # refuse unsupported models before any part changes the model
        if part.check is not None:
            part.check(target_model, arch)
    snap = snapshot(target_model)
    used: set = set()
    _RANK_KEYS_USED.append(used)
    try:
        adapted = _place(target_model, plan, arch, dims, before, adapter_dtype, config)
        _check_ranks_used(config.ranks, used, adapted)
        _follow_mode(target_model, old_modules)
    except BaseException:
        restore(snap)  # a failed inject leaves the model as it was
        raise
    finally:
        _RANK_KEYS_USED.remove(used)

    for p in target_model.parameters():
        p.requires_grad_(id(p) not in before)
    params = [n for n, p in target_model.named_parameters() if id(p) not in before]
    buffers = [n for n, b in target_model.named_buffers() if id(b) not in before]
    target_model.kfused_state = InjectState(
        config=config, arch=arch.name if arch else None, model_type=model_type_of(target_model),
        model_class=type(target_model).__name__, adapter_modules=adapted, param_names=params,
        buffer_names=buffers)
    return model


def _place(target_model, plan, arch, dims, before, adapter_dtype,
           config: AdapterConfig) -> List[str]:
    """Place every part's adapters; returns the adapted module names, in order. A part's own
    ranks keys (a composite's ``options[part]['ranks']``) must each match one of its targets,
    as ``config.ranks``' keys must match one of any part's (checked by inject)."""
    adapted: List[str] = []
    for part, cfg in plan:
        used: set = set()  # the ranks keys this part looks up
        _RANK_KEYS_USED.append(used)
        try:
            names = _place_part(target_model, part, cfg, arch, dims, before, adapter_dtype,
                                adapted)
        finally:
            _RANK_KEYS_USED.remove(used)
        _check_ranks_used(set(cfg.ranks) - set(config.ranks), used, names,
                          f"AdapterConfig.options[{part.name!r}]['ranks']")
        adapted.extend(names)
    return adapted


def _place_part(target_model, part, cfg, arch, dims, before, adapter_dtype,
                adapted: List[str]) -> List[str]:
    """Place one part's adapters (``adapted``: the modules earlier parts placed); returns the
    names of the modules it placed, in order."""
    if part.site in ("attention", "model"):
        return _apply_whole(target_model, part, cfg, arch, dims, before, adapter_dtype,
                            cfg.exclude)
    names: List[str] = []
    targets = cfg.targets if cfg.targets is not None else part.targets_for(arch)
    if targets is None:
        raise ValueError(f"method {part.name!r} has no default targets for this model "
                         f"(model_type={model_type_of(target_model)!r}); pass targets=[...]")
    for name, module, role in _match_targets(target_model, targets, arch, cfg.exclude,
                                             part.name):
        if name in adapted:
            # an earlier part of the composite wrapped this very module: skipping it left this
            # part out of the model without a word
            raise ValueError(
                f"method {part.name!r}: target {name!r}" + (f" (role {role!r})" if role else "")
                + f" is already adapted by an earlier part of this composite (it is a "
                f"{type(module).__name__} now); two parts cannot wrap the same module. Give "
                f"the parts disjoint targets (on GPT-2, q, k and v are one module, c_attn)")
        if any(name.startswith(a + ".") for a in adapted + names):
            continue  # inside an adapter already placed (e.g. its frozen base)
        target = _target(target_model, name, role, part.site, arch, dims)
        ref = next(iter(module.parameters()), None)
        if part.site == "linear":
            if not (isinstance(module, nn.Linear) or _is_conv1d(module)):
                raise ValueError(
                    f"method {part.name!r} adapts linear layers, but target {name!r} is a "
                    f"{type(module).__name__}; choose nn.Linear / Conv1D targets")
            target.d_in, target.d_out = linear_dims(module)
        if part.site == "block" and arch is not None and arch.ffn_kind == "bert_output" \
                and role == "ffn":
            new = _BertOutputParallel(module, part.wrap(_ZeroBlock(), target, cfg))
        else:
            new = part.wrap(module, target, cfg)
        _place_new_params(new, before, adapter_dtype, ref)
        _set_submodule(target_model, name, new)
        names.append(name)
    if part.finish is not None:
        part.finish(target_model, cfg)
    return names


def adapter_modules(model: nn.Module) -> Dict[str, nn.Module]:
    """name -> adapter module, in injection order."""
    m = unwrap(model)
    return {n: m.get_submodule(n) for n in get_state(m).adapter_modules}


def set_backend(model: nn.Module, backend: Optional[str]) -> None:
    """Point every adapter module (and submodule with a ``backend`` field) at ``backend``
    (None, "auto" or a backend name; any other name is refused here, not at the next
    forward)."""
    from kfused.modules._linear import check_backend_name

    check_backend_name(backend)
    for mod in adapter_modules(model).values():
        for sub in mod.modules():
            if hasattr(sub, "backend") and not isinstance(getattr(type(sub), "backend", None),
                                                           property):
                sub.backend = backend
    for sub in unwrap(model).modules():  # attention layers running inducer attention
        if hasattr(sub, "kfused_backend"):
            sub.kfused_backend = backend


def set_exact(model: nn.Module, exact: Optional[bool]) -> None:
    """Set ``exact`` of every adapter module whose op can fold its update into the frozen
    weight (KronA linear, the per-head q|k|v / single-projection / output-projection
    modules): True never folds (every bit of the update kept), False folds 16-bit inputs,
    None (the default) leaves it to each op's rule (fold on 16-bit CUDA inputs from
    ``FOLD_MIN_TOKENS`` tokens where it pays; see kfused.ops._fold)."""
    from kfused.ops._fold import check_exact

    check_exact(exact)
    for mod in adapter_modules(model).values():
        for sub in mod.modules():
            if hasattr(type(sub), "exact"):   # (a class attribute of those modules)
                sub.exact = exact


@contextlib.contextmanager
def use_backend(backend: Optional[str]):
    """Within the block, every kfused op defaults to ``backend`` ($KFUSED_BACKEND), including
    those of adapter modules that take the backend per call rather than as an attribute.
    None leaves the environment unchanged; a name that is not a backend is refused here, not
    at the first op (which would name $KFUSED_BACKEND, a variable the caller never set)."""
    if backend is None:
        yield
        return
    from kfused.modules._linear import check_backend_name

    check_backend_name(backend)
    old = os.environ.get("KFUSED_BACKEND")
    os.environ["KFUSED_BACKEND"] = backend
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("KFUSED_BACKEND", None)
        else:
            os.environ["KFUSED_BACKEND"] = old


def mergeable_methods() -> List[str]:
    """Names of the registered methods that merge() can fold."""
    return [name for name in sorted(methods()) if is_mergeable(name)]


def _merge_check(model: nn.Module, verb: str) -> Dict[str, nn.Module]:
    state = get_state(model)
    method = state.config.method
    if not is_mergeable(method):
        raise ValueError(
            f"cannot {verb} method {method!r}: it is not a linear update of frozen weights "
            "(block-parallel, attention-changing and composite methods add computation the "
            "base layers cannot absorb). Mergeable methods: "
            + ", ".join(mergeable_methods()) + ".")
    mods = adapter_modules(model)
    missing = [n for n, m in mods.items() if not hasattr(m, "merge")]
    if missing:
        raise ValueError(f"cannot {verb}: adapter modules {missing} have no merge()/unmerge()")
    if verb == "merge":
        _refuse_tied_bases(unwrap(model), mods, set(state.param_names))
    return mods


def _refuse_tied_bases(m: nn.Module, mods: Dict[str, nn.Module], adapter_params: set) -> None:
    """Merging folds the update into the frozen weight in place: refuse when that weight is
    also another module's (tied weights, e.g. GPT-2's lm_head and its token embedding), which
    the fold would change as well."""
    names: Dict[int, List[str]] = {}
    for n, p in m.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    for name, mod in mods.items():
        for sub, p in mod.named_parameters(prefix=name, remove_duplicate=False):
            if sub in adapter_params:
                continue
            others = [o for o in names.get(id(p), []) if not o.startswith(name + ".")]
            if others:
                raise ValueError(
                    f"cannot merge {name}: its frozen weight {sub} is the same tensor as "
                    f"{others[0]} (tied weights), so folding the update into it would change "
                    f"{others[0]} too. Keep this model unmerged, or untie the weights before "
                    "inject (e.g. load the model with tie_word_embeddings=False).")


def merged_modules(model: nn.Module) -> List[str]:
    """Names of the adapter modules (or their submodules) that are merged right now."""
    m = unwrap(model)
    state = get_state(m, required=False)
    if state is None:
        return []
    out = []
    for name in state.adapter_modules:
        for sub_name, sub in m.get_submodule(name).named_modules(prefix=name):
            if getattr(sub, "merged", False) is True:
                out.append(sub_name)
    return out


MERGED_TRAINING_MESSAGE = (
    "kfused: this model is merged (kfused.integration.merge folded its adapters into the frozen "
    "weights), so the adapters are not part of the forward pass and get no gradient. Call "
    "kfused.integration.unmerge(model) before training, and merge(model) again for inference.")


class _MergedTrainingGuard(torch.autograd.Function):
    """Identity on a merged adapter's output that ties it to one adapter parameter; its
    backward raises :data:`MERGED_TRAINING_MESSAGE` instead of autograd's "element 0 of tensors
    does not require grad"."""

    @staticmethod
    def forward(ctx, anchor, out):
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(MERGED_TRAINING_MESSAGE)


def _guard_hook(module, args, output):
    if not (module.training and torch.is_grad_enabled()):
        return output
    if not any(getattr(sub, "merged", False) is True for sub in module.modules()):
        return output  # unmerged since (e.g. by the module's own unmerge())
    anchor = next((p for p in module.parameters() if p.requires_grad), None)
    if anchor is None:
        return output

    def wrap(o):
        if isinstance(o, torch.Tensor) and o.is_floating_point():
            return _MergedTrainingGuard.apply(anchor, o)
        return o

    if isinstance(output, tuple):
        return type(output)(wrap(o) for o in output) if type(output) is tuple else output
    return wrap(output)


def _merge_all(mods: Dict[str, nn.Module]) -> None:
    """merge() every module, all or nothing: when one fails, the modules this call merged are
    unmerged again (in reverse order) and the error re-raised, so the model is as before.

    Modules merge in reverse injection order (:func:`unmerge` goes in injection order): a
    later part of a composite may read an earlier part's frozen weight (Kernel-wise-lite's
    key projection, adapted by a LoRA / KronA part on k), so it folds its update in while
    that weight is still frozen, and takes it out after that weight is frozen again."""
    done = []
    try:
        for m in reversed(list(mods.values())):
            if getattr(m, "merged", False) is not True:  # already merged: not this call's
                m.merge()
                done.append(m)
    except BaseException:
        for m in reversed(done):
            m.unmerge()
        raise


def merge(model: nn.Module) -> nn.Module:
    """Fold every adapter into its frozen weight (mergeable methods only); forward then runs
    the base layers alone. Idempotent. All or nothing: when a module fails to merge, the ones
    merged before it are unmerged again and the error is re-raised. Training a merged model
    raises a RuntimeError saying so at backward (in train mode); :func:`unmerge` first."""
    mods = _merge_check(model, "merge")
    _merge_all(mods)
    target = unwrap(model)
    if not getattr(target, "_kfused_merge_guards", None):
        target._kfused_merge_guards = [m.register_forward_hook(_guard_hook)
                                       for m in mods.values()]
    return model


def unmerge(model: nn.Module) -> nn.Module:
    """Undo :func:`merge` (exact up to the rounding of the add/subtract pair)."""
    for m in _merge_check(model, "unmerge").values():
        m.unmerge()
    target = unwrap(model)
    for h in getattr(target, "_kfused_merge_guards", None) or []:
        h.remove()
    target._kfused_merge_guards = []
    return model


def merge_and_unload(model: nn.Module) -> nn.Module:
    """Merge, then put the plain base layers back in place of the adapter wrappers: the result
    is the original architecture (its ``state_dict`` keys and ``save_pretrained`` output are
    those of an unadapted model) with the updates folded in. Mergeable methods only. All or
    nothing: every module is merged (as :func:`merge`, undone if one fails) before any is
    swapped out."""
    mods = _merge_check(model, "merge")
    m = unwrap(model)
    bases = {}
    for name, mod in mods.items():  # every base found before any module changes
        # the frozen layer the adapter wraps: .base, or the fused projection of a per-head
        # q|k|v adapter on a model with one fused qkv layer (GPT-2's c_attn)
        base = getattr(mod, "base", None)
        if base is None:
            base = getattr(mod, "fused", None)
        if not isinstance(base, nn.Module):
            raise ValueError(f"cannot unload {name}: {type(mod).__name__} has no .base layer")
        bases[name] = base
    _merge_all(mods)
    for name in mods:
        _set_submodule(m, name, bases[name])
    for h in getattr(m, "_kfused_merge_guards", None) or []:
        h.remove()
    m._kfused_merge_guards = []
    del m.kfused_state
    return model


def count_parameters(model: nn.Module) -> Tuple[int, int]:
    """(trainable, total) parameter counts (shared parameters counted once)."""
    trainable = total = 0
    for p in unwrap(model).parameters():
        n = p.numel()
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total


def print_trainable_parameters(model: nn.Module) -> Tuple[int, int]:
    """Print ``trainable params: … || all params: … || trainable%: …`` and return the counts."""
    trainable, total = count_parameters(model)
    pct = 100.0 * trainable / total if total else 0.0
    print(f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {pct:.4f}")
    return trainable, total
