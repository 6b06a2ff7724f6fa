"""Backend selection shared by every kfused op.

Each op names the backends that implement it. A backend *fits* a call when it is installed
and supports the inputs' device and dtype; otherwise it gives a reason. ``backend="auto"``
walks the op's priority list (CUDA tensors: fused kernels; CPU tensors: the reference) and
an explicitly requested backend that does not fit raises :class:`BackendError` with every
reason, never a silent fallback.

The process-wide default comes from the ``KFUSED_BACKEND`` environment variable
(``auto`` when unset); a per-call ``backend=`` argument overrides it.

Where an op has several fused backends and says which *regime* a call is in (inducer
attention: "prefill" or "decode"), ``auto`` takes them in the order measured on this GPU
model by ``kfused bench --write-prefs`` (:func:`measured_order`), not by their names; with
nothing measured it keeps the op's own order (Triton first).
"""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Callable, Iterable, Optional, Sequence, Tuple

import torch

BACKENDS = ("triton", "cuda", "reference")
ENV_VAR = "KFUSED_BACKEND"
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class BackendError(ValueError):
    """The requested backend cannot run these inputs (the message says why)."""


def triton_interpret() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``), read as
    Triton reads it: "false", "off" or "2" leave the interpreter off, and then kernels on CPU
    tensors cannot run."""
    value = os.environ.get("TRITON_INTERPRET", "0")
    if value in ("", "0", "1"):
        return value == "1"
    try:  # Triton >= 3.4 takes 1/true/yes/on/y in any case; before, "1" only
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except Exception:
        return False


_TRITON_IMPORT: list = []


def _triton_import_error() -> Optional[str]:
    if not _TRITON_IMPORT:  # checked once; a plain list keeps torch.compile tracing quiet
        try:
            import triton  # noqa: F401
            import triton.language  # noqa: F401

            _TRITON_IMPORT.append(None)
        except Exception as exc:  # pragma: no cover - depends on the install
            _TRITON_IMPORT.append(f"triton is not importable ({exc})")
    return _TRITON_IMPORT[0]


def _version(text: str) -> Tuple[int, ...]:
    """(major, minor) of a version string such as "3.6.0" or "2.4.0rc1"."""
    return tuple(int(m.group()) if m else 0
                 for m in (re.match(r"\d+", piece) for piece in text.split(".")[:2]))


_INTERPRETER_CHECK: list = []


def _interpreter_unfit() -> Optional[str]:
    """Why the Triton CPU interpreter of this install cannot run kfused's kernels (None if it
    can). Triton before 3.7 converts a runtime loop bound with ``int()`` of a one-element
    array, which numpy 2.4 made an error: every kernel with a ``range`` over a runtime size
    fails inside the interpreter ("only 0-dimensional arrays can be converted to Python
    scalars")."""
    if not _INTERPRETER_CHECK:  # checked once
        import numpy
        import triton

        reason = None
        if _version(triton.__version__) < (3, 7) and _version(numpy.__version__) >= (2, 4):
            reason = (f"the Triton {triton.__version__} CPU interpreter cannot run loops over "
                      f"runtime sizes with numpy {numpy.__version__}; install 'numpy<2.4' or "
                      "triton>=3.7 (compiled Triton on a GPU is not affected)")
        _INTERPRETER_CHECK.append(reason)
    return _INTERPRETER_CHECK[0]


def triton_unfit(device: torch.device, dtype: torch.dtype) -> Optional[str]:
    """Why the Triton backend cannot run tensors of this device/dtype (None if it can)."""
    err = _triton_import_error()
    if err:
        return err
    if device.type == "cpu" and triton_interpret():
        err = _interpreter_unfit()
        if err:
            return err
    if device.type == "cpu" and triton_interpret() and dtype == torch.float64:
        return None  # interpreter only: lets gradcheck run the kernels' autograd path
    if dtype not in FUSED_DTYPES:
        return f"dtype {dtype} is not one of float32, float16, bfloat16"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and triton_interpret():
        if dtype == torch.bfloat16:
            return "the Triton CPU interpreter mishandles bfloat16; run bfloat16 on a GPU"
        return None
    return (f"tensors are on {device}; Triton runs on CUDA devices "
            "(or on the CPU with TRITON_INTERPRET=1)")


def cuda_unfit(device: torch.device, dtype: torch.dtype, op: str,
               check_device: bool = False) -> Optional[str]:
    """Why the CUDA C++ extension cannot run this op on these tensors (None if it can).
    ``check_device``: also whether ``device`` exists here (a query by device name, not by
    tensors that are on it: :func:`available_backends`)."""
    from kfused import cuda as _cuda

    err = _cuda.unavailable_reason(op)
    if err:
        return err
    if device.type != "cuda":
        return f"tensors are on {device}; the CUDA extension needs CUDA tensors"
    if dtype not in FUSED_DTYPES:
        return f"dtype {dtype} is not one of float32, float16, bfloat16"
    if check_device:
        err = _no_cuda_device(device)
        if err:
            return err
    return _cuda_arch_unfit(device)


def _no_cuda_device(device: torch.device) -> Optional[str]:
    """Why the CUDA ``device`` does not exist on this machine (None if it does)."""
    if not torch.cuda.is_available():
        return ("no CUDA device is available here (torch.cuda.is_available() is False: no "
                "GPU, no driver, or a CPU-only torch)")
    n = torch.cuda.device_count()
    if device.index is not None and device.index >= n:
        return f"{device} does not exist: this machine has {n} CUDA device(s)"
    return None


_ARCH_UNFIT: dict = {}       # device index -> reason or None, asked once per device


def _cuda_arch_unfit(device: torch.device) -> Optional[str]:
    """Why the extension's kernels have no image for this GPU (None if one runs): the build's
    sm_XY cubins run on compute capability X.Y' with Y' >= Y (no PTX is embedded)."""
    from kfused import cuda as _cuda

    archs = tuple(getattr(_cuda.extension(), "CUDA_ARCHS", ()) or ())
    if not archs:                                    # a build that does not say: not checked
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _ARCH_UNFIT:
        major, minor = torch.cuda.get_device_capability(index)
        runs = any(int(a) // 10 == major and int(a) % 10 <= minor for a in archs)
        _ARCH_UNFIT[index] = None if runs else (
            f"the CUDA extension was built for {', '.join(f'sm_{int(a)}' for a in archs)}, "
            f"which cannot run on this GPU (cuda:{index}, compute capability {major}.{minor}): "
            f"rebuild it with KFUSED_CUDA_ARCHS={major}{minor} (see setup.py)")
    return _ARCH_UNFIT[index]


def default_backend() -> str:
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value != "auto" and value not in BACKENDS:
        raise BackendError(
            f"{ENV_VAR}={value!r} is not a backend; expected one of auto, {', '.join(BACKENDS)}")
    return value


PREFS_ENV = "KFUSED_BACKEND_PREFS"
PREFS_WRITER = "kfused bench --write-prefs"
_PREFS: dict = {}            # {"path": the file read, "data": its contents}
_PACKAGE_PREFS: list = []    # [the package's file or None], looked up once


def prefs_path() -> Optional[str]:
    """The measured backend preferences in use: the file ``KFUSED_BACKEND_PREFS`` names, else
    the package's ``kfused/data/backend_prefs.json`` when one was committed (looked up once per
    process), else None."""
    path = os.environ.get(PREFS_ENV, "").strip()
    if path:
        return path
    if not _PACKAGE_PREFS:
        here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                            "backend_prefs.json")
        _PACKAGE_PREFS.append(here if os.path.exists(here) else None)
    return _PACKAGE_PREFS[0]


def load_prefs(path: str) -> dict:
    """Read a preferences file (``{"written_by": ..., "devices": {gpu name: {op: {regime:
    [backend, ...]}}}}``); a malformed one is an error naming the file."""
    try:
        with open(path) as f:
            data = json.load(f)
        devices = data["devices"]
        ok = isinstance(devices, dict) and all(
            isinstance(ops, dict) and all(isinstance(reg, dict) and all(
                isinstance(o, list) and all(b in BACKENDS for b in o) for o in reg.values())
                for reg in ops.values()) for ops in devices.values())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BackendError(f"backend preferences {path}: cannot be read ({exc})") from exc
    if not ok:
        raise BackendError(f"backend preferences {path}: expected {{'devices': {{gpu name: "
                           f"{{op: {{regime: [backend, ...]}}}}}}}} with backends from "
                           f"{BACKENDS}")
    return data


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def measured_order(op: str, device: torch.device, regime: str) -> Optional[Tuple[str, ...]]:
    """``op``'s backends fastest first in ``regime`` on this GPU model, as measured (see
    :func:`prefs_path`), or None when nothing was measured for it. The file is read once per
    path (a call costs a dict lookup; a process that rewrites it calls ``_PREFS.clear()``)."""
    path = prefs_path()
    if path is None or device.type != "cuda":
        return None
    if _PREFS.get("path") != path:
        data = load_prefs(path)
        _PREFS.clear()
        _PREFS.update(path=path, data=data)
    name = _device_name(device.index if device.index is not None
                        else torch.cuda.current_device())
    order = _PREFS["data"]["devices"].get(name, {}).get(op, {}).get(regime)
    return tuple(order) if order else None


def ordered(impls: Sequence[str], order: Optional[Sequence[str]]) -> Tuple[str, ...]:
    """``impls`` with those named in ``order`` first, in that order; the rest after, as given."""
    if not order:
        return tuple(impls)
    first = [n for n in order if n in impls]
    return tuple(first) + tuple(n for n in impls if n not in first)


# torch.library.register_autograd builds its autograd.Function without setup_context, which
# torch.func refuses (pytorch/pytorch#170834): under a transform the fused ops would fail
# inside torch with its generic message, so they are unfit there and "auto" takes reference
FUNCTORCH_UNFIT = ("a torch.func transform (grad, vjp, jacrev, vmap, ...) is active, and the "
                   "fused kernels' custom ops do not run under torch.func in this torch "
                   "(pytorch/pytorch#170834); backend='reference' (or 'auto') does")


def select_backend(
    op: str,
    requested: Optional[str],
    tensors: Sequence[torch.Tensor],
    *,
    impls: Iterable[str] = ("triton", "cuda"),
    extra_unfit: Optional[Callable[[str], Optional[str]]] = None,
    regime: Optional[str] = None,
) -> str:
    """Pick the backend that runs ``op`` on ``tensors``.

    impls: fused backends that implement ``op``, fastest first ("reference" always exists).
    extra_unfit: op-specific check, ``backend -> reason or None`` (e.g. a head width a kernel
    does not support).
    regime: the call's regime (e.g. "decode"); ``auto`` then takes ``impls`` in the order
    measured for it on this GPU model (:func:`measured_order`) when there is one.
    """
    impls = tuple(impls)
    requested = default_backend() if requested is None else str(requested).lower()
    if requested != "auto" and requested not in BACKENDS:
        raise BackendError(
            f"backend={requested!r} is not a backend; expected one of auto, {', '.join(BACKENDS)}")
    device, dtype = tensors[0].device, tensors[0].dtype

    def unfit(name: str) -> Optional[str]:
        if name == "reference":
            return None
        if name not in impls:
            return f"{op} has no {name} implementation"
        if torch._C._are_functorch_transforms_active():
            return FUNCTORCH_UNFIT
        reason = (triton_unfit(device, dtype) if name == "triton"
                  else cuda_unfit(device, dtype, op))
        if reason is None and extra_unfit is not None:
            reason = extra_unfit(name)
        return reason

    if requested != "auto":
        reason = unfit(requested)
        if reason is not None:
            raise BackendError(f"{op}: backend {requested!r} cannot run these inputs: {reason}")
        return requested
    if device.type != "cuda":
        return "reference"
    if regime is not None:
        impls = ordered(impls, measured_order(op, device, regime))
    for name in impls:
        if unfit(name) is None:
            return name
    return "reference"


def available_backends(op: str = "", device: str = "cuda",
                       dtype: torch.dtype = torch.float16) -> dict:
    """Map each backend to None (usable) or the reason it is not, for a device/dtype (a
    CUDA device this machine does not have is a reason for both fused backends)."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (e.g. torch.float16), got "
                        f"{type(dtype).__name__} {dtype!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a device (cpu, cuda, cuda:N): {exc}") from None
    # asked by name, the device may not exist here (a CUDA build of torch on a machine with
    # no GPU or driver: the extension's architecture check raised torch's "Found no NVIDIA
    # driver", and Triton was reported usable)
    return {
        "triton": triton_unfit(dev, dtype) or (_no_cuda_device(dev) if dev.type == "cuda"
                                               else None),
        "cuda": cuda_unfit(dev, dtype, op or "kron_matvec", check_device=True),
        "reference": None,
    }
