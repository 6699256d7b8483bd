"""`rdma-netns devices [--json]`: RDMA devices, ports, state, netdevs and GIDs, with each GID's owner.

Run inside a pod it is a per-pod `show_gids`: in shared mode every namespace sees each device's
whole GID table (the host's entries and every pod's), and the index of the pod's own GID differs
per pod and per device. So each port lists the current namespace's own GIDs first, then the
others marked as the host's or another namespace's. An entry is this namespace's when its ndev
names an interface here and its GID is one of that interface's addresses (or its EUI-64
link-local address); "host" when its ndev is the device's own netdev (or, under RoCE LAG, its
bond, which carries the host's addresses); else another namespace's.

Each port also shows how full its GID table is (a full table silently takes no new address:
mlx5 has 255 entries, 2 per address), and under RoCE LAG the bond its netdev is a member of.

In exclusive mode a device is visible only in the namespace that holds it, so the listing
visits every named namespace (/var/run/netns) as well as the host's.
"""

from __future__ import annotations

import os

from rdma_netns.kernel import netns, netns_sysfs, rdma_sysfs, rtnl
from rdma_netns.kernel.inet import Prefix
from rdma_netns.kernel.netlink import NetlinkSocket
from rdma_netns.kernel.netns import NETNS_RUN_DIR

SELF, HOST, OTHER = "self", "host", "other"
OWNER_TEXT = {SELF: "this namespace", HOST: "host", OTHER: "another namespace"}
DEFAULT_GID_LIMIT = 64  # entries read per port: soft devices have 1024, slow to read under emulation


def eui64_link_local(mac: str) -> str | None:
    """The GID text of the EUI-64 link-local address the kernel derives from a MAC (fe80::...)."""
    parts = mac.split(":")
    if len(parts) != 6:
        return None
    try:
        octets = [int(p, 16) for p in parts]
    except ValueError:
        return None
    if not any(octets):
        return None
    iid = bytes([octets[0] ^ 0x02, *octets[1:3], 0xFF, 0xFE, *octets[3:]])
    return rdma_sysfs.gid_text(Prefix.from_bytes(b"\xfe\x80" + b"\0" * 6 + iid))


def local_gids() -> dict[str, set[str]]:
    """{interface name: GID texts of its addresses} of the current network namespace."""
    with NetlinkSocket() as sock:
        links = rtnl.list_links(sock)
        addresses = rtnl.list_addresses(sock)
    names = {link.index: link.name for link in links}
    out: dict[str, set[str]] = {link.name: set() for link in links}
    for address in addresses:
        if address.index in names:
            out[names[address.index]].add(rdma_sysfs.gid_text(address.interface))
    for link in links:
        ll = eui64_link_local(link.mac)
        if ll:
            out[link.name].add(ll)
    return out


def owner(entry: rdma_sysfs.GidEntry, local: dict[str, set[str]], device_netdevs: list[str]) -> str:
    if entry.gid in local.get(entry.ndev, ()):
        return SELF
    if entry.ndev in device_netdevs:
        return HOST
    return OTHER


def port_gids(sysfs: rdma_sysfs.RdmaSysfs, device: str, port: int, local: dict[str, set[str]],
              limit: int = DEFAULT_GID_LIMIT) -> list[dict]:
    """A port's GID entries with their owner, this namespace's first (then by index)."""
    netdevs = [*sysfs.netdevs_of_device(device), *sysfs.rail_netdevs_of_device(device)]
    rows = [{"index": g.index, "gid": g.gid, "type": g.gid_type, "ndev": g.ndev,
             "owner": owner(g, local, netdevs)}
            for g in sysfs.gids(rdma_sysfs.RdmaPort(device, port), limit)]
    return sorted(rows, key=lambda r: (r["owner"] != SELF, r["index"]))


def bond_facts(sysfs: rdma_sysfs.RdmaSysfs, netdev: str | None) -> dict:
    """The bond a port's netdev is a member of (or is), and its members; None and [] otherwise."""
    bond = sysfs.rail_netdev(netdev) if netdev else None
    if bond is None or not sysfs.is_bond(bond):
        return {"bond": None, "bondMembers": []}
    return {"bond": bond, "bondMembers": sysfs.bond_members(bond)}


def gid_table_facts(sysfs: rdma_sysfs.RdmaSysfs, device: str, port: int) -> dict:
    """How full a port's GID table is (whole table: the limit bounds only the listing)."""
    usage = sysfs.gid_usage(rdma_sysfs.RdmaPort(device, port))
    if usage is None:
        return {"gidsUsed": None, "gidsTotal": None, "gidEntriesPerAddress": None}
    return {"gidsUsed": usage.used, "gidsTotal": usage.total, "gidEntriesPerAddress": usage.per_address}


