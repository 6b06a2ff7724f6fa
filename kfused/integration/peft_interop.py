"""PEFT interop: bring a PEFT LoRA / LoKr adapter onto kfused's layers, and write a
kfused LoRA / KronA adapter as a PEFT adapter folder.

    model = kfused.from_peft(peft_model)                 # a PeftModel (LoRA or LoKr)
    model = kfused.from_peft(base_model, "adapter_dir")  # a PEFT adapter folder
    kfused.to_peft(model, "peft_dir")                    # then PeftModel.from_pretrained(base, ...)

What converts (exactly: same factors, same scale, so logits and adapter gradients agree under
docs/math.md §4):

* PEFT LoRA on ``nn.Linear`` and on transformers' ``Conv1D`` (GPT-2) -> :class:`LoRALinear`
  (``lora_A.weight`` -> ``A``, ``lora_B.weight`` -> ``B``, ``scaling = lora_alpha / r``, or
  ``lora_alpha / √r`` with rsLoRA, kept as kfused's ``alpha / r``). Per-module ``rank_pattern`` /
  ``alpha_pattern`` are kept as kfused per-module ranks and alpha as long as every module's
  ``scaling · r`` is the same number (kfused has one ``alpha``) or every scaling is 1 (kfused's
  ``alpha=None``); otherwise refused.
  ``lora_dropout`` becomes kfused's LoRA input dropout (same placement, same p).
* PEFT LoKr on ``nn.Linear`` -> :class:`KronALinear`: ``ΔW = (alpha / r) · w1 ⊗ w2`` becomes
  ``s · A ⊗ B`` with ``A = w1``, ``B = w2``, ``s = alpha / r``. The low-rank forms
  ``w1 = w1_a @ w1_b`` / ``w2 = w2_a @ w2_b`` (``decompose_both``, small ``r``) are multiplied
  out into full factors: the function is identical, but the trainable parameters become the
  full A and B (gradient of A is the gradient of PEFT's w1; PEFT's ``dw1_a = dA @ w1_bᵀ``), so
  further training follows a different (full-factor) path. Every module must share one scale
  (kfused's KronA has one ``scale``).

* PEFT prefix tuning (``prefix_projection=False``) on GPT-2 and Llama-style models with one
  key/value head per query head -> kfused's ``"prefix"`` method (docs/math.md §3) with
  ``prefix_k[layer] = E[:, 2·layer]``, ``prefix_v[layer] = E[:, 2·layer + 1]`` from PEFT's
  ``prompt_embeddings`` E viewed as (l, 2·layers, heads, head_dim). PEFT keeps the prefix in the
  key/value cache, so the real tokens sit at positions ``l … l + n - 1``; the converted model
  records ``options["position_offset"] = l`` and shifts its positions the same way (a forward
  pre-hook on the model: call the returned model, not its inner ``.transformer`` / ``.model``).

What is refused, with the layer and the reason, *before* the model is changed: any other PEFT
method (IA3, LoHa, AdaLoRA, OFT, prompt tuning, ...), DoRA and other LoRA variants,
``lora_bias``, trainable biases (``bias != "none"``), ``modules_to_save`` / trainable tokens,
adapters on embeddings or convolutions (including LoKr's Tucker-decomposed convolution
``lokr_t2`` / ``use_effective_conv2d``), LoKr ``rank_dropout`` / ``module_dropout`` > 0 (they drop
rows / the whole update at random in training mode; KronA has no such dropout, so training
would differ — set them to 0 to convert), merged adapters (``unmerge_adapter()`` first), models
holding more than one PEFT adapter, and prefix tuning with ``prefix_projection=True`` (its MLP
reparametrisation has no kfused equivalent), on encoder-decoder or BERT-style models (their
positions depend on padding), or on grouped-query models (PEFT keeps one prefix per key/value
head, kfused one per query head: the gradients would differ).

:func:`from_peft` strips the PEFT layers and calls :func:`kfused.integration.inject` with an
:class:`AdapterConfig` naming exactly the adapted modules, then copies the factors in: the
result is indistinguishable from an injected model (``kfused.save`` / ``load`` / ``merge`` /
``unmerge`` work on it). It returns the underlying transformers model (the PeftModel wrapper is
consumed: use the returned model).
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import errno
import functools
import json
import math
import os
import re
import shutil
import sys
import uuid
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from kfused._files import folder_refusal, sha256_file
from kfused.integration.checkpoint import _dist_rank, _full, _path_arg, _share_outcome
from kfused.integration.config import AdapterConfig
from kfused.integration.inject import (adapter_modules, get_state, inject, refuse_wrapped,
                                       restore, snapshot, unwrap)
from kfused.modules._linear import is_conv1d, linear_dims
from kfused.modules.krona import KronALinear, _resolve_shapes
from kfused.modules.lora import LoRALinear

__all__ = ["from_peft", "to_peft", "PeftConversionError"]

PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
EXPORT_MARKER = "kfused_export.json"   # written by to_peft: which files it wrote, and their hashes
_KEY_PREFIX = "base_model.model."

_PREFIX_REASON = (
    "PEFT prefix tuning stores its prefix in the key/value cache, so the real tokens take "
    "positions l..l+n-1; a kfused prefix adapter injected without options['position_offset'] = l "
    "numbers tokens from 0, so the logits would differ")


class PeftConversionError(ValueError):
    """The PEFT adapter (or the kfused adapter, for :func:`to_peft`) cannot be converted exactly.
    Raised before anything is changed."""


def _peft():
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - peft is in the dev / hf extras
        raise ImportError("kfused.from_peft / to_peft need the `peft` package "
                          "(pip install peft, or kfused[hf])") from exc
    return peft


def _ptype(cfg) -> str:
    t = getattr(cfg, "peft_type", None)
    return str(getattr(t, "value", t))


# ------------------------------------------------------------------------------------------
# PEFT -> kfused


@dataclasses.dataclass
class _Site:
    name: str                         # module name inside the base model
    method: str                       # "lora" | "krona"
    layer: nn.Module                  # the PEFT tuner layer
    parent: nn.Module
    attr: str
    tensors: Dict[str, torch.Tensor]  # kfused parameter name -> value (detached)
    r: int = 0
    alpha: float = 0.0                # kfused alpha (LoRA) or scale (KronA)
    dropout: float = 0.0


def _check_config(cfg, where: str) -> str:
    """Refuse (PeftConversionError) config-level features kfused cannot represent; returns the
    kfused method ("lora" or "krona")."""
    pt = _ptype(cfg)
    if pt not in ("LORA", "LOKR", "PREFIX_TUNING"):
        raise PeftConversionError(
            f"{where}: PEFT method {pt!r} has no kfused equivalent; from_peft converts LORA, "
            "LOKR and PREFIX_TUNING adapters")
    problems = []
    if pt == "PREFIX_TUNING":
        if getattr(cfg, "prefix_projection", False):
            problems.append("prefix_projection=True (the MLP reparametrisation of the prefix has "
                            "no kfused equivalent; its gradients would differ)")
        if int(getattr(cfg, "num_transformer_submodules", 1) or 1) != 1:
            problems.append("an encoder-decoder prefix (num_transformer_submodules="
                            f"{cfg.num_transformer_submodules})")
        if problems:
            raise PeftConversionError(f"{where}: cannot convert this PEFT prefix-tuning adapter "
                                      "exactly: " + "; ".join(problems))
        return "prefix"
    if getattr(cfg, "modules_to_save", None):
        problems.append(f"modules_to_save={cfg.modules_to_save!r} (fully trained copies of "
                        "whole modules are not adapters kfused records)")
    if getattr(cfg, "trainable_token_indices", None):
        problems.append("trainable_token_indices (trainable embedding rows)")
    if pt == "LORA":
        if getattr(cfg, "use_dora", False):
            problems.append("use_dora=True (DoRA's magnitude vector has no kfused equivalent)")
        if getattr(cfg, "lora_bias", False):
            problems.append("lora_bias=True (a trainable bias on lora_B)")
        if getattr(cfg, "bias", "none") != "none":
            problems.append(f"bias={cfg.bias!r} (trainable base biases)")
        if getattr(cfg, "layer_replication", None):
            problems.append("layer_replication")
    else:
        if float(getattr(cfg, "rank_dropout", 0.0) or 0.0) > 0:
            problems.append(f"rank_dropout={cfg.rank_dropout} (drops rows of the update at random "
                            "in training mode; KronA has no such dropout — set it to 0)")
        if float(getattr(cfg, "module_dropout", 0.0) or 0.0) > 0:
            problems.append(f"module_dropout={cfg.module_dropout} (skips the whole update at "
                            "random in training mode; KronA has no such dropout — set it to 0)")
    if problems:
        raise PeftConversionError(f"{where}: cannot convert this PEFT {pt} adapter exactly: "
                                  + "; ".join(problems))
    return "lora" if pt == "LORA" else "krona"


def _lora_site(name, layer, adapter, parent, attr) -> _Site:
    why = []
    if adapter in getattr(layer, "lora_variant", {}):
        why.append(f"it uses the LoRA variant {type(layer.lora_variant[adapter]).__name__} "
                   "(DoRA, aLoRA, ...)")
    if getattr(layer, "use_dora", {}).get(adapter, False):
        why.append("DoRA")
    if getattr(layer, "lora_bias", {}).get(adapter, False):
        why.append("lora_bias")
    drop = layer.lora_dropout[adapter] if adapter in layer.lora_dropout else nn.Identity()
    if not isinstance(drop, (nn.Identity, nn.Dropout)):
        why.append(f"its dropout is a {type(drop).__name__}")
    if why:
        raise PeftConversionError(f"PEFT LoRA layer {name!r}: cannot convert: " + "; ".join(why))
    A = layer.lora_A[adapter].weight.detach()
    B = layer.lora_B[adapter].weight.detach()
    r = int(A.shape[0])
    scaling = float(layer.scaling[adapter])
    return _Site(name, "lora", layer, parent, attr, {"A": A, "B": B}, r=r, alpha=scaling * r,
                 dropout=float(drop.p) if isinstance(drop, nn.Dropout) else 0.0)


def _lokr_site(name, layer, adapter, parent, attr) -> _Site:
    if adapter in getattr(layer, "lokr_t2", {}):
        raise PeftConversionError(
            f"PEFT LoKr layer {name!r}: cannot convert the Tucker-decomposed convolution factor "
            "lokr_t2 (use_effective_conv2d): KronA adapts linear layers only")
    for what in ("rank_dropout", "module_dropout"):
        v = float(getattr(layer, what, {}).get(adapter, 0.0) or 0.0)
        if v > 0:
            raise PeftConversionError(
                f"PEFT LoKr layer {name!r}: {what}={v} changes training-mode outputs at random; "
                "KronA has no such dropout (set it to 0 to convert)")
    with torch.no_grad():
        w1 = (layer.lokr_w1[adapter] if adapter in layer.lokr_w1
              else layer.lokr_w1_a[adapter] @ layer.lokr_w1_b[adapter]).detach()
        w2 = (layer.lokr_w2[adapter] if adapter in layer.lokr_w2
              else layer.lokr_w2_a[adapter] @ layer.lokr_w2_b[adapter]).detach()
    if w1.dim() != 2 or w2.dim() != 2:
        raise PeftConversionError(f"PEFT LoKr layer {name!r}: factors of shapes "
                                  f"{tuple(w1.shape)}, {tuple(w2.shape)} are not matrices")
    d_in, d_out = linear_dims(layer.get_base_layer())
    if w1.shape[0] * w2.shape[0] != d_out or w1.shape[1] * w2.shape[1] != d_in:
        raise PeftConversionError(f"PEFT LoKr layer {name!r}: w1 {tuple(w1.shape)} ⊗ w2 "
                                  f"{tuple(w2.shape)} does not give the layer's ({d_out}, {d_in})")
    return _Site(name, "krona", layer, parent, attr, {"A": w1, "B": w2},
                 r=int(layer.r[adapter]), alpha=float(layer.scaling[adapter]))


def _collect_sites(base: nn.Module, adapter: str, method: str) -> List[_Site]:
    peft = _peft()
    from peft.tuners.tuners_utils import BaseTunerLayer

    lora_linear = peft.tuners.lora.layer.Linear
    lokr_linear = peft.tuners.lokr.layer.Linear
    sites: List[_Site] = []
    for name, mod in base.named_modules():
        tname = type(mod).__name__
        convertible = isinstance(mod, (lora_linear, lokr_linear))
        if tname in ("ModulesToSaveWrapper", "TrainableTokensWrapper") or (
                isinstance(mod, BaseTunerLayer) and not convertible):
            raise PeftConversionError(
                f"PEFT layer {name!r} ({type(mod).__module__}.{tname}) cannot be converted: "
                "from_peft converts LoRA / LoKr layers on nn.Linear and transformers Conv1D "
                "only (embeddings, convolutions, quantized layers and other methods are not "
                "kfused adapters)")
        if not isinstance(mod, BaseTunerLayer):
            continue
        if getattr(mod, "merged_adapters", None):
            raise PeftConversionError(
                f"PEFT layer {name!r} has merged adapters {mod.merged_adapters}: call "
                "peft_model.unmerge_adapter() before converting")
        blayer = mod.get_base_layer()
        if not (isinstance(blayer, nn.Linear) or is_conv1d(blayer)):
            raise PeftConversionError(
                f"PEFT layer {name!r} adapts a {type(blayer).__name__}: kfused's LoRA / KronA "
                "adapt nn.Linear and transformers Conv1D only")
        if isinstance(mod.base_layer, BaseTunerLayer):
            raise PeftConversionError(f"PEFT layer {name!r} nests tuner layers; not converted")
        parent_name, _, attr = name.rpartition(".")
        parent = base.get_submodule(parent_name) if parent_name else base
        if isinstance(mod, lora_linear):
            if method != "lora":
                raise PeftConversionError(f"PEFT layer {name!r} is LoRA but the adapter is "
                                          f"{method}")
            if adapter not in mod.lora_A:
                continue
            sites.append(_lora_site(name, mod, adapter, parent, attr))
        else:
            if method != "krona":
                raise PeftConversionError(f"PEFT layer {name!r} is LoKr but the adapter is "
                                          f"{method}")
            if is_conv1d(blayer):
                raise PeftConversionError(f"PEFT LoKr layer {name!r} on a Conv1D is not "
                                          "supported")
            if not any(adapter in getattr(mod, p) for p in ("lokr_w1", "lokr_w1_a")):
                continue
            sites.append(_lokr_site(name, mod, adapter, parent, attr))
    if not sites:
        raise PeftConversionError(f"the PEFT model has no {method} layers for adapter "
                                  f"{adapter!r}: nothing to convert")
    return sites


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _build_config(sites: List[_Site], method: str, backend, adapter_dtype) -> AdapterConfig:
    names = [s.name for s in sites]
    dt = adapter_dtype or _dtype_name(sites[0].tensors["A"])
    if method == "lora":
        alphas = {s.alpha for s in sites}
        a0 = sites[0].alpha
        bad = [s.name for s in sites if not math.isclose(s.alpha, a0, rel_tol=1e-12, abs_tol=0)]
        if bad and all(s.alpha == s.r for s in sites):
            a0, bad = None, []  # scaling 1 everywhere: kfused's alpha=None (alpha = r per module)
        if bad:
            raise PeftConversionError(
                "PEFT LoRA scaling·r differs between layers (alpha_pattern, or rsLoRA with "
                f"per-layer ranks): {sites[0].name!r} has {a0}, {bad[0]!r} has "
                f"{next(s.alpha for s in sites if s.name == bad[0])}; kfused's LoRA has one alpha "
                f"({len(alphas)} different values here)")
        drops = {s.dropout for s in sites}
        if len(drops) > 1:
            raise PeftConversionError(f"PEFT LoRA dropout differs between layers ({drops}); "
                                      "kfused's LoRA has one dropout")
        r0 = collections.Counter(s.r for s in sites).most_common(1)[0][0]
        ranks = {s.name: s.r for s in sites if s.r != r0}
        return AdapterConfig(method="lora", targets=names, r=r0, ranks=ranks, alpha=a0,
                             dropout=drops.pop(), backend=backend, adapter_dtype=dt,
                             init="zero")
    scales = {s.alpha for s in sites}
    if len(scales) > 1:
        raise PeftConversionError(
            f"PEFT LoKr scale alpha/r differs between layers ({sorted(scales)}); kfused's KronA "
            "has one scale")
    # one (a_shape, b_shape) for all layers if one fits, else per-module shapes
    shapes = {s.name: (tuple(s.tensors["A"].shape), tuple(s.tensors["B"].shape)) for s in sites}
    dims = {s.name: linear_dims(s.layer.get_base_layer()) for s in sites}
    first_a, first_b = shapes[names[0]]
    options: Dict[str, Any] = {}
    chosen = None
    for a_shape, b_shape in ((None, None), (first_a, None), (None, first_b), (first_a, first_b)):
        try:
            if all(_resolve_shapes(*dims[n], a_shape, b_shape) == shapes[n] for n in names):
                chosen = (a_shape, b_shape)
                break
        except ValueError:
            continue
    if chosen is None:
        chosen = (None, None)
        options["krona_shapes"] = {n: [list(a), list(b)] for n, (a, b) in shapes.items()}
    return AdapterConfig(method="krona", targets=names, a_shape=chosen[0], b_shape=chosen[1],
                         scale=scales.pop(), backend=backend, adapter_dtype=dt, init="zero",
                         options=options)


def _only_adapter(peft_configs: Dict[str, Any]) -> str:
    if len(peft_configs) != 1:
        raise PeftConversionError(
            f"the PEFT model holds {len(peft_configs)} adapters ({sorted(peft_configs)}); "
            "kfused converts one: delete the others first (peft_model.delete_adapter(name))")
    return next(iter(peft_configs))


_HF_NATIVE = ("it holds PEFT adapters loaded through transformers (model.load_adapter / "
              "add_adapter), not a peft.PeftModel; from_peft converts a PeftModel or a model "
              "without adapters plus an adapter folder: call kfused.from_peft(fresh_model, "
              "adapter_folder)")


def _hf_native(model: nn.Module) -> bool:
    """A transformers model carrying PEFT adapters through transformers' own integration."""
    from peft import PeftModel

    return (bool(getattr(model, "_hf_peft_config_loaded", False))
            and not isinstance(model, PeftModel))


