"""The os.path pieces the CNI hot path uses, on `posix` alone.

`import os` costs ~1 ms of a cold interpreter (mostly its _collections_abc), a tenth of a whole
not-granted ADD, so the modules a pod event runs import `posix` and these instead. Each function
answers as posixpath's does for str paths (tests/unit/test_paths.py holds them to it).
"""

from __future__ import annotations

import posix
from _stat import S_ISDIR, S_ISLNK, S_ISREG


def join(first: str, *rest: str) -> str:
    path = first
    for part in rest:
        if part.startswith("/"):
            path = part
        elif not path or path.endswith("/"):
            path += part
        else:
            path += "/" + part
    return path


def dirname(path: str) -> str:
    head = path[:path.rfind("/") + 1]
    if head and head != "/" * len(head):
        head = head.rstrip("/")
    return head


def basename(path: str) -> str:
    return path[path.rfind("/") + 1:]


def _mode(path: str, follow: bool = True) -> int | None:
    try:
        return (posix.stat(path) if follow else posix.lstat(path)).st_mode
    except (OSError, ValueError):
        return None


def exists(path: str) -> bool:
    return _mode(path) is not None


def lexists(path: str) -> bool:
    return _mode(path, follow=False) is not None


def isdir(path: str) -> bool:
    mode = _mode(path)
    return mode is not None and S_ISDIR(mode)


def isfile(path: str) -> bool:
    mode = _mode(path)
    return mode is not None and S_ISREG(mode)


def islink(path: str) -> bool:
    mode = _mode(path, follow=False)
    return mode is not None and S_ISLNK(mode)


def makedirs(path: str, mode: int = 0o777) -> None:
    """os.makedirs(path, mode, exist_ok=True): the missing folders, the last with `mode` and those
    above it with 0o777 (both filtered by the umask, as os.makedirs does); something other than
    a folder in the way raises FileExistsError."""
    try:
        posix.mkdir(path, mode)
    except FileNotFoundError:
        parent = dirname(path.rstrip("/"))
        if not parent or parent == path:
            raise
        makedirs(parent)
        try:
            posix.mkdir(path, mode)
        except FileExistsError:
            if not isdir(path):
                raise
    except FileExistsError:
        if not isdir(path):
            raise
