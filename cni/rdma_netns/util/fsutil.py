"""Private files: 0700 folders, 0600 files, atomic replacement, no symlink following."""

from __future__ import annotations

import errno
import posix

from rdma_netns.util import jsonio, paths, trusted_paths


def ensure_private_dir(path: str) -> None:
    """Make `path` (and the folders missing on the way) 0700; an existing one is used only when
    nobody but root can change it, and its mode is left alone (util/trusted_paths.py)."""
    trusted_paths.make_folder(path, 0o700)


def make_daemon_folder(path: str) -> None:
    """The device-plugin daemon's own folder (its grants socket, the CNI events FIFO): 0700
    whatever made it (kubelet's hostPath DirectoryOrCreate makes it 0755), so only root reaches
    what is in it. Only a folder that passes trusted_paths is tightened: a shared one (sticky like
    /tmp, or writable by others) is refused, never taken away from whoever else uses it."""
    trusted_paths.make_folder(path, 0o700)
    if posix.lstat(path).st_mode & 0o7777 != 0o700:
        posix.chmod(path, 0o700)


def read_json(path: str) -> object | None:
    """The JSON in `path`, or None when it is missing, a symlink or unreadable garbage."""
    try:
        fd = posix.open(path, posix.O_RDONLY | posix.O_NOFOLLOW | posix.O_CLOEXEC)
    except OSError:
        return None
    try:
        with open(fd, "rb") as f:
            return jsonio.loads(f.read())
    except (OSError, ValueError):
        return None


def write_json_atomic(path: str, value: object) -> None:
    """Write `value` as JSON, 0600, atomically (see write_atomic)."""
    write_atomic(path, jsonio.dumps(value).encode())


def write_atomic(path: str, data: bytes, mode: int = 0o600, *, durable: bool = False,
                 like: posix.stat_result | None = None, tmp_path: str | None = None,
                 before_rename: object = None) -> None:
    """Write via a temporary file in the same folder and rename, so a reader sees the old or the
    new file, whole; the file gets `mode` (0600 unless it is meant to be read by others).

    The plugin's own files skip fsync: its state protects against a crash of the plugin process,
    and after a node reboot every pod namespace is gone anyway (a file truncated by power loss
    reads as missing). Files that belong to another program or restore one (the primary CNI's
    conflist and its backup, admin/cni_conf.py) ask for `durable`: fsync before the rename and of
    the folder after. `like` keeps an existing file's mode and owner; `tmp_path` names the
    temporary file (one the runtime never loads); `before_rename()` may raise to abandon the write
    (a concurrent writer won).
    """
    tmp = tmp_path or f"{path}.tmp.{posix.getpid()}"
    remove(tmp)  # left by a killed process that had our pid
    fd = posix.open(tmp, posix.O_WRONLY | posix.O_CREAT | posix.O_EXCL | posix.O_NOFOLLOW | posix.O_CLOEXEC, 0o600)
    try:
        with open(fd, "wb") as f:
            if like is not None:
                try:
                    posix.fchown(f.fileno(), like.st_uid, like.st_gid)
                except PermissionError:
                    pass
                posix.fchmod(f.fileno(), like.st_mode & 0o7777)
            elif mode != 0o600:
                posix.fchmod(f.fileno(), mode)  # O_CREAT's mode is filtered by the umask
            f.write(data)
            if durable:
                f.flush()
                posix.fsync(f.fileno())
        if before_rename is not None:
            before_rename()  # type: ignore[operator]
        posix.rename(tmp, path)
    except BaseException:
        try:
            posix.unlink(tmp)
        except OSError:
            pass
        raise
    if durable:
        fsync_dir(paths.dirname(path) or ".")


def fsync_dir(folder: str) -> None:
    """Make a rename in `folder` survive power loss."""
    fd = posix.open(folder, posix.O_RDONLY | posix.O_DIRECTORY | posix.O_CLOEXEC)
    try:
        posix.fsync(fd)
    finally:
        posix.close(fd)


def flock_polled(fd: int, deadline: float, max_delay: float) -> int | None:
    """Take an exclusive flock on `fd`, polling (LOCK_NB, then sleeps doubling from 1 ms up to
    `max_delay`) until the monotonic `deadline`, so a caller can give up instead of hanging a
    runtime. Returns how many tries failed before it was taken (0: at once). At the deadline
    it closes `fd` and returns None; on any other error it closes `fd` and raises. The plugin's
    lock files use it."""
    import fcntl  # here: a call that never locks does not load it
    import time

    failed, delay = 0, 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return failed
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                posix.close(fd)
                raise
        if time.monotonic() >= deadline:
            posix.close(fd)
            return None
        failed += 1
        time.sleep(delay)
        delay = min(delay * 2, max_delay)


def remove(path: str) -> None:
    try:
        posix.unlink(path)
    except FileNotFoundError:
        pass
