"""The rtnetlink requests the plugin needs: links, addresses, routes and policy rules.

Every function takes the NetlinkSocket to use, so the caller decides in which network
namespace a request runs (a socket acts in the namespace it was created in).
"""

from __future__ import annotations

import posix
import struct
from _socket import AF_INET6, AF_UNSPEC

from rdma_netns.kernel.inet import Prefix
from rdma_netns.kernel.netlink import (
    NLM_F_CREATE,
    NLM_F_EXCL,
    NetlinkSocket,
    attr,
    attr_nested,
    attr_str,
    attr_u16,
    attr_u32,
    attr_text,
    is_missing,
    parse_attrs,
    u32,
)

RTM_NEWLINK, RTM_DELLINK, RTM_GETLINK, RTM_SETLINK = 16, 17, 18, 19
RTM_NEWADDR, RTM_DELADDR, RTM_GETADDR = 20, 21, 22
RTM_NEWROUTE, RTM_DELROUTE, RTM_GETROUTE = 24, 25, 26
RTM_NEWRULE, RTM_DELRULE, RTM_GETRULE = 32, 33, 34

IFINFOMSG = struct.Struct("=BxHiII")     # family, type, index, flags, change
IFADDRMSG = struct.Struct("=BBBBI")      # family, prefixlen, flags, scope, index
RTMSG = struct.Struct("=BBBBBBBBI")      # family, dst_len, src_len, tos, table, proto, scope, type, flags
FIB_RULE_HDR = struct.Struct("=BBBBBBBBI")  # family, dst_len, src_len, tos, table, res1, res2, action, flags

IFLA_ADDRESS, IFLA_IFNAME, IFLA_MTU, IFLA_LINK = 1, 3, 4, 5
IFLA_LINKINFO, IFLA_GROUP, IFLA_NET_NS_FD = 18, 27, 28
IFLA_INFO_KIND, IFLA_INFO_DATA = 1, 2
IFLA_MACVLAN_MODE = 1
IFLA_IPVLAN_MODE = 1
IFF_UP = 0x1
IFF_LOOPBACK = 0x8

MACVLAN_MODES = {"private": 1, "vepa": 2, "bridge": 4, "passthru": 8}
IPVLAN_MODES = {"l2": 0, "l3": 1, "l3s": 2}

IFA_ADDRESS, IFA_LOCAL, IFA_FLAGS = 1, 2, 8
IFA_F_TEMPORARY, IFA_F_NODAD, IFA_F_OPTIMISTIC, IFA_F_DADFAILED = 0x01, 0x02, 0x04, 0x08
IFA_F_DEPRECATED, IFA_F_TENTATIVE = 0x20, 0x40

RTA_DST, RTA_OIF, RTA_GATEWAY, RTA_PRIORITY, RTA_TABLE = 1, 4, 5, 6, 15
RT_TABLE_UNSPEC, RT_TABLE_MAIN = 0, 254
RTPROT_BOOT, RTPROT_KERNEL = 3, 2
RT_SCOPE_UNIVERSE, RT_SCOPE_LINK = 0, 253
RTN_UNICAST = 1

FRA_DST, FRA_SRC, FRA_PRIORITY, FRA_TABLE = 1, 2, 6, 15
FR_ACT_TO_TBL = 1


class Link:
    __slots__ = ("index", "name", "flags", "mac", "kind", "parent_index")

    def __init__(self, index: int, name: str, flags: int, mac: str, kind: str, parent_index: int) -> None:
        self.index, self.name, self.flags, self.mac, self.kind = index, name, flags, mac, kind
        self.parent_index = parent_index


def _mac_text(raw: bytes) -> str:
    return ":".join(f"{b:02x}" for b in raw)


