"""Adapter-only checkpoints: safetensors weights + a JSON description, committed atomically.

Layout of a checkpoint directory ``D`` (format version 2)::

    D/kfused_checkpoint.json          the pointer: names the current version and the sha256 of
                                      its two files; only ever replaced atomically (os.replace)
    D/kfused_checkpoint-<id>/         one complete version, never modified once written
        adapter_model.safetensors     the adapter parameters and buffers, by full module path
        adapter_config.json           kfused version, AdapterConfig, base architecture, tensors
    D/<anything else>                 not kfused's: never read, replaced or deleted

Save protocol (the numbers are the steps :data:`KILL_ENV` can stop a process after)::

    1  create D if missing; clean dead leftovers (see below)
    2  create a new version folder kfused_checkpoint-<id>/ (no pointer names it yet)
    3  write + fsync adapter_model.safetensors
    4  write + fsync adapter_config.json, fsync the folder
    5  write + fsync the new pointer as .kfused_checkpoint.json.<id>.tmp
    6  os.replace(it, kfused_checkpoint.json), fsync D          <- the commit
    7  remove the version folder the old pointer named
    8  remove a format-1 checkpoint's files that step 6 superseded (verified by their hashes)

Up to step 6 the pointer names the old version (or there is none), from step 6 on the new one,
and the version a pointer names is always complete: at every instant ``D`` holds one complete
version, old or new. A process killed part way leaves a version folder no pointer names, a
pointer temp file, or a superseded folder; their names carry ``<id>`` = time, host, pid and a
random tag, and the next :func:`save` or :func:`load` on ``D`` removes them once their writer is
gone (same host and pid no longer running, or older than a day). Nothing else is ever deleted:
a folder holding other files (e.g. PEFT's) keeps them, and a path that is a file is refused.
A save holds an advisory lock (``flock``) on ``D`` itself from step 1 to step 8: saves into one
folder run one at a time, and a load cleans only when it can take the lock at once (never
beside a running save, whose pid a load in another PID namespace cannot see).

:func:`load` checks the pointer, the hashes (of the very bytes it parses), the JSON description
and every tensor of the weights file against it (name, shape, dtype) before it changes the
model; any mismatch is a :class:`CheckpointError` naming the file and tensor. Format-1
checkpoints (``adapter_model.safetensors`` + ``adapter_config.json`` + ``COMPLETE`` directly in
``D``) still load. Under torch.distributed every rank must call :func:`save` (sharded FSDP2
parameters are gathered); rank 0 writes, and when its write fails every rank raises.
"""

from __future__ import annotations

import calendar
import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import threading
import time
import uuid
from typing import Dict, Optional, Set, Tuple

try:
    import fcntl
except ImportError:  # pragma: no cover  (not POSIX)
    fcntl = None

import torch
from torch import nn

from kfused.integration.config import AdapterConfig
from kfused.integration.inject import (get_state, inject, merged_modules, refuse_wrapped,
                                       restore, snapshot, unwrap)

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
MARKER = "COMPLETE"              # format 1 only
POINTER = "kfused_checkpoint.json"
VERSION_PREFIX = "kfused_checkpoint-"
FORMAT = "kfused-adapter"
FORMAT_VERSION = 2
KILL_ENV = "KFUSED_CHECKPOINT_KILL_AFTER"   # test hook: os._exit(KILL_EXIT) after that step
KILL_EXIT = 86
SAVE_STEPS = 8
KILL_POINTS = ("1", "2", "3-", "3", "4-", "4", "5-", "5", "6", "7", "8")  # every one, in order
LEFTOVER_MAX_AGE_S = 24 * 3600

_ID = r"(?P<stamp>\d{8}T\d{6})-(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-(?P<tag>[0-9a-f]{8})"
_VERSION_RE = re.compile(re.escape(VERSION_PREFIX) + _ID)
_POINTER_TMP_RE = re.compile(r"\." + re.escape(POINTER) + r"\." + _ID + r"\.tmp")
_V1_TMP_RE = re.compile(r"\.(?P<base>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]{8}(?P<old>\.old)?")
_ACTIVE: Set[str] = set()        # ids of saves in progress in this process
_ACTIVE_LOCK = threading.Lock()

_DTYPES = {str(dt).replace("torch.", ""): dt for dt in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}


class CheckpointError(ValueError):
    """The checkpoint is incomplete, corrupt, or does not fit the model."""


