"""The NETLINK_RDMA (nldev) client (kernel/rdma_nldev.py) against the kernel ABI, byte for byte.

Each request is captured on one end of a socketpair (this host's kernel has no NETLINK_RDMA) and
compared with bytes written out by hand from include/uapi/rdma/rdma_netlink.h: nlmsghdr with
type (RDMA_NL_NLDEV=5 << 10) + command, no family header, attributes padded to 4 bytes. The
"kernel" end answers with canned replies shaped like drivers/infiniband/core/nldev.c's. The
guest check (integration/guest/check_rdma_netlink.py) proves the same against a real kernel.

pyroute2 serves here, and only here, as an independent codec: its generic netlink message class,
given the nldev attribute map, must encode the same requests and decode the same replies as the
hand-written standard-library codec (the project's client no longer uses pyroute2 at all).
"""

from __future__ import annotations

import errno
import socket
import struct
import sys
import threading
from collections.abc import Callable, Iterator

import pytest

from rdma_netns.kernel import rdma_nldev
from rdma_netns.kernel.netlink import NetlinkSocket
from rdma_netns.kernel.rdma_nldev import (
    Chardev,
    NldevDevice,
    NldevPort,
    RdmaBusy,
    RdmaError,
    RdmaNetlink,
)

pytestmark = pytest.mark.skipif(sys.byteorder != "little", reason="expected bytes are little-endian")

NLMSG_ERROR, NLMSG_DONE = 2, 3
NLM_F_MULTI, NLM_F_CAPPED, NLM_F_ACK_TLVS = 0x2, 0x100, 0x200


def wire(text: str) -> bytes:
    """Hand-written message bytes: hex, spaces and newlines ignored."""
    return bytes.fromhex("".join(text.split()))


def strip_ids(message: bytes) -> bytes:
    """The message with nlmsg_seq and nlmsg_pid zeroed: each transport picks its own."""
    return message[:8] + bytes(8) + message[16:]


# ---------------------------------------------------------------- canned kernel replies

def nla(kind: int, payload: bytes) -> bytes:
    size = 4 + len(payload)
    return struct.pack("=HH", size, kind) + payload + bytes(-size % 4)


def cstr(text: str) -> bytes:
    return text.encode() + b"\0"


def message(kind: int, flags: int, seq: int, body: bytes = b"") -> bytes:
    return struct.pack("=IHHII", 16 + len(body), kind, flags, seq, 0) + body


Answer = Callable[[int, bytes], bytes]  # (seq, request) -> the kernel's reply datagram


def ack(seq: int, request: bytes) -> bytes:
    return message(NLMSG_ERROR, NLM_F_CAPPED, seq, struct.pack("=i", 0) + request[:16])


def dump(kind: int, *bodies: bytes) -> Answer:
    def answer(seq: int, _request: bytes) -> bytes:
        parts = [message(kind, NLM_F_MULTI, seq, body) for body in bodies]
        return b"".join(parts) + message(NLMSG_DONE, NLM_F_MULTI, seq, struct.pack("=i", 0))
    return answer


def reply(kind: int, body: bytes) -> Answer:
    return lambda seq, _request: message(kind, 0, seq, body)


def refuse(code: int, text: str = "", capped: bool = True) -> Answer:
    """An NLMSG_ERROR as netlink_ack() builds it: the request echoed whole unless capped."""
    def answer(seq: int, request: bytes) -> bytes:
        tlvs = nla(1, cstr(text)) + nla(2, struct.pack("=I", 16)) if text else b""
        flags = (NLM_F_CAPPED if capped else 0) | (NLM_F_ACK_TLVS if text else 0)
        echoed = request[:16] if capped else request
        return message(NLMSG_ERROR, flags, seq, struct.pack("=i", -code) + echoed + tlvs)
    return answer


