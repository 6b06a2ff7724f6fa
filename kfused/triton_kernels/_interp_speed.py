"""Two caches the Triton interpreter lacks (``TRITON_INTERPRET=1``, CPU): the tests turn them
on (tests/conftest.py), and so do the ``kfused check``, ``bench`` and ``demo`` commands in
their own process (kfused.cli.main); ``KFUSED_INTERP_SPEED=0`` leaves them off. Importing
kfused installs nothing. Nothing a kernel computes changes — only how often the interpreter
repeats work whose result it already has (``kfused check`` on a CPU: 1094 s -> 678 s, the same
698 rows to the digit).

1. **Nested @triton.jit calls.** Each call of a jit function from inside a kernel (Triton's
   own ``tl.sum``, ``tl.zeros``, ``tl.cdiv``; kfused's ``_mm``, ``_blk`` helpers) makes the
   interpreter patch ``triton.language`` again (``_patch_lang``: ``inspect.getmembers`` over
   the language modules, about 3 ms on CI's CPU), in every program of the grid. Within one
   launch nothing restores those patches before the launch ends (the nested calls' scopes
   are dropped; the launch's own scope is restored when its grid is done), and patching an
   already patched module leaves it as it was (its builtins are wrappers by then, no longer
   builtins, and the few attributes set directly get equivalent closures). So within a
   launch, a module set that is already patched is not patched again; the first nested call
   that needs another module (``tl.core``, which Triton's standard library sees) still
   patches it, as before, and that patch stays after the launch exactly as it did without
   this cache. Measured on this project's kernel tests (same seed, this CPU): test_krona's
   gradcheck / dx cases with test_headwise_section and test_inducer_decode 88.7 s -> 59.6 s;
   single files 12-19 % less.
2. **``_get_np_dtype``** built a 19-entry dict (hashing each language dtype) on every call,
   hundreds of thousands of times a test file: its answer is remembered per dtype (a block
   type's is its element type's, as in the interpreter; a dtype it refuses is asked again).

``install()`` returns False, changing nothing, where the interpreter lacks what this patches
(checked by name; written against Triton 3.6 and 3.9). ``uninstall()`` restores both.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
from typing import List

_installed: List[tuple] = []
_state = threading.local()


def supported() -> bool:
    try:
        from triton.runtime import interpreter as itp
    except ImportError:
        return False
    return all(callable(getattr(itp, n, None)) for n in ("_patch_lang", "_get_np_dtype")) \
        and all(hasattr(itp, n) for n in ("_LangPatchScope", "GridExecutor", "tl"))


def installed() -> bool:
    return bool(_installed)


def _lang_ids(fn, tl) -> frozenset:
    # the modules the interpreter's _patch_lang patches for fn: triton.language and/or
    # triton.language.core where fn's module sees them
    return frozenset(id(v) for v in list(fn.__globals__.values())
                     if inspect.ismodule(v) and (v is tl or v is tl.core))


class _LaunchScope:
    """The launch's own patch scope; its restore (at the end of the grid) ends the launch."""

    __slots__ = ("scope", "stack")

    def __init__(self, scope, stack):
        self.scope, self.stack = scope, stack

    def restore(self) -> None:
        try:
            self.scope.restore()
        finally:
            if self.stack:
                self.stack.pop()


def install() -> bool:
    """Turn both caches on for every later interpreted launch (idempotent); False where this
    Triton lacks what they patch."""
    if _installed:
        return True
    if not supported():
        return False
    from triton.runtime import interpreter as itp

    tl = itp.tl
    orig_patch, orig_dtype = itp._patch_lang, itp._get_np_dtype
    grid_executor, empty_scope = itp.GridExecutor, itp._LangPatchScope

    def _patch_lang(fn):
        stack = getattr(_state, "stack", None)
        if stack is None:
            stack = _state.stack = []
        caller = sys._getframe(1).f_locals.get("self")
        if isinstance(caller, grid_executor):
            # a launch: its scope is restored when its grid is done (see _LaunchScope)
            scope = orig_patch(fn)
            stack.append(set(_lang_ids(fn, tl)))
            return _LaunchScope(scope, stack)
        if stack:
            want = _lang_ids(fn, tl)
            if want <= stack[-1]:
                return empty_scope()           # already patched in this launch
            scope = orig_patch(fn)
            stack[-1] |= want
            return scope
        return orig_patch(fn)                  # a jit function called outside any launch

    memo: dict = {}
    block, ptr = tl.block_type, tl.pointer_type

    def _get_np_dtype(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, block) else tt_dtype
        if isinstance(key, ptr):
            return orig_dtype(key)             # answered before the dict is built (unhashable)
        found = memo.get(key)
        if found is None:
            found = memo[key] = orig_dtype(key)
        return found

    _installed.append((itp, "_patch_lang", orig_patch))
    itp._patch_lang = _patch_lang
    _installed.append((itp, "_get_np_dtype", orig_dtype))
    itp._get_np_dtype = _get_np_dtype
    return True


def install_unless_disabled() -> bool:
    """:func:`install`, unless ``KFUSED_INTERP_SPEED=0`` (then False, nothing changed)."""
    return os.environ.get("KFUSED_INTERP_SPEED", "1") != "0" and install()


def uninstall() -> None:
    while _installed:
        mod, name, orig = _installed.pop()
        setattr(mod, name, orig)
