"""Paths a network config names, used only where nobody but root can change them.

The plugin runs as root, but its config is not always written by root's equals (a Multus
NetworkAttachmentDefinition, a ConfigMap an operator edits). So a folder or FIFO the config names
(stateDir, podInfoDir, cdiSpecDir, eventsFifo) is used only when the walk from / to it finds, the
way OpenSSH's StrictModes and systemd's CHASE_SAFE walk a path:

- every folder on the way owned by root (or by the plugin's own user) and writable by nobody else,
  or sticky (like /tmp: others may add entries there, but not move or remove root's);
- every symlink on the way owned by root (followed, at most MAX_LINKS of them);
- the named folder itself a real folder (not a symlink) owned by root, writable by nobody else and
  not sticky; the named FIFO a FIFO owned by root with mode 0600, as rdma-netns-dp makes it.

What is missing at the end is fine: the plugin makes it when it first writes there, each folder
with the caller's mode whatever the umask, and checks by the same rule one that somebody else made
first. It never changes the mode or owner of a folder it did not make. A refusal raises Untrusted
(an OSError), whose text says which folder and why.

Nobody but root can change a folder that passed, so what passed once (a folder on the way, the
named folder or FIFO) is not looked at again by the same process: the CNI lives for one call. Standard library only, no os: the
CNI's hot path uses it (util/paths.py).
"""

from __future__ import annotations

import posix
from _stat import S_IFMT, S_ISDIR, S_ISFIFO, S_ISLNK, S_ISVTX

MAX_LINKS = 40  # Linux's own limit on symlinks in one lookup
OTHERS_WRITE = 0o022
FIFO_MODE = 0o600  # rdma_netns_dp.cni_events makes its FIFO so
_EUID = posix.geteuid()
_checked: set[str] = set()  # real paths of folders on the way that passed (see the docstring)
_real: dict[str, str] = {}  # a path as given -> the real path it led to, for folders that passed
_named: dict[str, posix.stat_result] = {}  # a named folder or FIFO that passed, as given: its lstat
_KINDS = {0o140000: "a socket", 0o120000: "a symlink", 0o100000: "a regular file", 0o060000: "a block device",
          0o040000: "a folder", 0o020000: "a character device", 0o010000: "a FIFO"}


class Untrusted(PermissionError):
    """A path the plugin refuses; str() says why."""


class Found:
    """Where a walk ended. `parent`: the real path of the last folder reached (checked);
    `missing`: the names below it that do not exist, the named one last ([] when it exists);
    `st`: the named path's lstat when it exists, else None."""

    __slots__ = ("parent", "missing", "st", "name")

    def __init__(self, parent: str, missing: list[str], st: posix.stat_result | None, name: str = "") -> None:
        self.parent, self.missing, self.st, self.name = parent, missing, st, name

    @property
    def path(self) -> str:
        """The real path of the named thing (when it exists)."""
        return _join(self.parent, self.name)


def forget() -> None:
    """Drop what this process has checked (tests that change modes between calls)."""
    _checked.clear()
    _real.clear()
    _named.clear()


def kind(st: posix.stat_result) -> str:
    return _KINDS.get(S_IFMT(st.st_mode), "an unknown file type")