def failed_dump(code: int, text: str = "") -> Answer:
    """A dump whose dumpit failed: NLMSG_DONE carries the errno (netlink_dump_done())."""
    def answer(seq: int, _request: bytes) -> bytes:
        flags = NLM_F_MULTI | (NLM_F_ACK_TLVS if text else 0)
        body = struct.pack("=i", -code) + (nla(1, cstr(text)) if text else b"")
        return message(NLMSG_DONE, flags, seq, body)
    return answer


def device_body(index: int, name: str, guid: int, protocol: str = "roce") -> bytes:
    """fill_dev_info(): u64 attributes come with RDMA_NLDEV_ATTR_PAD (0) where alignment needs it."""
    return (nla(1, struct.pack("=I", index)) + nla(2, cstr(name)) + nla(3, struct.pack("=I", 1))
            + nla(0, b"") + nla(4, struct.pack("=Q", 0x1234)) + nla(0, b"")
            + nla(6, struct.pack("=Q", guid)) + nla(0, b"") + nla(7, struct.pack("=Q", guid))
            + nla(14, b"\x01") + nla(99, b"\x00") + nla(67, cstr(protocol)))  # 99: unmapped


def port_body(index: int, name: str, port: int, state: int, phys: int, netdev: str | None) -> bytes:
    body = (nla(1, struct.pack("=I", index)) + nla(2, cstr(name)) + nla(3, struct.pack("=I", port))
            + nla(12, bytes([state])) + nla(13, bytes([phys])))
    if netdev:
        body += nla(50, struct.pack("=I", 7)) + nla(51, cstr(netdev))
    return body


def huge_encode_dev(major: int, minor: int) -> int:
    return (minor & 0xFF) | (major << 8) | ((minor & ~0xFF) << 12)


class FakeKernel:
    """The far ends of socketpairs: records each request and answers it with the next canned reply."""

    def __init__(self) -> None:
        self.requests: list[bytes] = []
        self.answers: list[Answer] = []
        self._ends: list[tuple[socket.socket, socket.socket, threading.Thread]] = []

    def connect(self) -> socket.socket:
        """A new client end, served by its own thread."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        thread = threading.Thread(target=self._serve, args=(theirs,), daemon=True)
        thread.start()
        self._ends.append((ours, theirs, thread))
        return ours

    def _serve(self, theirs: socket.socket) -> None:
        while data := theirs.recv(1 << 16):
            self.requests.append(data)
            seq = struct.unpack_from("=I", data, 8)[0]
            answer = self.answers.pop(0) if self.answers else ack
            theirs.send(answer(seq, data))

    def close(self) -> None:
        for ours, theirs, thread in self._ends:
            theirs.shutdown(socket.SHUT_RDWR)  # wakes _serve's recv with b""
            thread.join(5)
            theirs.close()
            ours.close()


class PairedSocket(NetlinkSocket):
    """kernel/netlink.py's transport on a given socket (it always opens its own otherwise)."""

    def __init__(self, sock: socket.socket) -> None:  # no super().__init__(): it opens AF_NETLINK
        self._sock = sock
        self._seq = 0


@pytest.fixture
def kernel() -> Iterator[FakeKernel]:
    fake = FakeKernel()
    yield fake
    fake.close()


@pytest.fixture
def rdma(kernel: FakeKernel) -> Iterator[RdmaNetlink]:
    with RdmaNetlink(PairedSocket(kernel.connect())) as client:
        yield client


@pytest.fixture
def stdlib(kernel: FakeKernel) -> PairedSocket:
    return PairedSocket(kernel.connect())


# ------------------------------------------------------------------ requests on the wire

def test_message_types_follow_the_nldev_rule():
    assert rdma_nldev.nldev_type(rdma_nldev.RDMA_NLDEV_CMD_GET) == 0x1401
    assert rdma_nldev.nldev_type(rdma_nldev.RDMA_NLDEV_CMD_GET_CHARDEV) == (5 << 10) + 15 == 0x140F


