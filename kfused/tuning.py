"""Measured launch configurations: the block sizes a GPU run timed fastest, per kernel and shape.

Some kernels' best launch parameters cannot be derived on the CPU. The performance model
(kfused.perf) prices FLOPs and bytes, not the latency chain of a kernel's loop: on the H100 of
2026-11-27 ``_kron_grad_kernel`` ran at 2.1x its prediction with 2 tokens per step
(benchmarks/results/h100/proof-2026-11-27). For such kernels ``benchmarks/tune_kernels.py``
times a few compile-checked candidates on the GPU (each also tested for correctness on the
CPU) and records the fastest per shape; the host code asks :func:`lookup` and otherwise keeps
its default rule. A table changes which tested configuration runs, never what is computed.

The table: ``KFUSED_KERNEL_TUNING`` names a file, else the package's
``kfused/data/kernel_tuning.json`` when one was committed. Format::

    {"written_by": "benchmarks/tune_kernels.py",
     "devices": {gpu name: {kernel: [{"key": {...}, "T": tokens, "config": {...},
                                      "us": {candidate: time, ...}}, ...]}}}

``key`` holds everything but the token count that must match (factor shapes, element size);
of the matching entries the one timed at the nearest token count (in log2) applies.
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Optional

import torch

TUNING_ENV = "KFUSED_KERNEL_TUNING"
WRITER = "benchmarks/tune_kernels.py"
_CONFIG_KEYS = ("BT", "num_warps", "num_stages")


class TuningError(ValueError):
    """A tuning table that cannot be read or does not have the documented form."""


@functools.lru_cache(maxsize=None)
def _package_table() -> Optional[str]:
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                        "kernel_tuning.json")
    return here if os.path.exists(here) else None


def table_path() -> Optional[str]:
    """The table in use: ``KFUSED_KERNEL_TUNING``, else the package's file if present (looked
    up once per process)."""
    path = os.environ.get(TUNING_ENV, "").strip()
    return path or _package_table()


_GENERATION = [0]       # how often forget() ran: part of what cached choices depend on


def state() -> tuple:
    """What a choice made from the table depends on: the table in use and how often
    :func:`forget` ran (host code that caches a looked-up configuration keys it on this)."""
    return table_path(), _GENERATION[0]


def _valid_entry(e) -> bool:
    return (isinstance(e, dict) and isinstance(e.get("key"), dict)
            and isinstance(e.get("T"), int) and not isinstance(e["T"], bool) and e["T"] > 0
            and isinstance(e.get("config"), dict)
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                    for v in e["config"].values()))


@functools.lru_cache(maxsize=8)
def load(path: str) -> dict:
    """Read and check a table (remembered per path); a malformed one is an error naming it."""
    try:
        with open(path) as f:
            data = json.load(f)
        devices = data["devices"]
        ok = isinstance(devices, dict) and all(
            isinstance(kernels, dict) and all(
                isinstance(entries, list) and all(_valid_entry(e) for e in entries)
                for entries in kernels.values())
            for kernels in devices.values())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TuningError(f"kernel tuning table {path}: cannot be read ({exc})") from exc
    if not ok:
        raise TuningError(f"kernel tuning table {path}: expected {{'devices': {{gpu name: "
                          f"{{kernel: [{{'key': {{...}}, 'T': int, 'config': {{name: int}}}}]}}}}}}")
    return data


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device) -> Optional[str]:
    """The CUDA device's model name (asked once per device), or None off a CUDA device."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return _device_name(device.index if device.index is not None else torch.cuda.current_device())


def pick(entries, key: dict, T: int) -> Optional[dict]:
    """Of ``entries`` with this ``key``, the config timed at the token count nearest ``T``."""
    best, dist = None, math.inf
    for e in entries:
        if e["key"] != key:
            continue
        d = abs(math.log2(max(T, 1) / e["T"]))
        if d < dist:
            best, dist = e, d
    return None if best is None else {k: best["config"][k] for k in best["config"]}


_LOOKUPS: dict = {}


def lookup(kernel: str, device: torch.device, key: dict, T: int,
           candidates=None) -> Optional[dict]:
    """The measured config of ``kernel`` for this device and shape, or None (no table, another
    GPU model, a shape not timed, or not a CUDA device). Remembered per (kernel, device,
    key, T, table): host code may ask on every call.

    ``candidates``: the configurations benchmarks/tune_kernels.py times for this kernel and
    shape (each tested for correctness); a table entry that is none of them is refused
    (:class:`TuningError` naming the table, the kernel and the entry): a table chooses among
    tested configurations, and one it invented (e.g. 2 tokens per step where the kernel needs
    at least 4) could fail inside the kernel or compute on a path no test covers."""
    name = device_name(device)
    if name is None:
        return None
    path = table_path()
    if path is None:
        return None
    memo = (kernel, name, json.dumps(key, sort_keys=True), int(T), path)
    try:
        hit = _LOOKUPS[memo]
    except KeyError:
        if len(_LOOKUPS) >= 4096:
            _LOOKUPS.clear()
        entries = load(path)["devices"].get(name, {}).get(kernel, [])
        hit = pick(entries, key, T)
        if hit is not None and candidates is not None and hit not in list(candidates):
            raise TuningError(
                f"kernel tuning table {path}: the entry for {kernel} on {name} at key {key} "
                f"has config {hit}, which is not one of the configurations "
                f"benchmarks/tune_kernels.py times for it ({list(candidates)}); rewrite the "
                f"table with benchmarks/tune_kernels.py or remove the entry")
        _LOOKUPS[memo] = hit
    return dict(hit) if hit is not None else None


def forget() -> None:
    """Drop what was read and looked up (a table rewritten, tests), and every configuration
    host code cached from it (they are keyed on :func:`state`)."""
    load.cache_clear()
    _LOOKUPS.clear()
    _GENERATION[0] += 1


def merge(path: str, device: str, kernel: str, entries, extra: Optional[dict] = None) -> dict:
    """Write ``entries`` for (device, kernel) into the table at ``path`` (created if absent),
    replacing those with the same key and token count; returns the table. Replaced whole or
    not at all (a temporary file of a fresh name, then a rename); a symbolic link is refused
    (the rename would replace the link, not the table it names)."""
    from kfused._files import replace_atomically

    if os.path.islink(path):
        raise TuningError(f"kernel tuning table {path} is a symbolic link; not replacing it "
                          f"(give the file it points to, {os.path.realpath(path)})")
    data = load(path) if os.path.exists(path) else {"written_by": WRITER, "devices": {}}
    data = json.loads(json.dumps(data))           # a copy: load() is cached
    have = data["devices"].setdefault(device, {}).setdefault(kernel, [])
    for e in entries:
        if not _valid_entry(e):
            raise TuningError(f"not a tuning entry: {e!r}")
        have[:] = [h for h in have if not (h["key"] == e["key"] and h["T"] == e["T"])]
        have.append(e)
    have.sort(key=lambda e: (json.dumps(e["key"], sort_keys=True), e["T"]))
    if extra:
        data.update(extra)
    def dump(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.write("\n")

    replace_atomically(path, dump)
    forget()
    return data
