"""IP set-up of one rail interface inside the pod: sysctls, addresses, per-rail routing.

Mode-independent: shared mode (a macvlan/ipvlan) and exclusive mode (the moved netdev) both end
with an interface in the pod that gets configured the same way. Must run with the calling
thread inside the pod namespace (sysctls are written through /proc/sys of the current netns).

Per-rail source routing: each rail has its own routing table (routeTableBase + rail index) with
the rail's connected subnets and IPAM routes, and a rule `from <address> lookup <table>`, so
traffic from a rail's address (a RoCE v2 GID) always leaves by that rail, even when several rails
route the same destinations.
"""

from __future__ import annotations

from _socket import AF_INET, AF_INET6

from rdma_netns.kernel import neigh_announce, rtnl, sysctl
from rdma_netns.kernel.inet import Prefix
from rdma_netns.kernel.netlink import NetlinkSocket, is_missing
from rdma_netns.spec.errors import CHECK_FAILED, IPAM_FAILED, CniError
from rdma_netns.util import paths


class RailAddressing:
    """What IPAM gave one rail, parsed: (address/len, gateway) pairs, (dst, gw) routes, dns."""

    __slots__ = ("addresses", "routes", "dns")

    def __init__(self, dns: dict | None = None) -> None:
        self.addresses: list[tuple[Prefix, Prefix | None]] = []
        self.routes: list[tuple[Prefix, Prefix | None]] = []
        self.dns = dns or {}


def parse_ipam_result(result: dict, ifname: str) -> RailAddressing:
    out = RailAddressing(dns=result.get("dns") or {})
    try:
        for ip in result.get("ips") or []:
            gw = Prefix.parse(ip["gateway"]) if ip.get("gateway") else None
            out.addresses.append((Prefix.parse(ip["address"]), gw))
        for route in result.get("routes") or []:
            gw = Prefix.parse(route["gw"]) if route.get("gw") else None
            out.routes.append((Prefix.parse(route["dst"]).network, gw))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CniError(IPAM_FAILED, f"IPAM result for {ifname} is malformed: {exc}") from None
    return out


def prepare_sysctls(ifname: str, needs_ipv6: bool, link_local: bool = True) -> None:
    """IPv6 on (pods often start with it disabled), no router adverts, keep addresses on link down;
    and a link-local address usable from the first packet, or none when the config says so.

    When a RoCE QP moves to RTR the kernel resolves the peer's MAC through the neighbour table
    with no packet to take a source address from, and then the neighbour solicitation needs a
    link-local source that is not tentative (ndisc_send_ns): without one nothing is sent and the
    QP fails to reach RTR. So the rail keeps the EUI-64 link-local address the kernel makes at
    link up, and skips DAD on it (accept_dad 0, before the link goes up), which would leave it
    tentative for a second or more: macvlans get random MACs, each ipvlan its own dev_id (so its
    own EUI-64 address), and IPAM's addresses are unique and added nodad anyway.
    "linkLocal": false (addr_gen_mode 1) trades that for GID room: every address is a GID, two
    entries of mlx5's ~255 each. Set for IPv4-only rails too, whose IPv6 is often on.
    """
    has_ipv6 = paths.isdir(f"/proc/sys/net/ipv6/conf/{ifname}")
    if has_ipv6:
        if link_local:
            sysctl.set_ipv6_conf(ifname, "accept_dad", "0")
        else:
            sysctl.set_ipv6_conf(ifname, "addr_gen_mode", "1")
    if not needs_ipv6:
        return
    if not has_ipv6:
        raise CniError(IPAM_FAILED, "IPv6 is disabled in this kernel (no /proc/sys/net/ipv6), "
                                    f"but {ifname} was given an IPv6 address")
    sysctl.set_ipv6_conf(ifname, "disable_ipv6", "0")
    sysctl.set_ipv6_conf(ifname, "accept_ra", "0")
    sysctl.set_ipv6_conf(ifname, "keep_addr_on_down", "1")


def configure(sock: NetlinkSocket, link: rtnl.Link, plan: RailAddressing, table: int, priority: int,
              link_local: bool = True) -> None:
    """Bring the link up and give it its addresses, its routing table and its source rules.

    The three steps are separate functions so that ADD can run the GID-producing ones (link up,
    addresses) for all rails in lockstep under the node-wide GID order lock (rails/gid_order.py) and
    the routing outside it.
    """
    bring_up(sock, link, plan, link_local)
    add_addresses(sock, link, plan)
    add_routing(sock, link, plan, table, priority)