def test_get_dump(rdma, kernel):
    kernel.answers.append(dump(0x1401))
    assert rdma.devices() == []
    #                      len       type flags (REQUEST|DUMP)  seq, pid
    assert strip_ids(kernel.requests[0]) == wire("10000000 0114 0103 00000000 00000000")


def test_get_by_index(rdma, kernel):
    kernel.answers.append(reply(0x1401, device_body(3, "rxe1", 1)))
    rdma.device(3)
    assert strip_ids(kernel.requests[0]) == wire("""
        18000000 0114 0100 00000000 00000000
        08000100 03000000""")  # DEV_INDEX (1) u32 3; a GET without ACK: the reply is the answer


def test_get_by_name_is_a_dump(rdma, kernel):
    """nldev_get_doit() needs DEV_INDEX (a GET with DEV_NAME alone is EINVAL): names need a dump."""
    kernel.answers.append(dump(0x1401, device_body(1, "rxe0", 1), device_body(2, "rxe1", 2)))
    assert rdma.device("rxe1").index == 2
    assert strip_ids(kernel.requests[0]) == wire("10000000 0114 0103 00000000 00000000")


def test_port_get_dump(rdma, kernel):
    kernel.answers.append(dump(0x1405))
    assert rdma.ports(3) == []
    assert strip_ids(kernel.requests[0]) == wire("""
        18000000 0514 0103 00000000 00000000
        08000100 03000000""")  # the kernel's PORT_GET dump needs the device


def test_sys_get(rdma, kernel):
    kernel.answers.append(reply(0x1406, nla(66, b"\x01") + nla(99, b"\x00")))  # 99: unmapped
    assert rdma.netns_mode() == "shared"
    assert strip_ids(kernel.requests[0]) == wire("10000000 0614 0100 00000000 00000000")


@pytest.mark.parametrize(("mode", "value"), [("exclusive", "00"), ("shared", "01")])
def test_sys_set(rdma, kernel, mode, value):
    rdma.set_netns_mode(mode)
    assert strip_ids(kernel.requests[0]) == wire(f"""
        18000000 0714 0500 00000000 00000000
        05004200 {value}000000""")  # NETNS_MODE (66) u8, 3 bytes of padding; REQUEST|ACK


def test_set_net_ns_fd(rdma, kernel):
    rdma.move_device(3, 7)
    assert strip_ids(kernel.requests[0]) == wire("""
        20000000 0214 0500 00000000 00000000
        08000100 03000000
        08004400 07000000""")  # DEV_INDEX 3, NET_NS_FD (68) u32 7


def test_get_chardev(rdma, kernel):
    body = (nla(0, b"") + nla(72, struct.pack("=Q", huge_encode_dev(231, 192)))
            + nla(0, b"") + nla(71, struct.pack("=Q", 6)) + nla(70, cstr("uverbs0")))
    kernel.answers.append(reply(0x140F, body))
    assert rdma.chardev(3) == Chardev("uverbs0", 231, 192, 6)
    assert strip_ids(kernel.requests[0]) == wire("""
        24000000 0f14 0100 00000000 00000000
        08000100 03000000
        0b004500 75766572 62730000""")  # CHARDEV_TYPE (69) "uverbs\\0", 1 byte of padding


def test_get_chardev_global(rdma, kernel):
    kernel.answers.append(reply(0x140F, nla(72, struct.pack("=Q", huge_encode_dev(10, 300)))
                                + nla(71, struct.pack("=Q", 4)) + nla(70, cstr("rdma_cm"))))
    assert rdma.chardev(None, "rdma_cm") == Chardev("rdma_cm", 10, 300, 4)  # minor > 255 too
    assert strip_ids(kernel.requests[0]) == wire("""
        1c000000 0f14 0100 00000000 00000000
        0c004500 72646d61 5f636d00""")


def test_newlink(rdma, kernel):
    rdma.link_add("rxe0", "rxe", "v0")
    assert strip_ids(kernel.requests[0]) == wire("""
        2c000000 0314 0500 00000000 00000000
        09000200 72786530 00000000
        08004100 72786500
        07003300 76300000""")  # DEV_NAME "rxe0", LINK_TYPE (65) "rxe", NDEV_NAME (51) "v0"


