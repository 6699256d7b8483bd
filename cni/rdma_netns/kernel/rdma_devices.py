"""What RDMA hardware a node has, as one record per device: ports, netdevs, PCI facts, char devices.

The device plugin's view, read through the one sysfs reader (kernel/rdma_sysfs.py), so it and the
CNI plugin agree about every device's netdev. sysfs is the cheap source the health loop can
re-read every second (a few small files per device, no netlink, no verbs context). In exclusive
mode the kernel shows only the devices of the reader's network namespace, which is why a device
moved into a pod vanishes here. Not imported by the CNI plugin (dataclasses cost ~10 ms there).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from rdma_netns.kernel.rdma_sysfs import RdmaSysfs, port_word


@dataclass(frozen=True)
class PortInfo:
    number: int
    state: str            # "ACTIVE", "DOWN", "INIT", ... (the word after "N: " in sysfs)
    phys_state: str       # "LinkUp", "Disabled", ...
    link_layer: str       # "Ethernet" or "InfiniBand"

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"


@dataclass(frozen=True)
class CharDevice:
    name: str             # "uverbs0", "umad1", "issm1"
    port: int | None = None

    @property
    def container_path(self) -> str:
        return f"/dev/infiniband/{self.name}"


@dataclass(frozen=True)
class RdmaDevice:
    name: str
    ports: tuple[PortInfo, ...]
    netdevs: tuple[str, ...]
    pci_address: str | None
    vendor: str | None          # "15b3" (no 0x)
    device_id: str | None       # "101b"
    driver: str | None          # "mlx5_core"
    numa_node: int | None
    uverbs: CharDevice | None
    mad: tuple[CharDevice, ...] = field(default=())   # umadN and issmN of its ports
    # RoCE LAG: the bond its netdev is a member of (mlx5_bond_N names a member, eth1, while the
    # bond, bond0, carries the addresses and so the rails), and that bond's members.
    bond: str | None = None
    bond_members: tuple[str, ...] = field(default=())
    node_type: str | None = None  # "CA" (InfiniBand, RoCE), "RNIC" (iWARP): sysfs node_type

    @property
    def iwarp(self) -> bool:
        """iWARP: Ethernet link layer, but one MAC-based GID, never one per address."""
        return self.node_type == "RNIC"

    @property
    def healthy(self) -> bool:
        """Usable now: at least one port is ACTIVE (a device whose links are all down is not) and
        a uverbs char device to open it by (none while ib_uverbs is not loaded: every Allocate
        would fail, so the scheduler must not place pods on it)."""
        return self.uverbs is not None and any(p.active for p in self.ports)

    @property
    def link_types(self) -> set[str]:
        return {p.link_layer.lower() for p in self.ports}

    @property
    def related_netdevs(self) -> tuple[str, ...]:
        """Its netdevs, its bond and the bond's members: every name an admin may know it by."""
        return tuple(dict.fromkeys((*self.netdevs, *((self.bond,) if self.bond else ()), *self.bond_members)))

    @property
    def stable_id(self) -> str:
        """The ID kubelet sees in exclusive mode: the PCI address survives renames; else the name."""
        return self.pci_address or self.name


class DeviceSysfs(RdmaSysfs):
    """The sysfs reader with whole-device records (the device plugin's discovery pass)."""

    __slots__ = ()

    def devices(self) -> list[RdmaDevice]:
        """Every RDMA device this namespace sees, as a record; a device removed mid-read is left out."""
        verbs = self.char_devices("infiniband_verbs")
        mad = self.char_devices("infiniband_mad")
        out = []
        for name in self.device_names():
            device = self.device(name, verbs.get(name, []), mad.get(name, []))
            if device is not None:
                out.append(device)
        return out

    def device(self, name: str, verbs: list[tuple[str, int | None]],
               mad: list[tuple[str, int | None]]) -> RdmaDevice | None:
        if not self.has_device(name):
            return None  # removed while we looked
        ports = tuple(PortInfo(p, *self.port_status(name, p)) for p in self.ports(name))
        pci, vendor, device_id, driver, numa = self.function_of_device(name)
        uverbs = _chars(verbs)
        netdevs = tuple(self.netdevs_of_device(name))
        bond = self._bond_of_netdevs(netdevs)
        return RdmaDevice(name=name, ports=ports, netdevs=netdevs,
                          pci_address=pci, vendor=vendor, device_id=device_id, driver=driver,
                          numa_node=numa, uverbs=uverbs[0] if uverbs else None, mad=_chars(mad),
                          bond=bond, bond_members=tuple(self.bond_members(bond)) if bond else (),
                          node_type=self.node_type(name))

    def pcie_root(self, device: RdmaDevice) -> str | None:
        """The PCIe root complex a device sits under ("pci0000:15"): its PCI function's, or for a
        soft device (rxe) its netdev's, as the kernel lays out devices/pci<domain>:<bus>/...; None
        for a device with no PCI ancestor or when unreadable. DRA's standard attribute
        resource.kubernetes.io/pcieRoot: a NIC and a GPU under one root talk without crossing the
        CPU's interconnect."""
        links = [f"{self.root}/class/infiniband/{device.name}/device"]
        links += [f"{self.root}/class/net/{netdev}/device" for netdev in (*device.netdevs, *device.bond_members)]
        for link in links:
            try:
                parts = os.path.realpath(link).split("/")
            except OSError:
                continue
            if not os.path.exists(link) or "devices" not in parts:
                continue
            after = parts[len(parts) - parts[::-1].index("devices"):]
            if after and after[0].startswith("pci"):
                return after[0]
        return None

    def node_type(self, device: str) -> str | None:
        """'CA', 'RNIC', ... from sysfs's '1: CA'; None when unreadable."""
        try:
            with open(f"{self.root}/class/infiniband/{device}/node_type") as f:
                return port_word(f.read()) or None
        except OSError:
            return None

    def _bond_of_netdevs(self, netdevs: tuple[str, ...]) -> str | None:
        """The bond a device's rails use: its netdev's master (RoCE LAG), or the netdev itself
        when that is a bond (Soft-RoCE made on one)."""
        rails = (self.rail_netdev(netdev) for netdev in netdevs)
        return next((rail for rail in rails if self.is_bond(rail)), None)

    def fresh_char_devices(self, names: list[str]) -> dict[str, tuple[CharDevice | None, tuple[CharDevice, ...]]]:
        """uverbs and umad/issm of each named device, read now: the kernel renumbers them after a move."""
        verbs = self.char_devices("infiniband_verbs")
        mad = self.char_devices("infiniband_mad")
        out = {}
        for name in names:
            uverbs = _chars(verbs.get(name, []))
            out[name] = (uverbs[0] if uverbs else None, _chars(mad.get(name, [])))
        return out


def _chars(found: list[tuple[str, int | None]]) -> tuple[CharDevice, ...]:
    return tuple(CharDevice(name, port) for name, port in sorted(found, key=lambda c: c[0]))