def _parse_link(body: bytes) -> Link:
    _fam, _type, index, flags, _change = IFINFOMSG.unpack_from(body)
    attrs = parse_attrs(body, IFINFOMSG.size)
    kind = ""
    if IFLA_LINKINFO in attrs:
        info = parse_attrs(attrs[IFLA_LINKINFO])
        kind = attr_text(info.get(IFLA_INFO_KIND, b""))
    return Link(
        index=index,
        name=attr_text(attrs.get(IFLA_IFNAME, b"")),
        flags=flags,
        mac=_mac_text(attrs.get(IFLA_ADDRESS, b"")),
        kind=kind,
        parent_index=u32(attrs[IFLA_LINK]) if IFLA_LINK in attrs else 0,
    )


def get_link(sock: NetlinkSocket, name: str) -> Link | None:
    """The link called `name`, or None when there is none."""
    body = IFINFOMSG.pack(AF_UNSPEC, 0, 0, 0, 0) + attr_str(IFLA_IFNAME, name)
    try:
        replies = sock.query(RTM_GETLINK, body, what=f"get link {name}")
    except OSError as exc:
        if is_missing(exc):
            return None
        raise
    return _parse_link(replies[0]) if replies else None


def list_links(sock: NetlinkSocket) -> list[Link]:
    return [_parse_link(b) for b in sock.dump(RTM_GETLINK, IFINFOMSG.pack(AF_UNSPEC, 0, 0, 0, 0), "list links")]


def create_sublink(
    sock: NetlinkSocket, *, kind: str, mode: str, parent_index: int, name: str, netns_fd: int, mtu: int = 0,
    mac: str | None = None,
) -> None:
    """Create a macvlan or ipvlan on `parent_index`, born directly in the namespace `netns_fd`.

    Creating it inside the target namespace (IFLA_NET_NS_FD on NEWLINK) means the host never
    sees the pod's interface name, so it cannot clash with a host interface.
    """
    if kind == "macvlan":
        data = attr_u32(IFLA_MACVLAN_MODE, MACVLAN_MODES[mode])
    elif kind == "ipvlan":
        data = attr_u16(IFLA_IPVLAN_MODE, IPVLAN_MODES[mode])
    else:
        raise ValueError(f"unsupported link kind {kind}")
    body = (
        IFINFOMSG.pack(AF_UNSPEC, 0, 0, 0, 0)
        + attr_str(IFLA_IFNAME, name)
        + attr_u32(IFLA_LINK, parent_index)
        + attr_u32(IFLA_NET_NS_FD, netns_fd)
        + attr_nested(IFLA_LINKINFO, attr_str(IFLA_INFO_KIND, kind), attr_nested(IFLA_INFO_DATA, data))
    )
    if mtu:
        body += attr_u32(IFLA_MTU, mtu)
    if mac:
        body += attr(IFLA_ADDRESS, bytes.fromhex(mac.replace(":", "")))
    sock.request(RTM_NEWLINK, body, NLM_F_CREATE | NLM_F_EXCL, what=f"create {kind} {name}")


def set_link_up(sock: NetlinkSocket, index: int, up: bool = True) -> None:
    body = IFINFOMSG.pack(AF_UNSPEC, 0, index, IFF_UP if up else 0, IFF_UP)
    sock.request(RTM_NEWLINK, body, what=f"set link {index} {'up' if up else 'down'}")


def delete_link(sock: NetlinkSocket, index: int) -> None:
    sock.request(RTM_DELLINK, IFINFOMSG.pack(AF_UNSPEC, 0, index, 0, 0), what=f"delete link {index}")


# The device group teardown gives the links it deletes together: a value no one else sets in a
# pod's namespace (interfaces start in group 0), made distinct per process so that two
# teardowns in one namespace at once never take each other's links.
DELETE_GROUP_BASE = 0x52440000


def delete_links(sock: NetlinkSocket, indexes: list[int], group: int | None = None) -> None:
    """Delete several links in one step: each joins one device group, then one RTM_DELLINK of
    that group, which the kernel unregisters together (one RCU grace period, not one per link)."""
    group = DELETE_GROUP_BASE | (posix.getpid() & 0xFFFF) if group is None else group
    for index in indexes:
        sock.request(RTM_NEWLINK, IFINFOMSG.pack(AF_UNSPEC, 0, index, 0, 0) + attr_u32(IFLA_GROUP, group),
                     what=f"set link {index} group {group}")
    sock.request(RTM_DELLINK, IFINFOMSG.pack(AF_UNSPEC, 0, 0, 0, 0) + attr_u32(IFLA_GROUP, group),
                 what=f"delete link group {group}")


def add_address(sock: NetlinkSocket, index: int, iface: Prefix, *, nodad: bool) -> None:
    packed = iface.packed
    flags = IFA_F_NODAD if nodad and iface.version == 6 else 0
    body = (
        IFADDRMSG.pack(iface.family, iface.prefixlen, flags & 0xFF, RT_SCOPE_UNIVERSE, index)
        + attr(IFA_LOCAL, packed)
        + attr(IFA_ADDRESS, packed)
        + attr_u32(IFA_FLAGS, flags)
    )
    sock.request(RTM_NEWADDR, body, NLM_F_CREATE | NLM_F_EXCL, what=f"add address {iface}")


class Address:
    __slots__ = ("index", "interface", "flags", "scope")

    def __init__(self, index: int, interface: Prefix, flags: int, scope: int = RT_SCOPE_UNIVERSE) -> None:
        self.index, self.interface, self.flags, self.scope = index, interface, flags, scope


def list_addresses(sock: NetlinkSocket, family: int = AF_UNSPEC, index: int = 0) -> list[Address]:
    """The namespace's addresses (index: only that interface's; the kernel dumps them all)."""
    out = []
    for body in sock.dump(RTM_GETADDR, IFADDRMSG.pack(family, 0, 0, 0, 0), "list addresses"):
        _fam, plen, flags8, scope, ifindex = IFADDRMSG.unpack_from(body)
        if index and ifindex != index:
            continue
        attrs = parse_attrs(body, IFADDRMSG.size)
        raw = attrs.get(IFA_LOCAL) or attrs.get(IFA_ADDRESS)
        if raw is None:
            continue
        flags = u32(attrs[IFA_FLAGS]) if IFA_FLAGS in attrs else flags8
        out.append(Address(ifindex, Prefix.from_bytes(raw, plen), flags, scope))
    return out


def add_route(sock: NetlinkSocket, *, dst: Prefix, index: int, gateway: Prefix | None = None,
              table: int = RT_TABLE_MAIN, priority: int = 0) -> None:
    scope = RT_SCOPE_UNIVERSE if gateway is not None else RT_SCOPE_LINK
    if dst.version == 6:
        scope = RT_SCOPE_UNIVERSE  # IPv6 routes are always universe scope
    body = (
        RTMSG.pack(dst.family, dst.prefixlen, 0, 0, table if table < 256 else RT_TABLE_UNSPEC,
                   RTPROT_BOOT, scope, RTN_UNICAST, 0)
        + attr_u32(RTA_TABLE, table)
        + attr_u32(RTA_OIF, index)
    )
    if dst.prefixlen:
        body += attr(RTA_DST, dst.network.packed)
    if gateway is not None:
        body += attr(RTA_GATEWAY, gateway.packed)
    if priority:
        body += attr_u32(RTA_PRIORITY, priority)
    sock.request(RTM_NEWROUTE, body, NLM_F_CREATE | NLM_F_EXCL, what=f"add route {dst} table {table}")


class Route:
    __slots__ = ("dst", "gateway", "oif", "table")

    def __init__(self, dst: Prefix, gateway: Prefix | None, oif: int, table: int) -> None:
        self.dst, self.gateway, self.oif, self.table = dst, gateway, oif, table


def list_routes(sock: NetlinkSocket, family: int) -> list[Route]:
    out = []
    for body in sock.dump(RTM_GETROUTE, RTMSG.pack(family, 0, 0, 0, 0, 0, 0, 0, 0), "list routes"):
        fam, dst_len, _sl, _tos, table8, _proto, _scope, rtype, _flags = RTMSG.unpack_from(body)
        if rtype != RTN_UNICAST:
            continue
        attrs = parse_attrs(body, RTMSG.size)
        zero = b"\0" * (16 if fam == AF_INET6 else 4)
        dst = Prefix.from_bytes(attrs.get(RTA_DST, zero), dst_len)
        gw = Prefix.from_bytes(attrs[RTA_GATEWAY]) if RTA_GATEWAY in attrs else None
        out.append(Route(dst, gw, u32(attrs[RTA_OIF]) if RTA_OIF in attrs else 0,
                         u32(attrs[RTA_TABLE]) if RTA_TABLE in attrs else table8))
    return out


def _rule_body(src: Prefix, table: int, priority: int) -> bytes:
    return (
        FIB_RULE_HDR.pack(src.family, 0, src.max_prefixlen, 0, table if table < 256 else 0, 0, 0,
                          FR_ACT_TO_TBL, 0)
        + attr(FRA_SRC, src.packed)
        + attr_u32(FRA_TABLE, table)
        + attr_u32(FRA_PRIORITY, priority)
    )


def add_source_rule(sock: NetlinkSocket, src: Prefix, table: int, priority: int) -> None:
    """`from <src>/max lookup <table> pref <priority>`: traffic of that address leaves by its rail."""
    sock.request(RTM_NEWRULE, _rule_body(src, table, priority), NLM_F_CREATE | NLM_F_EXCL,
                 what=f"add rule from {src.address_text()} lookup {table}")


class Rule:
    __slots__ = ("src", "table", "priority")

    def __init__(self, src: Prefix | None, table: int, priority: int) -> None:
        self.src, self.table, self.priority = src, table, priority


def list_rules(sock: NetlinkSocket, family: int) -> list[Rule]:
    out = []
    for body in sock.dump(RTM_GETRULE, FIB_RULE_HDR.pack(family, 0, 0, 0, 0, 0, 0, 0, 0), "list rules"):
        fam, _dl, src_len, _tos, table8, _r1, _r2, _action, _flags = FIB_RULE_HDR.unpack_from(body)
        attrs = parse_attrs(body, FIB_RULE_HDR.size)
        src = None
        if FRA_SRC in attrs:
            src = Prefix.from_bytes(attrs[FRA_SRC], src_len)
        out.append(Rule(src, u32(attrs[FRA_TABLE]) if FRA_TABLE in attrs else table8,
                        u32(attrs[FRA_PRIORITY]) if FRA_PRIORITY in attrs else 0))
    return out


def delete_source_rule(sock: NetlinkSocket, src: Prefix, table: int, priority: int) -> None:
    sock.request(RTM_DELRULE, _rule_body(src, table, priority),
                 what=f"delete rule from {src.address_text()} lookup {table}")


def move_link(sock: NetlinkSocket, index: int, netns_fd: int, name: str) -> None:
    """Move a link to the namespace `netns_fd`, named `name` there, in one request.

    The kernel closes the link on the move and applies the new name in the target namespace, so
    the old name never has to be free there and the new name is never used in the source.
    """
    body = (IFINFOMSG.pack(AF_UNSPEC, 0, index, 0, 0) + attr_u32(IFLA_NET_NS_FD, netns_fd)
            + attr_str(IFLA_IFNAME, name))
    sock.request(RTM_NEWLINK, body, what=f"move link {index} as {name}")


def rename_link(sock: NetlinkSocket, index: int, name: str) -> None:
    """Rename a link (it must be down)."""
    sock.request(RTM_NEWLINK, IFINFOMSG.pack(AF_UNSPEC, 0, index, 0, 0) + attr_str(IFLA_IFNAME, name),
                 what=f"rename link {index} to {name}")
