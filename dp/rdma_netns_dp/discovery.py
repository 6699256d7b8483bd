"""What RDMA hardware this node has, read from sysfs: devices, ports, PCI facts, char devices.

sysfs is the cheap source the health loop can re-read every second (a few small files per
device, no netlink, no verbs context), and tests can lay out the same tree in a temp folder.
In exclusive mode the kernel shows only the devices of the reader's network namespace, which is
why a device moved into a pod vanishes here (see inventory.py for how that is told apart from
a removal).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


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


class Sysfs:
    """Reads the kernel's RDMA sysfs layout under `root` (the real /sys or a test tree)."""

    def __init__(self, root: str = "/sys") -> None:
        self.root = root.rstrip("/") or "/"

    def _path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def _read(self, *parts: str) -> str | None:
        try:
            with open(self._path(*parts)) as f:
                return f.read().strip()
        except OSError:
            return None

    def _list(self, *parts: str) -> list[str]:
        try:
            return sorted(os.listdir(self._path(*parts)))
        except OSError:
            return []

    def netns_mode(self) -> str | None:
        """'shared' or 'exclusive' from ib_core's live parameter; None without an RDMA core."""
        value = self._read("module", "ib_core", "parameters", "netns_mode")
        if value is None:
            return None
        return "shared" if value in ("Y", "1") else "exclusive"

    def device_names(self) -> list[str]:
        return self._list("class", "infiniband")

    def _char_devices(self, cls: str) -> dict[str, list[CharDevice]]:
        """Char devices of a class (infiniband_verbs, infiniband_mad) grouped by RDMA device."""
        found: dict[str, list[CharDevice]] = {}
        for name in self._list("class", cls):
            ibdev = self._read("class", cls, name, "ibdev")
            if not ibdev:
                continue  # abi_version and other plain files of the class
            port = self._read("class", cls, name, "port")
            found.setdefault(ibdev, []).append(
                CharDevice(name, int(port) if port and port.isdigit() else None))
        return found

    def devices(self) -> list[RdmaDevice]:
        verbs = self._char_devices("infiniband_verbs")
        mad = self._char_devices("infiniband_mad")
        out = []
        for name in self.device_names():
            device = self._device(name, verbs.get(name, []), mad.get(name, []))
            if device is not None:
                out.append(device)
        return out

    def _device(self, name: str, verbs: list[CharDevice], mad: list[CharDevice]) -> RdmaDevice | None:
        base = ("class", "infiniband", name)
        if not os.path.isdir(self._path(*base)):
            return None  # removed while we looked
        ports = []
        for port in self._list(*base, "ports"):
            if not port.isdigit():
                continue
            state = self._read(*base, "ports", port, "state") or ""
            phys = self._read(*base, "ports", port, "phys_state") or ""
            ports.append(PortInfo(int(port), _word(state), _word(phys),
                                  self._read(*base, "ports", port, "link_layer") or "Ethernet"))
        ports.sort(key=lambda p: p.number)
        pci = vendor = device_id = driver = None
        numa = None
        device_link = self._path(*base, "device")
        netdevs: list[str] = []
        if os.path.islink(device_link) or os.path.isdir(device_link):
            real = os.path.realpath(device_link)
            bus = os.path.basename(os.path.realpath(os.path.join(real, "subsystem"))) \
                if os.path.exists(os.path.join(real, "subsystem")) else None
            last = os.path.basename(real)
            if bus == "pci" or (bus is None and _looks_like_pci(last)):
                pci = last
            vendor = _hex_id(self._read(*base, "device", "vendor"))
            device_id = _hex_id(self._read(*base, "device", "device"))
            drv = os.path.join(real, "driver")
            driver = os.path.basename(os.path.realpath(drv)) if os.path.exists(drv) else None
            numa_text = self._read(*base, "device", "numa_node")
            if numa_text and numa_text.lstrip("-").isdigit() and int(numa_text) >= 0:
                numa = int(numa_text)
            netdevs = self._list(*base, "device", "net")
        if not netdevs:
            parent = self._read(*base, "parent")  # rxe, siw: the netdev they were created on
            if parent:
                netdevs = [parent]
        uverbs = sorted(verbs, key=lambda c: c.name)
        return RdmaDevice(name=name, ports=tuple(ports), netdevs=tuple(netdevs), pci_address=pci,
                          vendor=vendor, device_id=device_id, driver=driver, numa_node=numa,
                          uverbs=uverbs[0] if uverbs else None,
                          mad=tuple(sorted(mad, key=lambda c: c.name)))


def _word(text: str) -> str:
    """sysfs prints '4: ACTIVE'; keep the name."""
    return text.split(":", 1)[1].strip() if ":" in text else text.strip()


def _hex_id(text: str | None) -> str | None:
    return text.lower().removeprefix("0x") if text else None


def _looks_like_pci(name: str) -> bool:
    parts = name.split(":")
    return len(parts) == 3 and "." in parts[2]


def fresh_char_devices(sysfs: Sysfs, names: list[str]) -> dict[str, tuple[CharDevice | None, tuple[CharDevice, ...]]]:
    """uverbs and umad/issm of each named device, read now: the kernel renumbers them after a move."""
    verbs = sysfs._char_devices("infiniband_verbs")
    mad = sysfs._char_devices("infiniband_mad")
    out = {}
    for name in names:
        uverbs = sorted(verbs.get(name, []), key=lambda c: c.name)
        out[name] = (uverbs[0] if uverbs else None, tuple(sorted(mad.get(name, []), key=lambda c: c.name)))
    return out
