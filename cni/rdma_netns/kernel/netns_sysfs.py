"""Read sysfs as a pod's network namespace sees it.

In exclusive RDMA mode a device moved into a pod disappears from the host's
/sys/class/infiniband: sysfs shows the RDMA (and net) devices of the namespace that mounted it.
To read a pod device's GID table the plugin forks a child that enters a private mount
namespace, joins the pod's network namespace and mounts a fresh sysfs over /sys there (what
`ip netns exec` does). The parent's mounts and namespaces stay untouched.
"""

from __future__ import annotations

import posix

from rdma_netns.kernel import netns
from rdma_netns.util import jsonio

CLONE_NEWNS = 0x00020000
MS_REC, MS_PRIVATE = 0x4000, 0x40000

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable


def _enter_pod_sysfs(netns_fd: int) -> None:
    unshare, mount = netns.libc_function("unshare"), netns.libc_function("mount")
    if unshare(CLONE_NEWNS) != 0:
        raise OSError(netns.libc_errno(), "unshare(CLONE_NEWNS)")
    # Private propagation first, so the sysfs mounted below never shows up in the host.
    if mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise OSError(netns.libc_errno(), "make / private")
    netns.setns(netns_fd)
    if mount(b"sysfs", b"/sys", b"sysfs", 0, None) != 0:
        raise OSError(netns.libc_errno(), "mount sysfs")


def call_in_pod_view(netns_fd: int, func: Callable[[], object]) -> object:
    """Run `func` in a child that sees the pod's sysfs; return its JSON-able result.

    The child is bounded by `func` itself (callers pass a lookup with its own deadline)."""
    read_fd, write_fd = posix.pipe2(posix.O_CLOEXEC)
    pid = posix.fork()
    if pid == 0:  # child: never returns
        code = 0
        try:
            posix.close(read_fd)
            _enter_pod_sysfs(netns_fd)
            payload = {"ok": func()}
        except BaseException as exc:  # reported to the parent, which raises it there
            payload = {"error": f"{type(exc).__name__}: {exc}"}
            code = 1
        try:
            posix.write(write_fd, jsonio.dumps(payload).encode())
        finally:
            posix._exit(code)
    posix.close(write_fd)
    chunks = []
    try:
        while data := posix.read(read_fd, 65536):
            chunks.append(data)
    finally:
        posix.close(read_fd)
        posix.waitpid(pid, 0)
    try:
        answer = jsonio.loads(b"".join(chunks))
    except ValueError:
        raise OSError("the pod sysfs reader died without an answer") from None
    if "error" in answer:
        raise OSError(f"reading the pod's sysfs: {answer['error']}")
    return answer["ok"]
