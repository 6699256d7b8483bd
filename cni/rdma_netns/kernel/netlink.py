"""A minimal netlink transport on the standard library.

Why not pyroute2 here: `import pyroute2` costs about 0.3 s, and the CNI executable starts once
per pod event. The plugin needs a dozen fixed rtnetlink messages; building them with `struct`
keeps ADD in the tens of milliseconds. The RDMA netlink family (kernel/rdma_nldev.py) runs on
this transport too, for the CNI, the device plugin and the admin tool alike. pyroute2 stays in
the tests only, as an independent codec and kernel inspector.
"""

from __future__ import annotations

import errno
import posix
import struct
from _socket import AF_NETLINK, SO_RCVBUF, SOCK_CLOEXEC, SOCK_RAW, SOL_SOCKET
from _socket import socket as _socket

TYPE_CHECKING = False  # typing is not imported on the hot path
if TYPE_CHECKING:
    from collections.abc import Iterator

NETLINK_ROUTE = 0

NLMSG_HDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
NLA_HDR = struct.Struct("=HH")       # len, type
NLMSG_ERROR = 2
NLMSG_DONE = 3

NLM_F_REQUEST = 0x1
NLM_F_MULTI = 0x2
NLM_F_ACK = 0x4
NLM_F_DUMP = 0x300
NLM_F_REPLACE = 0x100
NLM_F_EXCL = 0x200
NLM_F_CREATE = 0x400

NLA_F_NESTED = 0x8000
NLA_TYPE_MASK = 0x3FFF


def _align(n: int) -> int:
    return (n + 3) & ~3


def attr(kind: int, payload: bytes) -> bytes:
    """One netlink attribute, padded to 4 bytes."""
    size = NLA_HDR.size + len(payload)
    return NLA_HDR.pack(size, kind) + payload + b"\0" * (_align(size) - size)


def attr_u8(kind: int, value: int) -> bytes:
    return attr(kind, struct.pack("=B", value))


def attr_u16(kind: int, value: int) -> bytes:
    return attr(kind, struct.pack("=H", value))


def attr_u32(kind: int, value: int) -> bytes:
    return attr(kind, struct.pack("=I", value))


def attr_str(kind: int, value: str) -> bytes:
    return attr(kind, value.encode() + b"\0")


def attr_nested(kind: int, *children: bytes) -> bytes:
    return attr(kind | NLA_F_NESTED, b"".join(children))


def parse_attrs(data: bytes, offset: int = 0) -> dict[int, bytes]:
    """Attributes of one message (first occurrence of each type wins, as in the kernel's parser)."""
    out: dict[int, bytes] = {}
    end = len(data)
    while offset + NLA_HDR.size <= end:
        size, kind = NLA_HDR.unpack_from(data, offset)
        if size < NLA_HDR.size:
            break
        out.setdefault(kind & NLA_TYPE_MASK, data[offset + NLA_HDR.size: offset + size])
        offset += _align(size)
    return out


def attr_text(value: bytes) -> str:
    return value.split(b"\0", 1)[0].decode(errors="replace")


def u32(value: bytes) -> int:
    return struct.unpack("=I", value[:4])[0]


class NetlinkError(OSError):
    """A request the kernel refused; errno is the kernel's, message says which request."""


class NetlinkSocket:
    """One netlink socket bound in the network namespace current when it is created."""

    def __init__(self, protocol: int = NETLINK_ROUTE) -> None:
        self._sock = _socket(AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC, protocol)
        self._sock.setsockopt(SOL_SOCKET, SO_RCVBUF, 1 << 20)
        # Extended ACKs give the kernel's own reason text; harmless where unsupported.
        try:
            self._sock.setsockopt(270, 11, 1)  # SOL_NETLINK, NETLINK_EXT_ACK
        except OSError:
            pass
        self._sock.bind((0, 0))
        self._seq = 0

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> NetlinkSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, msg_type: int, flags: int, body: bytes) -> int:
        self._seq += 1
        header = NLMSG_HDR.pack(NLMSG_HDR.size + len(body), msg_type, flags | NLM_F_REQUEST, self._seq, 0)
        self._sock.send(header + body)
        return self._seq

    def _replies(self, seq: int, what: str) -> Iterator[tuple[int, int, bytes]]:
        """Yield (type, flags, body) of the replies to `seq` until DONE or the ACK/error."""
        while True:
            data = self._sock.recv(1 << 16)
            offset = 0
            while offset + NLMSG_HDR.size <= len(data):
                size, msg_type, flags, msg_seq, _pid = NLMSG_HDR.unpack_from(data, offset)
                body = data[offset + NLMSG_HDR.size: offset + size]
                offset += _align(size)
                if msg_seq != seq:
                    continue
                if msg_type == NLMSG_DONE:
                    # A dump that failed part-way ends with DONE carrying the negative errno.
                    code = -struct.unpack_from("=i", body)[0] if len(body) >= 4 else 0
                    if code > 0:
                        raise NetlinkError(code, f"{what}: {posix.strerror(code)}")
                    return
                if msg_type == NLMSG_ERROR:
                    code = -struct.unpack_from("=i", body)[0]
                    if code:
                        raise NetlinkError(code, f"{what}: {posix.strerror(code)}{_ext_ack(body, flags)}")
                    return
                yield msg_type, flags, body
                if not flags & NLM_F_MULTI:
                    return

    def request(self, msg_type: int, body: bytes, flags: int = 0, what: str = "netlink request") -> None:
        """Send one request and wait for its ACK; raise NetlinkError on refusal."""
        seq = self._send(msg_type, flags | NLM_F_ACK, body)
        for _ in self._replies(seq, what):
            pass

    def query(self, msg_type: int, body: bytes, what: str = "netlink query") -> list[bytes]:
        """A GET of one object: the reply bodies."""
        seq = self._send(msg_type, 0, body)
        return [b for _t, _f, b in self._replies(seq, what)]

    def dump(self, msg_type: int, body: bytes, what: str = "netlink dump") -> list[bytes]:
        seq = self._send(msg_type, NLM_F_DUMP, body)
        return [b for _t, _f, b in self._replies(seq, what)]


def _ext_ack(body: bytes, flags: int) -> str:
    """The kernel's NLMSGERR_ATTR_MSG text, when it sent one."""
    if not flags & 0x200:  # NLM_F_ACK_TLVS
        return ""
    # nlmsgerr = error(i32) + the original header (16 bytes; payload capped when TLVs follow).
    if not flags & 0x100:  # NLM_F_CAPPED: the whole request was echoed back
        orig_len = struct.unpack_from("=I", body, 4)[0]
        start = 4 + _align(orig_len)
    else:
        start = 4 + NLMSG_HDR.size
    text = parse_attrs(body, start).get(1)  # NLMSGERR_ATTR_MSG
    return f" ({attr_text(text)})" if text else ""


def is_missing(exc: OSError) -> bool:
    """The errno values that mean "that object is not there (any more)"."""
    return exc.errno in (errno.ENODEV, errno.ENOENT, errno.ESRCH, errno.EADDRNOTAVAIL)
