"""Tell the pod's L2 neighbours which MAC now owns its addresses: one unsolicited NA or gratuitous ARP each.

Why: IPv6 addresses are added with IFA_F_NODAD, and for those the kernel announces nothing. A
peer that still holds a neighbour entry for a reused address (a previous pod's) would keep
sending to the old MAC until the entry ages out, and RoCE resolves the destination MAC through
the same neighbour table, so RDMA traffic is lost too. The Go reference plugins send one
gratuitous ARP for IPv4 after ADD; this module does that and its IPv6 counterpart, once, with no
retries and no sleeps.

- IPv6: an unsolicited Neighbour Advertisement (RFC 4861 7.2.6): Override set, Solicited and
  Router clear, target = the address, a Target Link-Layer Address option with the MAC, to
  ff02::1 with hop limit 255, from the address itself. A raw IPPROTO_ICMPV6 socket: the kernel
  always computes the ICMPv6 checksum for those (the checksum field is sent as zero here).
- IPv4: a gratuitous ARP request, broadcast, sender IP = target IP = the address, sender MAC =
  the link's. Sent by the kernel itself: a throw-away neighbour entry for the address, created
  with NTF_USE, makes the kernel probe it at once (arp_solicit picks the address as the sender
  when it is the link's primary address of its subnet), and the entry is deleted right after.
  Why not an AF_PACKET socket (the Go plugins' way): closing one waits for an RCU grace period
  (synchronize_net in packet_release), 7-20 ms per ADD on a 2-core VM against ~0.05 ms for two
  netlink messages. AF_PACKET stays the fallback for the rare address the kernel would not send
  gratuitously (a secondary address, or an entry that already exists).

The calling thread must be inside the pod namespace (sockets belong to the netns they are made in).
Stdlib only and no `socket`/`ipaddress` import: this runs on the ADD hot path.
"""

from __future__ import annotations

import struct
import sys
from _socket import (
    AF_INET,
    AF_INET6,
    AF_PACKET,
    IPPROTO_ICMPV6,
    IPPROTO_IPV6,
    IPV6_MULTICAST_HOPS,
    IPV6_MULTICAST_LOOP,
    IPV6_PKTINFO,
    SOCK_CLOEXEC,
    SOCK_RAW,
    inet_ntop,
)
from _socket import socket as _socket

from rdma_netns.kernel import rtnl
from rdma_netns.kernel.netlink import NLM_F_CREATE, NLM_F_EXCL, attr

TYPE_CHECKING = False  # typing is not imported on the hot path
if TYPE_CHECKING:
    from rdma_netns.kernel.inet import Prefix
    from rdma_netns.kernel.netlink import NetlinkSocket

IFF_NOARP = 0x80           # no neighbour resolution on this link (ipvlan l3/l3s, point-to-point)
IFA_F_SECONDARY = 0x01
ALL_NODES = "ff02::1"
BROADCAST = b"\xff" * 6
ETH_P_ARP = 0x0806
ND_NEIGHBOR_ADVERT = 136
NA_FLAG_OVERRIDE = 0x20000000  # R=0x80000000, S=0x40000000, O=0x20000000 in the first word
ND_OPT_TARGET_LL_ADDR = 2
RTM_NEWNEIGH, RTM_DELNEIGH = 28, 29
NDA_DST = 1
NTF_USE = 0x01

# type, code, checksum (0: the kernel fills it), flags+reserved, target, option type, length (8-octet units), MAC
_NA = struct.Struct("!BBHI16sBB6s")
# Ethernet dst, src, type; ARP htype, ptype, hlen, plen, op, sha, spa, tha, tpa
_GARP = struct.Struct("!6s6sHHHBBH6s4s6s4s")
_PKTINFO_IFINDEX = struct.Struct("=i")  # struct in6_pktinfo { in6_addr; int ifindex; }
_NDMSG = struct.Struct("=BxxxiHBB")     # family, pad, ifindex, state, flags, type


def neighbour_advertisement(target: bytes, mac: bytes) -> bytes:
    """The ICMPv6 body of an unsolicited NA for `target` (16 bytes) owned by `mac` (6 bytes)."""
    return _NA.pack(ND_NEIGHBOR_ADVERT, 0, 0, NA_FLAG_OVERRIDE, target, ND_OPT_TARGET_LL_ADDR, 1, mac)


def gratuitous_arp(address: bytes, mac: bytes) -> bytes:
    """The Ethernet frame of a gratuitous ARP request (`arping -U`'s form) for `address` from `mac`."""
    return _GARP.pack(BROADCAST, mac, ETH_P_ARP, 1, 0x0800, 6, 4, 1, mac, address, BROADCAST, address)


def probe_request(index: int, address: bytes) -> bytes:
    """RTM_NEWNEIGH body: a neighbour entry for `address` (IPv4) that the kernel resolves at once (NTF_USE)."""
    return _NDMSG.pack(AF_INET, index, 0, NTF_USE, 0) + attr(NDA_DST, address)


def delete_request(index: int, address: bytes) -> bytes:
    """RTM_DELNEIGH body for the entry probe_request made."""
    return _NDMSG.pack(AF_INET, index, 0, 0, 0) + attr(NDA_DST, address)


def ethernet_mac(link: rtnl.Link) -> bytes | None:
    """The link's MAC when it is an Ethernet link that resolves neighbours, else None (nothing to announce)."""
    if link.flags & IFF_NOARP:
        return None
    try:
        mac = bytes.fromhex(link.mac.replace(":", ""))
    except ValueError:
        return None
    if len(mac) != 6 or mac == b"\0\0\0\0\0\0":
        return None  # loopback-like, or not Ethernet (IPoIB has 20-byte addresses and its own ARP)
    return mac


def send(sock: NetlinkSocket, link: rtnl.Link, addresses: list[Prefix]) -> tuple[int, list[str]]:
    """Send one announcement per address: (number sent, failures as text). Send errors are returned, not raised."""
    mac = ethernet_mac(link)
    if mac is None:
        return 0, []
    v6 = [a.packed for a in addresses if len(a.packed) == 16]
    v4 = [a.packed for a in addresses if len(a.packed) == 4]
    sent = 0
    failures: list[str] = []
    if v6:
        sent += _send_v6(link, mac, v6, failures)
    if v4:
        sent += _send_v4(sock, link, mac, v4, failures)
    return sent, failures


def announce(sock: NetlinkSocket, link: rtnl.Link, addresses: list[Prefix]) -> None:
    """Best effort for ADD: an announcement that cannot be sent is logged once and never fails the ADD."""
    try:
        _sent, failures = send(sock, link, addresses)
    except Exception as exc:  # noqa: BLE001 - nothing here may fail an ADD whose addresses are in place
        failures = [f"{type(exc).__name__}: {exc}"]
    if failures:
        print(f"rdma-netns: {link.name}: neighbour announcement not sent ({'; '.join(failures)}); "
              "peers may use a stale MAC for these addresses until their neighbour entries expire",
              file=sys.stderr)


def _send_v6(link: rtnl.Link, mac: bytes, targets: list[bytes], failures: list[str]) -> int:
    try:
        sock = _socket(AF_INET6, SOCK_RAW | SOCK_CLOEXEC, IPPROTO_ICMPV6)
    except OSError as exc:
        failures.append(f"ICMPv6 socket: {exc.strerror or exc}")
        return 0
    sent = 0
    try:
        sock.setsockopt(IPPROTO_IPV6, IPV6_MULTICAST_HOPS, 255)  # receivers drop NAs with any other hop limit
        sock.setsockopt(IPPROTO_IPV6, IPV6_MULTICAST_LOOP, 0)    # our own stack needs no copy
        ifindex = _PKTINFO_IFINDEX.pack(link.index)
        dst = (ALL_NODES, 0, 0, link.index)                      # scope id: out of this link
        for target in targets:
            # IPV6_PKTINFO: the source is the address itself (not the link-local, which may still be in DAD).
            try:
                sock.sendmsg([neighbour_advertisement(target, mac)],
                             [(IPPROTO_IPV6, IPV6_PKTINFO, target + ifindex)], 0, dst)
                sent += 1
            except OSError as exc:
                failures.append(f"NA for {inet_ntop(AF_INET6, target)}: {exc.strerror or exc}")
    finally:
        sock.close()
    return sent


def _send_v4(sock: NetlinkSocket, link: rtnl.Link, mac: bytes, addresses: list[bytes], failures: list[str]) -> int:
    sent = 0
    by_packet: list[bytes] = []
    primaries = _kernel_sender_candidates(sock, link.index)
    for address in addresses:
        if _kernel_would_send_from(primaries, address) != address:
            by_packet.append(address)  # the kernel's probe would carry another sender address
            continue
        try:
            sock.request(RTM_NEWNEIGH, probe_request(link.index, address), NLM_F_CREATE | NLM_F_EXCL,
                         what="ARP probe")
        except OSError:
            by_packet.append(address)  # an entry exists already: NTF_USE would not probe it
            continue
        sent += 1
        try:
            sock.request(RTM_DELNEIGH, delete_request(link.index, address), what="delete ARP probe entry")
        except OSError as exc:
            failures.append(f"removing the probe entry for {inet_ntop(AF_INET, address)}: {exc.strerror or exc}")
    if by_packet:
        sent += _send_v4_packet(link, mac, by_packet, failures)
    return sent


def _kernel_sender_candidates(sock: NetlinkSocket, index: int) -> list[tuple[int, int, bytes]]:
    """The link's primary IPv4 addresses in the kernel's order, as (network, mask, address)."""
    out = []
    for a in rtnl.list_addresses(sock, AF_INET):
        if a.index == index and not a.flags & IFA_F_SECONDARY:
            mask = (0xFFFFFFFF << (32 - a.interface.prefixlen)) & 0xFFFFFFFF
            out.append((int.from_bytes(a.interface.packed, "big") & mask, mask, a.interface.packed))
    return out


def _kernel_would_send_from(primaries: list[tuple[int, int, bytes]], target: bytes) -> bytes | None:
    """arp_solicit's sender without a packet: inet_select_addr's first primary address on the target's subnet."""
    value = int.from_bytes(target, "big")
    for network, mask, address in primaries:
        if value & mask == network:
            return address
    return None


def _send_v4_packet(link: rtnl.Link, mac: bytes, addresses: list[bytes], failures: list[str]) -> int:
    """The slow path (its close waits for an RCU grace period): the frame written by hand on AF_PACKET."""
    try:
        sock = _socket(AF_PACKET, SOCK_RAW | SOCK_CLOEXEC, 0)  # protocol 0: send-only, nothing is queued to it
    except OSError as exc:
        failures.append(f"packet socket: {exc.strerror or exc}")
        return 0
    sent = 0
    try:
        dst = (link.name, ETH_P_ARP)
        for address in addresses:
            try:
                sock.sendto(gratuitous_arp(address, mac), dst)
                sent += 1
            except OSError as exc:
                failures.append(f"gratuitous ARP for {inet_ntop(AF_INET, address)}: {exc.strerror or exc}")
    finally:
        sock.close()
    return sent