def _convert(peft_model: nn.Module, backend, adapter_dtype) -> nn.Module:
    if _hf_native(peft_model):
        raise TypeError(f"from_peft({type(peft_model).__name__}): {_HF_NATIVE}")
    configs = getattr(peft_model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        raise TypeError(f"from_peft(model) expects a peft.PeftModel, got "
                        f"{type(peft_model).__name__}; for an adapter folder call "
                        "from_peft(base_model, folder)")
    adapter = _only_adapter(configs)
    method = _check_config(configs[adapter], f"PEFT adapter {adapter!r}")
    if method == "prefix":
        return _convert_prefix(peft_model, configs[adapter], adapter, backend, adapter_dtype)
    tuner = peft_model.base_model
    base = getattr(tuner, "model", None)
    if not isinstance(base, nn.Module):
        raise PeftConversionError(f"cannot find the base model inside {type(tuner).__name__}")
    if get_state(base, required=False) is not None:
        raise PeftConversionError("the base model already has kfused adapters")
    sites = _collect_sites(base, adapter, method)
    cfg = _build_config(sites, method, backend, adapter_dtype)
    # everything is checked: strip the PEFT layers and inject (rolled back on failure)
    try:
        for s in sites:
            setattr(s.parent, s.attr, s.layer.get_base_layer())
        inject(base, cfg)
        mods = adapter_modules(base)
        with torch.no_grad():
            for s in sites:
                mod = mods[s.name]
                for pname, val in s.tensors.items():
                    getattr(mod, pname).copy_(val)
    except BaseException:
        for s in sites:
            setattr(s.parent, s.attr, s.layer)
        if hasattr(base, "kfused_state"):
            del base.kfused_state
        raise
    # PEFT's tuner records its configs on the model (model.peft_config) and removes them when
    # it unloads its layers, as here: the converted model holds no PEFT adapter
    vars(base).pop("peft_config", None)
    return base


def _check_prefix_model(base: nn.Module, cfg, where: str) -> None:
    from kfused.integration.arch import model_dims
    from kfused.integration.hf_attention import (POSITION_OFFSET_MODEL_TYPES,
                                                 self_attention_blocks, unsupported_reason)

    mcfg = getattr(base, "config", None)
    mt = getattr(mcfg, "model_type", None)
    if mt not in POSITION_OFFSET_MODEL_TYPES:
        raise PeftConversionError(
            f"{where}: prefix tuning on model_type {mt!r} is not converted: kfused reproduces "
            f"PEFT's position shift only for {POSITION_OFFSET_MODEL_TYPES} (positions "
            "arange(past, past + n)); BERT-style positions depend on padding")
    reason = unsupported_reason(base)
    if reason is not None:
        raise PeftConversionError(f"{where}: {reason}")
    dims = model_dims(base)
    H, p, kv = dims["n_heads"], dims["head_dim"], dims["n_kv_heads"]
    if kv != H:
        raise PeftConversionError(
            f"{where}: the model uses grouped-query attention ({kv} key/value heads for {H} "
            "query heads): PEFT keeps one prefix per key/value head and kfused one per query "
            "head, so the adapter gradients (and training) would differ")
    n_layers = len(self_attention_blocks(base))
    want = {"num_layers": n_layers, "num_attention_heads": H, "token_dim": H * p}
    got = {k: getattr(cfg, k, None) for k in want}
    if got != want:
        raise PeftConversionError(f"{where}: the prefix was made for {got}, this model has "
                                  f"{want}")


def _convert_prefix(peft_model, cfg, adapter, backend, adapter_dtype) -> nn.Module:
    base = peft_model.base_model
    where = f"PEFT prefix-tuning adapter {adapter!r}"
    if get_state(base, required=False) is not None:
        raise PeftConversionError("the base model already has kfused adapters")
    _check_prefix_model(base, cfg, where)
    E = peft_model.prompt_encoder[adapter].embedding.weight.detach()
    l, L, H = int(cfg.num_virtual_tokens), int(cfg.num_layers), int(cfg.num_attention_heads)
    p = int(cfg.token_dim) // H
    Ev = E[:l].reshape(l, 2 * L, H, p)
    config = AdapterConfig(method="prefix", r=l, options={"position_offset": l},
                           backend=backend, adapter_dtype=adapter_dtype or _dtype_name(E))
    inject(base, config)
    mods = adapter_modules(base)
    if len(mods) != L:  # pragma: no cover - checked above
        raise RuntimeError(f"expected {L} prefix adapters, got {len(mods)}")
    with torch.no_grad():
        for i, mod in enumerate(mods.values()):
            mod.prefix_k.copy_(Ev[:, 2 * i].permute(1, 0, 2))
            mod.prefix_v.copy_(Ev[:, 2 * i + 1].permute(1, 0, 2))
    return base


def _refuse_kfused_checkpoint(folder: str) -> None:
    """A kfused.save checkpoint (or one of its version folders) is not a PEFT adapter folder:
    say which loader reads it (PEFT said "Can't find 'adapter_config.json'" or "missing
    required keys: {'peft_type'}")."""
    from kfused.integration import checkpoint as ck

    kfused_meta = False
    try:
        with open(os.path.join(folder, PEFT_CONFIG), "rb") as f:
            kfused_meta = json.load(f).get("format") == ck.FORMAT
    except (OSError, ValueError, AttributeError):
        pass
    if kfused_meta or (os.path.lexists(os.path.join(folder, ck.POINTER))
                       and not os.path.lexists(os.path.join(folder, PEFT_CONFIG))):
        raise PeftConversionError(
            f"{folder!r} is a kfused checkpoint (written by kfused.save), not a PEFT adapter "
            "folder: load it with kfused.load(model, checkpoint_dir) (the directory holding "
            f"{ck.POINTER})")


def _prevalidate_folder(model: nn.Module, folder: str) -> None:
    """Checks on an adapter folder before PeftModel.from_pretrained changes the model."""
    peft = _peft()
    if os.path.exists(folder) and not os.path.isdir(folder):
        kind = "a file" if os.path.isfile(folder) else "a special file"
        raise NotADirectoryError(f"from_peft: PEFT adapter folder {folder!r} is {kind}, not a "
                                 f"folder (a PEFT adapter folder holds {PEFT_CONFIG} and "
                                 f"{PEFT_WEIGHTS})")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"PEFT adapter folder {folder!r} does not exist")
    _refuse_kfused_checkpoint(folder)
    if not os.path.isfile(os.path.join(folder, PEFT_CONFIG)):
        named = sorted(n for n in os.listdir(folder)
                       if os.path.isfile(os.path.join(folder, n, PEFT_CONFIG)))
        raise PeftConversionError(
            f"{folder!r} has no {PEFT_CONFIG}, so it is not a PEFT adapter folder"
            + (f"; PEFT saves an adapter named other than 'default' in a subfolder of that "
               f"name, and {named} here hold one: pass os.path.join(folder, name)"
               if named else ""))
    cfg = peft.PeftConfig.from_pretrained(folder)
    method = _check_config(cfg, f"PEFT adapter folder {folder!r}")
    if method == "prefix":
        _check_prefix_model(model, cfg, f"PEFT adapter folder {folder!r}")
        return
    from safetensors import safe_open

    path = os.path.join(folder, PEFT_WEIGHTS)
    if not os.path.exists(path):
        raise PeftConversionError(f"{folder!r} has no {PEFT_WEIGHTS}")
    suffix = (r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)"
              r"(\.weight)?$" if method == "lora" else r"\.lokr_(w1|w1_a|w1_b|w2|w2_a|w2_b|t2)$")
    # module -> {factor key suffix: saved shape}, read from the header without loading tensors
    factors: Dict[str, Dict[str, Tuple[int, ...]]] = collections.defaultdict(dict)
    with safe_open(path, framework="pt") as f:
        for k in f.keys():
            m = re.search(suffix, k)
            if m is None:
                raise PeftConversionError(
                    f"{folder!r}: tensor {k!r} is not a {method} factor kfused can convert"
                    + ("; it is a whole layer's weight PEFT saved beside the adapter (the "
                       "embedding weights it saves for an adapter on a tied embedding / "
                       "lm_head), which kfused does not load: convert the PeftModel in memory "
                       "(from_peft(peft_model)), or save the adapter without them "
                       "(save_pretrained(..., save_embedding_layers=False))"
                       if re.search(r"\.base_layer\.|(embed|wte|lm_head)[^.]*\.weight$", k)
                       else ""))
            factors[k[:m.start()]][k[m.start() + 1:]] = tuple(f.get_slice(k).get_shape())
    for n in sorted(factors):
        shapes = factors[n]
        n = n[len(_KEY_PREFIX):] if n.startswith(_KEY_PREFIX) else n
        try:
            mod = model.get_submodule(n)
        except AttributeError:
            continue  # let PEFT report key mismatches
        if not (isinstance(mod, nn.Linear) or is_conv1d(mod)):
            raise PeftConversionError(
                f"{folder!r} adapts {n!r}, a {type(mod).__name__}: kfused's LoRA / KronA adapt "
                "nn.Linear and transformers Conv1D only")
        if method == "krona" and is_conv1d(mod):
            raise PeftConversionError(f"{folder!r}: LoKr on the Conv1D {n!r} is not supported")
        _check_factor_shapes(folder, n, method, shapes, *linear_dims(mod))


