"""Permissions for exports written through `tempfile` and renamed into place.

tempfile.mkstemp / mkdtemp create 0600 files and 0700 directories, so an export renamed into place from one would
stay unreadable to other users and to an inference server. `chmod_like_new` gives such a path the mode open() or
os.mkdir() would have given it (as transformers' save_pretrained does): 0o666 (files) or 0o777 (directories)
minus the process umask.
"""
from __future__ import annotations

import os
import threading

_UMASK_LOCK = threading.Lock()


def umask() -> int:
    """The process umask. os.umask can only be read by setting it: it is set to 0o077 for the instant before it is
    restored, so a file another thread creates meanwhile is at worst private, never more open than intended; the
    lock keeps two callers from restoring each other's temporary value."""
    with _UMASK_LOCK:
        current = os.umask(0o077)
        os.umask(current)
    return current


def chmod_like_new(path: str | os.PathLike) -> None:
    """Give the file or directory `path` the mode a newly created one gets under the current umask."""
    base = 0o777 if os.path.isdir(path) else 0o666
    os.chmod(path, base & ~umask())
