"""A pod's GID-producing changes go to all its rails in lockstep, under one node-wide lock.

Why: the kernel puts a new GID in the first free slot of each RDMA device's table. Pods whose
addresses reach every rail in the same order therefore get the same GID index on every rail
whenever the tables have the same layout, and a training framework can use one index
(NCCL_IB_GID_INDEX) for all of them. Three things break that order:
- concurrent ADDs of different pods interleaving per rail (pod a first on rail 0, pod b first on rail 1);
- concurrent DELs freeing slots on one rail before and on another after an ADD fills them;
- a rail's IPv6 link-local address (a GID too) appearing asynchronously after its link goes up,
  sometimes after the pod's own address. Rail interfaces have one unless "linkLocal": false
  (addressing.prepare_sysctls); ADD waits for it whenever the kernel will make one.
So ADD takes <stateDir>/locks/gid-order (flock, polled like state.AttachmentLock) for a short
critical section: every rail's link up, the link-local addresses awaited, every rail's addresses
added, their GIDs awaited; DEL takes it around deleting the pod's links. The kernel's GID work
queue is ordered, so changes made under the lock land in the tables in that order.

The order is an optimisation: the published per-rail indexes are read back from the tables, so
a caller that cannot get the lock in time goes on without it (saying so) instead of failing.
"""

from __future__ import annotations

import posix
import sys
import time
from _socket import AF_INET6

from rdma_netns.kernel import rtnl, sysctl
from rdma_netns.kernel.netlink import NetlinkSocket
from rdma_netns.util import fsutil

LOCK_FOLDER = "locks"      # state.LOCKS: a reserved name, never a network's folder
LOCK_NAME = "gid-order"    # no ':' in it, so GC's sweep of attachment locks leaves it alone


class Lockstep:
    """`with Lockstep(state_dir, timeout, active):` holds the node-wide GID order lock.

    The file is never unlinked (a fixed name, one per state folder), so there is no unlink race;
    the kernel drops the flock of a killed holder. `active` False (no rail has an RDMA device):
    a no-op. `waited`: seconds spent waiting, or None when it went on without the lock.
    """

    __slots__ = ("path", "folder", "timeout", "active", "fd", "waited")

    def __init__(self, state_dir: str, timeout: float, active: bool = True) -> None:
        self.folder = f"{state_dir}/{LOCK_FOLDER}"
        self.path = f"{self.folder}/{LOCK_NAME}"
        self.timeout, self.active = timeout, active
        self.fd = -1
        self.waited: float | None = None

    def __enter__(self) -> Lockstep:
        if not self.active:
            return self
        start = time.monotonic()
        try:
            fsutil.ensure_private_dir(self.folder)
            fd = posix.open(self.path, posix.O_RDWR | posix.O_CREAT | posix.O_NOFOLLOW | posix.O_CLOEXEC, 0o600)
        except OSError as exc:
            _log(f"cannot open {self.path} ({exc.strerror or exc}): GID indexes may differ between rails")
            return self
        if fsutil.flock_polled(fd, start + self.timeout, 0.02) is None:  # fd closed
            _log(f"another call held {self.path} for {self.timeout:.1f} s; going on without it: "
                 "GID indexes may differ between rails")
            return self
        self.fd = fd
        self.waited = time.monotonic() - start
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            posix.close(self.fd)  # drops the flock (a forked child that shares it has exited by now)
            self.fd = -1


def _log(message: str) -> None:
    sys.stderr.write(f"rdma-netns: gid-order: {message}\n")


def expects_link_local(ifname: str) -> bool:
    """Will the kernel give this (up) interface an IPv6 link-local address? Not with IPv6
    disabled on it or in the kernel, nor with addr_gen_mode 1 (none). Current netns."""
    try:
        if sysctl.get_ipv6_conf(ifname, "disable_ipv6") != "0":
            return False
        return sysctl.get_ipv6_conf(ifname, "addr_gen_mode") != "1"
    except OSError:
        return False


def _is_link_local(address: rtnl.Address) -> bool:
    packed = address.interface.packed
    return len(packed) == 16 and packed[0] == 0xFE and packed[1] & 0xC0 == 0x80


def wait_for_link_local(sock: NetlinkSocket, links: list[rtnl.Link], timeout: float) -> list[str]:
    """After the links went up: wait until each that expects one has its link-local address, so
    that its GID is queued before the pod's own addresses' GIDs on every rail. Returns the names
    still without one at `timeout` (then the order is not guaranteed; ADD goes on)."""
    pending = {link.index: link.name for link in links if expects_link_local(link.name)}
    deadline = time.monotonic() + timeout
    while pending:
        for address in rtnl.list_addresses(sock, AF_INET6):
            if address.index in pending and _is_link_local(address):
                del pending[address.index]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.002)
    if pending:
        _log(f"no IPv6 link-local address on {', '.join(sorted(pending.values()))} after {timeout:.1f} s")
    return sorted(pending.values())
