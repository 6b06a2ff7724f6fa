"""Writing files so that nothing is lost: a file kfused replaces is replaced whole or not at
all (shared by the CLI's reports, plots and preferences)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Callable


def replace_atomically(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` into a new file beside ``path``, then rename it over ``path``: an
    interrupted or failed write leaves the earlier file whole (never a partial one) and no
    temporary file behind."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".",
                               prefix="." + os.path.basename(path) + ".",
                               suffix=os.path.splitext(path)[1])
    os.close(fd)
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # the mode a plain open() gives, not mkstemp's 0600
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