def _port_facts(keys: list[tuple[str, int, str | None]], local: dict[str, set[str]], limit: int) -> list[dict]:
    """Per port: its bond, GID table fill and GID entries, all read through one sysfs view."""
    sysfs = rdma_sysfs.default
    return [{**bond_facts(sysfs, netdev), **gid_table_facts(sysfs, dev, port),
             "gids": port_gids(sysfs, dev, port, local, limit)} for dev, port, netdev in keys]


def _ports_here() -> list[tuple[str, int, str, str | None]]:
    """(device, port, state, netdev) of the ports visible here: NETLINK_RDMA, else sysfs."""
    try:
        from rdma_netns.kernel.rdma_nldev import RdmaNetlink

        with RdmaNetlink() as rdma:
            return [(p.device_name, p.port_index, p.state_name, p.netdev_name) for p in rdma.ports()]
    except OSError:
        sysfs = rdma_sysfs.default
        return [(dev, port, sysfs.port_status(dev, port)[0] or "?", (sysfs.netdevs_of_device(dev) or [None])[0])
                for dev in sysfs.device_names() for port in sysfs.ports(dev)]


def _rows_here(namespace: str, view_fd: int | None, limit: int) -> list[dict]:
    """Devices and ports visible in the current namespace; GIDs through that namespace's sysfs,
    owners relative to the current namespace's interfaces."""
    ports = _ports_here()
    try:
        local = local_gids()
    except OSError:
        local = {}
    keys = [(dev, port, netdev) for dev, port, _state, netdev in ports]
    if view_fd is None:
        facts = _port_facts(keys, local, limit)
    else:
        facts = netns_sysfs.call_in_pod_view(view_fd, lambda: _port_facts(keys, local, limit))
    return [{"device": dev, "port": port, "state": state, "netdev": netdev,
             "pci": rdma_sysfs.pci_address_of_device(dev), "namespace": namespace, **fact}
            for (dev, port, state, netdev), fact in zip(ports, facts)]


def collect(limit: int = DEFAULT_GID_LIMIT) -> list[dict]:
    mode = rdma_sysfs.netns_mode()
    if mode is None:
        return []
    rows = _rows_here("host" if mode == "exclusive" else "all (shared mode)", None, limit)
    if mode != "exclusive":
        return rows
    try:
        names = sorted(os.listdir(NETNS_RUN_DIR))
    except OSError:
        names = []
    for name in names:
        try:
            fd = netns.open_netns(f"{NETNS_RUN_DIR}/{name}")
        except (OSError, netns.NotANetns):
            continue
        try:
            with netns.inside(fd):
                rows += _rows_here(name, fd, limit)
        finally:
            os.close(fd)
    return rows


def netdev_text(row: dict) -> str:
    """The NETDEV column: the netdev, or under RoCE LAG its bond and members: bond0 (eth1+eth2)."""
    if row.get("bond"):
        return f"{row['bond']} ({'+'.join(row['bondMembers'])})"
    return row["netdev"] or "-"


def gids_text(row: dict) -> str:
    """The GIDS column: entries used/total, 6/255."""
    return "-" if row.get("gidsTotal") is None else f"{row['gidsUsed']}/{row['gidsTotal']}"


def table(rows: list[dict]) -> str:
    if not rows:
        return "no RDMA devices (or no RDMA subsystem) on this node"
    width = max(12, *(len(netdev_text(r)) for r in rows))
    out = [f"{'DEVICE':<12} {'PORT':>4} {'STATE':<8} {'NETDEV':<{width}} {'PCI':<14} {'GIDS':<9} NAMESPACE"]
    for r in rows:
        out.append(f"{r['device']:<12} {r['port']:>4} {r['state']:<8} {netdev_text(r):<{width}} "
                   f"{r['pci'] or '-':<14} {gids_text(r):<9} {r['namespace']}")
    for r in rows:
        out.append("")
        out.append(f"{r['device']} port {r['port']} GIDs (own first):")
        if not r["gids"]:
            out.append("  none")
            continue
        out.append(f"  {'INDEX':>5}  {'GID':<39}  {'TYPE':<11}  {'NDEV':<15}  OWNER")
        for g in r["gids"]:
            out.append(f"  {g['index']:>5}  {g['gid']:<39}  {g['type'] or '-':<11}  {g['ndev'] or '-':<15}  "
                       f"{OWNER_TEXT.get(g['owner'], g['owner'])}")
    return "\n".join(out)
