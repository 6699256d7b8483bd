"""What RDMA hardware a node has, as one record per device: ports, netdevs, PCI facts, char devices.

The device plugin's view, read through the one sysfs reader (kernel/rdma_sysfs.py), so it and the
CNI plugin agree about every device's netdev. sysfs is the cheap source the health loop can
re-read every second (a few small files per device, no netlink, no verbs context). In exclusive
mode the kernel shows only the devices of the reader's network namespace, which is why a device
moved into a pod vanishes here. Not imported by the CNI plugin (dataclasses cost ~10 ms there).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rdma_netns.kernel.rdma_sysfs import RdmaSysfs


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

    @property
    def healthy(self) -> bool:
        """Usable now: at least one port is ACTIVE (a device whose links are all down is not)."""
        return any(p.active for p in self.ports)

    @property
    def link_types(self) -> set[str]:
        return {p.link_layer.lower() for p in self.ports}

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
        return RdmaDevice(name=name, ports=ports, netdevs=tuple(self.netdevs_of_device(name)),
                          pci_address=pci, vendor=vendor, device_id=device_id, driver=driver,
                          numa_node=numa, uverbs=uverbs[0] if uverbs else None, mad=_chars(mad))

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