# ------------------------------------------------------------------------------------------
# hashing, durable writes and version folders


def _version() -> str:
    try:
        import kfused

        return getattr(kfused, "__version__", "unknown")
    except Exception:  # pragma: no cover
        return "unknown"


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fsync_write(path: str, data: bytes, step: Optional[int] = None) -> None:
    with open(path, "xb") as f:  # never overwrite: every name we write is fresh
        if step is not None and os.environ.get(KILL_ENV) == f"{step}-":
            f.write(data[:len(data) // 2])  # test hook: killed half way through the write
            f.flush()
            os._exit(KILL_EXIT)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover  (e.g. Windows)
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _step(k: int) -> None:
    """Test hook: with $KFUSED_CHECKPOINT_KILL_AFTER=k the process dies here, as a kill would
    (``k-`` for the writing steps 3, 4, 5: half way through that step's file)."""
    if os.environ.get(KILL_ENV) == str(k):
        os._exit(KILL_EXIT)


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _new_id() -> str:
    return (f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{_host_tag()}-{os.getpid()}-"
            f"{uuid.uuid4().hex[:8]}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _content_is_ours(path: str) -> bool:
    """Whether a leftover's content shows kfused wrote it: a pointer temp file or a version
    folder's description that is kfused's JSON, a weights file whose safetensors header
    carries kfused's format tag, or an empty version folder."""
    def tagged_json(f: str, limit: int) -> bool:
        try:
            with open(f, "rb") as fh:
                data = fh.read(limit + 1)
            return len(data) <= limit and json.loads(data).get("format") == FORMAT
        except (OSError, ValueError, AttributeError):
            return False

    if os.path.isfile(path):
        return tagged_json(path, 1 << 16)
    try:
        names = os.listdir(path)
    except OSError:
        return False
    if CONFIG in names:
        return tagged_json(os.path.join(path, CONFIG), 1 << 26)
    if WEIGHTS in names:
        try:
            with open(os.path.join(path, WEIGHTS), "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(n)) if 0 < n <= (1 << 26) else {}
            return header.get("__metadata__", {}).get("format") == FORMAT
        except (OSError, ValueError, AttributeError):
            return False
    return not names


@contextlib.contextmanager
def _dir_lock(directory: str, wait: bool):
    """An advisory lock on the checkpoint folder itself (``flock`` on the folder: no file of
    its own): a save holds it from its cleaning to its last step, and the cleaning a
    :func:`load` does runs only while it can take it at once. Yields whether it is held.
    Without it a load beside a running save (another thread, or another PID namespace on
    the same host, where the save's pid looks dead) could read the old pointer, then remove
    the version that save had just committed. Where the folder cannot be locked (no flock,
    some network filesystems) it yields False: a save goes on as before, a load skips its
    cleaning."""
    if fcntl is None:
        yield False
        return
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            held = True
        except OSError:
            held = False
        try:
            yield held
        finally:
            if held:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _writer_gone(match: "re.Match", path: str) -> bool:
    """Whether the save that wrote the leftover ``path`` (its name parsed as ``match``) can no
    longer be running: this host's process ``pid`` has ended, or the leftover is older than a
    day (another host's, or a recycled pid) and its content shows kfused wrote it. A name
    alone never makes a file or folder removable when its writer cannot be checked."""
    ident = "-".join(match.group(k) for k in ("stamp", "host", "pid", "tag"))
    try:
        age = time.time() - calendar.timegm(time.strptime(match.group("stamp"), "%Y%m%dT%H%M%S"))
    except ValueError:  # pragma: no cover
        age = 0.0
    if match.group("host") != _host_tag():
        return age > LEFTOVER_MAX_AGE_S and _content_is_ours(path)
    if age > LEFTOVER_MAX_AGE_S and _content_is_ours(path):
        return True
    pid = int(match.group("pid"))
    if pid == os.getpid():
        with _ACTIVE_LOCK:
            return ident not in _ACTIVE
    return not _pid_alive(pid)


def _only_ours(folder: str) -> bool:
    """A version folder holds nothing but files kfused writes there."""
    try:
        return all(n in (WEIGHTS, CONFIG) and os.path.isfile(os.path.join(folder, n))
                   and not os.path.islink(os.path.join(folder, n)) for n in os.listdir(folder))
    except OSError:
        return False


def _full(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "full_tensor"):  # DTensor (FSDP2): gather the shards (collective)
        t = t.full_tensor()
    return t.detach().to("cpu").contiguous().clone()


def _dist_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path, "rb") as f:
            data = f.read()
        obj = json.loads(data.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read the {what} ({type(exc).__name__}: {exc})"
                              ) from exc
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: the {what} is not a JSON object")
    return obj


# ------------------------------------------------------------------------------------------
# the pointer and the versions


def _read_pointer(directory: str) -> Optional[dict]:
    """The validated pointer of ``directory``, or None when there is none."""
    path = os.path.join(directory, POINTER)
    if not os.path.lexists(path):
        return None
    ptr = _read_json(path, "checkpoint pointer")
    if ptr.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a kfused checkpoint pointer (format "
                              f"{ptr.get('format')!r}, expected {FORMAT!r})")
    ver = ptr.get("format_version")
    if not isinstance(ver, int) or ver < 2:
        raise CheckpointError(f"{path}: invalid format_version {ver!r}")
    if ver > FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {ver}; this kfused reads up to "
                              f"{FORMAT_VERSION}")
    name = ptr.get("version")
    if not isinstance(name, str) or not _VERSION_RE.fullmatch(name):
        raise CheckpointError(f"{path}: invalid version name {name!r}")
    hashes = ptr.get("sha256")
    if not (isinstance(hashes, dict) and all(isinstance(hashes.get(n), str)
                                             for n in (WEIGHTS, CONFIG))):
        raise CheckpointError(f"{path}: 'sha256' must map {WEIGHTS} and {CONFIG} to hashes")
    return ptr


def _read_version(folder: str, hashes: dict, where: str) -> Tuple[dict, bytes]:
    """(description, weights bytes) of one version, both checked against ``hashes``."""
    blobs = {}
    for name in (WEIGHTS, CONFIG):
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as f:
                blobs[name] = f.read()
        except FileNotFoundError:
            raise CheckpointError(f"{where} is incomplete: {path} is missing") from None
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read it ({exc})") from exc
        if _sha256_bytes(blobs[name]) != hashes.get(name):
            raise CheckpointError(f"{path} does not match the hash recorded in {where}: the "
                                  "checkpoint is corrupt or was modified")
    cfg_path = os.path.join(folder, CONFIG)
    try:
        meta = json.loads(blobs[CONFIG].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{cfg_path}: invalid JSON ({exc})") from exc
    _check_meta(meta, cfg_path)
    return meta, blobs[WEIGHTS]


def _check_meta(meta, path: str) -> None:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a kfused adapter description")
    ver = meta.get("format_version", 0)
    if not isinstance(ver, int):
        raise CheckpointError(f"{path}: invalid format_version {ver!r}")
    if ver > FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {ver}; this kfused reads up to "
                              f"{FORMAT_VERSION}")
    for key, typ in (("config", dict), ("base", dict), ("tensors", dict)):
        if not isinstance(meta.get(key), typ):
            raise CheckpointError(f"{path}: field {key!r} is missing or not a {typ.__name__}")
    for n, d in meta["tensors"].items():
        shape = d.get("shape") if isinstance(d, dict) else None
        dtype = d.get("dtype") if isinstance(d, dict) else None
        if not (isinstance(shape, list) and all(isinstance(s, int) and not isinstance(s, bool)
                                                and s >= 0 for s in shape)):
            raise CheckpointError(f"{path}: tensor {n!r} has an invalid shape {shape!r}")
        if dtype not in _DTYPES:
            raise CheckpointError(f"{path}: tensor {n!r} has an unknown dtype {dtype!r}")


def _read_v1(directory: str) -> Tuple[dict, bytes]:
    marker = os.path.join(directory, MARKER)
    hashes = _read_json(marker, f"{MARKER} marker")
    if not all(isinstance(hashes.get(n), str) for n in (WEIGHTS, CONFIG)):
        raise CheckpointError(f"{marker}: must map {WEIGHTS} and {CONFIG} to sha256 hashes")
    return _read_version(directory, hashes, marker)


def _v1_is_ours(directory: str) -> bool:
    try:
        _read_v1(directory)
        return True
    except CheckpointError:
        return False


def _current(directory: str) -> Tuple[dict, bytes, str]:
    """(description, weights bytes, weights path) of the version ``directory`` holds now."""
    if not os.path.exists(directory):
        raise CheckpointError(f"{directory} does not exist")
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory} is not a directory (a kfused checkpoint is one)")
    last = None
    for _ in range(5):  # a concurrent save may swap the version between our reads: retry
        ptr = _read_pointer(directory)
        if ptr is None:
            if os.path.lexists(os.path.join(directory, MARKER)):
                meta, weights = _read_v1(directory)
                return meta, weights, os.path.join(directory, WEIGHTS)
            raise CheckpointError(
                f"{directory} holds no kfused checkpoint (no {POINTER}): not a kfused "
                "checkpoint, or its first save was interrupted before completing")
        folder = os.path.join(directory, ptr["version"])
        try:
            meta, weights = _read_version(folder, ptr["sha256"],
                                          os.path.join(directory, POINTER))
            return meta, weights, os.path.join(folder, WEIGHTS)
        except CheckpointError as exc:
            again = _read_pointer(directory)
            if again is not None and again != ptr and again != last:
                last = ptr
                continue
            raise exc
    raise CheckpointError(f"{directory} kept changing while being read (concurrent saves?)")


def _clean(directory: str) -> None:
    """Remove the leftovers of killed saves into ``directory`` (best effort, see the module
    docstring); restore a format-1 checkpoint that a killed format-1 save left moved aside."""
    parent, base = os.path.split(directory.rstrip(os.sep))
    # format 1 moved the old folder to <parent>/.<base>.tmp-<pid>-<hex>.old before the rename
    try:
        siblings = os.listdir(parent or ".")
    except OSError:
        siblings = []
    for n in siblings:
        m = _V1_TMP_RE.fullmatch(n)
        if not m or m.group("base") != base or _pid_alive(int(m.group("pid"))):
            continue
        path = os.path.join(parent, n)
        if m.group("old") and not os.path.exists(directory) and _v1_is_ours(path):
            try:
                os.replace(path, directory)  # the only complete copy: put it back
                continue
            except OSError:
                pass
        if os.path.isdir(path) and all(x in (WEIGHTS, CONFIG, MARKER) for x in os.listdir(path)):
            shutil.rmtree(path, ignore_errors=True)
    if not os.path.isdir(directory):
        return
    try:
        ptr = _read_pointer(directory)
    except CheckpointError:
        return  # not ours to judge
    current = ptr["version"] if ptr else None
    for n in os.listdir(directory):
        path = os.path.join(directory, n)
        m = _POINTER_TMP_RE.fullmatch(n)
        if m and os.path.isfile(path) and _writer_gone(m, path):
            try:
                os.unlink(path)
            except OSError:
                pass
            continue
        m = _VERSION_RE.fullmatch(n)
        if m and n != current and os.path.isdir(path) and not os.path.islink(path) \
                and _only_ours(path) and _writer_gone(m, path):
            shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------------
# public API


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


def _path_arg(directory, fn: str, arg: str = "directory") -> str:
    """The folder argument ``arg`` of ``fn`` as an absolute path; '' is refused (it names no
    folder: os.path.abspath('') is the working directory, kfused._files.folder_refusal)."""
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"{fn}: {arg} must be a path (str or os.PathLike), got "
                        f"{type(directory).__name__} {directory!r}")
    if not os.fspath(directory):
        raise ValueError(f"{fn}: {arg} '' names no folder; pass a folder path (e.g. '.' for "
                         "the working directory)")
    return os.path.abspath(os.fspath(directory))


