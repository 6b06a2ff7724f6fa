"""Writing files so that nothing is lost: a file kfused replaces is replaced whole or not at
all (shared by the CLI's reports, plots and preferences)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Callable, Optional


def folder_refusal(path) -> Optional[str]:
    """Why a command cannot write its files into the folder ``path`` (None if it can): it is
    not a directory, or it does not exist and cannot be made because its nearest existing
    parent is not a directory (a file, a dangling link) or is not writable. Asked before the
    work, so a run never fails on its output folder after it (a traceback, the work lost)."""
    path = os.fspath(path)
    if not path:  # os.makedirs('') fails; joined names would land in the working directory
        return "'' names no folder"
    if os.path.lexists(path):
        if not os.path.isdir(path):
            return f"{path} exists and is not a directory"
        parent = path
    else:
        parent = os.path.dirname(os.path.abspath(path))
        while not os.path.lexists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            return f"{path} cannot be made: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{path} cannot be written: {parent} is not writable"
    return None


def _temp_beside(path: str) -> str:
    """A new empty temporary file in ``path``'s folder (a hidden name of its own, so a rename
    or link from it stays on one filesystem), with the mode a plain ``open()`` would give
    (not mkstemp's 0600)."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".",
                               prefix="." + os.path.basename(path) + ".",
                               suffix=os.path.splitext(path)[1])
    os.close(fd)
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    return tmp


def replace_atomically(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` into a new file beside ``path``, then rename it over ``path``: an
    interrupted or failed write leaves the earlier file whole (never a partial one) and no
    temporary file behind."""
    path = os.fspath(path)
    tmp = _temp_beside(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def free_stem(folder, stem: str, suffixes, start: int = 1) -> str:
    """The first of ``<stem>`` (when ``start`` is 1), ``<stem>-2``, ``<stem>-3``, ... under
    which no file or link with any of ``suffixes`` exists in ``folder``."""
    for i in range(start, 1000):
        name = stem + (f"-{i}" if i > 1 else "")
        if not any(os.path.lexists(os.path.join(folder, name + x)) for x in suffixes):
            return name
    raise FileExistsError(f"kfused: {folder} holds {stem}-{max(start, 2)} to {stem}-999")


def new_results_file(out_dir, stem: str, text: str) -> Path:
    """Write ``text`` to a new ``<stem>.json`` in ``out_dir`` (``<stem>-2.json``, ... when a
    file of that name or its ``.png`` is there: another run in the same second, or a file
    kfused did not write; kfused never overwrites either), whole or not at all
    (:func:`write_new`: a failed write, a full disk, leaves no partial file under a results
    name). Returns its path; the plot goes beside it as ``path.with_suffix(".png")``."""
    out_dir = Path(out_dir)
    for _ in range(1000):   # a name taken between the look and the write: the next one
        path = out_dir / (free_stem(out_dir, stem, (".json", ".png")) + ".json")
        if write_new(path, lambda tmp: Path(tmp).write_text(text)):
            return path
    raise FileExistsError(f"kfused: no free name for {stem}.json in {out_dir}")


def write_new(path, write: Callable[[str], None]) -> bool:
    """``write(tmp)`` into a temporary file beside ``path``, then link it in as ``path`` if
    nothing is there: True; False (and nothing written) when a file or link holds the name,
    e.g. one that appeared during a long run after its names were chosen. Never over a file,
    never through a link, never a partial file under ``path``."""
    path = os.fspath(path)
    tmp = _temp_beside(path)
    try:
        write(tmp)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:     # no hard links here: only if the name is still free
            if os.path.lexists(path):
                return False
            os.replace(tmp, path)
        return True
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def sha256_file(path) -> str:
    """The hex SHA-256 of the file at ``path`` (read in 1 MiB pieces)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
