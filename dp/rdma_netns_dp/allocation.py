"""What a container gets for its RDMA devices: device nodes (or CDI names) and environment.

Char device numbers are looked up when kubelet asks, not from the last poll: the kernel
re-creates uverbsN (possibly under another N) whenever a device changes namespace.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from rdma_netns.kernel.rdma_devices import DeviceSysfs, RdmaDevice

RDMA_CM = "rdma_cm"


class AllocationError(RuntimeError):
    """The devices exist but cannot be handed out (no uverbs char device)."""


@dataclass
class DeviceNode:
    container_path: str
    host_path: str
    permissions: str = "rw"


@dataclass
class ContainerGrant:
    """One container's share, independent of the protobuf types (servicer.py converts)."""

    nodes: list[DeviceNode] = field(default_factory=list)
    envs: dict[str, str] = field(default_factory=dict)
    cdi_devices: list[str] = field(default_factory=list)


def pod_cdi_nodes(g: ContainerGrant) -> list[dict]:
    """A grant's device nodes as CDI deviceNodes (for the pod CDI placeholder)."""
    return [{"path": n.container_path, "hostPath": n.host_path, "permissions": n.permissions} for n in g.nodes]


def cdi_kind(slug: str) -> str:
    return f"rdma-netns.io/{slug}"


def grant(devices: list[RdmaDevice], sysfs: DeviceSysfs, dev_root: str, resource_name: str, slug: str,
          include_umad: bool, use_cdi: bool, skip_leaving: bool = False) -> ContainerGrant:
    """skip_leaving (shared mode): a device unplugged since the last poll is left out, as long as
    another one remains; kubelet does not retry a failed Allocate, so failing would fail the pod."""
    names = sorted({d.name for d in devices})
    chars = sysfs.fresh_char_devices(names)
    if skip_leaving:
        staying = [n for n in names if chars[n][0] is not None]
        if staying:
            names = staying
            devices = [d for d in devices if d.name in staying]
    nodes: dict[str, DeviceNode] = {}
    uverbs_paths = []
    for name in names:
        uverbs, mad = chars[name]
        if uverbs is None:
            raise AllocationError(f"RDMA device {name} has no uverbs char device now "
                                  "(ib_uverbs not loaded, or the device is leaving)")
        uverbs_paths.append(uverbs.container_path)
        wanted = [uverbs] + (list(mad) if include_umad else [])
        for char in wanted:
            nodes.setdefault(char.container_path, DeviceNode(
                char.container_path, os.path.join(dev_root, "infiniband", char.name)))
    if sysfs.rdma_cm_present():  # rdma_ucm loaded; verbs work without it, a missing node fails the container
        nodes.setdefault(f"/dev/infiniband/{RDMA_CM}",
                         DeviceNode(f"/dev/infiniband/{RDMA_CM}", os.path.join(dev_root, "infiniband", RDMA_CM)))
    netdevs = sorted({n for d in devices for n in d.netdevs})
    out = ContainerGrant(envs={
        "RDMA_NETNS_RESOURCE": resource_name,
        "RDMA_NETNS_DEVICES": ",".join(names),
        "RDMA_NETNS_NETDEVS": ",".join(netdevs),
        "RDMA_NETNS_UVERBS": ",".join(uverbs_paths),
    })
    if use_cdi:
        out.cdi_devices = [f"{cdi_kind(slug)}={name}" for name in names]
    else:
        out.nodes = list(nodes.values())
    return out