def test_dellink(rdma, kernel):
    rdma.link_delete(3)
    assert strip_ids(kernel.requests[0]) == wire("""
        18000000 0414 0500 00000000 00000000
        08000100 03000000""")


def test_the_hot_path_functions_and_the_client_send_the_same_bytes(rdma, stdlib, kernel):
    kernel.answers += [dump(0x1401, device_body(2, "rxe1", 2)), dump(0x1401, device_body(2, "rxe1", 2))]
    assert rdma_nldev.device_index(stdlib, "rxe1") == rdma.device("rxe1").index == 2
    rdma_nldev.move_device(stdlib, 2, 9)
    rdma.move_device(2, 9)
    lookup_fn, lookup_client, move_fn, move_client = kernel.requests
    assert lookup_fn[8:16] == struct.pack("=II", 1, 0)  # the stdlib transport: seq 1, pid 0
    assert strip_ids(lookup_fn) == strip_ids(lookup_client) == wire("10000000 0114 0103" + "00" * 8)
    assert strip_ids(move_fn) == strip_ids(move_client)
    assert move_client.endswith(wire("08000100 02000000 08004400 09000000"))


# ------------------------------------------- pyroute2 as an independent codec of the same ABI

@pytest.fixture(scope="module")
def pyroute2_nldev() -> type:
    """pyroute2's generic netlink message with the nldev attribute map (it has no RDMA module)."""
    netlink = pytest.importorskip("pyroute2.netlink")
    n = rdma_nldev
    names = {n.RDMA_NLDEV_ATTR_PAD: ("PAD", "none"), n.RDMA_NLDEV_ATTR_DEV_INDEX: ("DEV_INDEX", "uint32"),
             n.RDMA_NLDEV_ATTR_DEV_NAME: ("DEV_NAME", "asciiz"), n.RDMA_NLDEV_ATTR_PORT_INDEX: ("PORT_INDEX", "uint32"),
             n.RDMA_NLDEV_ATTR_NODE_GUID: ("NODE_GUID", "uint64"), n.RDMA_NLDEV_ATTR_PORT_STATE: ("PORT_STATE", "uint8"),
             n.RDMA_NLDEV_ATTR_PORT_PHYS_STATE: ("PORT_PHYS_STATE", "uint8"),
             n.RDMA_NLDEV_ATTR_NDEV_INDEX: ("NDEV_INDEX", "uint32"), n.RDMA_NLDEV_ATTR_NDEV_NAME: ("NDEV_NAME", "asciiz"),
             n.RDMA_NLDEV_ATTR_LINK_TYPE: ("LINK_TYPE", "asciiz"), n.RDMA_NLDEV_SYS_ATTR_NETNS_MODE: ("NETNS_MODE", "uint8"),
             n.RDMA_NLDEV_ATTR_DEV_PROTOCOL: ("DEV_PROTOCOL", "asciiz"), n.RDMA_NLDEV_NET_NS_FD: ("NET_NS_FD", "uint32"),
             n.RDMA_NLDEV_ATTR_CHARDEV_TYPE: ("CHARDEV_TYPE", "asciiz"),
             n.RDMA_NLDEV_ATTR_CHARDEV_NAME: ("CHARDEV_NAME", "asciiz"),
             n.RDMA_NLDEV_ATTR_CHARDEV_ABI: ("CHARDEV_ABI", "uint64"), n.RDMA_NLDEV_ATTR_CHARDEV: ("CHARDEV", "uint64")}

    class nldevmsg(netlink.nlmsg):  # noqa: N801 - pyroute2's naming
        nla_map = tuple((kind, name, fmt) for kind, (name, fmt) in sorted(names.items()))

    return nldevmsg