def _check_target(directory: str) -> None:
    if os.path.lexists(directory) and not os.path.isdir(directory):
        kind = "a regular file" if os.path.isfile(directory) else "not a directory"
        raise CheckpointError(f"cannot save to {directory}: it exists and is {kind}; a kfused "
                              "checkpoint is a directory, and save never replaces a file")
    ptr = os.path.join(directory, POINTER)
    if os.path.lexists(ptr):
        try:
            _read_pointer(directory)
        except CheckpointError as exc:
            raise CheckpointError(f"cannot save to {directory}: {POINTER} there was not written "
                                  f"by kfused or is damaged ({exc}); move it away first") from exc


def save(model: nn.Module, directory: str) -> str:
    """Write the adapters of ``model`` to ``directory`` as a new version, committed atomically.

    ``directory`` is created if missing; other files in it are left alone. At every instant it
    holds one complete version (the old one until the commit, the new one after). Returns the
    directory path. Raises :class:`CheckpointError` if ``directory`` is a file. Under
    torch.distributed every rank calls it and rank 0 writes; when rank 0 fails, every rank
    raises (the others a :class:`CheckpointError` quoting rank 0's error).
    """
    directory = _path_arg(directory, "save")
    state = get_state(model)
    tensors = adapter_state_dict(model)  # collective under FSDP2: every rank gathers
    failure = None
    if _dist_rank() == 0:
        try:
            _write_version(model, directory, state, tensors)
        except BaseException as exc:
            failure = exc
    _share_outcome(model, failure, f"save to {directory}", "the checkpoint")
    return directory


