"""Which NICs an attachment uses ("rails"), resolved to host netdevs and RDMA ports.

A rail names its NIC by netdev, rdmaDevice or pciAddress; with no rails configured every
RDMA-capable netdev on the node is a rail. runtimeConfig.deviceID (a PCI address or an
auxiliary device name, as device plugins hand them out) narrows the attachment to that NIC.
"""

from __future__ import annotations

from rdma_netns.kernel import rdma_sysfs
from rdma_netns.spec.errors import INVALID_CONFIG, NO_RDMA, RAIL_UNAVAILABLE, CniError


class Rail:
    """One resolved rail of an attachment."""

    __slots__ = ("index", "ifname", "netdev", "ipam", "mtu", "rdma")

    def __init__(self, index: int, ifname: str, netdev: str, ipam: dict, mtu: int | None,
                 rdma: rdma_sysfs.RdmaPort | None) -> None:
        self.index, self.ifname, self.netdev, self.ipam, self.mtu, self.rdma = index, ifname, netdev, ipam, mtu, rdma

    def to_state(self) -> dict:
        return {"index": self.index, "ifname": self.ifname, "netdev": self.netdev, "ipam": self.ipam,
                "rdmaDevice": self.rdma.device if self.rdma else None, "port": self.rdma.port if self.rdma else None}


def configured_rails(net: dict) -> list[dict]:
    """The rail entries of the config, or one per RDMA netdev of the node when none are listed."""
    if net["rails"]:
        return net["rails"]
    found = [{"netdev": nd} for dev in rdma_sysfs.devices() for nd in rdma_sysfs.netdevs_of_device(dev)]
    if not found:
        raise CniError(NO_RDMA, "no rails configured and no RDMA-capable netdev found on this node",
                       "list the NICs under \"rails\" (netdev, rdmaDevice or pciAddress)")
    return [dict(r, ifname=None, ipam=None, mtu=None, rdmaDevice=None, pciAddress=None) for r in found]


def default_ifname(entry: dict, index: int, count: int, cni_ifname: str, chained: bool) -> str:
    """A rail's pod-side name: its own ifname, else CNI_IFNAME for a lone rail, else rdma<N>."""
    if entry.get("ifname"):
        return entry["ifname"]
    if count == 1 and not chained:
        return cni_ifname
    return f"rdma{index}"


def netdev_of(entry: dict) -> str:
    """The host netdev a rail entry names (rdmaDevice and pciAddress resolved through sysfs)."""
    if entry.get("netdev"):
        return entry["netdev"]
    if entry.get("rdmaDevice"):
        found = rdma_sysfs.netdevs_of_device(entry["rdmaDevice"])
        what = f"RDMA device {entry['rdmaDevice']}"
    else:
        found = rdma_sysfs.netdevs_of_pci(entry["pciAddress"])
        what = f"PCI device {entry['pciAddress']}"
    if not found:
        raise CniError(RAIL_UNAVAILABLE, f"{what} has no netdev in this namespace (missing, or moved elsewhere)")
    return found[0]


def _by_device_id(entries: list[dict], device_id: str) -> list[dict]:
    """Narrow the rails to the one NIC the runtime's deviceID names."""
    netdevs = rdma_sysfs.netdevs_of_pci(device_id) or rdma_sysfs.netdevs_of_device(device_id)
    if not netdevs:
        raise CniError(RAIL_UNAVAILABLE, f"runtimeConfig.deviceID {device_id} has no netdev on this node")
    for entry in entries:
        if (entry.get("pciAddress") == device_id or entry.get("rdmaDevice") == device_id
                or entry.get("netdev") in netdevs):
            return [entry]
    # Never a NIC outside the configured rails, even with one rail: deviceID comes from the pod's
    # side (Multus, the runtime) and must not be able to take any interface of the node.
    raise CniError(INVALID_CONFIG, f"runtimeConfig.deviceID {device_id} is not one of the configured rails")


def plan(net: dict, cni_ifname: str, device_id: str | None, chained: bool) -> list[Rail]:
    """Resolve the attachment's rails; every name and NIC is checked before anything changes."""
    entries = configured_rails(net)
    if device_id:
        entries = _by_device_id(entries, device_id)
    rdma_present = rdma_sysfs.subsystem_present()
    if net["requireRdma"] and not rdma_present:
        raise CniError(NO_RDMA, "this kernel has no RDMA subsystem (ib_core is not loaded)",
                       "set \"requireRdma\": false to run on plain netdevs (tests, demos)")
    rails: list[Rail] = []
    for index, entry in enumerate(entries):
        if not (entry.get("ipam") or net["ipam"]):
            raise CniError(INVALID_CONFIG, f"rail {index} has no ipam (its own, or the top-level default); only "
                           "exclusive mode chained after a netdev plugin runs without IPAM")
        netdev = netdev_of(entry)
        port = rdma_sysfs.device_of_netdev(netdev) if rdma_present else None
        if net["requireRdma"] and port is None:
            raise CniError(NO_RDMA, f"rail netdev {netdev} belongs to no RDMA device")
        rails.append(Rail(index=index, ifname=default_ifname(entry, index, len(entries), cni_ifname, chained),
                          netdev=netdev, ipam=entry.get("ipam") or net["ipam"], mtu=entry.get("mtu") or net["mtu"],
                          rdma=port))
    for attr, what in (("ifname", "interface name"), ("netdev", "netdev")):
        values = [getattr(r, attr) for r in rails]
        if len(values) != len(set(values)):
            raise CniError(INVALID_CONFIG, f"two rails resolve to the same {what}: {', '.join(values)}")
    return rails
