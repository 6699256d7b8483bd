"""Char devices of RDMA devices away in pods (exclusive mode), for the CDI spec.

A container is created after its pod's network (kubelet: RunPodSandbox, CNI ADD, then
CreateContainer), so in exclusive mode the CNI plugin has already moved the granted device into
the pod when the runtime resolves the CDI name Allocate returned. The kernel re-creates the
device's uverbs char device on every namespace move (the minor may change), and the host's sysfs
no longer shows the device. So the daemon asks the kernel itself, from inside the pod's network
namespace (the CNI state records its path): NETLINK_RDMA GET_CHARDEV answers with the uverbs
node's name and dev_t as they are now, through the project's one NETLINK_RDMA client
(rdma_netns.kernel.rdma_nldev, standard library only): this runs once per poll and device away.
"""

from __future__ import annotations

import logging
import os

from rdma_netns.kernel.rdma_devices import CharDevice
from rdma_netns.kernel.rdma_nldev import decode_dev_t

__all__ = ["decode_dev_t", "uverbs_in_netns"]  # decode_dev_t: the kernel's dev_t rule, kept here for callers

log = logging.getLogger("rdma_netns_dp.away")


def uverbs_in_netns(device: str, netns_path: str) -> tuple[CharDevice, int, int] | None:
    """(uverbsN, major, minor) of `device` as the namespace at `netns_path` sees it; None when the
    namespace or the device is gone, or the kernel does not answer (the caller keeps what it had)."""
    from rdma_netns.kernel import netns
    from rdma_netns.kernel.netlink import NetlinkSocket
    from rdma_netns.kernel.rdma_nldev import NETLINK_RDMA, RdmaNetlink, device_index

    try:
        fd = netns.open_netns(netns_path)
    except (OSError, netns.NotANetns):
        return None
    try:
        # NETLINK_RDMA finds devices in the socket's namespace, which is the creating thread's.
        with netns.inside(fd):
            sock = NetlinkSocket(NETLINK_RDMA)
        with RdmaNetlink(sock) as rdma:
            index = device_index(sock, device)
            if index is None:
                return None
            found = rdma.chardev(index, "uverbs")
    except OSError as exc:  # RdmaError and the transport's errors alike
        log.debug("cannot ask the pod's namespace for the char device", extra={
            "rdma_device": device, "netns": netns_path, "error": str(exc)})
        return None
    finally:
        os.close(fd)
    if not found.name or not (found.major or found.minor):
        return None
    return CharDevice(found.name), found.major, found.minor
