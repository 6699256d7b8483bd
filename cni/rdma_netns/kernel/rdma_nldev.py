"""NETLINK_RDMA (nldev) numbers, error texts, and the two requests the CNI hot path needs.

The numbers of the kernel ABI live here once (include/uapi/rdma/rdma_netlink.h): this module is
standard library only, so the CNI plugin can import it without pyroute2 (~0.3 s per pod event),
and kernel/rdma_netlink.py (the full pyroute2 client) builds its attribute map from them.

nldev messages have no family header: the attributes follow the 16-byte nlmsghdr directly, and
the message type is (RDMA_NL_NLDEV << 10) + command.
"""

from __future__ import annotations

import errno
import os

from rdma_netns.kernel.netlink import (
    NetlinkError,
    NetlinkSocket,
    attr_text,
    attr_u32,
    parse_attrs,
    u32,
)

NETLINK_RDMA = 20
RDMA_NL_NLDEV = 5

RDMA_NLDEV_CMD_GET = 1
RDMA_NLDEV_CMD_SET = 2
RDMA_NLDEV_CMD_NEWLINK = 3
RDMA_NLDEV_CMD_DELLINK = 4
RDMA_NLDEV_CMD_PORT_GET = 5
RDMA_NLDEV_CMD_SYS_GET = 6
RDMA_NLDEV_CMD_SYS_SET = 7
RDMA_NLDEV_CMD_GET_CHARDEV = 15

RDMA_NLDEV_ATTR_PAD = 0                # alignment filler before u64 attributes
RDMA_NLDEV_ATTR_DEV_INDEX = 1          # u32
RDMA_NLDEV_ATTR_DEV_NAME = 2           # NUL string
RDMA_NLDEV_ATTR_PORT_INDEX = 3         # u32 (in a device reply: the last port number)
RDMA_NLDEV_ATTR_NODE_GUID = 6          # u64
RDMA_NLDEV_ATTR_PORT_STATE = 12        # u8
RDMA_NLDEV_ATTR_PORT_PHYS_STATE = 13   # u8
RDMA_NLDEV_ATTR_NDEV_INDEX = 50        # u32
RDMA_NLDEV_ATTR_NDEV_NAME = 51         # NUL string
RDMA_NLDEV_ATTR_LINK_TYPE = 65         # NUL string
RDMA_NLDEV_SYS_ATTR_NETNS_MODE = 66    # u8: 1 shared, 0 exclusive
RDMA_NLDEV_ATTR_DEV_PROTOCOL = 67      # NUL string
RDMA_NLDEV_NET_NS_FD = 68              # u32
RDMA_NLDEV_ATTR_CHARDEV_TYPE = 69      # NUL string
RDMA_NLDEV_ATTR_CHARDEV_NAME = 70      # NUL string
RDMA_NLDEV_ATTR_CHARDEV_ABI = 71       # u64
RDMA_NLDEV_ATTR_CHARDEV = 72           # u64 dev_t (huge_encode_dev)


def nldev_type(cmd: int) -> int:
    """The nlmsg_type of an nldev command."""
    return (RDMA_NL_NLDEV << 10) + cmd


class RdmaError(OSError):
    """An RDMA netlink request the kernel refused: its errno, and what that means for the request."""


class RdmaBusy(RdmaError):
    """The kernel said EBUSY (the netns mode cannot change while other network namespaces exist)."""


_INVISIBLE = ("device not visible in this namespace (it is in another netns in exclusive mode, "
              "or the calling thread is not in the device's netns)")

# What an errno means for each kind of request; EPERM means the same for all of them.
_HINTS: dict[tuple[str, int], str] = {
    ("open", errno.EPROTONOSUPPORT): "the kernel has no RDMA core (ib_core is not loaded)",
    ("device", errno.EINVAL): "no RDMA device with that index in this network namespace "
                              "(in exclusive mode devices of other namespaces are invisible)",
    ("move", errno.EOPNOTSUPP): "driver cannot change namespace (no disassociate_ucontext) "
                                "or the kernel is in shared mode",
    ("move", errno.EINVAL): _INVISIBLE + "; or the fd is not a network namespace",
    ("move", errno.ENODEV): _INVISIBLE,
    ("move", errno.EBADF): "the network namespace fd is not open",
    ("move", errno.EEXIST): "a device with that name exists in the target network namespace",
    ("mode", errno.EBUSY): "the kernel changes the RDMA netns mode only while no network "
                           "namespace but the initial one exists; set it at boot "
                           "(options ib_core netns_mode=0 for exclusive) or remove them",
    ("chardev", errno.EINVAL): _INVISIBLE,
    ("chardev", errno.EOPNOTSUPP): "no char device of that type (its module, e.g. ib_uverbs or "
                                   "rdma_ucm, is not loaded, or the type is unknown)",
    ("link", errno.ENODEV): "no such netdev in this network namespace",
    ("link", errno.EINVAL): "unknown link type, invalid name, or (delete) the device is not in "
                            "this namespace or its driver does not allow deleting it",
    ("link", errno.EEXIST): "a device with that name, or on that netdev, already exists",
}


def describe(what: str, code: int, kernel_text: str = "") -> str:
    """'<what>: <strerror> (<kernel's extended-ack text>)', as kernel/netlink.py words refusals."""
    reason = os.strerror(code)
    if kernel_text and kernel_text != reason:
        return f"{what}: {reason} ({kernel_text})"
    return f"{what}: {reason}"


def rdma_error(op: str, code: int, message: str) -> RdmaError:
    """The exception for a refused request of kind `op`, with what its errno means there."""
    hint = "needs CAP_NET_ADMIN" if code == errno.EPERM else _HINTS.get((op, code))
    cls = RdmaBusy if code == errno.EBUSY else RdmaError
    return cls(code, f"{message}: {hint}" if hint else message)


def device_index(sock: NetlinkSocket, name: str) -> int | None:
    """Index of RDMA device `name` in the socket's network namespace; None when it is not there.

    The kernel's GET finds devices by index only (a GET with just DEV_NAME fails with EINVAL),
    so this dumps the devices and matches the name.
    """
    try:
        bodies = sock.dump(nldev_type(RDMA_NLDEV_CMD_GET), b"", what="list RDMA devices")
    except NetlinkError as exc:
        raise rdma_error("device", exc.errno, exc.strerror) from None
    for body in bodies:
        attrs = parse_attrs(body)
        if attr_text(attrs.get(RDMA_NLDEV_ATTR_DEV_NAME, b"")) == name:
            return u32(attrs[RDMA_NLDEV_ATTR_DEV_INDEX])
    return None


def move_device(sock: NetlinkSocket, index: int, netns_fd: int) -> None:
    """Move RDMA device `index` into the network namespace `netns_fd` (exclusive mode only).

    The kernel looks the device up in the socket's netns and also requires the calling thread to
    be in the device's netns: to move a device out of a pod, setns() the thread into the pod and
    open the socket there first. A move into the netns the device is already in succeeds as a
    no-op, in either mode.
    """
    body = attr_u32(RDMA_NLDEV_ATTR_DEV_INDEX, index) + attr_u32(RDMA_NLDEV_NET_NS_FD, netns_fd)
    what = f"move RDMA device {index} to netns fd {netns_fd}"
    try:
        sock.request(nldev_type(RDMA_NLDEV_CMD_SET), body, what=what)
    except NetlinkError as exc:
        raise rdma_error("move", exc.errno, exc.strerror) from None