def _check_factor_shapes(folder: str, name: str, method: str,
                         shapes: Dict[str, Tuple[int, ...]], d_in: int, d_out: int) -> None:
    """Refuse saved factors whose shapes do not fit the target layer (a folder saved from a model
    of another width), before PeftModel.from_pretrained injects anything."""
    where = f"{folder!r}: {name!r}"
    for key, shape in shapes.items():
        if len(shape) != 2 and (key in ("lora_A.weight", "lora_B.weight")
                                or key.startswith("lokr_w")):
            raise PeftConversionError(f"{where}: saved {key} has shape {shape}, expected a matrix")
    if method == "lora":
        a, b = shapes.get("lora_A.weight"), shapes.get("lora_B.weight")
        if a is not None and a[1] != d_in:
            raise PeftConversionError(
                f"{where}: saved lora_A.weight is {a}, this model's layer needs {(a[0], d_in)} "
                f"(r, in_features={d_in}); was the adapter saved from a model of another width?")
        if b is not None and b[0] != d_out:
            raise PeftConversionError(
                f"{where}: saved lora_B.weight is {b}, this model's layer needs {(d_out, b[1])} "
                f"(out_features={d_out}, r); was the adapter saved from a model of another width?")
        if a is not None and b is not None and a[0] != b[1]:
            raise PeftConversionError(f"{where}: saved lora_A.weight {a} and lora_B.weight {b} "
                                      "have different ranks")
        return

    def full(w: str) -> Optional[Tuple[int, int]]:
        if f"lokr_{w}" in shapes:
            return shapes[f"lokr_{w}"]
        lo, hi = shapes.get(f"lokr_{w}_a"), shapes.get(f"lokr_{w}_b")
        if lo is None or hi is None:
            return None  # incomplete: PEFT reports the missing key
        if lo[1] != hi[0]:
            raise PeftConversionError(f"{where}: saved lokr_{w}_a {lo} and lokr_{w}_b {hi} do "
                                      "not multiply")
        return lo[0], hi[1]

    w1, w2 = full("w1"), full("w2")
    if w1 is not None and w2 is not None and (w1[0] * w2[0], w1[1] * w2[1]) != (d_out, d_in):
        raise PeftConversionError(
            f"{where}: the saved LoKr factors w1 {w1} ⊗ w2 {w2} make a "
            f"{(w1[0] * w2[0], w1[1] * w2[1])} update (out, in), this model's layer is "
            f"{(d_out, d_in)}; was the adapter saved from a model of another width?")


