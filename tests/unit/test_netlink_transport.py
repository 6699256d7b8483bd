"""The stdlib netlink transport's reply handling, on canned kernel answers."""

from __future__ import annotations

import errno
import struct

import pytest

from rdma_netns.kernel.netlink import NLMSG_DONE, NLMSG_ERROR, NLMSG_HDR, NetlinkError, NetlinkSocket, attr


class CannedSocket:
    def __init__(self, replies: list[bytes]) -> None:
        self.replies = replies
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)

    def recv(self, size: int) -> bytes:
        return self.replies.pop(0)

    def close(self) -> None:
        pass


def message(msg_type: int, flags: int, seq: int, body: bytes) -> bytes:
    return NLMSG_HDR.pack(NLMSG_HDR.size + len(body), msg_type, flags, seq, 0) + body


def transport(replies: list[bytes]) -> NetlinkSocket:
    sock = NetlinkSocket.__new__(NetlinkSocket)
    sock._sock = CannedSocket(replies)
    sock._seq = 0
    return sock


def test_dump_collects_multipart_replies_until_done():
    sock = transport([message(16, 2, 1, b"a" * 4) + message(16, 2, 1, b"b" * 4),
                      message(NLMSG_DONE, 2, 1, struct.pack("=i", 0))])
    assert sock.dump(18, b"") == [b"aaaa", b"bbbb"]


def test_a_dump_that_fails_part_way_raises():
    sock = transport([message(16, 2, 1, b"a" * 4) + message(NLMSG_DONE, 2, 1, struct.pack("=i", -errno.EINVAL))])
    with pytest.raises(NetlinkError) as err:
        sock.dump(18, b"", "list ports")
    assert err.value.errno == errno.EINVAL and "list ports" in str(err.value)


def test_error_with_extended_ack_text():
    original = NLMSG_HDR.pack(16, 16, 5, 1, 0)
    body = struct.pack("=i", -errno.EEXIST) + original + attr(1, b"File exists here\0")
    sock = transport([message(NLMSG_ERROR, 0x100 | 0x200, 1, body)])
    with pytest.raises(NetlinkError) as err:
        sock.request(16, b"", what="create link")
    assert err.value.errno == errno.EEXIST and "(File exists here)" in str(err.value)


def test_replies_to_other_requests_are_ignored():
    sock = transport([message(NLMSG_ERROR, 0, 99, struct.pack("=i", -errno.EPERM) + b"\0" * 16)
                      + message(NLMSG_ERROR, 0, 1, struct.pack("=i", 0) + b"\0" * 16)])
    sock.request(16, b"")
