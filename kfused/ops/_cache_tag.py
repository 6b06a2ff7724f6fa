"""A source stamp in torch.compile's cache keys.

torch.compile's caches (FX graph, AOTAutograd) key a graph on its ops' names and schemas, not
on what a custom op's fake (meta) function computes. When kfused changes an op's output shapes
without changing its schema (the per-head rank-space width of ``headwise_qkv``, stop 33), a warm
inductor cache reuses a graph compiled for the old shapes: seen as ``AssertionError: expected
size 6==6, stride 8==16`` from ``assert_size_stride`` in the cached graph, and with shapes that
happen to agree it could read the wrong columns. On import kfused appends a hash of its op and
kernel sources to ``torch.compiler.config.cache_key_tag`` (after any tag of the user's), so a
graph compiled against other kfused sources is never reused; graphs without kfused ops are
recompiled once per kfused source change.
"""

from __future__ import annotations

import hashlib
import os
from typing import Iterable

_PREFIX = "kfused-"
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what an op's shapes, strides and kernels come from
_FOLDERS = ("ops", "triton_kernels", "cuda", "reference")


def source_hash(root: str = _PACKAGE, folders: Iterable[str] = _FOLDERS) -> str:
    """16 hex digits of SHA-256 over the .py files of ``folders`` under ``root`` (names and
    contents, in sorted order)."""
    h = hashlib.sha256()
    for folder in folders:
        base = os.path.join(root, folder)
        if not os.path.isdir(base):
            continue
        for name in sorted(os.listdir(base)):
            if name.endswith(".py"):
                h.update(f"{folder}/{name}\0".encode())
                with open(os.path.join(base, name), "rb") as f:
                    h.update(f.read())
                h.update(b"\0")
    return h.hexdigest()[:16]


def tagged(tag: str, stamp: str) -> str:
    """``tag`` with ``kfused-<stamp>`` as its last part (an earlier kfused stamp replaced)."""
    parts = [p for p in tag.split("+") if p and not p.startswith(_PREFIX)]
    return "+".join(parts + [_PREFIX + stamp])


def install() -> None:
    try:
        import torch.compiler.config as cconfig
    except ImportError:  # a torch without torch.compiler.config has no such key
        return
    if hasattr(cconfig, "cache_key_tag"):
        cconfig.cache_key_tag = tagged(cconfig.cache_key_tag or "", source_hash())
