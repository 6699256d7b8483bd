"""Which NICs an attachment uses ("rails"), resolved to host netdevs and RDMA ports.

A rail names its NIC by netdev, rdmaDevice or pciAddress; with no rails configured every
RDMA device on the node is a rail (on its bond under RoCE LAG). runtimeConfig.deviceID (a PCI address or an
auxiliary device name, as device plugins hand them out) narrows the attachment to that NIC, and
so do kubelet's grants in exclusive mode with pairing (commands/pairing.py).
"""

from __future__ import annotations

from rdma_netns.config.netconf import NetConfig, RailConf
from rdma_netns.kernel import rdma_sysfs, rtnl
from rdma_netns.kernel.netlink import NetlinkSocket
from rdma_netns.spec.errors import INVALID_CONFIG, NO_RDMA, NOT_GRANTED, RAIL_UNAVAILABLE, CniError


class Rail:
    """One resolved rail of an attachment."""

    __slots__ = ("index", "ifname", "netdev", "ipam", "mtu", "rdma", "range_rule", "node_range")

    def __init__(self, index: int, ifname: str, netdev: str, ipam: dict, mtu: int | None,
                 rdma: rdma_sysfs.RdmaPort | None, range_rule: dict | None = None) -> None:
        self.index, self.ifname, self.netdev, self.ipam, self.mtu, self.rdma = index, ifname, netdev, ipam, mtu, rdma
        self.range_rule = range_rule  # rangeFromNodeAddress: ipam's ranges come from the node's address
        self.node_range = None  # node_range.NodeRange, once derived (ADD); ipam then carries its ranges

    def to_state(self) -> dict:
        out = {"index": self.index, "ifname": self.ifname, "netdev": self.netdev, "ipam": self.ipam,
               "rdmaDevice": self.rdma.device if self.rdma else None, "port": self.rdma.port if self.rdma else None}
        if self.node_range is not None:
            out["nodeRange"] = self.node_range.to_state()
        return out


def configured_rails(net: NetConfig) -> list[RailConf]:
    """The rail entries of the config, or one per RDMA netdev of the node when none are listed."""
    if net.rails:
        return net.rails
    # One rail per RDMA device, on the netdev a rail of it uses (its bond under RoCE LAG: one rail
    # for mlx5_bond_N, never one per member); two devices on one bond make one rail.
    netdevs = [nds[0] for dev in rdma_sysfs.devices() if (nds := rdma_sysfs.rail_netdevs_of_device(dev))]
    found = [RailConf(netdev=nd) for nd in dict.fromkeys(netdevs)]
    if not found:
        raise CniError(NO_RDMA, "no rails configured and no RDMA-capable netdev found on this node",
                       "list the NICs under \"rails\" (netdev, rdmaDevice or pciAddress)")
    return found


def pod_ifnames(entries: list[RailConf], cni_ifname: str, chained: bool) -> list[str]:
    """The rails' pod-side names: a rail's own ifname, else rdma<N>.

    As the pod's only network (not chained), rail 0 is named CNI_IFNAME unless a rail already is:
    a CRI runtime (containerd, CRI-O) takes the pod IP only from the interface of that name and
    fails the sandbox without one.
    """
    names = [e.ifname or f"rdma{i}" for i, e in enumerate(entries)]
    if names and not chained and cni_ifname not in names:
        names[0] = cni_ifname
    return names


def netdev_of(entry: RailConf) -> str:
    """The host netdev a rail entry uses (rdmaDevice and pciAddress resolved through sysfs).

    A bond member always resolves to its bond (kernel/rdma_sysfs.py, "bonds"): under RoCE LAG the
    device's and the PCI function's netdev is a member, which can neither take a sub-interface nor
    leave the host without breaking the LAG; `netdev: bond0`, `rdmaDevice: mlx5_bond_0` and
    either member's PCI address are one rail.
    """
    if entry.netdev:
        return rdma_sysfs.rail_netdev(entry.netdev)
    if entry.rdma_device:
        found = rdma_sysfs.netdevs_of_device(entry.rdma_device)
        what = f"RDMA device {entry.rdma_device}"
    else:
        found = rdma_sysfs.netdevs_of_pci(entry.pci_address or "")
        what = f"PCI device {entry.pci_address}"
    if not found:
        raise CniError(RAIL_UNAVAILABLE, f"{what} has no netdev in this namespace (missing, or moved elsewhere)")
    return rdma_sysfs.rail_netdev(found[0])


def _resolved_netdev(entry: RailConf) -> str | None:
    try:
        return netdev_of(entry)
    except CniError:
        return None