def pyroute2_encode(msgclass: type, cmd: int, flags: int, attrs: list[tuple[str, object]]) -> bytes:
    msg = msgclass()
    msg["header"]["type"] = rdma_nldev.nldev_type(cmd)
    msg["header"]["flags"] = flags
    msg["attrs"] = attrs
    msg.encode()
    return bytes(msg.data)


def pyroute2_decode(msgclass: type, body: bytes) -> dict[str, object]:
    msg = msgclass(message(0x1401, 0, 1, body))
    msg.decode()
    return {name: value for name, value in msg["attrs"] if name != "PAD"}


def test_requests_encode_as_pyroute2_encodes_them(rdma, kernel, pyroute2_nldev):
    n = rdma_nldev
    calls = [
        (lambda: rdma.devices(), n.RDMA_NLDEV_CMD_GET, 0x301, [], dump(0x1401)),
        (lambda: rdma.device(3), n.RDMA_NLDEV_CMD_GET, 0x1, [("DEV_INDEX", 3)], reply(0x1401, device_body(3, "x", 1))),
        (lambda: rdma.ports(3), n.RDMA_NLDEV_CMD_PORT_GET, 0x301, [("DEV_INDEX", 3)], dump(0x1405)),
        (lambda: rdma.netns_mode(), n.RDMA_NLDEV_CMD_SYS_GET, 0x1, [], reply(0x1406, nla(66, b"\x00"))),
        (lambda: rdma.set_netns_mode("shared"), n.RDMA_NLDEV_CMD_SYS_SET, 0x5, [("NETNS_MODE", 1)], ack),
        (lambda: rdma.move_device(3, 7), n.RDMA_NLDEV_CMD_SET, 0x5, [("DEV_INDEX", 3), ("NET_NS_FD", 7)], ack),
        (lambda: rdma.chardev(3), n.RDMA_NLDEV_CMD_GET_CHARDEV, 0x1,
         [("DEV_INDEX", 3), ("CHARDEV_TYPE", "uverbs")], reply(0x140F, nla(70, cstr("uverbs0")))),
        (lambda: rdma.link_add("rxe0", "rxe", "v0"), n.RDMA_NLDEV_CMD_NEWLINK, 0x5,
         [("DEV_NAME", "rxe0"), ("LINK_TYPE", "rxe"), ("NDEV_NAME", "v0")], ack),
        (lambda: rdma.link_delete(3), n.RDMA_NLDEV_CMD_DELLINK, 0x5, [("DEV_INDEX", 3)], ack),
    ]
    for call, cmd, flags, attrs, answer in calls:
        kernel.answers.append(answer)
        call()
        assert strip_ids(kernel.requests[-1]) == pyroute2_encode(pyroute2_nldev, cmd, flags, attrs), cmd


def test_replies_decode_as_pyroute2_decodes_them(pyroute2_nldev):
    body = device_body(7, "mlx5_0", 0x0C42A1030065F2B8, "ib")
    theirs = pyroute2_decode(pyroute2_nldev, body)
    ours = rdma_nldev.parse_device(body)
    assert (ours.index, ours.name, ours.ports, ours.protocol) == \
        (theirs["DEV_INDEX"], theirs["DEV_NAME"], theirs["PORT_INDEX"], theirs["DEV_PROTOCOL"])
    assert ours.node_guid.replace(":", "") == f"{theirs['NODE_GUID']:016x}"

    body = port_body(7, "mlx5_0", 2, 4, 5, "ens1f1")
    theirs = pyroute2_decode(pyroute2_nldev, body)
    port = rdma_nldev.parse_port(body)
    assert (port.device_index, port.device_name, port.port_index, port.state, port.phys_state,
            port.netdev_index, port.netdev_name) == tuple(theirs[k] for k in (
                "DEV_INDEX", "DEV_NAME", "PORT_INDEX", "PORT_STATE", "PORT_PHYS_STATE", "NDEV_INDEX", "NDEV_NAME"))

    encoded = huge_encode_dev(231, 300)
    body = nla(0, b"") + nla(72, struct.pack("=Q", encoded)) + nla(71, struct.pack("=Q", 6)) + nla(70, cstr("uverbs3"))
    theirs = pyroute2_decode(pyroute2_nldev, body)
    assert theirs["CHARDEV"] == encoded
    assert rdma_nldev.parse_chardev(body) == Chardev(theirs["CHARDEV_NAME"], 231, 300, theirs["CHARDEV_ABI"])


