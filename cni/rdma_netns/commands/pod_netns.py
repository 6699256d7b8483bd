"""Opening the pod's network namespace from CNI_NETNS (or the path the state recorded), and
refusing what is unsafe: the plugin's own namespace, a path that is not a network namespace."""

from __future__ import annotations

import posix
import stat

from rdma_netns.kernel import netns
from rdma_netns.spec.errors import INVALID_ENV, CniError


def open_pod_netns(path: str) -> int:
    try:
        fd = netns.open_netns(path)
    except FileNotFoundError:
        raise CniError(INVALID_ENV, f"CNI_NETNS {path} does not exist") from None
    except netns.NotANetns:
        raise CniError(INVALID_ENV, f"CNI_NETNS {path} is not a network namespace") from None
    except OSError as exc:
        raise CniError(INVALID_ENV, f"CNI_NETNS {path} cannot be opened: {exc.strerror}") from None
    return _refuse_own_netns(fd, path)


def _refuse_own_netns(fd: int, path: str) -> int:
    """A pod namespace is never the plugin's own: pod-side work there would hit host interfaces."""
    home = netns.current_netns_fd()
    try:
        if netns.same_netns(fd, home):
            posix.close(fd)
            raise CniError(INVALID_ENV, f"CNI_NETNS {path} is the plugin's own (host) namespace")
    finally:
        posix.close(home)
    return fd


def open_pod_netns_if_alive(path: str, strict: bool = True) -> int | None:
    """For teardown: the pod namespace if it still exists, else None (its links went with it).

    Refused, as on ADD and saying why: the plugin's own namespace (teardown there would delete
    host interfaces that happen to carry a pod-side name) and a path that is something else than
    a network namespace (a directory, a FIFO, another kind of namespace, a file with content).
    An empty regular file is a netns mount point whose namespace the runtime already unmounted:
    gone, like a missing path. strict=False (a path the state recorded at ADD, when it was a
    netns): whatever is there now, the pod's namespace is gone."""
    if not path:
        return None
    try:
        fd = netns.open_netns(path)
    except netns.NotANetns:
        if not strict or _is_empty_file(path):
            return None
        raise CniError(INVALID_ENV, f"CNI_NETNS {path} is not a network namespace; DEL refuses to tear down "
                       "through it") from None
    except OSError:
        return None
    return _refuse_own_netns(fd, path)


def _is_empty_file(path: str) -> bool:
    """An empty regular file outside nsfs (namespace files look like empty files too)."""
    try:
        st = posix.stat(path)
        nsfs = posix.stat("/proc/thread-self/ns/net").st_dev
    except OSError:
        return True
    return stat.S_ISREG(st.st_mode) and st.st_size == 0 and st.st_dev != nsfs
