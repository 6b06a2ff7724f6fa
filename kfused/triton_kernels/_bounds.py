"""A bounds check for Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``).

While it is on, every load, store and atomic that a kernel issues with its mask true must fall
inside the memory spanned by one of that launch's tensor arguments (a tensor's span: from its
first element to the last byte of its last one, as its shape and strides place them). An
access outside every span raises ``BoundsError`` naming the kernel, the program id, the kind of
access and where the first stray address lies against the nearest argument. A tensor that is
a view into a larger buffer counts only its own span: a write past it would land in a
neighbour's memory, which a GPU does not report and the NaN poisoning of outputs does not see.

What it cannot see: an access that stays inside a tensor's span but falls in a gap of a
strided view, or inside the span of the wrong argument. The compiled kernels on a GPU are the
same programs, so a clean run here says the same of them for the shapes and block sizes that
ran (the tests also run the GPU's block sizes in the interpreter: tests/test_gpu_configs.py).

It patches Triton's interpreter (``triton.runtime.interpreter``: the builder's masked load,
masked store and atomics, and the grid executor that copies the arguments), written against
Triton 3.6 and 3.9; :func:`supported` says whether this Triton has what it patches.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, List, Optional, Tuple

import numpy as np

_state = threading.local()
_installed: List[Tuple[type, str, object]] = []


class BoundsError(RuntimeError):
    """A kernel in the interpreter accessed memory outside its tensor arguments."""


class _Arg:
    __slots__ = ("name", "start", "end", "desc")

    def __init__(self, name: str, start: int, end: int, desc: str):
        self.name, self.start, self.end, self.desc = name, start, end, desc


def _span(t) -> Optional[Tuple[int, int]]:
    if t.numel() == 0:
        return None
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + (last + 1) * t.element_size()


def _collect(name: str, value, out: List[_Arg], unwrap) -> None:
    if isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            _collect(f"{name}[{i}]", v, out, unwrap)
        return
    if not hasattr(value, "data_ptr"):
        return
    t = unwrap(value)
    span = _span(t)
    if span is not None:
        out.append(_Arg(name, span[0], span[1],
                        f"shape {tuple(t.shape)}, stride {tuple(t.stride())}, {t.dtype}"))


class _Launch:
    def __init__(self, kernel: str):
        self.kernel = kernel
        self.args: List[_Arg] = []
        self.lo = self.hi = None        # the disjoint union of the spans, sorted

    def set_args(self, args: List[_Arg]) -> None:
        self.args = args
        merged: List[List[int]] = []
        for a in sorted(args, key=lambda a: a.start):
            if merged and a.start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], a.end)
            else:
                merged.append([a.start, a.end])
        self.lo = np.array([m[0] for m in merged], dtype=np.uint64)
        self.hi = np.array([m[1] for m in merged], dtype=np.uint64)

    def check(self, kind: str, ptrs, mask, builder) -> None:
        if self.lo is None:
            return                       # the arguments were not seen (not a GridExecutor launch)
        addr = np.asarray(ptrs.data, dtype=np.uint64)
        if mask is not None:
            addr = addr[np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)]
        else:
            addr = addr.reshape(-1)
        if addr.size == 0:
            return
        size = np.uint64(max(1, ptrs.get_element_ty().primitive_bitwidth // 8))
        first, last = addr.min(), addr.max() + size
        i = int(np.searchsorted(self.lo, first, side="right")) - 1
        if i >= 0 and last <= self.hi[i]:
            return                       # all inside one span: the usual case
        j = np.searchsorted(self.lo, addr, side="right").astype(np.int64) - 1
        inside = (j >= 0) & (addr + size <= self.hi[np.maximum(j, 0)])
        if inside.all():
            return
        self._fail(kind, addr[~inside], int(addr.size), int(size), builder)

    def _fail(self, kind, stray, total, size, builder) -> None:
        a = int(stray[0])
        where = "no tensor argument"
        if self.args:
            def gap(arg):
                return arg.start - a if a < arg.start else max(0, a + size - arg.end)
            near = min(self.args, key=gap)
            if a < near.start:
                rel = f"{near.start - a} bytes before the start of"
            else:
                rel = f"{a + size - near.end} bytes past the end of"
            where = f"{rel} argument '{near.name}' ({near.desc})"
        pid = getattr(builder, "grid_idx", None)
        raise BoundsError(
            f"kernel {self.kernel} (program id {pid}): {len(stray)} of {total} {kind} "
            f"addresses ({size}-byte elements) fall outside every tensor argument of the launch; "
            f"the first, {a:#x}, is {where}")


def _current() -> Optional[_Launch]:
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


def supported() -> bool:
    try:
        from triton.runtime import interpreter as itp
    except ImportError:
        return False
    b, g = getattr(itp, "InterpreterBuilder", None), getattr(itp, "GridExecutor", None)
    return (b is not None and g is not None
            and all(hasattr(b, n) for n in ("create_masked_load", "create_masked_store",
                                           "create_atomic_rmw", "create_atomic_cas"))
            and all(hasattr(g, n) for n in ("__call__", "_init_args_hst"))
            and hasattr(itp, "_unwrap_tensor"))


def installed() -> bool:
    return bool(_installed)


def install() -> bool:
    """Turn the check on for every later interpreted launch; False where this Triton lacks
    what it patches. Idempotent."""
    if _installed:
        return True
    if not supported():
        return False
    from triton.runtime import interpreter as itp

    B, G, unwrap = itp.InterpreterBuilder, itp.GridExecutor, itp._unwrap_tensor

    def patch(cls, name, make):
        orig = getattr(cls, name)
        _installed.append((cls, name, orig))
        setattr(cls, name, make(orig))

    def checked(kind, ptr_at, mask_at):
        def make(orig):
            def wrapper(self, *args):
                launch = _current()
                if launch is not None:
                    mask = args[mask_at] if mask_at is not None else None
                    launch.check(kind, args[ptr_at], mask, self)
                return orig(self, *args)
            return wrapper
        return make

    patch(B, "create_masked_load", checked("load", 0, 1))       # (ptrs, mask, other, ...)
    patch(B, "create_masked_store", checked("store", 0, 2))     # (ptrs, value, mask, ...)
    patch(B, "create_atomic_rmw", checked("atomic", 1, 3))      # (op, ptr, val, mask, ...)
    patch(B, "create_atomic_cas", checked("atomic", 0, None))   # (ptr, cmp, val, ...)

    def make_call(orig):
        def __call__(self, *args, **kwargs):
            stack = getattr(_state, "stack", None)
            if stack is None:
                stack = _state.stack = []
            stack.append(_Launch(getattr(self.fn, "__name__", repr(self.fn))))
            try:
                return orig(self, *args, **kwargs)
            finally:
                stack.pop()
        return __call__

    def make_init(orig):
        def _init_args_hst(self, args_dev, kwargs):
            args_hst, kwargs_hst = orig(self, args_dev, kwargs)
            launch = _current()
            if launch is not None:
                found: List[_Arg] = []
                names = list(self.arg_names)
                for i, v in enumerate(args_hst):
                    _collect(names[i] if i < len(names) else f"#{i}", v, found, unwrap)
                for k, v in kwargs_hst.items():
                    _collect(k, v, found, unwrap)
                launch.set_args(found)
            return args_hst, kwargs_hst
        return _init_args_hst

    patch(G, "__call__", make_call)
    patch(G, "_init_args_hst", make_init)
    return True


def uninstall() -> None:
    while _installed:
        cls, name, orig = _installed.pop()
        setattr(cls, name, orig)


@contextlib.contextmanager
def bounds_checked() -> Iterator[bool]:
    """Within the block, interpreted launches are bounds-checked (yields False where this
    Triton cannot be patched; the block then runs unchecked)."""
    was = installed()
    ok = install()
    try:
        yield ok
    finally:
        if not was:
            uninstall()