# ------------------------------------------------------------------------ parsing replies

def test_dump_of_two_devices(rdma, kernel):
    kernel.answers.append(dump(0x1401, device_body(1, "rxe0", 0x505400FFFE123456),
                               device_body(2, "mlx5_0", 0x0C42A1030065F2B8, "ib")))
    assert rdma.devices() == [
        NldevDevice(1, "rxe0", "5054:00ff:fe12:3456", 1, "roce"),
        NldevDevice(2, "mlx5_0", "0c42:a103:0065:f2b8", 1, "ib"),
    ]


def test_ports_of_every_device(rdma, kernel):
    kernel.answers += [
        dump(0x1401, device_body(1, "rxe0", 1), device_body(2, "rxe1", 2)),
        dump(0x1405, port_body(1, "rxe0", 1, 4, 5, "v0")),
        dump(0x1405, port_body(2, "rxe1", 1, 1, 3, None)),
    ]
    assert rdma.ports() == [
        NldevPort(1, "rxe0", 1, 4, "ACTIVE", 5, "LINK_UP", 7, "v0"),
        NldevPort(2, "rxe1", 1, 1, "DOWN", 3, "DISABLED", None, None),  # netdev in another netns
    ]
    assert [strip_ids(r)[16:] for r in kernel.requests[1:]] == [wire("08000100 01000000"),
                                                                wire("08000100 02000000")]


def test_ports_skip_a_device_that_went_away(rdma, kernel):
    kernel.answers += [dump(0x1401, device_body(1, "rxe0", 1), device_body(2, "rxe1", 2)),
                       failed_dump(errno.EINVAL), dump(0x1405, port_body(2, "rxe1", 1, 4, 5, "v1"))]
    assert [p.device_name for p in rdma.ports()] == ["rxe1"]


def test_failed_dump_raises(rdma, kernel):
    """The errno rides in NLMSG_DONE (a generic client that ignores it would return [])."""
    kernel.answers.append(failed_dump(errno.EINVAL, "dump refused"))
    with pytest.raises(RdmaError) as caught:
        rdma.ports(5)
    assert caught.value.errno == errno.EINVAL
    assert str(caught.value) == (
        "[Errno 22] list ports of RDMA device 5: Invalid argument: no RDMA device "
        "with that index in this network namespace (in exclusive mode devices of other namespaces "
        "are invisible)")


def test_error_with_errno(rdma, kernel):
    kernel.answers.append(refuse(errno.EOPNOTSUPP))
    with pytest.raises(RdmaError) as caught:
        rdma.move_device(3, 7)
    assert caught.value.errno == errno.EOPNOTSUPP
    assert caught.value.strerror == (
        "move RDMA device 3 to netns fd 7: Operation not supported: driver cannot change namespace "
        "(no disassociate_ucontext) or the kernel is in shared mode")


@pytest.mark.parametrize("capped", [True, False])
def test_extended_ack(rdma, kernel, capped):
    """netlink_ack() echoes the whole request unless capped; the text follows either way.

    The text is what kernel 7.3.4 answers to a move in shared mode.
    """
    text = "Cannot change net namespace of RDMA device in shared netns mode"
    kernel.answers.append(refuse(errno.EOPNOTSUPP, text, capped=capped))
    with pytest.raises(RdmaError) as caught:
        rdma.move_device(3, 7)
    assert caught.value.strerror.startswith(
        f"move RDMA device 3 to netns fd 7: Operation not supported ({text}): driver cannot")


