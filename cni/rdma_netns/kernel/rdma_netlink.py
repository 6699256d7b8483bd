"""The NETLINK_RDMA (nldev) client: devices, ports, netns mode, device moves, char devices, links.

Used by the admin CLI and the device plugin, so it is built on pyroute2's netlink classes
(pyroute2 has no RDMA module: the message, marshal and socket classes are defined here). The CNI
hot path does not import it: rdma_nldev.py has its two requests on the standard library, and the
kernel's numbers and the error texts, which this module shares.

The socket is opened in the calling thread's current network namespace, and pyroute2 keeps one
socket per thread: use an RdmaNetlink from the thread that created it.
"""

from __future__ import annotations

import errno
import os
import struct
from dataclasses import dataclass
from socket import socket

from pyroute2.netlink import (
    NLM_F_ACK,
    NLM_F_ACK_TLVS,
    NLM_F_CAPPED,
    NLM_F_DUMP,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NLMSG_ERROR,
    nlmsg,
)
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.nlsocket import Marshal, NetlinkSocket

from rdma_netns.kernel import rdma_nldev as nl
from rdma_netns.kernel.netlink import attr_text, parse_attrs
from rdma_netns.kernel.netns import other_namespaces as blocking_netns
from rdma_netns.kernel.rdma_nldev import RdmaBusy, RdmaError

__all__ = ["Chardev", "RdmaBusy", "RdmaDevice", "RdmaError", "RdmaNetlink", "RdmaPort",
           "RdmaSocket", "blocking_netns"]

NLMSGERR_ATTR_MSG = 1

# enum ib_port_state / ib_port_phys_state (include/rdma/ib_verbs.h)
PORT_STATES = ("NOP", "DOWN", "INIT", "ARMED", "ACTIVE", "ACTIVE_DEFER")
PORT_PHYS_STATES = ("NOP", "SLEEP", "POLLING", "DISABLED", "PORT_CONFIGURATION_TRAINING",
                    "LINK_UP", "LINK_ERROR_RECOVERY", "PHY_TEST")


class nldevmsg(nlmsg):  # noqa: N801 - pyroute2's naming for message classes
    """An nldev message: no family header, the attributes follow the nlmsghdr."""

    nla_map = (
        (nl.RDMA_NLDEV_ATTR_PAD, "RDMA_NLDEV_ATTR_PAD", "none"),
        (nl.RDMA_NLDEV_ATTR_DEV_INDEX, "RDMA_NLDEV_ATTR_DEV_INDEX", "uint32"),
        (nl.RDMA_NLDEV_ATTR_DEV_NAME, "RDMA_NLDEV_ATTR_DEV_NAME", "asciiz"),
        (nl.RDMA_NLDEV_ATTR_PORT_INDEX, "RDMA_NLDEV_ATTR_PORT_INDEX", "uint32"),
        (nl.RDMA_NLDEV_ATTR_NODE_GUID, "RDMA_NLDEV_ATTR_NODE_GUID", "uint64"),
        (nl.RDMA_NLDEV_ATTR_PORT_STATE, "RDMA_NLDEV_ATTR_PORT_STATE", "uint8"),
        (nl.RDMA_NLDEV_ATTR_PORT_PHYS_STATE, "RDMA_NLDEV_ATTR_PORT_PHYS_STATE", "uint8"),
        (nl.RDMA_NLDEV_ATTR_NDEV_INDEX, "RDMA_NLDEV_ATTR_NDEV_INDEX", "uint32"),
        (nl.RDMA_NLDEV_ATTR_NDEV_NAME, "RDMA_NLDEV_ATTR_NDEV_NAME", "asciiz"),
        (nl.RDMA_NLDEV_ATTR_LINK_TYPE, "RDMA_NLDEV_ATTR_LINK_TYPE", "asciiz"),
        (nl.RDMA_NLDEV_SYS_ATTR_NETNS_MODE, "RDMA_NLDEV_SYS_ATTR_NETNS_MODE", "uint8"),
        (nl.RDMA_NLDEV_ATTR_DEV_PROTOCOL, "RDMA_NLDEV_ATTR_DEV_PROTOCOL", "asciiz"),
        (nl.RDMA_NLDEV_NET_NS_FD, "RDMA_NLDEV_NET_NS_FD", "uint32"),
        (nl.RDMA_NLDEV_ATTR_CHARDEV_TYPE, "RDMA_NLDEV_ATTR_CHARDEV_TYPE", "asciiz"),
        (nl.RDMA_NLDEV_ATTR_CHARDEV_NAME, "RDMA_NLDEV_ATTR_CHARDEV_NAME", "asciiz"),
        (nl.RDMA_NLDEV_ATTR_CHARDEV_ABI, "RDMA_NLDEV_ATTR_CHARDEV_ABI", "uint64"),
        (nl.RDMA_NLDEV_ATTR_CHARDEV, "RDMA_NLDEV_ATTR_CHARDEV", "uint64"),
    )


