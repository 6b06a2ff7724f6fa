"""Adapter-only checkpoints: safetensors weights + a JSON description + a completeness marker.

Layout of a checkpoint directory::

    adapter_model.safetensors   the adapter parameters and buffers, by full module path
    adapter_config.json         kfused version, AdapterConfig, base architecture, tensor shapes
    COMPLETE                    sha256 of the two files above, written last

:func:`save` writes everything into a temporary sibling directory and renames it into place
(``os.replace``), so a save killed half way never leaves a directory that :func:`load` accepts;
:func:`load` also checks the hashes in ``COMPLETE``. Under torch.distributed every rank must
call :func:`save` (sharded FSDP2 parameters are gathered); rank 0 writes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from typing import Dict, Optional

import torch
from torch import nn

from kfused.integration.config import AdapterConfig
from kfused.integration.inject import get_state, inject, unwrap

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
MARKER = "COMPLETE"
FORMAT = "kfused-adapter"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """The checkpoint is incomplete, corrupt, or does not fit the model."""


def _version() -> str:
    try:
        import kfused

        return getattr(kfused, "__version__", "unknown")
    except Exception:  # pragma: no cover
        return "unknown"


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _full(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "full_tensor"):  # DTensor (FSDP2): gather the shards (collective)
        t = t.full_tensor()
    return t.detach().to("cpu").contiguous().clone()


def _dist_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def adapter_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """name -> CPU copy of every adapter parameter and buffer (full tensors under FSDP2)."""
    m = unwrap(model)
    state = get_state(m)
    out = {n: _full(m.get_parameter(n)) for n in state.param_names}
    out.update({n: _full(m.get_buffer(n)) for n in state.buffer_names})
    return out


def _describe(model: nn.Module) -> Dict[str, object]:
    from kfused.integration.arch import model_dims

    m = unwrap(model)
    state = get_state(m)
    return {"model_class": state.model_class, "model_type": state.model_type,
            "arch": state.arch, **model_dims(m)}


def save(model: nn.Module, directory: str) -> str:
    """Write the adapters of ``model`` to ``directory`` (created or atomically replaced).

    Returns the directory path. Refuses to replace an existing non-empty directory that is not
    a kfused checkpoint.
    """
    from safetensors.torch import save_file

    state = get_state(model)
    tensors = adapter_state_dict(model)  # collective under FSDP2: every rank gathers
    directory = os.path.abspath(directory)
    if _dist_rank() == 0:
        if os.path.isdir(directory) and os.listdir(directory) and not (
                os.path.exists(os.path.join(directory, CONFIG))
                or os.path.exists(os.path.join(directory, MARKER))):
            raise CheckpointError(f"{directory} exists and is not a kfused checkpoint; "
                                  "refusing to replace it")
        meta = {
            "format": FORMAT, "format_version": FORMAT_VERSION, "kfused_version": _version(),
            "torch_version": torch.__version__,
            "config": state.config.to_dict(),
            "base": _describe(model),
            "adapter_modules": list(state.adapter_modules),
            "tensors": {n: {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
                        for n, t in tensors.items()},
            "buffers": list(state.buffer_names),
        }
        parent = os.path.dirname(directory) or "."
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f".{os.path.basename(directory)}.tmp-{os.getpid()}-"
                                   f"{uuid.uuid4().hex[:8]}")
        os.makedirs(tmp)
        try:
            save_file(tensors, os.path.join(tmp, WEIGHTS), metadata={"format": FORMAT})
            with open(os.path.join(tmp, WEIGHTS), "rb") as f:
                os.fsync(f.fileno())
            _fsync_write(os.path.join(tmp, CONFIG), json.dumps(meta, indent=2).encode())
            marker = {WEIGHTS: _sha256(os.path.join(tmp, WEIGHTS)),
                      CONFIG: _sha256(os.path.join(tmp, CONFIG))}
            _fsync_write(os.path.join(tmp, MARKER), json.dumps(marker, indent=2).encode())
            old = None
            if os.path.exists(directory):
                old = tmp + ".old"
                os.replace(directory, old)
            os.replace(tmp, directory)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    return directory


def read_checkpoint_config(directory: str) -> Dict[str, object]:
    """The JSON description of a complete checkpoint (raises CheckpointError otherwise)."""
    marker = os.path.join(directory, MARKER)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory} is not a directory")
    if not os.path.exists(marker):
        raise CheckpointError(
            f"{directory} has no {MARKER} marker: not a kfused checkpoint, or its save was "
            "interrupted before completing; refusing to load it")
    with open(marker) as f:
        hashes = json.load(f)
    for name in (WEIGHTS, CONFIG):
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            raise CheckpointError(f"{directory} is incomplete: {name} is missing")
        if _sha256(path) != hashes.get(name):
            raise CheckpointError(f"{directory}/{name} does not match the hash recorded in "
                                  f"{MARKER}: the checkpoint is corrupt or was modified")
    with open(os.path.join(directory, CONFIG)) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{directory} is not a kfused adapter checkpoint")
    if int(meta.get("format_version", 0)) > FORMAT_VERSION:
        raise CheckpointError(f"{directory} has format version {meta['format_version']}; this "
                              f"kfused reads up to {FORMAT_VERSION}")
    return meta


def load(model: nn.Module, directory: str, *, backend: Optional[str] = None) -> nn.Module:
    """Load adapters saved by :func:`save` into ``model`` (bit-exact).

    A model without adapters is injected first from the checkpoint's config; a model with
    adapters must have been injected with the same method. Raises :class:`CheckpointError` for
    an incomplete checkpoint, another architecture, or different adapter names or shapes.
    backend: overrides the saved config's kernel backend when injecting.
    """
    from safetensors.torch import load_file

    meta = read_checkpoint_config(directory)
    cfg = AdapterConfig.from_dict(meta["config"])
    if backend is not None:
        cfg = cfg.replace(backend=backend)
    m = unwrap(model)
    base = meta["base"]
    here_class = type(m).__name__
    here_type = getattr(getattr(m, "config", None), "model_type", None)
    if base.get("model_type") != here_type or (
            here_type is None and base.get("model_class") != here_class):
        raise CheckpointError(
            f"checkpoint {directory} was saved from a {base.get('model_class')} "
            f"(model_type {base.get('model_type')!r}); this model is a {here_class} "
            f"(model_type {here_type!r})")
    state = get_state(m, required=False)
    if state is None:
        try:
            inject(m, cfg)
        except (ValueError, TypeError) as exc:
            raise CheckpointError(f"cannot inject the checkpoint's adapters "
                                  f"({cfg.method}) into this model: {exc}") from exc
        state = get_state(m)
    elif state.config.method != cfg.method:
        raise CheckpointError(f"checkpoint holds method {cfg.method!r} adapters but the model has "
                              f"{state.config.method!r} adapters")
    expected = {n: m.get_parameter(n) for n in state.param_names}
    expected.update({n: m.get_buffer(n) for n in state.buffer_names})
    saved = meta["tensors"]
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    bad_shapes = [f"{n}: checkpoint {tuple(saved[n]['shape'])}, model {tuple(t.shape)}"
                  for n, t in expected.items() if n in saved and list(t.shape) != saved[n]["shape"]]
    if missing or unexpected or bad_shapes:
        lines = []
        if missing:
            lines.append(f"missing in checkpoint ({len(missing)}): {missing[:5]}")
        if unexpected:
            lines.append(f"not in model ({len(unexpected)}): {unexpected[:5]}")
        if bad_shapes:
            lines.append(f"shape mismatch ({len(bad_shapes)}): {bad_shapes[:5]}")
        raise CheckpointError(f"checkpoint {directory} does not fit this model "
                              f"({base.get('model_class')} d_model={base.get('d_model')} -> "
                              f"{here_class}): " + "; ".join(lines))
    tensors = load_file(os.path.join(directory, WEIGHTS))
    with torch.no_grad():
        for n, dst in expected.items():
            src = tensors[n]
            if hasattr(dst, "device_mesh"):  # DTensor: shard the full tensor the same way
                from torch.distributed.tensor import distribute_tensor

                src = distribute_tensor(src.to(dst.device_mesh.device_type), dst.device_mesh,
                                        dst.placements)
            dst.copy_(src)
    return model
