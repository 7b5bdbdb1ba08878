"""An inter-process lock for the files qjl caches under ``$QJL_CACHE_DIR`` (converted models, compiled C
extensions).

Every cache writer already writes aside and renames into place, so a reader never sees half a file; the lock
only stops two processes started together (pytest-xdist workers, tensor-parallel ranks, several servers) from
doing the same 20 s of work twice: the second waits, then finds the first one's result.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

__all__ = ["cache_lock"]

try:
    import fcntl
except ImportError:  # not POSIX: no lock, the write-aside-and-rename still keeps readers safe
    fcntl = None


@contextlib.contextmanager
def cache_lock(path):
    """Hold an exclusive advisory lock on ``path`` + ".lock" (created, and its folder too) while in the block.

    Where the lock file cannot be created (a read-only cache folder) or there is no ``fcntl``, the block runs
    unlocked: the callers' atomic renames make that safe, only possibly duplicated.
    """
    lock = Path(str(path) + ".lock")
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        fd = None
    if fd is None or fcntl is None:
        if fd is not None:
            os.close(fd)
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock
