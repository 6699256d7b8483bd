"""The announcements' exact bytes, built by the module's pure functions, against hand-written wire images."""

from __future__ import annotations

import sys

import pytest

from rdma_netns.kernel import neigh_announce as na
from rdma_netns.kernel import rtnl
from rdma_netns.kernel.inet import Prefix

MAC = bytes.fromhex("021122334455")
V6 = Prefix.parse("fd00::5").packed
V4 = Prefix.parse("10.9.0.5").packed


def link(mac: str = "02:11:22:33:44:55", flags: int = rtnl.IFF_UP) -> rtnl.Link:
    return rtnl.Link(index=7, name="net1", flags=flags, mac=mac, kind="macvlan", parent_index=0)


def test_neighbour_advertisement_bytes():
    body = na.neighbour_advertisement(V6, MAC)
    assert body.hex() == (
        "88"                                  # type 136: Neighbor Advertisement
        "00"                                  # code 0
        "0000"                                # checksum: left to the kernel (raw IPPROTO_ICMPV6 socket)
        "20000000"                            # R=0 S=0 O=1, reserved 0
        "fd000000000000000000000000000005"    # target address = the pod's address
        "02"                                  # option 2: Target Link-Layer Address
        "01"                                  # option length 1 (x 8 octets)
        "021122334455"                        # the interface MAC
    )
    flags = body[4]
    assert flags & 0x80 == 0, "Router flag must be clear"
    assert flags & 0x40 == 0, "Solicited flag must be clear (unsolicited, to a multicast group)"
    assert flags & 0x20, "Override flag must be set, or peers keep their cached MAC"
    assert len(body) == 32  # 24-byte NA + one 8-byte option


def test_gratuitous_arp_frame_bytes():
    frame = na.gratuitous_arp(V4, MAC)
    assert frame.hex() == (
        "ffffffffffff" "021122334455" "0806"  # Ethernet: broadcast, from the interface MAC, ARP
        "0001" "0800" "06" "04"               # Ethernet hardware, IPv4, 6-byte MAC, 4-byte IP
        "0001"                                # request (arping -U, the Go plugins' GratuitousArpOverIface)
        "021122334455" "0a090005"             # sender: the interface MAC and the address
        "ffffffffffff" "0a090005"             # target: broadcast MAC, the same address (gratuitous)
    )


def test_probe_and_delete_requests_bytes():
    # struct ndmsg in host byte order: family, 3 pad bytes, ifindex, state, flags, type; then NDA_DST.
    ifindex = (7).to_bytes(4, sys.byteorder).hex()
    nla_hdr = (8).to_bytes(2, sys.byteorder).hex() + (1).to_bytes(2, sys.byteorder).hex()
    assert na.probe_request(7, V4).hex() == "02" "000000" + ifindex + "0000" "01" "00" + nla_hdr + "0a090005"
    assert na.delete_request(7, V4).hex() == "02" "000000" + ifindex + "0000" "00" "00" + nla_hdr + "0a090005"


@pytest.mark.parametrize("mac,flags,expected", [
    ("02:11:22:33:44:55", rtnl.IFF_UP, MAC),
    ("00:00:00:00:00:00", rtnl.IFF_UP, None),                  # loopback-like
    ("02:11:22:33:44:55", rtnl.IFF_UP | na.IFF_NOARP, None),   # ipvlan l3/l3s: no neighbour resolution
    ("", rtnl.IFF_UP, None),                                   # no hardware address at all
    (":".join(["80"] * 20), rtnl.IFF_UP, None),                # IPoIB: not an Ethernet MAC
])
def test_which_links_are_announced(mac, flags, expected):
    assert na.ethernet_mac(link(mac, flags)) == expected


def test_no_mac_means_nothing_sent_and_no_socket_touched():
    class NoSocket:
        def __getattr__(self, name):
            raise AssertionError(f"netlink used for a link without a MAC: {name}")

    assert na.send(NoSocket(), link("00:00:00:00:00:00"), [Prefix.parse("fd00::5/64")]) == (0, [])


def test_kernel_sender_is_the_first_primary_on_the_subnet():
    def primary(text: str) -> tuple[int, int, bytes]:
        p = Prefix.parse(text)
        mask = (0xFFFFFFFF << (32 - p.prefixlen)) & 0xFFFFFFFF
        return int.from_bytes(p.packed, "big") & mask, mask, p.packed

    primaries = [primary("10.0.0.1/16"), primary("10.9.0.5/24")]
    assert na._kernel_would_send_from(primaries, V4) == V4
    # 10.0.1.7 (a secondary of 10.0.0.1/16, or an overlapping /24 listed later): the kernel would
    # send from 10.0.0.1, which is not gratuitous, so that address takes the AF_PACKET path.
    assert na._kernel_would_send_from(primaries, Prefix.parse("10.0.1.7").packed) == Prefix.parse("10.0.0.1").packed
    assert na._kernel_would_send_from(primaries, Prefix.parse("192.168.0.1").packed) is None


def test_announce_never_raises_and_logs_once(monkeypatch, capsys):
    def failing(sock, lnk, addresses):
        return 0, ["NA for fd00::5: Network is unreachable", "NA for fd00::6: Network is unreachable"]

    monkeypatch.setattr(na, "send", failing)
    na.announce(None, link(), [Prefix.parse("fd00::5/64"), Prefix.parse("fd00::6/64")])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("rdma-netns: net1: neighbour announcement not sent")
    assert "fd00::5" in err[0] and "fd00::6" in err[0]

    def crashing(sock, lnk, addresses):
        raise RuntimeError("boom")

    monkeypatch.setattr(na, "send", crashing)
    na.announce(None, link(), [Prefix.parse("fd00::5/64")])  # must not raise: the addresses are in place
    assert "RuntimeError: boom" in capsys.readouterr().err


def test_announce_is_silent_when_all_sent(monkeypatch, capsys):
    monkeypatch.setattr(na, "send", lambda sock, lnk, addresses: (1, []))
    na.announce(None, link(), [Prefix.parse("fd00::5/64")])
    assert capsys.readouterr().err == ""


def test_hot_path_imports_stay_small():
    import ast
    from pathlib import Path

    tree = ast.parse(Path(na.__file__).read_text())
    imported = {n.module if isinstance(n, ast.ImportFrom) else a.name
                for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in getattr(n, "names", [])}
    assert not imported & {"socket", "ipaddress", "subprocess", "pyroute2", "typing"}, imported