def bring_up(sock: NetlinkSocket, link: rtnl.Link, plan: RailAddressing, link_local: bool = True) -> None:
    """Sysctls, then link up: with link_local the kernel then adds the link-local address (a GID)."""
    prepare_sysctls(link.name, any(a.version == 6 for a, _ in plan.addresses), link_local)
    rtnl.set_link_up(sock, link.index)


def add_addresses(sock: NetlinkSocket, link: rtnl.Link, plan: RailAddressing) -> None:
    """The rail's addresses, in IPAM's order: each becomes a GID of the rail's RDMA port.

    IPv6 addresses are added with IFA_F_NODAD: IPAM hands out unique addresses, so DAD would
    only delay ADD by about 1.5 s (the Go plugins' cost). The RoCE GID appears at once either way.
    """
    for address, _gw in plan.addresses:
        rtnl.add_address(sock, link.index, address, nodad=True)


def add_routing(sock: NetlinkSocket, link: rtnl.Link, plan: RailAddressing, table: int, priority: int) -> None:
    """The rail's routing table and source rules; no GID changes, so outside the GID order lock.

    With NODAD the kernel announces nothing, so the end sends one unsolicited NA (IPv6) or
    gratuitous ARP (IPv4) per address: peers holding a stale entry for a reused address update it.
    """
    for network in _connected(plan):
        rtnl.add_route(sock, dst=network, index=link.index, table=table)
    for dst, gw in _gateway_routes(plan):
        rtnl.add_route(sock, dst=dst, index=link.index, gateway=gw, table=table)
    for address, _gw in plan.addresses:
        rtnl.add_source_rule(sock, address, table, priority)
    neigh_announce.announce(sock, link, [address for address, _gw in plan.addresses])


def remove_rules(sock: NetlinkSocket, addresses: list[Prefix], table: int, priority: int) -> None:
    """Policy rules outlive their interface, so teardown deletes them explicitly."""
    for address in addresses:
        try:
            rtnl.delete_source_rule(sock, address, table, priority)
        except OSError as exc:
            if not is_missing(exc):
                raise


def _connected(plan: RailAddressing) -> list[Prefix]:
    seen: list[Prefix] = []
    for address, _gw in plan.addresses:
        if address.network not in seen:
            seen.append(address.network)
    return seen


def _gateway_routes(plan: RailAddressing) -> list[tuple[Prefix, Prefix]]:
    """IPAM routes; a route without gw uses the gateway of the address in its family."""
    out = []
    for dst, gw in plan.routes:
        if gw is None:
            gw = next((g for a, g in plan.addresses if g is not None and a.version == dst.version), None)
        if gw is None:
            continue  # an on-link route: the connected route already covers the rail's subnet
        out.append((dst, gw))
    return out


def verify(sock: NetlinkSocket, link: rtnl.Link, plan: RailAddressing, table: int, priority: int) -> None:
    """CHECK: what configure() set up is still there, else CHECK_FAILED naming the difference."""
    if not link.flags & rtnl.IFF_UP:
        raise CniError(CHECK_FAILED, f"{link.name} is down")
    present = {a.interface: a.flags for a in rtnl.list_addresses(sock) if a.index == link.index}
    for address, _gw in plan.addresses:
        if address not in present:
            raise CniError(CHECK_FAILED, f"{link.name} lost its address {address}")
        if present[address] & rtnl.IFA_F_DADFAILED:
            raise CniError(CHECK_FAILED, f"{link.name}: address {address} failed duplicate address detection")
    families = {a.version for a, _ in plan.addresses}
    for family in families:
        af = AF_INET6 if family == 6 else AF_INET
        routes = {(r.dst, r.gateway) for r in rtnl.list_routes(sock, af) if r.table == table and r.oif == link.index}
        for network in _connected(plan):
            if network.version == family and (network, None) not in routes:
                raise CniError(CHECK_FAILED, f"route {network} dev {link.name} table {table} is missing")
        for dst, gw in _gateway_routes(plan):
            if dst.version == family and (dst, gw) not in routes:
                raise CniError(CHECK_FAILED, f"route {dst} via {gw} table {table} is missing")
        rules = {(r.src, r.table, r.priority) for r in rtnl.list_rules(sock, af)}
        for address, _gw in plan.addresses:
            if address.version == family:
                if (address.ip, table, priority) not in rules:
                    raise CniError(CHECK_FAILED, f"rule from {address.address_text()} lookup {table} is missing")