def narrow(entries: list[RailConf], device_ids: list[str], what: str, absent_code: int,
           foreign_code: int) -> list[RailConf]:
    """The rails whose NIC one of `device_ids` names (PCI address, auxiliary or RDMA device name),
    in config order. Never a NIC outside the configured rails: device IDs come from the pod's side
    (Multus, the runtime) or kubelet's grants and must not be able to take any interface of the node."""
    chosen: set[int] = set()
    for device_id in device_ids:
        netdevs = [rdma_sysfs.rail_netdev(nd) for nd in
                   rdma_sysfs.netdevs_of_pci(device_id) or rdma_sysfs.netdevs_of_device(device_id)]
        hits = [i for i, e in enumerate(entries)
                if device_id in (e.pci_address, e.rdma_device)
                or (netdevs and _resolved_netdev(e) in netdevs)]
        if not hits:
            if not netdevs:
                raise CniError(absent_code, f"{what} {device_id} has no netdev on this node")
            raise CniError(foreign_code, f"{what} {device_id} is not one of the configured rails")
        chosen.update(hits)
    return [e for i, e in enumerate(entries) if i in chosen]


def plan(net: NetConfig, cni_ifname: str, device_id: str | None, chained: bool,
         granted_ids: list[str] | None = None) -> list[Rail]:
    """Resolve the attachment's rails; every name and NIC is checked before anything changes.

    granted_ids (exclusive mode with pairing): kubelet's unit IDs for the pod, one NIC each.
    """
    entries = configured_rails(net)
    if granted_ids is not None:
        entries = narrow(entries, granted_ids, f"{net.resource_name} unit granted to the pod",
                         NOT_GRANTED, NOT_GRANTED)
    if device_id:
        entries = narrow(entries, [device_id], "runtimeConfig.deviceID", RAIL_UNAVAILABLE, INVALID_CONFIG)
    rdma_present = rdma_sysfs.subsystem_present()
    if net.require_rdma and not rdma_present:
        raise CniError(NO_RDMA, "this kernel has no RDMA subsystem (ib_core is not loaded)",
                       "set \"requireRdma\": false to run on plain netdevs (tests, demos)")
    rails: list[Rail] = []
    names = pod_ifnames(entries, cni_ifname, chained)
    for index, entry in enumerate(entries):
        if not (entry.ipam or net.ipam):
            raise CniError(INVALID_CONFIG, f"rail {index} has no ipam (its own, or the top-level default); only "
                           "exclusive mode chained after a netdev plugin runs without IPAM")
        netdev = netdev_of(entry)
        port = rdma_sysfs.device_of_netdev(netdev) if rdma_present else None
        if net.require_rdma and port is None:
            members = rdma_sysfs.bond_members(netdev)
            raise CniError(NO_RDMA, f"rail netdev {netdev} belongs to no RDMA device"
                           + (f" (none of its bond members {', '.join(members)} is an RDMA port)" if members else ""))
        rails.append(Rail(index=index, ifname=names[index],
                          netdev=netdev, ipam=entry.ipam or net.ipam, mtu=entry.mtu or net.mtu,
                          rdma=port, range_rule=net.range_rule(entry)))
    for attr, what in (("ifname", "interface name"), ("netdev", "netdev")):
        values = [getattr(r, attr) for r in rails]
        if len(values) != len(set(values)):
            raise CniError(INVALID_CONFIG, f"two rails resolve to the same {what}: {', '.join(values)}")
    return rails


def host_parent(sock: NetlinkSocket, rail: Rail, must_be_up: bool) -> rtnl.Link:
    """The rail's netdev in the host; must_be_up: the mode needs it up (shared: its pods' links
    follow it)."""
    link = rtnl.get_link(sock, rail.netdev)
    if link is None:
        raise CniError(RAIL_UNAVAILABLE, f"rail netdev {rail.netdev} does not exist in the host namespace")
    if link.flags & rtnl.IFF_LOOPBACK:
        raise CniError(RAIL_UNAVAILABLE, f"rail netdev {rail.netdev} is a loopback device, not a NIC")
    if must_be_up and not link.flags & rtnl.IFF_UP:
        raise CniError(RAIL_UNAVAILABLE, f"rail netdev {rail.netdev} is down")
    return link


def routing(net: NetConfig, link: rtnl.Link) -> tuple[int, int]:
    """A rail's routing table and rule priority in the pod.

    The table is derived from the interface's index in the pod, which is unique there, so two
    attachments (even of different networks) in one pod never share a table, and teardown can
    find the table again from the link without trusting stored numbers.
    """
    return net.route_table_base + link.index, net.rule_priority_base