def from_peft(model: nn.Module, adapter: Optional[str] = None, *,
              backend: Optional[str] = None, adapter_dtype: Optional[str] = None) -> nn.Module:
    """Move a PEFT LoRA / LoKr adapter onto kfused's layers; returns the transformers model.

    Two forms:

    * ``from_peft(peft_model)``: ``peft_model`` is a :class:`peft.PeftModel` (from
      ``get_peft_model`` or ``PeftModel.from_pretrained``). Its PEFT layers are replaced by
      kfused's; the underlying transformers model is returned (use it instead of the PeftModel).
    * ``from_peft(model, adapter_folder)``: ``model`` is a plain transformers model and
      ``adapter_folder`` a PEFT adapter folder (``adapter_config.json`` +
      ``adapter_model.safetensors``). ``model`` is adapted in place and returned.

    LoRA -> :class:`kfused.LoRALinear`, LoKr -> :class:`kfused.KronALinear` (see the module
    docstring for the exact mapping and what is refused). The result is what
    ``kfused.inject(model, AdapterConfig(...))`` would have built, with the PEFT factors loaded:
    ``kfused.save`` / ``load`` / ``merge`` / ``unmerge`` / ``to_peft`` work on it, and only the
    adapter factors are trainable.

    Args:
        backend: kernel backend recorded in the config (None: auto / $KFUSED_BACKEND).
        adapter_dtype: dtype of the kfused factors (None: the PEFT factors' dtype).
    Raises:
        PeftConversionError (a ValueError): something kfused cannot represent exactly, naming
            the layer and the reason (for a folder: also factors whose shapes do not fit the
            model's layers); raised before the model is changed. Should PEFT still fail to load
            a folder, the model is restored as it was and the error says so.
        TypeError: wrong argument types.
        ValueError: ``model`` is already wrapped by DDP / FSDP2 (convert before wrapping).
        FileNotFoundError / NotADirectoryError: the adapter folder does not exist / is a file.
    """
    _peft()
    if adapter is None:
        return _convert(model, backend, adapter_dtype)
    if not isinstance(adapter, (str, os.PathLike)):
        raise TypeError(f"adapter must be a PEFT adapter folder path, got {type(adapter).__name__}")
    folder = os.fspath(adapter)
    if getattr(model, "peft_config", None):
        raise TypeError("from_peft(model, folder) takes a plain transformers model; this one "
                        + (_HF_NATIVE.replace("it holds", "holds") if _hf_native(model) else
                           "is already a PeftModel — call from_peft(peft_model)"))
    target = unwrap(model)
    if get_state(target, required=False) is not None:
        raise PeftConversionError("the model already has kfused adapters")
    refuse_wrapped(model, "from_peft")
    _prevalidate_folder(target, folder)
    from peft import PeftModel

    snap = snapshot(target)  # PEFT changes the model in place; undone on failure
    try:
        pm = PeftModel.from_pretrained(target, folder)
    except Exception as exc:
        restore(snap)
        raise PeftConversionError(
            f"PEFT could not load the adapter folder {folder!r} onto this model "
            f"({type(exc).__name__}: {exc}); the model was restored unchanged") from exc
    except BaseException:
        restore(snap)
        raise
    try:
        return _convert(pm, backend, adapter_dtype)
    except BaseException:
        restore(snap)  # the original layers, requires_grad flags and attributes
        raise