_COMMANDS = (nl.RDMA_NLDEV_CMD_GET, nl.RDMA_NLDEV_CMD_SET, nl.RDMA_NLDEV_CMD_NEWLINK,
             nl.RDMA_NLDEV_CMD_DELLINK, nl.RDMA_NLDEV_CMD_PORT_GET, nl.RDMA_NLDEV_CMD_SYS_GET,
             nl.RDMA_NLDEV_CMD_SYS_SET, nl.RDMA_NLDEV_CMD_GET_CHARDEV)


class MarshalRdma(Marshal):
    """Parses nldev replies; NLMSG_ERROR and NLMSG_DONE are decoded here, not by pyroute2.

    pyroute2 0.9 parses the request header an NLMSG_ERROR echoes as attributes (so it loses the
    extended-ack text, or fails outright when the echoed request is longer than its header), and
    ignores the errno of a failed dump's NLMSG_DONE (a PORT_GET dump of an invisible device ends
    that way).
    """

    msg_map = {nl.nldev_type(cmd): nldevmsg for cmd in _COMMANDS}

    def parse_one_message(self, key: int, flags: int, sequence_number: int, data: bytes,
                          offset: int, length: int) -> nlmsg:
        if key not in (NLMSG_ERROR, NLMSG_DONE):
            return super().parse_one_message(key, flags, sequence_number, data, offset, length)
        msg = nlmsg(data, offset=offset)  # the header only
        msg.decode()
        body = data[offset + 16: offset + length]
        msg["header"]["error"] = _status_error(key, flags, body) if len(body) >= 4 else None
        return msg


def _status_error(kind: int, flags: int, body: bytes) -> NetlinkError | None:
    """The error an NLMSG_ERROR/NLMSG_DONE body carries (None for an ACK or a clean end)."""
    code = -struct.unpack_from("=i", body)[0]
    if code <= 0:
        return None
    return NetlinkError(code, _ext_ack_text(kind, flags, body))


def _ext_ack_text(kind: int, flags: int, body: bytes) -> str:
    """The kernel's NLMSGERR_ATTR_MSG, if it sent one ("" otherwise)."""
    if not flags & NLM_F_ACK_TLVS:
        return ""
    if kind == NLMSG_DONE:
        start = 4                         # errno, then the TLVs
    elif flags & NLM_F_CAPPED:
        start = 4 + 16                    # errno + the request's header only
    else:
        start = 4 + ((struct.unpack_from("=I", body, 4)[0] + 3) & ~3)  # errno + whole request
    return attr_text(parse_attrs(body, start).get(NLMSGERR_ATTR_MSG, b""))


class RdmaSocket(NetlinkSocket):
    """pyroute2's netlink socket on NETLINK_RDMA with the nldev marshal.

    `use_socket` hands it an already open socket instead (tests use one end of a socketpair).
    """

    def __init__(self, use_socket: socket | None = None) -> None:
        super().__init__(family=nl.NETLINK_RDMA, ext_ack=True, use_socket=use_socket)
        self.set_marshal(MarshalRdma())


@dataclass(frozen=True)
class RdmaDevice:
    index: int
    name: str
    node_guid: str             # as sysfs and `rdma dev` print it: 4 groups of 4 hex digits
    ports: int | None          # the last port number (the kernel's rdma_end_port)
    protocol: str | None       # "roce", "ib", "iw", "opa", "usnic"


@dataclass(frozen=True)
class RdmaPort:
    device_index: int
    device_name: str
    port_index: int
    state: int
    state_name: str            # ACTIVE, DOWN, ... (enum ib_port_state)
    phys_state: int
    phys_state_name: str       # LINK_UP, DISABLED, ... (enum ib_port_phys_state)
    netdev_index: int | None   # only when the netdev is in the socket's network namespace
    netdev_name: str | None


@dataclass(frozen=True)
class Chardev:
    name: str                  # e.g. uverbs0, rdma_cm
    major: int
    minor: int
    abi: int


