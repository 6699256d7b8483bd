"""The host node's "RDMA NICs": veth rails in the cluster's network namespace, and a kernel-shaped
fake sysfs (tests/fake_rdma_sysfs.py) with one Soft-RoCE-shaped device per rail, mounted at /sys in
the node's mount namespace (this machine's kernel has no RDMA subsystem).

So the DaemonSet runs exactly as written on this node, its device plugin reading /sys and the CNI
reading /sys and /dev/infiniband, the only edit being the rails' netdev names, as on any node. What a
fake tree cannot do: see addresses appear, so the RoCE v2 GIDs of the first PREFILLED addresses of
the node's range on each rail are there ahead (the guest node proves the kernel's part), and move
RDMA traffic (the guest node does). Its char devices are /dev/null's (1:3), as runc needs real nodes.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from integration.cluster.layout import NETNS, Layout
from integration.cluster.namespaces import run
from rdma_netns.kernel.inet import Prefix
from tests.fake_rdma_sysfs import FakeRdmaSysfs

RAILS = 2
PREFILLED = 64
HOST_NODE_INDEX = 1
# What stays the kernel's: cgroups (kubelet, runc), CPU and memory topology (kubelet's cAdvisor).
REAL_SYSFS_PARTS = ("fs/cgroup", "devices/system", "kernel")


def rail_netdev(rail: int) -> str:
    return f"rail{rail}"


def rail_pci(rail: int) -> tuple[str, str]:
    """The PCIe root complex and PCI function of the NIC whose netdev a rail's rxe is made on:
    each rail under its own root, as on a GPU node where every NIC sits beside its GPUs (the DRA
    driver publishes the root as resource.kubernetes.io/pcieRoot)."""
    bus = 0x10 + 0x10 * rail
    return f"pci0000:{bus:02x}", f"0000:{bus + 1:02x}:00.0"


def node_address(rail: int) -> str:
    """The node's own address on the rail (the shipped entry's rangeFromNodeAddress derives pods' from it)."""
    return f"fd00:1{rail}::{HOST_NODE_INDEX}:1/64"


def pod_address(rail: int, n: int) -> str:
    return f"fd00:1{rail}::{HOST_NODE_INDEX}:{n:x}"


def make(layout: Layout) -> FakeRdmaSysfs:
    """Rails in the node's network namespace and the fake tree; mounted by mount()."""
    ns = ["ip", "-n", NETNS]
    fake = FakeRdmaSysfs(layout.root / "fake-rdma")
    for rail in range(RAILS):
        netdev = rail_netdev(rail)
        run(*ns, "link", "add", netdev, "type", "veth", "peer", "name", f"{netdev}p")
        run(*ns, "link", "set", netdev, "up")
        run(*ns, "link", "set", f"{netdev}p", "up")
        run(*ns, "address", "add", node_address(rail), "dev", netdev, "nodad")
        fake.add_soft_device(f"rxe{rail}", netdev, parent_pci=rail_pci(rail))
        fake.soft_gid_table(f"rxe{rail}", table=2048)
        for n in range(2, 2 + PREFILLED):
            fake.add_gid(f"rxe{rail}", Prefix.parse(pod_address(rail, n)).exploded(), f"rdma{rail}")
    for node in (fake.dev / "infiniband").iterdir():  # runc wants real char nodes
        node.unlink()
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    return fake


def mount_script(fake: FakeRdmaSysfs) -> list[str]:
    """Shell steps (run inside the node's mount namespace) that put the fake tree at /sys, with the
    kernel's own parts of sysfs kept, and its char devices at /dev/infiniband."""
    steps = []
    for part in REAL_SYSFS_PARTS:
        inner = fake.sys / part
        inner.mkdir(parents=True, exist_ok=True)
        steps.append(f"mount --rbind /sys/{part} {inner}")
    steps.append(f"mount --rbind {fake.sys} /sys")
    steps.append(f"mkdir -p /dev/infiniband && mount --bind {fake.dev / 'infiniband'} /dev/infiniband")
    return steps


def created_outside() -> list[str]:
    """Folders mount_script() makes on this machine (down removes them)."""
    return [] if Path("/dev/infiniband").exists() else ["/dev/infiniband"]