# ------------------------------------------------------------------------------------------
# kfused -> PEFT


def _lokr_factor(sites: Dict[str, Tuple[Tuple[int, int], Tuple[int, int], Tuple[int, int]]]
                 ) -> int:
    """A ``decompose_factor`` for which PEFT's own factorisation gives every layer the same
    (w1, w2) shapes as kfused's (A, B); raises PeftConversionError if there is none."""
    from peft.tuners.lokr.layer import factorization

    limit = max(max(a) for a, _, _ in sites.values())
    fails: Dict[int, str] = {}
    for f in [-1] + list(range(1, limit + 1)):
        for name, (a, b, (d_in, d_out)) in sites.items():
            out_l, out_k = factorization(d_out, f)
            in_m, in_n = factorization(d_in, f)
            if (out_l, in_m) != tuple(a) or (out_k, in_n) != tuple(b):
                fails[f] = name
                break
        else:
            return f
    name = fails[-1]
    a, b, (d_in, d_out) = sites[name]
    raise PeftConversionError(
        f"KronA layer {name!r} has A {tuple(a)}, B {tuple(b)} on a ({d_out}, {d_in}) layer, and "
        "no single PEFT LoKr decompose_factor makes PEFT's factorisation give every layer its "
        "shapes (PEFT derives w1 = (factor(out), factor(in)) from one decompose_factor); PEFT "
        "could not load these factors")


