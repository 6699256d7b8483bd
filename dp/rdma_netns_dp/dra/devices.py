"""The node's rails as DRA devices: what a ResourceSlice lists, built from one discovery pass.

One device per RDMA rail device (an mlx5 port's device, a RoCE LAG bond's mlx5_bond_N, an rxe),
named after it as a DNS label. Attributes: the standard `resource.kubernetes.io/pcieRoot` and
`numaNode` (GPU claims match NICs on them) and the product's own, so a DeviceClass or a claim's
CEL selector can pick rails by resource, netdev, bond or link layer.

Shared mode: one device, many claims (`allowMultipleAllocations`), bounded by what really runs
out on a shared NIC, its GID table: capacity `gidEntries` is the entries pods may take (the
table less the node's own), and every claim consumes exactly the entries one pod's addresses
take (the request policy admits that one value), so the scheduler stops placing pods on a full
table instead of a sandbox failing on the node. Exclusive mode: one claim per device, no capacity.

An unhealthy device (no ACTIVE port, no uverbs char device, the kernel's RDMA netns mode wrong)
stays listed with a NoSchedule taint saying why: claims already holding it keep it, new ones
go elsewhere (DRA device taints, GA in 1.37).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from rdma_netns.kernel.rdma_devices import RdmaDevice
from rdma_netns.kernel.rdma_sysfs import GidUsage, RdmaPort

PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
NUMA_NODE = "resource.kubernetes.io/numaNode"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
GID_ENTRIES = "gidEntries"  # capacity names are unqualified within the driver's domain
UNHEALTHY_TAINT = "unhealthy"  # the taint key is qualified with the driver name
MAX_DEVICE_NAME = 63


@dataclass(frozen=True)
class Rail:
    """One publishable device: the RDMA device, the pool (resource) that selects it, and what
    the discovery pass read about it."""

    device: RdmaDevice
    resource: str                 # the resource config's name (rdma/hca), an attribute to select by
    mode: str                     # "shared" | "exclusive"
    pcie_root: str | None
    gids: GidUsage | None         # the RoCE port's table (shared mode), None when not read
    entries_per_pod: int          # GID entries one pod's addresses take on this rail
    blocked: str | None = None    # the kernel's RDMA netns mode blocks every device, and why
    away: bool = False            # exclusive: inside a pod's namespace now (allocated, keep listing it)


def device_name(rdma_device: str) -> str:
    """A DNS label for an RDMA device name (mlx5_bond_0 -> mlx5-bond-0); the attribute
    rdmaDevice keeps the kernel's name."""
    name = re.sub(r"[^a-z0-9-]+", "-", rdma_device.lower()).strip("-")[:MAX_DEVICE_NAME].strip("-")
    return name or "rdma"


def gid_capacity(rail: Rail, limit: int = 0) -> int | None:
    """GID entries pods may take on the rail: the table less the entries the node itself uses
    (its own addresses, the default GIDs), capped by `limit` when set; None when no table."""
    usage = rail.gids
    if usage is None:
        return None
    node_own = max(0, usage.used - usage.in_pods)
    capacity = max(0, usage.total - node_own)
    return min(capacity, limit) if limit else capacity


def health_problem(rail: Rail) -> str | None:
    """Why the rail cannot take a new pod now (a taint value, at most 63 characters), or None."""
    if rail.blocked:
        return "kernel-netns-mode"
    if rail.away:
        return None
    if rail.device.uverbs is None:
        return "no-uverbs"
    if not any(p.active for p in rail.device.ports):
        return "port-down"
    return None


def to_device(rail: Rail, driver: str, gid_limit: int = 0) -> dict:
    """The resource.k8s.io/v1 Device for a rail."""
    d = rail.device
    attributes: dict[str, dict] = {
        "rdmaDevice": {"string": d.name},
        "resource": {"string": rail.resource},
        "kernelMode": {"string": rail.mode},
        "linkLayer": {"string": ",".join(sorted(d.link_types)) or "unknown"},
        "netdev": {"string": d.bond or (d.netdevs[0] if d.netdevs else "")},
    }
    if d.bond_members:
        attributes["bondMembers"] = {"string": ",".join(d.bond_members)}
    if d.driver:
        attributes["driver"] = {"string": d.driver}
    if d.pci_address:
        attributes[PCI_BUS_ID] = {"string": d.pci_address}
    if rail.pcie_root:
        attributes[PCIE_ROOT] = {"string": rail.pcie_root}
    if d.numa_node is not None and d.numa_node >= 0:
        attributes[NUMA_NODE] = {"int": d.numa_node}
    device: dict = {"name": device_name(d.name), "attributes": attributes}
    if rail.mode == "shared":
        device["allowMultipleAllocations"] = True
        capacity = gid_capacity(rail, gid_limit)
        if capacity is not None:
            per_pod = str(rail.entries_per_pod)
            device["capacity"] = {GID_ENTRIES: {"value": str(capacity), "requestPolicy": {
                "default": per_pod, "validValues": [per_pod]}}}
    problem = health_problem(rail)
    if problem:
        device["taints"] = [{"key": f"{driver}/{UNHEALTHY_TAINT}", "value": problem, "effect": "NoSchedule"}]
    return device


def rails_of(devices: list[RdmaDevice], resource: str, mode: str, pcie_root: Mapping[str, str | None],
             gids: Mapping[RdmaPort, GidUsage], addresses_per_pod: int, blocked: str | None,
             away: list[RdmaDevice] = ()) -> list[Rail]:
    """One pool's rails from a discovery pass. `gids`: usage of the RoCE ports read; a device's
    first Ethernet port is the one its rail's addresses land on."""
    out = []
    for d in devices:
        port = next((RdmaPort(d.name, p.number) for p in d.ports if p.link_layer.lower() == "ethernet"), None)
        usage = gids.get(port) if port is not None and not d.iwarp else None
        per_pod = (usage.per_address if usage else 1) * addresses_per_pod
        out.append(Rail(d, resource, mode, pcie_root.get(d.name), usage if mode == "shared" else None,
                        per_pod, blocked))
    out += [Rail(d, resource, mode, pcie_root.get(d.name), None, addresses_per_pod, blocked, away=True)
            for d in away]
    return out