def _share_outcome(model: nn.Module, failure: Optional[BaseException], what: str, written: str,
                   error: type = CheckpointError) -> None:
    """Raise ``failure`` (rank 0's, or None); under torch.distributed every rank first learns
    whether rank 0's write succeeded, so no rank returns as if a failed write had happened
    (nor waits for a rank 0 that left with an exception): the others raise ``error``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        outcome = [None if failure is None else f"{type(failure).__name__}: {failure}"]
        device = None  # NCCL stages the bytes on this rank's GPU: the model's, not cuda:0
        if torch.distributed.get_backend() == "nccl":
            device = next((p.device for p in unwrap(model).parameters()
                           if p.device.type == "cuda"), None)
        torch.distributed.broadcast_object_list(outcome, src=0, device=device)
        if failure is None and outcome[0] is not None:
            raise error(f"{what} failed on rank 0, which writes {written}: {outcome[0]}")
    if failure is not None:
        raise failure


def _write_version(model: nn.Module, directory: str, state, tensors: Dict[str, torch.Tensor]
                   ) -> None:
    """Rank 0's part of :func:`save`: steps 1-8 of the module docstring's protocol."""
    from safetensors.torch import save as save_bytes

    _check_target(directory)
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
    weights = save_bytes(tensors, metadata={"format": FORMAT})
    config = json.dumps(meta, indent=2).encode()
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create {directory}: {exc}") from exc
    # one save at a time into a folder, and no load cleans while one runs (_dir_lock)
    with _dir_lock(directory, wait=True):
        _clean(directory)
        old = _read_pointer(directory)
        _step(1)
        ident = _new_id()
        folder = os.path.join(directory, VERSION_PREFIX + ident)
        tmp = os.path.join(directory, f".{POINTER}.{ident}.tmp")
        with _ACTIVE_LOCK:
            _ACTIVE.add(ident)
        try:
            os.mkdir(folder)
            _step(2)
            _fsync_write(os.path.join(folder, WEIGHTS), weights, 3)
            _step(3)
            _fsync_write(os.path.join(folder, CONFIG), config, 4)
            _fsync_dir(folder)
            _step(4)
            pointer = {"format": FORMAT, "format_version": FORMAT_VERSION,
                       "version": VERSION_PREFIX + ident,
                       "sha256": {WEIGHTS: _sha256_bytes(weights),
                                  CONFIG: _sha256_bytes(config)}}
            _fsync_write(tmp, json.dumps(pointer, indent=2).encode(), 5)
            _step(5)
            os.replace(tmp, os.path.join(directory, POINTER))
            _fsync_dir(directory)
            _step(6)
        except BaseException:
            for path, rm in ((tmp, os.unlink), (folder, shutil.rmtree)):
                try:
                    if os.path.lexists(path):
                        rm(path)
                except OSError:
                    pass
            raise
        finally:
            with _ACTIVE_LOCK:
                _ACTIVE.discard(ident)
        if old is not None:
            stale = os.path.join(directory, old["version"])
            if os.path.isdir(stale) and not os.path.islink(stale) and _only_ours(stale):
                shutil.rmtree(stale, ignore_errors=True)
        _step(7)
        if os.path.lexists(os.path.join(directory, MARKER)) and _v1_is_ours(directory):
            for n in (MARKER, CONFIG, WEIGHTS):  # MARKER first: a half-removed v1 is never read
                try:
                    os.unlink(os.path.join(directory, n))
                except OSError:
                    pass
        _step(8)


def read_checkpoint_config(directory: str) -> Dict[str, object]:
    """The JSON description of the checkpoint in ``directory`` (CheckpointError otherwise)."""
    return _current(_path_arg(directory, "read_checkpoint_config"))[0]


def _parse_weights(weights: bytes, path: str) -> Dict[str, torch.Tensor]:
    from safetensors.torch import load as load_bytes

    try:
        return load_bytes(weights)
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc


def _check_tensors(tensors: Dict[str, torch.Tensor], described: dict, path: str) -> None:
    """Every tensor of the weights file is the one the description promises, and vice versa."""
    for n in described:
        if n not in tensors:
            raise CheckpointError(f"{path}: tensor {n!r} is described in {CONFIG} but missing "
                                  "from the weights file")
    for n, t in tensors.items():
        if n not in described:
            raise CheckpointError(f"{path}: tensor {n!r} is in the weights file but not "
                                  f"described in {CONFIG}")
        want_shape, want_dtype = described[n]["shape"], described[n]["dtype"]
        if list(t.shape) != want_shape:
            raise CheckpointError(f"{path}: tensor {n!r} has shape {tuple(t.shape)} but "
                                  f"{CONFIG} says {tuple(want_shape)}")
        if str(t.dtype).replace("torch.", "") != want_dtype:
            raise CheckpointError(f"{path}: tensor {n!r} has dtype "
                                  f"{str(t.dtype).replace('torch.', '')} but {CONFIG} says "
                                  f"{want_dtype}")


def load(model: nn.Module, directory: str, *, backend: Optional[str] = None) -> nn.Module:
    """Load adapters saved by :func:`save` into ``model`` (bit-exact).

    A model without adapters is injected first from the checkpoint's config; a model with
    adapters must have been injected with the same method and must not be merged. The files
    are fully checked before the model changes, and every name, shape and dtype before any
    adapter tensor is written. Raises :class:`CheckpointError` for a missing,
    incomplete or corrupt checkpoint, a weights file that disagrees with its description,
    another architecture, different adapter names or shapes, or a merged model.
    backend: overrides the saved config's kernel backend when injecting.
    """
    directory = _path_arg(directory, "load")
    m = unwrap(model)
    state = get_state(m, required=False)
    if state is not None:
        merged = merged_modules(m)
        if merged:
            raise CheckpointError(
                f"cannot load {directory} into a merged model: its adapters are folded into the "
                f"frozen weights ({len(merged)} merged modules, e.g. {merged[0]!r}), and "
                "replacing them would leave those weights wrong. Call "
                "kfused.integration.unmerge(model), then load, then merge(model) again.")
    try:
        with _dir_lock(directory, wait=False) as held:
            # not held: a save is under way (it cleans, not this load), or no lock here; a
            # missing folder has nothing inside to race over (a format-1 save killed while
            # its old copy was moved aside: _clean puts that back)
            if held or not os.path.isdir(directory):
                _clean(directory)
    except OSError:
        pass
    meta, weights, wpath = _current(directory)
    cpath = os.path.join(os.path.dirname(wpath), CONFIG)
    try:
        raw = dict(meta["config"])
        # kfused 0.1 checkpoints wrote init="lora" for the methods' exact (or, for prefix
        # tuning, default) start, which is what init=None means now; the loaded tensors replace
        # the initial values in any case.
        if raw.get("init") == "lora":
            raw["init"] = None
        cfg = AdapterConfig.from_dict(raw)
    except (ValueError, TypeError, KeyError) as exc:
        raise CheckpointError(f"{cpath}: invalid adapter config ({exc})") from exc
    if backend is not None:
        cfg = cfg.replace(backend=backend)
    base = meta["base"]
    here_class = type(m).__name__
    here_type = getattr(getattr(m, "config", None), "model_type", None)
    if base.get("model_type") != here_type or (
            here_type is None and base.get("model_class") != here_class):
        raise CheckpointError(
            f"checkpoint {directory} was saved from a {base.get('model_class')} "
            f"(model_type {base.get('model_type')!r}); this model is a {here_class} "
            f"(model_type {here_type!r})")
    saved = meta["tensors"]
    tensors = _parse_weights(weights, wpath)
    _check_tensors(tensors, saved, wpath)
    if state is not None and state.config.method != cfg.method:
        raise CheckpointError(f"checkpoint holds method {cfg.method!r} adapters but the model has "
                              f"{state.config.method!r} adapters")
    if state is not None:
        _check_same_config(state.config, cfg, directory)
    snap = None
    if state is None:
        snap = snapshot(m)
        try:
            refuse_wrapped(model)
            inject(m, cfg)
        except (ValueError, TypeError) as exc:
            raise CheckpointError(f"cannot inject the checkpoint's adapters "
                                  f"({cfg.method}) into this model: {exc}") from exc
        state = get_state(m)
    try:
        _fill(m, state, saved, tensors, directory, base, here_class)
    except BaseException:
        if snap is not None:
            restore(snap)  # a refused load leaves the model as it was, uninjected
        raise
    return model


# Config fields that change what the saved tensors mean (the scale they are applied with, the
# parts of a composite); the kernel backend, dropout, the initialisation (the tensors replace
# it) and the adapter dtype (tensors are cast on load) do not, and names and shapes are
# compared tensor by tensor (so are KronA's factor shapes: a_shape=None and the (4, 4) it
# resolves to are one adapter).
_MEANING_FIELDS = ("r", "ranks", "alpha", "scale", "bias", "options")


def _by_value(v):
    """A config value as compared: numbers by value (alpha 8 and 8.0 are one scale)."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, dict):
        return {str(k): _by_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_by_value(x) for x in v]
    return v