def _join(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder != "/" else f"/{name}"


def _parts(path: str) -> list[str]:
    return [p for p in path.split("/") if p and p != "."]


def _owned(st: posix.stat_result) -> bool:
    return st.st_uid == 0 or st.st_uid == _EUID


def _owner(st: posix.stat_result) -> str:
    return f"belongs to uid {st.st_uid}, not root"


def _check_on_the_way(path: str, st: posix.stat_result) -> None:
    """A folder the walk passes through: root's, and nobody else can move what is in it."""
    if path in _checked:
        return
    if not S_ISDIR(st.st_mode):
        raise Untrusted(f"{path} is {kind(st)}, not a folder")
    if not _owned(st):
        raise Untrusted(f"{path} {_owner(st)}")
    if st.st_mode & OTHERS_WRITE and not st.st_mode & S_ISVTX:
        raise Untrusted(f"{path} is writable by group or others (mode {st.st_mode & 0o7777:o}): "
                        "they could put another folder in place of what is below it")
    _checked.add(path)


def walk(path: str) -> Found:
    """Follow the absolute `path` from /, checking each folder and symlink on the way. A prefix
    of `path` this process has walked before starts from where it led (no lstat again)."""
    if not path.startswith("/") or "\0" in path:
        raise Untrusted(f"{path!r} is not an absolute path")
    parts = _parts(path)
    real, first = "/", 0
    for k in range(len(parts) - 1, 0, -1):  # the named component itself is always looked at
        known = _real.get("/" + "/".join(parts[:k]))
        if known is not None:
            real, first = known, k
            break
    else:
        if "/" not in _checked:
            _check_on_the_way("/", posix.lstat("/"))
    # A stack of (name, i): i is the index in `parts` of an original component, -1 for a part of
    # a symlink's target; (None, i) marks where component i's symlink has been followed to its end.
    todo: list[tuple[str | None, int]] = [(parts[i], i) for i in range(len(parts) - 1, first - 1, -1)]
    links = 0
    while todo:
        name, i = todo.pop()
        if name is None:
            _real["/" + "/".join(parts[:i + 1])] = real
            continue
        if name == "..":  # only from a symlink's target: the config's own paths have none
            real = real.rpartition("/")[0] or "/"
            continue
        child = _join(real, name)
        try:
            st = posix.lstat(child)
        except FileNotFoundError:
            missing = [name] + [n for n, _j in reversed(todo) if n is not None]
            if ".." in missing:
                raise Untrusted(f"{path}: a symlink on the way leads through a missing folder") from None
            return Found(real, missing, None)
        if not todo:
            return Found(real, [], st, name)
        if S_ISLNK(st.st_mode):
            if not _owned(st):
                raise Untrusted(f"{child} is a symlink that {_owner(st)}")
            links += 1
            if links > MAX_LINKS:
                raise Untrusted(f"{path}: more than {MAX_LINKS} symlinks")
            target = posix.readlink(child)
            if target.startswith("/"):
                real = "/"
            if i >= 0:
                todo.append((None, i))
            todo.extend((n, -1) for n in reversed(_parts(target)))
            continue
        _check_on_the_way(child, st)
        real = child
        if i >= 0:
            _real["/" + "/".join(parts[:i + 1])] = child
    return Found("/", [], posix.lstat("/"), "")  # the path is / itself


def _passed(path: str, real: str) -> None:
    """The named folder passed (a stricter rule than on the way): later walks may pass through it."""
    _checked.add(real)
    _real["/" + "/".join(_parts(path))] = real


def _check_folder(path: str, st: posix.stat_result) -> None:
    """The named folder itself: stricter than one on the way (no symlink, not sticky)."""
    if S_ISLNK(st.st_mode):
        raise Untrusted(f"{path} is a symlink; name the folder it points to")
    if not S_ISDIR(st.st_mode):
        raise Untrusted(f"{path} is {kind(st)}, not a folder")
    if not _owned(st):
        raise Untrusted(f"{path} {_owner(st)}")
    mode = st.st_mode & 0o7777
    if mode & S_ISVTX:
        raise Untrusted(f"{path} is a sticky folder (mode {mode:o}) that others share, like /tmp; "
                        "name a folder of its own below it")
    if mode & OTHERS_WRITE:
        raise Untrusted(f"{path} is writable by group or others (mode {mode:o})")


def check_folder(path: str) -> bool:
    """True when the folder `path` exists and passes, False when it is missing (and every folder
    on the way to it passes); Untrusted otherwise."""
    if path in _named:
        return True
    found = walk(path)
    if found.st is None:
        return False
    _check_folder(path, found.st)
    _passed(path, found.path)
    _named[path] = found.st
    return True


def make_folder(path: str, mode: int) -> None:
    """Make the folder `path` and the missing ones on the way, each with `mode` (not filtered by
    the umask); check one somebody else made first by the same rule. Untrusted or OSError."""
    if path in _named:
        return
    found = walk(path)
    if found.st is not None:
        _check_folder(path, found.st)
        _passed(path, found.path)
        _named[path] = found.st
        return
    folder = found.parent
    for i, name in enumerate(found.missing):
        child = _join(folder, name)
        try:
            posix.mkdir(child, mode)
            made = True
        except FileExistsError:
            made = False
        st = posix.lstat(child)
        if made:
            if st.st_mode & 0o7777 != mode:
                posix.chmod(child, mode)  # ours, made a moment ago: the umask took some bits
        elif i == len(found.missing) - 1:
            _check_folder(child, st)
        else:
            _check_on_the_way(child, st)
        _checked.add(child)
        folder = child
    _passed(path, folder)


def check_fifo(path: str) -> posix.stat_result | None:
    """The lstat of the FIFO at `path` when it is one rdma-netns-dp made (root's, 0600, in
    folders that pass); None when nothing is there; Untrusted for anything else."""
    st = _named.get(path)
    if st is not None:
        return st
    st = walk(path).st
    if st is None:
        return None
    if not S_ISFIFO(st.st_mode):
        raise Untrusted(f"{path} is {kind(st)}, not the FIFO rdma-netns-dp makes")
    if not _owned(st):
        raise Untrusted(f"{path} is a FIFO that {_owner(st)}")
    if st.st_mode & 0o7777 != FIFO_MODE:
        raise Untrusted(f"{path} is a FIFO with mode {st.st_mode & 0o7777:o}, not {FIFO_MODE:o} as rdma-netns-dp makes it")
    _named[path] = st
    return st
