"""The NETLINK_RDMA (nldev) client of both programs, on the standard-library transport.

The numbers of the kernel ABI live here once (include/uapi/rdma/rdma_netlink.h), with the errno
texts, the reply decoders and every request the project makes: the CNI hot path's two
(`device_index`, `move_device`: exclusive mode only), and, through `RdmaNetlink`, the device and
port dumps, the netns mode, char devices and soft-device links the admin tool, the device plugin
and the guest checks use. Standard library only and no dataclasses, so the CNI plugin can import
it (pyroute2 costs ~0.3 s per pod event, 10-30 s under emulation); pyroute2 remains only in
tests/unit/test_rdma_netlink.py, which cross-checks these messages against its generic decoder.

nldev messages have no family header: the attributes follow the 16-byte nlmsghdr directly, and
the message type is (RDMA_NL_NLDEV << 10) + command. A socket belongs to the network namespace
of the thread that opened it (see move_device for the moves' extra rule).
"""

from __future__ import annotations

import errno
import posix
import struct

from rdma_netns.kernel.netlink import (
    NetlinkError,
    NetlinkSocket,
    attr,
    attr_str,
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
    reason = posix.strerror(code)
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


# ----------------------------------------------------------------------------- replies, decoded

# enum ib_port_state / ib_port_phys_state (include/rdma/ib_verbs.h)
PORT_STATES = ("NOP", "DOWN", "INIT", "ARMED", "ACTIVE", "ACTIVE_DEFER")
PORT_PHYS_STATES = ("NOP", "SLEEP", "POLLING", "DISABLED", "PORT_CONFIGURATION_TRAINING",
                    "LINK_UP", "LINK_ERROR_RECOVERY", "PHY_TEST")


class _Record:
    """A small immutable-by-convention record: equality, hash and repr over its __slots__."""

    __slots__ = ()

    def _values(self) -> tuple:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._values() == self._values()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{n}={getattr(self, n)!r}' for n in self.__slots__)})"


class NldevDevice(_Record):
    """An RDMA device as RDMA_NLDEV_CMD_GET answers."""

    __slots__ = ("index", "name", "node_guid", "ports", "protocol")

    def __init__(self, index: int, name: str, node_guid: str, ports: int | None, protocol: str | None) -> None:
        self.index, self.name, self.node_guid = index, name, node_guid   # guid as `rdma dev` prints it
        self.ports, self.protocol = ports, protocol   # the last port number; "roce", "ib", "iw", ...


class NldevPort(_Record):
    """A port as RDMA_NLDEV_CMD_PORT_GET answers; the netdev only when it is in the socket's netns."""

    __slots__ = ("device_index", "device_name", "port_index", "state", "state_name", "phys_state",
                 "phys_state_name", "netdev_index", "netdev_name")

    def __init__(self, device_index: int, device_name: str, port_index: int, state: int, state_name: str,
                 phys_state: int, phys_state_name: str, netdev_index: int | None,
                 netdev_name: str | None) -> None:
        self.device_index, self.device_name, self.port_index = device_index, device_name, port_index
        self.state, self.state_name = state, state_name                      # 4, "ACTIVE"
        self.phys_state, self.phys_state_name = phys_state, phys_state_name  # 5, "LINK_UP"
        self.netdev_index, self.netdev_name = netdev_index, netdev_name


class Chardev(_Record):
    """A char device as RDMA_NLDEV_CMD_GET_CHARDEV answers (uverbsN of a device, or rdma_cm)."""

    __slots__ = ("name", "major", "minor", "abi")

    def __init__(self, name: str, major: int, minor: int, abi: int) -> None:
        self.name, self.major, self.minor, self.abi = name, major, minor, abi


def _u8(value: bytes) -> int:
    return value[0]


def _u64(value: bytes) -> int:
    return struct.unpack("=Q", value[:8])[0]


def _text(attrs: dict[int, bytes], kind: int) -> str | None:
    value = attrs.get(kind)
    return attr_text(value) if value is not None else None


def _int(attrs: dict[int, bytes], kind: int, read: object = u32) -> int | None:
    value = attrs.get(kind)
    return read(value) if value is not None else None  # type: ignore[operator]


def guid_text(value: int) -> str:
    """A GUID as sysfs and `rdma dev` print it: 4 groups of 4 hex digits."""
    text = f"{value:016x}"
    return ":".join(text[i:i + 4] for i in range(0, 16, 4))


def decode_dev_t(value: int) -> tuple[int, int]:
    """The kernel's huge_encode_dev(): minor low 8 bits | major << 8 | (minor >> 8) << 20."""
    return (value >> 8) & 0xFFF, (value & 0xFF) | ((value >> 12) & 0xFFF00)


def _name_of(names: tuple[str, ...], value: int) -> str:
    return names[value] if value < len(names) else str(value)


def parse_device(body: bytes) -> NldevDevice:
    attrs = parse_attrs(body)
    guid = _int(attrs, RDMA_NLDEV_ATTR_NODE_GUID, _u64)
    return NldevDevice(u32(attrs[RDMA_NLDEV_ATTR_DEV_INDEX]), _text(attrs, RDMA_NLDEV_ATTR_DEV_NAME) or "",
                       guid_text(guid) if guid is not None else "", _int(attrs, RDMA_NLDEV_ATTR_PORT_INDEX),
                       _text(attrs, RDMA_NLDEV_ATTR_DEV_PROTOCOL))


def parse_port(body: bytes) -> NldevPort:
    attrs = parse_attrs(body)
    state = _int(attrs, RDMA_NLDEV_ATTR_PORT_STATE, _u8) or 0
    phys = _int(attrs, RDMA_NLDEV_ATTR_PORT_PHYS_STATE, _u8) or 0
    return NldevPort(u32(attrs[RDMA_NLDEV_ATTR_DEV_INDEX]), _text(attrs, RDMA_NLDEV_ATTR_DEV_NAME) or "",
                     u32(attrs[RDMA_NLDEV_ATTR_PORT_INDEX]), state, _name_of(PORT_STATES, state),
                     phys, _name_of(PORT_PHYS_STATES, phys), _int(attrs, RDMA_NLDEV_ATTR_NDEV_INDEX),
                     _text(attrs, RDMA_NLDEV_ATTR_NDEV_NAME))


def parse_chardev(body: bytes) -> Chardev:
    attrs = parse_attrs(body)
    major, minor = decode_dev_t(_int(attrs, RDMA_NLDEV_ATTR_CHARDEV, _u64) or 0)
    return Chardev(_text(attrs, RDMA_NLDEV_ATTR_CHARDEV_NAME) or "", major, minor,
                   _int(attrs, RDMA_NLDEV_ATTR_CHARDEV_ABI, _u64) or 0)


# ------------------------------------------------------------------------------- the client

class RdmaNetlink:
    """A NETLINK_RDMA connection in the network namespace of the thread that opens it.

    `sock` hands it an open transport instead (tests use one end of a socketpair).
    """

    def __init__(self, sock: NetlinkSocket | None = None) -> None:
        if sock is None:
            try:
                sock = NetlinkSocket(NETLINK_RDMA)
            except OSError as exc:
                if exc.errno is None:
                    raise
                raise rdma_error("open", exc.errno, describe("open NETLINK_RDMA socket", exc.errno)) from None
        self.sock = sock

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RdmaNetlink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, op: str, what: str, kind: str, cmd: int, body: bytes = b"") -> list[bytes]:
        """One request (`kind`: request = ACKed change, query = GET, dump); its reply bodies, or
        RdmaError worded for `op`."""
        try:
            if kind == "request":
                self.sock.request(nldev_type(cmd), body, what=what)
                return []
            send = self.sock.query if kind == "query" else self.sock.dump
            return send(nldev_type(cmd), body, what=what)
        except NetlinkError as exc:
            raise rdma_error(op, exc.errno, exc.strerror) from None

    def _one(self, op: str, what: str, cmd: int, body: bytes = b"") -> bytes:
        """The single reply body of a GET (the kernel always sends one; an empty answer is an error)."""
        replies = self._call(op, what, "query", cmd, body)
        if not replies:
            raise RdmaError(errno.ENODATA, f"{what}: the kernel sent no reply")
        return replies[0]

    def devices(self) -> list[NldevDevice]:
        """Every RDMA device this network namespace sees (all of them in shared mode)."""
        return [parse_device(b) for b in self._call("device", "list RDMA devices", "dump", RDMA_NLDEV_CMD_GET)]

    def device(self, name_or_index: str | int) -> NldevDevice:
        """One device by index (a kernel GET) or by name (the kernel has no lookup by name)."""
        if isinstance(name_or_index, int):
            return parse_device(self._one("device", f"get RDMA device {name_or_index}", RDMA_NLDEV_CMD_GET,
                                          attr_u32(RDMA_NLDEV_ATTR_DEV_INDEX, name_or_index)))
        for found in self.devices():
            if found.name == name_or_index:
                return found
        raise RdmaError(errno.ENODEV, f"no RDMA device {name_or_index!r} in this network namespace "
                                      "(in exclusive mode devices of other namespaces are invisible)")

    def ports(self, device: str | int | None = None) -> list[NldevPort]:
        """The ports of one device, or of every visible device (the kernel dumps one device's)."""
        if device is not None:
            return self._device_ports(device if isinstance(device, int) else self.device(device).index)
        found: list[NldevPort] = []
        for each in self.devices():
            try:
                found += self._device_ports(each.index)
            except RdmaError as exc:  # removed or moved away since the device list
                if exc.errno != errno.EINVAL:
                    raise
        return found

    def _device_ports(self, index: int) -> list[NldevPort]:
        return [parse_port(b) for b in self._call("device", f"list ports of RDMA device {index}", "dump",
                                                  RDMA_NLDEV_CMD_PORT_GET,
                                                  attr_u32(RDMA_NLDEV_ATTR_DEV_INDEX, index))]

    def netns_mode(self) -> str:
        """The kernel's RDMA netns mode: "shared" or "exclusive"."""
        attrs = parse_attrs(self._one("mode", "get RDMA netns mode", RDMA_NLDEV_CMD_SYS_GET))
        return "shared" if _int(attrs, RDMA_NLDEV_SYS_ATTR_NETNS_MODE, _u8) else "exclusive"

    def set_netns_mode(self, mode: str) -> None:
        """Switch the mode; RdmaBusy names the network namespaces that keep the kernel from it."""
        if mode not in ("shared", "exclusive"):
            raise ValueError(f"RDMA netns mode must be 'shared' or 'exclusive', not {mode!r}")
        try:
            self._call("mode", f"set RDMA netns mode {mode}", "request", RDMA_NLDEV_CMD_SYS_SET,
                       attr(RDMA_NLDEV_SYS_ATTR_NETNS_MODE, bytes([mode == "shared"])))
        except RdmaBusy as exc:
            names = blocking_netns()
            listed = ", ".join(names) if names else (
                "none found in /var/run/netns or /proc (one may still be being torn down, or be "
                "kept alive by an open fd or a bind mount elsewhere; retry shortly)")
            raise RdmaBusy(exc.errno, f"{exc.strerror}; other network namespaces: {listed}") from None

    def move_device(self, index: int, netns_fd: int) -> None:
        """Move a device into `netns_fd`: the module function move_device on this connection."""
        move_device(self.sock, index, netns_fd)

    def chardev(self, device_index: int | None, name: str = "uverbs") -> Chardev:
        """The char device of type `name` of a device (None: a global one such as rdma_cm).

        Moving a device re-creates its uverbs device: look it up again after a move.
        """
        body = attr_u32(RDMA_NLDEV_ATTR_DEV_INDEX, device_index) if device_index is not None else b""
        where = f" of RDMA device {device_index}" if device_index is not None else ""
        return parse_chardev(self._one("chardev", f"get {name} char device{where}", RDMA_NLDEV_CMD_GET_CHARDEV,
                                       body + attr_str(RDMA_NLDEV_ATTR_CHARDEV_TYPE, name)))

    def link_add(self, name: str, link_type: str, netdev: str) -> None:
        """Create a software RDMA device (e.g. rxe) on `netdev` of this network namespace."""
        self._call("link", f"add RDMA link {name} type {link_type} on {netdev}", "request",
                   RDMA_NLDEV_CMD_NEWLINK, attr_str(RDMA_NLDEV_ATTR_DEV_NAME, name)
                   + attr_str(RDMA_NLDEV_ATTR_LINK_TYPE, link_type) + attr_str(RDMA_NLDEV_ATTR_NDEV_NAME, netdev))

    def link_delete(self, index: int) -> None:
        """Delete a software RDMA device made with link_add."""
        self._call("link", f"delete RDMA link {index}", "request", RDMA_NLDEV_CMD_DELLINK,
                   attr_u32(RDMA_NLDEV_ATTR_DEV_INDEX, index))


def blocking_netns() -> list[str]:
    """The network namespaces that keep the kernel from changing the mode (kernel/netns.py)."""
    from rdma_netns.kernel.netns import other_namespaces  # only on EBUSY

    return other_namespaces()