def _check_same_config(have: AdapterConfig, saved: AdapterConfig, directory: str) -> None:
    a, b = have.to_dict(), saved.to_dict()
    for d in (a, b):
        if d["alpha"] is None and not d["ranks"]:
            d["alpha"] = d["r"]          # alpha=None means alpha = r: one rank, one scale
    diff = [f"{f}: checkpoint {b[f]!r}, model {a[f]!r}" for f in _MEANING_FIELDS
            if json.dumps(_by_value(a[f]), sort_keys=True, default=str)
            != json.dumps(_by_value(b[f]), sort_keys=True, default=str)]
    if diff:
        raise CheckpointError(
            f"checkpoint {directory} was saved with another {have.method!r} config than this "
            "model's adapters, so its tensors would act differently here: " + "; ".join(diff)
            + ". Load it into a model without adapters (load injects from the checkpoint's "
            "config), or inject with the checkpoint's config (read_checkpoint_config).")


def _fill(m: nn.Module, state, saved: dict, tensors: Dict[str, torch.Tensor], directory: str,
          base: dict, here_class: str) -> None:
    """Copy the checked tensors into the model's adapters, after every name, shape and dtype
    kind was compared (CheckpointError before any tensor is written)."""
    expected = {n: m.get_parameter(n) for n in state.param_names}
    expected.update({n: m.get_buffer(n) for n in state.buffer_names})
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    bad_shapes = [f"{n}: checkpoint {tuple(saved[n]['shape'])}, model {tuple(t.shape)}"
                  for n, t in expected.items() if n in saved and list(t.shape) != saved[n]["shape"]]
    bad_kinds = [f"{n}: checkpoint {saved[n]['dtype']}, model {str(t.dtype).replace('torch.', '')}"
                 for n, t in expected.items() if n in saved and (
                     _DTYPES[saved[n]["dtype"]].is_floating_point != t.dtype.is_floating_point
                     or (not t.dtype.is_floating_point and _DTYPES[saved[n]["dtype"]] != t.dtype))]
    if missing or unexpected or bad_shapes or bad_kinds:
        lines = []
        if missing:
            lines.append(f"missing in checkpoint ({len(missing)}): {missing[:5]}")
        if unexpected:
            lines.append(f"not in model ({len(unexpected)}): {unexpected[:5]}")
        if bad_shapes:
            lines.append(f"shape mismatch ({len(bad_shapes)}): {bad_shapes[:5]}")
        if bad_kinds:
            lines.append(f"dtype mismatch ({len(bad_kinds)}): {bad_kinds[:5]}")
        from kfused.integration.arch import model_dims

        try:
            here = model_dims(m).get("d_model")
        except Exception:  # noqa: BLE001 (only the message's detail)
            here = None
        raise CheckpointError(f"checkpoint {directory} does not fit this model "
                              f"(saved from {base.get('model_class')} d_model="
                              f"{base.get('d_model')}; this model: {here_class} d_model={here}): "
                              + "; ".join(lines))
    with torch.no_grad():
        for n, dst in expected.items():
            src = tensors[n]
            if hasattr(dst, "device_mesh"):  # DTensor: shard the full tensor the same way
                from torch.distributed.tensor import distribute_tensor

                src = distribute_tensor(src.to(dst.device_mesh.device_type), dst.device_mesh,
                                        dst.placements)
            dst.copy_(src)