def _check_target_folder(path: str) -> None:
    """Refuse (before anything is written) a target that is not ours to replace."""
    if os.path.islink(path):
        raise ValueError(f"to_peft: path {path!r} is a symbolic link (to "
                         f"{os.readlink(path)!r}); refusing to replace it: pass the real "
                         "folder (os.path.realpath) or a new path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise FileExistsError(f"to_peft: {path!r} exists and is not a folder; refusing to "
                              "replace it")
    if not os.path.isdir(path):
        unusable = folder_refusal(path)  # under a file, or in a folder that cannot be written
        if unusable:
            raise ValueError(f"to_peft: path {path!r} cannot take the export: {unusable}")
        return
    entries = set(os.listdir(path))
    if not entries:
        return
    marker = os.path.join(path, EXPORT_MARKER)
    ours = {PEFT_WEIGHTS, PEFT_CONFIG, EXPORT_MARKER}
    if EXPORT_MARKER not in entries:
        raise FileExistsError(f"to_peft: {path!r} is a non-empty folder that to_peft did not "
                              f"write (no {EXPORT_MARKER}); refusing to overwrite its files")
    foreign = sorted(entries - ours)
    if foreign:
        raise FileExistsError(f"to_peft: {path!r} holds files to_peft did not write "
                              f"({foreign[:5]}); refusing to overwrite the folder")
    try:
        with open(marker) as f:
            hashes = json.load(f)["files"]
        if not isinstance(hashes, dict):
            raise TypeError(f"'files' is a {type(hashes).__name__}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise FileExistsError(f"to_peft: {marker} is unreadable; refusing to overwrite "
                              f"{path!r}") from exc
    for fname in entries - {EXPORT_MARKER}:
        p = os.path.join(path, fname)
        if (os.path.islink(p) or not os.path.isfile(p)
                or hashes.get(fname) != sha256_file(p)):
            raise FileExistsError(f"to_peft: {path!r}/{fname} changed since to_peft wrote it; "
                                  "refusing to overwrite it")