def _guid_text(value: int) -> str:
    text = f"{value:016x}"
    return ":".join(text[i:i + 4] for i in range(0, 16, 4))


def _state_name(names: tuple[str, ...], value: int) -> str:
    return names[value] if value < len(names) else str(value)


def _device(msg: nldevmsg) -> RdmaDevice:
    guid = msg.get_attr("RDMA_NLDEV_ATTR_NODE_GUID")
    return RdmaDevice(
        index=msg.get_attr("RDMA_NLDEV_ATTR_DEV_INDEX"),
        name=msg.get_attr("RDMA_NLDEV_ATTR_DEV_NAME"),
        node_guid=_guid_text(guid) if guid is not None else "",
        ports=msg.get_attr("RDMA_NLDEV_ATTR_PORT_INDEX"),
        protocol=msg.get_attr("RDMA_NLDEV_ATTR_DEV_PROTOCOL"),
    )


def _port(msg: nldevmsg) -> RdmaPort:
    state = msg.get_attr("RDMA_NLDEV_ATTR_PORT_STATE", 0)
    phys = msg.get_attr("RDMA_NLDEV_ATTR_PORT_PHYS_STATE", 0)
    return RdmaPort(
        device_index=msg.get_attr("RDMA_NLDEV_ATTR_DEV_INDEX"),
        device_name=msg.get_attr("RDMA_NLDEV_ATTR_DEV_NAME"),
        port_index=msg.get_attr("RDMA_NLDEV_ATTR_PORT_INDEX"),
        state=state,
        state_name=_state_name(PORT_STATES, state),
        phys_state=phys,
        phys_state_name=_state_name(PORT_PHYS_STATES, phys),
        netdev_index=msg.get_attr("RDMA_NLDEV_ATTR_NDEV_INDEX"),
        netdev_name=msg.get_attr("RDMA_NLDEV_ATTR_NDEV_NAME"),
    )


def _chardev(msg: nldevmsg) -> Chardev:
    dev = msg.get_attr("RDMA_NLDEV_ATTR_CHARDEV")  # the kernel's huge_encode_dev()
    return Chardev(
        name=msg.get_attr("RDMA_NLDEV_ATTR_CHARDEV_NAME"),
        major=(dev & 0xFFF00) >> 8,
        minor=(dev & 0xFF) | ((dev >> 12) & 0xFFF00),
        abi=msg.get_attr("RDMA_NLDEV_ATTR_CHARDEV_ABI"),
    )


