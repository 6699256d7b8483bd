"""Network namespaces: open a pod's namespace safely and run code inside it.

Python 3.11 has no os.setns, so setns(2) is called in libc. The plugin process is
single-threaded, so switching the calling thread switches everything it opens afterwards
(netlink sockets, /proc/sys/net files).
"""

from __future__ import annotations

import fcntl
import posix

CLONE_NEWNET = 0x40000000
NS_GET_NSTYPE = 0xB703  # _IO(0xb7, 0x3)


def libc_function(name: str) -> object:
    """A libc function as a callable returning int, with errno captured (see libc_errno).

    Built on the C module `_ctypes` directly: `import ctypes` costs ~3.5 ms of start-up (it
    defines every C type), the two classes needed here ~1 ms. Falls back to ctypes.
    Arguments may be ints, bytes and None (pointers), which is all the callers pass.
    """
    try:
        import _ctypes

        class CInt(_ctypes._SimpleCData):
            _type_ = "i"

        class CFunction(_ctypes.CFuncPtr):
            _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
            _restype_ = CInt

        return CFunction(_ctypes.dlsym(_ctypes.dlopen(None), name))
    except (ImportError, AttributeError, OSError, TypeError):  # pragma: no cover - other Pythons
        import ctypes

        return getattr(ctypes.CDLL(None, use_errno=True), name)


def libc_errno() -> int:
    import _ctypes

    return _ctypes.get_errno()


_setns = None  # libc's setns(2), resolved on first use (load_setns): ~0.3 ms of a cold process


def load_setns() -> object:
    global _setns
    if _setns is None:
        _setns = libc_function("setns")
    return _setns


class NotANetns(Exception):
    """The path exists but is not a network namespace."""


def open_netns(path: str) -> int:
    """Open `path` as a network namespace fd; FileNotFoundError if gone, NotANetns if not one."""
    # O_NONBLOCK: a FIFO (or a device) given as the netns must not block the open; nsfs ignores it.
    fd = posix.open(path, posix.O_RDONLY | posix.O_CLOEXEC | posix.O_NOCTTY | posix.O_NONBLOCK)
    try:
        kind = fcntl.ioctl(fd, NS_GET_NSTYPE)
    except OSError:
        posix.close(fd)
        raise NotANetns(path) from None
    if kind != CLONE_NEWNET:
        posix.close(fd)
        raise NotANetns(path)
    return fd


def setns(fd: int) -> None:
    if load_setns()(fd, CLONE_NEWNET) != 0:  # type: ignore[operator]
        err = libc_errno()
        raise OSError(err, f"setns: {posix.strerror(err)}")


def current_netns_fd() -> int:
    return posix.open("/proc/thread-self/ns/net", posix.O_RDONLY | posix.O_CLOEXEC)


class inside:  # noqa: N801 - used like a function: `with netns.inside(fd):`
    """Run the block inside the namespace `netns_fd`, then return to where we were."""

    def __init__(self, netns_fd: int) -> None:
        self.target = netns_fd
        self.home = -1

    def __enter__(self) -> None:
        self.home = current_netns_fd()
        try:
            setns(self.target)
        except BaseException:
            posix.close(self.home)
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            setns(self.home)
        finally:
            posix.close(self.home)


def same_netns(fd_a: int, fd_b: int) -> bool:
    a, b = posix.fstat(fd_a), posix.fstat(fd_b)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


NETNS_RUN_DIR = "/var/run/netns"


def _ns_id(path: str) -> tuple[int, int] | None:
    try:
        st = posix.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _listdir(path: str) -> list[str]:
    try:
        return sorted(posix.listdir(path))
    except OSError:
        return []


def _comm(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def other_namespaces(run_dir: str = NETNS_RUN_DIR) -> list[str]:
    """Every network namespace other than init_net (PID 1's), described for a person: named ones
    from /var/run/netns first, then any other one some task is in. These are what make an RDMA
    netns mode change fail with EBUSY."""
    init = _ns_id("/proc/1/ns/net")
    if init is None:
        return []
    found: dict[tuple[int, int], str] = {}
    for name in _listdir(run_dir):
        ns = _ns_id(f"{run_dir}/{name}")
        if ns and ns[0] == init[0] and ns != init:  # same st_dev: an nsfs inode, not a stale file
            found.setdefault(ns, f"{name} ({run_dir}/{name})")
    for pid in filter(str.isdigit, _listdir("/proc")):
        for tid in _listdir(f"/proc/{pid}/task"):
            ns = _ns_id(f"/proc/{pid}/task/{tid}/ns/net")
            if ns and ns != init and ns not in found:
                found[ns] = f"net:[{ns[1]}] (pid {pid} {_comm(pid)})"
    return list(found.values())