@functools.lru_cache(maxsize=None)
def _renameat2():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: str, b: str) -> bool:
    """Swap two existing paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``).
    False, with nothing changed, where the platform or the filesystem cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False  # not supported here: the caller falls back to two renames
    raise OSError(err, os.strerror(err), b)


def _install(tmp: str, path: str) -> Optional[str]:
    """Put the finished export folder ``tmp`` at ``path`` so that ``path`` holds one complete
    export at every moment it exists: the old one until the new one is in place. Returns where
    the previous folder now is (to be removed by the caller), or None if there was none. On
    failure the previous folder is back at ``path`` (or, if even that fails, the error names
    where it is) and ``tmp`` is untouched."""
    if not os.path.lexists(path):
        os.replace(tmp, path)
        return None
    if _exchange(tmp, path):
        return tmp  # one atomic step: tmp now holds the previous export
    # no atomic exchange: move the old folder aside, rename the new one in, then drop the old
    parent, base = os.path.split(path)
    aside = os.path.join(parent, f".{base}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.replace(path, aside)
    try:
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.replace(aside, path)
        except BaseException as exc2:
            raise OSError(f"to_peft: writing {path!r} failed ({exc}) and so did putting the "
                          f"previous export back ({exc2}); it is complete at {aside!r}: rename it "
                          f"to {path!r}") from exc
        raise
    return aside


def _remove_old_export(folder: str) -> None:
    """Delete what an earlier to_peft wrote in ``folder`` (only files whose hash its marker
    records) and the folder if that empties it; anything else is left, with a warning."""
    if os.path.islink(folder) or not os.path.isdir(folder):  # pragma: no cover - checked before
        warnings.warn(f"to_peft: the previous export was replaced; {folder!r} is not a folder "
                      "to_peft wrote, so it was left in place")
        return
    marker = os.path.join(folder, EXPORT_MARKER)
    try:
        with open(marker) as f:
            hashes = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        hashes = {}
    for fname in (PEFT_WEIGHTS, PEFT_CONFIG):
        p = os.path.join(folder, fname)
        if (isinstance(hashes, dict) and os.path.isfile(p) and not os.path.islink(p)
                and hashes.get(fname) == sha256_file(p)):
            os.remove(p)
    if os.path.isfile(marker) and not (set(os.listdir(folder)) & {PEFT_WEIGHTS, PEFT_CONFIG}):
        os.remove(marker)
    try:
        os.rmdir(folder)
    except OSError:
        warnings.warn(f"to_peft: the new export is in place; the previous export's folder, now "
                      f"{folder!r}, still holds files to_peft did not write "
                      f"({sorted(os.listdir(folder))[:5]}), so it was left there")


def _peft_config(model: nn.Module, task_type: Optional[str]):
    """(peft config object, tensors) for the kfused adapters of ``model``."""
    peft = _peft()
    m = unwrap(model)
    state = get_state(m)
    method = state.config.method
    if method == "prefix":
        return _prefix_peft_config(m, state, task_type)
    if method not in ("lora", "krona"):
        raise PeftConversionError(
            f"to_peft: kfused method {method!r} has no PEFT equivalent (PEFT has LoRA and LoKr; "
            "Kernel-wise/-mix, inducer, KronA^B, parallel adapters and composites are kfused's "
            "own); nothing was written")
    mods = adapter_modules(m)
    tensors: Dict[str, torch.Tensor] = {}
    for name, mod in mods.items():
        want = LoRALinear if method == "lora" else KronALinear
        if not isinstance(mod, want):
            raise PeftConversionError(f"to_peft: adapter {name!r} is a {type(mod).__name__}, "
                                      f"expected {want.__name__}")
        if mod.merged:
            raise PeftConversionError(f"to_peft: adapter {name!r} is merged into its base "
                                      "weight; call kfused.unmerge(model) first")
    base_class = getattr(m, "name_or_path", None) or None
    if method == "lora":
        r = {n: mod.r for n, mod in mods.items()}
        alpha = {n: mod.alpha for n, mod in mods.items()}
        drops = {n: (mod.dropout.p if isinstance(mod.dropout, nn.Dropout) else 0.0)
                 for n, mod in mods.items()}
        r0 = collections.Counter(r.values()).most_common(1)[0][0]
        a0 = collections.Counter(alpha.values()).most_common(1)[0][0]
        if len(set(drops.values())) > 1:
            raise PeftConversionError(f"to_peft: LoRA dropout differs between layers ({drops})")
        # PEFT sets fan_in_fan_out per layer as it builds it (True on a Conv1D, False on an
        # nn.Linear), so adapters on both kinds (GPT-2's c_attn and lm_head) load as they are
        conv = [is_conv1d(mod.base) for mod in mods.values()]
        cfg = peft.LoraConfig(
            r=r0, lora_alpha=a0, target_modules=list(mods), lora_dropout=next(iter(drops.values())),
            fan_in_fan_out=any(conv), bias="none", task_type=task_type,
            rank_pattern={re.escape(n): v for n, v in r.items() if v != r0},
            alpha_pattern={re.escape(n): v for n, v in alpha.items() if v != a0},
            base_model_name_or_path=base_class)
        for n, mod in mods.items():
            tensors[f"{_KEY_PREFIX}{n}.lora_A.weight"] = mod.A
            tensors[f"{_KEY_PREFIX}{n}.lora_B.weight"] = mod.B
        return cfg, tensors
    shapes = {}
    for n, mod in mods.items():
        if is_conv1d(mod.base):
            raise PeftConversionError(
                f"to_peft: KronA adapter {n!r} sits on a transformers Conv1D (GPT-2); PEFT's "
                "LoKr adapts nn.Linear / nn.Conv1d / nn.Conv2d only, so PEFT could not load it")
        shapes[n] = (tuple(mod.A.shape), tuple(mod.B.shape), linear_dims(mod.base))
    factor = _lokr_factor(shapes)
    scales = {mod.scale for mod in mods.values()}
    if len(scales) > 1:  # pragma: no cover - inject gives one scale
        raise PeftConversionError(f"to_peft: KronA scales differ between layers ({scales})")
    scale = scales.pop()
    # w2 stays one full matrix when r >= max(w2 shape) / 2; a power of two keeps alpha / r == s
    need = max(max(b) for _, b, _ in shapes.values()) / 2
    r = 1
    while r < need:
        r *= 2
    cfg = peft.LoKrConfig(r=r, alpha=scale * r, target_modules=list(mods), rank_dropout=0.0,
                          module_dropout=0.0, decompose_both=False, decompose_factor=factor,
                          use_effective_conv2d=False, task_type=task_type,
                          base_model_name_or_path=base_class)
    for n, mod in mods.items():
        tensors[f"{_KEY_PREFIX}{n}.lokr_w1"] = mod.A
        tensors[f"{_KEY_PREFIX}{n}.lokr_w2"] = mod.B
    return cfg, tensors


def _prefix_peft_config(m: nn.Module, state, task_type: Optional[str]):
    peft = _peft()
    l = int(state.config.r)
    offset = int(state.config.options.get("position_offset", 0) or 0)
    if offset != l:
        raise PeftConversionError(f"to_peft: this kfused prefix adapter has position_offset="
                                  f"{offset}, prefix length {l}: {_PREFIX_REASON}")
    mods = list(adapter_modules(m).values())
    H, p = mods[0].num_heads, mods[0].head_dim
    from kfused.integration.arch import model_dims

    kv_heads = model_dims(m)["n_kv_heads"]
    if kv_heads != H:
        raise PeftConversionError(
            f"to_peft: this kfused prefix adapter is on a grouped-query model ({kv_heads} "
            f"key/value heads for {H} query heads): kfused keeps one prefix per query head, PEFT "
            f"one per key/value head ({kv_heads}), so PEFT could not load it")
    cfg = peft.PrefixTuningConfig(num_virtual_tokens=l, task_type=task_type or "CAUSAL_LM",
                                  num_layers=len(mods), token_dim=H * p, num_attention_heads=H,
                                  encoder_hidden_size=H * p, prefix_projection=False,
                                  num_transformer_submodules=1,
                                  base_model_name_or_path=getattr(m, "name_or_path", None) or None)
    with torch.no_grad():
        kv = []
        for mod in mods:
            kv += [mod.prefix_k.permute(1, 0, 2), mod.prefix_v.permute(1, 0, 2)]
        E = torch.stack(kv, dim=1).reshape(l, -1)
    return cfg, {"prompt_embeddings": E}


def to_peft(model: nn.Module, path: str, *, task_type: Optional[str] = None) -> str:
    """Write the kfused LoRA / KronA adapters of ``model`` as a PEFT adapter folder.

    The folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (loadable with
    ``peft.PeftModel.from_pretrained(base_model, path)``, same logits) plus
    ``kfused_export.json`` (the hashes of the files to_peft wrote). LoRA -> PEFT LoRA (per-module
    ranks / alphas as ``rank_pattern`` / ``alpha_pattern``); KronA -> PEFT LoKr with ``w1 = A``,
    ``w2 = B`` and ``alpha / r = s``, when one ``decompose_factor`` makes PEFT's factorisation
    produce every layer's (A, B) shapes (true for kfused's default shapes); a prefix adapter
    that came from PEFT (``options["position_offset"]`` equal to its length) -> PEFT prefix
    tuning.

    Args:
        model: a model with kfused adapters (``kfused.inject`` or :func:`from_peft`).
        path: the folder to write (created). An existing folder is replaced only if it is empty
            or holds exactly what an earlier to_peft wrote, unchanged; the replacement is
            atomic where the platform can swap two folders (Linux), else the old folder is
            moved aside and put back if the new one cannot be renamed in. Never a symlink.
            It may be the current directory (``to_peft(model, ".")``): the process is then
            moved into the new folder, not left in the removed one.
        task_type: PEFT task type recorded in the config (e.g. "CAUSAL_LM"; None: plain
            PeftModel for LoRA / LoKr, "CAUSAL_LM" for prefix tuning).
    Returns: the folder's absolute path.
    Raises:
        PeftConversionError: a method or layout PEFT has no equivalent for (nothing is written).
        FileExistsError: ``path`` is a file, or a folder with files to_peft did not write.
        TypeError: ``path`` is not a str / os.PathLike.
        ValueError: ``path`` is '', a symbolic link, or cannot be made (under a file, in a
            folder that cannot be written); nothing is written.
        OSError: writing or renaming failed; the previous export, if any, is kept complete.
    Under torch.distributed every rank calls it (FSDP2's sharded adapters are gathered) and
    rank 0 writes; when rank 0 fails the other ranks raise a RuntimeError quoting its error.
    """
    path = _path_arg(path, "to_peft", "path")
    cfg, tensors = _peft_config(model, task_type)
    tensors = {k: _full(v) for k, v in tensors.items()}  # FSDP2: a collective, every rank
    failure = None
    if _dist_rank() == 0:  # under torch.distributed rank 0 writes, every rank learns how it went
        try:
            _write_export(cfg, tensors, path)
        except BaseException as exc:
            failure = exc
    _share_outcome(model, failure, f"to_peft to {path}", "the export", error=RuntimeError)
    return path


def _write_export(cfg, tensors: Dict[str, torch.Tensor], path: str) -> None:
    from safetensors.torch import save_file

    _check_target_folder(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent,
                       f".{os.path.basename(path)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        cfg.save_pretrained(tmp)
        save_file(tensors, os.path.join(tmp, PEFT_WEIGHTS), metadata={"format": "pt"})
        written = sorted(os.listdir(tmp))
        if set(written) != {PEFT_WEIGHTS, PEFT_CONFIG}:  # pragma: no cover - peft version drift
            raise RuntimeError(f"to_peft: unexpected files {written} from PEFT's save")
        with open(os.path.join(tmp, EXPORT_MARKER), "w") as f:
            json.dump({"writer": "kfused.to_peft",
                       "files": {n: sha256_file(os.path.join(tmp, n)) for n in written}},
                      f, indent=2)
        _check_target_folder(path)  # again, just before replacing
        try:  # the process works inside the folder being replaced ("." from the export)
            inside = os.path.samefile(path, os.getcwd())
        except OSError:
            inside = False
        old = _install(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # the new export, not yet in place
        raise
    if inside and old is not None:
        os.chdir(path)  # into the new folder: the old one, the cwd until now, is removed next
    if old is not None:
        _remove_old_export(old)
