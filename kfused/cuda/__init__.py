"""Loader for the compiled CUDA C++ extension (``kfused._C``, built from csrc/ by setup.py).

The extension is optional: without a CUDA toolkit and a CUDA build of torch the package still
installs and :func:`unavailable_reason` explains why the ``cuda`` backend cannot be used.
"""

from __future__ import annotations

from typing import Optional


_LOADED: list = []


def _load():
    if not _LOADED:  # once per process; a plain list keeps torch.compile tracing quiet
        try:
            from kfused import _C  # type: ignore[attr-defined]

            _LOADED.append((_C, None))
        except Exception as exc:
            _LOADED.append((None, "the CUDA extension kfused._C is not built "
                                  f"({exc.__class__.__name__}: {exc})"))
    return _LOADED[0]


def extension():
    """The compiled module, or None."""
    return _load()[0]


# ops the extension runs with the kernels of others (name -> the kernels' op names)
_COMPOSED = {"krona_linear": ("krona_fold", "kron_matvec")}
# kernels the extension defines without a backward (`<op>_fwd` only; every other needs both)
_FORWARD_ONLY = ("krona_fold", "inducer_attention")


def unavailable_reason(op: str = "") -> Optional[str]:
    """None when the extension is loaded and implements ``op`` (its ``<op>_fwd`` and, unless
    the kernel is forward-only, ``<op>_bwd``); else the reason."""
    mod, err = _load()
    if mod is None:
        return err
    for part in _COMPOSED.get(op, (op,) if op else ()):
        for fn in (f"{part}_fwd",) + (() if part in _FORWARD_ONLY else (f"{part}_bwd",)):
            if not hasattr(mod, fn):
                return (f"the CUDA extension has no {fn} (kernel for {part}); it was built "
                        "from other sources than this kfused: rebuild it")
    return None


def require(op: str):
    """The compiled module for a custom op that runs ``op``; RuntimeError with the reason when
    it is not built or lacks ``op``'s kernels (the ops only call it after backend selection
    found the extension)."""
    reason = unavailable_reason(op)
    if reason:
        raise RuntimeError(reason)
    return extension()