class RdmaNetlink:
    """A NETLINK_RDMA connection in the calling thread's current network namespace."""

    def __init__(self, sock: RdmaSocket | None = None) -> None:
        if sock is None:
            try:
                sock = RdmaSocket()
            except OSError as exc:
                if exc.errno is None:
                    raise
                what = nl.describe("open NETLINK_RDMA socket", exc.errno)
                raise nl.rdma_error("open", exc.errno, what) from None
        self._sock = sock

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> RdmaNetlink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, op: str, what: str, cmd: int, attrs: list[tuple[str, object]],
                 flags: int = 0) -> list[nldevmsg]:
        """Send one nldev request; its replies, or RdmaError worded for `op`."""
        msg = nldevmsg()
        msg["attrs"] = attrs
        try:
            return list(self._sock.nlm_request(msg, msg_type=nl.nldev_type(cmd),
                                               msg_flags=NLM_F_REQUEST | flags))
        except NetlinkError as exc:
            raise nl.rdma_error(op, exc.code, nl.describe(what, exc.code, exc.args[1])) from None

    def devices(self) -> list[RdmaDevice]:
        """Every RDMA device this network namespace sees (all of them in shared mode)."""
        return [_device(m) for m in self._request(
            "device", "list RDMA devices", nl.RDMA_NLDEV_CMD_GET, [], NLM_F_DUMP)]

    def device(self, name_or_index: str | int) -> RdmaDevice:
        """One device by index (a kernel GET) or by name (the kernel has no lookup by name)."""
        if isinstance(name_or_index, int):
            replies = self._request("device", f"get RDMA device {name_or_index}",
                                    nl.RDMA_NLDEV_CMD_GET,
                                    [("RDMA_NLDEV_ATTR_DEV_INDEX", name_or_index)])
            return _device(replies[0])
        for found in self.devices():
            if found.name == name_or_index:
                return found
        raise RdmaError(errno.ENODEV, f"no RDMA device {name_or_index!r} in this network namespace "
                                      "(in exclusive mode devices of other namespaces are invisible)")

    def ports(self, device: str | int | None = None) -> list[RdmaPort]:
        """The ports of one device, or of every visible device (the kernel dumps one device's)."""
        if device is not None:
            index = device if isinstance(device, int) else self.device(device).index
            return self._device_ports(index)
        found: list[RdmaPort] = []
        for each in self.devices():
            try:
                found += self._device_ports(each.index)
            except RdmaError as exc:  # removed or moved away since the device list
                if exc.errno != errno.EINVAL:
                    raise
        return found

    def _device_ports(self, index: int) -> list[RdmaPort]:
        return [_port(m) for m in self._request(
            "device", f"list ports of RDMA device {index}", nl.RDMA_NLDEV_CMD_PORT_GET,
            [("RDMA_NLDEV_ATTR_DEV_INDEX", index)], NLM_F_DUMP)]

    def netns_mode(self) -> str:
        """The kernel's RDMA netns mode: "shared" or "exclusive"."""
        reply = self._request("mode", "get RDMA netns mode", nl.RDMA_NLDEV_CMD_SYS_GET, [])[0]
        return "shared" if reply.get_attr("RDMA_NLDEV_SYS_ATTR_NETNS_MODE") else "exclusive"

    def set_netns_mode(self, mode: str) -> None:
        """Switch the mode; RdmaBusy names the network namespaces that keep the kernel from it."""
        if mode not in ("shared", "exclusive"):
            raise ValueError(f"RDMA netns mode must be 'shared' or 'exclusive', not {mode!r}")
        try:
            self._request("mode", f"set RDMA netns mode {mode}", nl.RDMA_NLDEV_CMD_SYS_SET,
                          [("RDMA_NLDEV_SYS_ATTR_NETNS_MODE", int(mode == "shared"))], NLM_F_ACK)
        except RdmaBusy as exc:
            names = blocking_netns()
            listed = ", ".join(names) if names else (
                "none found in /var/run/netns or /proc (one may still be being torn down, or be "
                "kept alive by an open fd or a bind mount elsewhere; retry shortly)")
            raise RdmaBusy(exc.errno, f"{exc.strerror}; other network namespaces: {listed}") from None

    def move_device(self, index: int, netns_fd: int) -> None:
        """Move a device into `netns_fd` (exclusive mode; its own netns is a no-op in any mode).

        To move one out of a pod, setns() the calling thread into the pod and open this
        connection there first: the kernel wants the thread in the device's netns.
        """
        self._request("move", f"move RDMA device {index} to netns fd {netns_fd}",
                      nl.RDMA_NLDEV_CMD_SET,
                      [("RDMA_NLDEV_ATTR_DEV_INDEX", index), ("RDMA_NLDEV_NET_NS_FD", netns_fd)],
                      NLM_F_ACK)

    def chardev(self, device_index: int | None, name: str = "uverbs") -> Chardev:
        """The char device of type `name` of a device (None: a global one such as rdma_cm).

        Moving a device re-creates its uverbs device: look it up again after a move.
        """
        attrs: list[tuple[str, object]] = []
        if device_index is not None:
            attrs.append(("RDMA_NLDEV_ATTR_DEV_INDEX", device_index))
        attrs.append(("RDMA_NLDEV_ATTR_CHARDEV_TYPE", name))
        where = f" of RDMA device {device_index}" if device_index is not None else ""
        reply = self._request("chardev", f"get {name} char device{where}",
                              nl.RDMA_NLDEV_CMD_GET_CHARDEV, attrs)[0]
        return _chardev(reply)

    def link_add(self, name: str, link_type: str, netdev: str) -> None:
        """Create a software RDMA device (e.g. rxe) on `netdev` of this network namespace."""
        self._request("link", f"add RDMA link {name} type {link_type} on {netdev}",
                      nl.RDMA_NLDEV_CMD_NEWLINK,
                      [("RDMA_NLDEV_ATTR_DEV_NAME", name), ("RDMA_NLDEV_ATTR_LINK_TYPE", link_type),
                       ("RDMA_NLDEV_ATTR_NDEV_NAME", netdev)], NLM_F_ACK)

    def link_delete(self, index: int) -> None:
        """Delete a software RDMA device made with link_add."""
        self._request("link", f"delete RDMA link {index}", nl.RDMA_NLDEV_CMD_DELLINK,
                      [("RDMA_NLDEV_ATTR_DEV_INDEX", index)], NLM_F_ACK)
