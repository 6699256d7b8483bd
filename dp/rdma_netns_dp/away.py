"""Char devices of RDMA devices away in pods (exclusive mode), for the CDI spec.

A container is created after its pod's network (kubelet: RunPodSandbox, CNI ADD, then
CreateContainer), so in exclusive mode the CNI plugin has already moved the granted device into
the pod when the runtime resolves the CDI name Allocate returned. The kernel re-creates the
device's uverbs char device on every namespace move (the minor may change), and the host's sysfs
no longer shows the device. So the daemon asks the kernel itself, from inside the pod's network
namespace (the CNI state records its path): NETLINK_RDMA GET_CHARDEV answers with the uverbs
node's name and dev_t as they are now. Standard library only (rdma_netns.kernel.rdma_nldev), no
pyroute2: this runs once per poll and device away.
"""

from __future__ import annotations

import logging
import os

from rdma_netns.kernel.rdma_devices import CharDevice

log = logging.getLogger("rdma_netns_dp.away")


def decode_dev_t(value: int) -> tuple[int, int]:
    """The kernel's huge_encode_dev(): minor low 8 bits | major << 8 | (minor >> 8) << 20."""
    major = (value >> 8) & 0xFFF
    minor = (value & 0xFF) | ((value >> 12) & 0xFFF00)
    return major, minor


def uverbs_in_netns(device: str, netns_path: str) -> tuple[CharDevice, int, int] | None:
    """(uverbsN, major, minor) of `device` as the namespace at `netns_path` sees it; None when the
    namespace or the device is gone, or the kernel does not answer (the caller keeps what it had)."""
    from rdma_netns.kernel import netns, rdma_nldev
    from rdma_netns.kernel.netlink import NetlinkError, NetlinkSocket, attr_str, attr_u32, parse_attrs

    try:
        fd = netns.open_netns(netns_path)
    except (OSError, netns.NotANetns):
        return None
    try:
        # NETLINK_RDMA finds devices in the socket's namespace, which is the creating thread's.
        with netns.inside(fd):
            sock = NetlinkSocket(rdma_nldev.NETLINK_RDMA)
        with sock:
            index = rdma_nldev.device_index(sock, device)
            if index is None:
                return None
            bodies = sock.query(rdma_nldev.nldev_type(rdma_nldev.RDMA_NLDEV_CMD_GET_CHARDEV),
                                attr_u32(rdma_nldev.RDMA_NLDEV_ATTR_DEV_INDEX, index)
                                + attr_str(rdma_nldev.RDMA_NLDEV_ATTR_CHARDEV_TYPE, "uverbs"),
                                what=f"uverbs char device of {device}")
    except (OSError, NetlinkError) as exc:
        log.debug("cannot ask the pod's namespace for the char device", extra={
            "rdma_device": device, "netns": netns_path, "error": str(exc)})
        return None
    finally:
        os.close(fd)
    for body in bodies:
        attrs = parse_attrs(body)
        name = attrs.get(rdma_nldev.RDMA_NLDEV_ATTR_CHARDEV_NAME, b"").split(b"\0", 1)[0].decode()
        raw = attrs.get(rdma_nldev.RDMA_NLDEV_ATTR_CHARDEV)
        if name and raw is not None and len(raw) >= 8:
            major, minor = decode_dev_t(int.from_bytes(raw[:8], "little"))
            return CharDevice(name), major, minor
    return None