@pytest.mark.parametrize("code", [errno.EINVAL, errno.ENODEV])
def test_move_invisible_device(rdma, kernel, code):
    kernel.answers.append(refuse(code))
    with pytest.raises(RdmaError, match="device not visible in this namespace") as caught:
        rdma.move_device(3, 7)
    assert caught.value.errno == code


def test_set_mode_without_cap_net_admin(rdma, kernel):
    kernel.answers.append(refuse(errno.EPERM))
    with pytest.raises(RdmaError, match="needs CAP_NET_ADMIN$"):
        rdma.set_netns_mode("exclusive")


def test_set_mode_busy_names_the_namespaces(rdma, kernel, monkeypatch):
    monkeypatch.setattr(rdma_nldev, "blocking_netns",
                        lambda: ["pod1 (/var/run/netns/pod1)", "net:[4026532300] (pid 77 sleep)"])
    kernel.answers.append(refuse(errno.EBUSY))
    with pytest.raises(RdmaBusy) as caught:
        rdma.set_netns_mode("exclusive")
    assert caught.value.errno == errno.EBUSY
    assert caught.value.strerror.endswith(
        "; other network namespaces: pod1 (/var/run/netns/pod1), net:[4026532300] (pid 77 sleep)")


def test_set_mode_refuses_other_words(rdma, kernel):
    with pytest.raises(ValueError, match="'shared' or 'exclusive'"):
        rdma.set_netns_mode("on")
    assert kernel.requests == []


def test_device_by_name_absent(rdma, kernel):
    kernel.answers.append(dump(0x1401, device_body(1, "rxe0", 1)))
    with pytest.raises(RdmaError, match="no RDMA device 'mlx5_9'") as caught:
        rdma.device("mlx5_9")
    assert caught.value.errno == errno.ENODEV


def test_no_rdma_core(monkeypatch):
    def unsupported(_protocol: int) -> None:
        raise OSError(errno.EPROTONOSUPPORT, "Protocol not supported")
    monkeypatch.setattr(rdma_nldev, "NetlinkSocket", unsupported)
    with pytest.raises(RdmaError, match="no RDMA core"):
        RdmaNetlink()


def test_stdlib_device_index(stdlib, kernel):
    kernel.answers += [dump(0x1401, device_body(1, "rxe0", 1), device_body(4, "rxe2", 4))] * 2
    assert rdma_nldev.device_index(stdlib, "rxe2") == 4
    assert rdma_nldev.device_index(stdlib, "rxe9") is None


def test_the_hot_path_and_the_client_word_a_refusal_alike(rdma, stdlib, kernel):
    kernel.answers += [refuse(errno.EINVAL, "bad fd")] * 2
    errors = []
    for move in (lambda: rdma_nldev.move_device(stdlib, 3, 7), lambda: rdma.move_device(3, 7)):
        with pytest.raises(RdmaError) as caught:
            move()
        errors.append(caught.value)
    assert errors[0].errno == errors[1].errno == errno.EINVAL
    assert str(errors[0]) == str(errors[1])
    assert "Invalid argument (bad fd): device not visible" in str(errors[0])


def test_records_compare_and_print_by_value():
    port = NldevPort(1, "rxe0", 1, 4, "ACTIVE", 5, "LINK_UP", None, None)
    assert port == NldevPort(1, "rxe0", 1, 4, "ACTIVE", 5, "LINK_UP", None, None) != Chardev("x", 1, 2, 3)
    assert len({port, NldevPort(1, "rxe0", 1, 4, "ACTIVE", 5, "LINK_UP", None, None)}) == 1
    assert repr(Chardev("uverbs0", 231, 192, 1)) == "Chardev(name='uverbs0', major=231, minor=192, abi=1)"


def test_blocking_netns_ignores_stale_names(tmp_path):
    """A leftover file in /var/run/netns (its bind mount gone) is no namespace."""
    from rdma_netns.kernel import netns

    (tmp_path / "gone").write_text("")
    assert not any(name.startswith("gone") for name in netns.other_namespaces(str(tmp_path)))
