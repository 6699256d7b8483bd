"""A fake sysfs + /dev tree shaped like the kernel's, for RDMA device discovery tests.

Layout (relative to `sys`), with the kernel's relative symlinks:
  devices/pci0000:00/<pci>/{vendor,device,numa_node,driver->bus/pci/drivers/<drv>,net/<netdev>/}
  devices/pci0000:00/<pci>/infiniband/<dev>/{device-><pci>,node_type,ports/<p>/{state,phys_state,link_layer,gids,gid_attrs}}
  devices/virtual/infiniband/<dev>/{parent,ports/...}               (soft devices such as rxe)
  class/infiniband/<dev> -> the device folder above
  class/infiniband_verbs/uverbs<N>/ibdev, class/infiniband_mad/{umad,issm}<N>/{ibdev,port}
  class/net/<netdev>, bus/pci/devices/<pci>, module/ib_core/parameters/netns_mode
  devices/virtual/net/<bond>/{bonding/slaves,lower_<m>}, <member>/{master,upper_<bond>}  (add_bond)
and `dev`/infiniband/{uverbsN,rdma_cm,umadN,issmN} as plain files.

Devices appear atomically (class symlink made last) and disappear class symlink first.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
STATES = {"ACTIVE": "4: ACTIVE", "DOWN": "1: DOWN", "INIT": "2: INIT", "ARMED": "3: ARMED"}
PHYS = {"ACTIVE": "5: LinkUp", "DOWN": "3: Disabled", "INIT": "5: LinkUp", "ARMED": "5: LinkUp"}


def _write(path: Path, text: str) -> None:
    """Atomic like a sysfs read: a reader never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text + "\n")
    os.replace(tmp, path)


def _symlink(target: Path, link: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(target, link.parent), link)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@dataclass
class FakeDevice:
    name: str
    netdev: str
    folder: Path  # the real folder class/infiniband/<name> points at
    pci: str | None = None
    numa_node: int | None = None
    ports: int = 1
    uverbs: int = -1
    mad: list[int] = field(default_factory=list)  # umad/issm number of each port


class FakeRdmaSysfs:
    """Build and mutate a fake tree under `root`: `root`/sys and `root`/dev."""

    def __init__(self, root: str | os.PathLike, netns_mode: str | None = "Y") -> None:
        self.root = Path(root)
        self.sys = self.root / "sys"
        self.dev = self.root / "dev"
        self.devices: dict[str, FakeDevice] = {}
        for folder in ("class/infiniband", "class/net", "bus/pci/devices", "devices/virtual/net"):
            (self.sys / folder).mkdir(parents=True, exist_ok=True)
        _write(self.sys / "class/infiniband_verbs/abi_version", "6")
        _write(self.sys / "class/infiniband_mad/abi_version", "5")
        (self.dev / "infiniband").mkdir(parents=True, exist_ok=True)
        _write(self.dev / "infiniband/rdma_cm", "")
        (self.sys / "class/misc/rdma_cm").mkdir(parents=True, exist_ok=True)  # rdma_ucm loaded
        self.set_netns_mode(netns_mode)

    # --- kernel-wide --------------------------------------------------------------------------
    def set_netns_mode(self, value: str | None) -> None:
        """"Y" (shared), "N" (exclusive) or None (parameter absent, as on old kernels)."""
        path = self.sys / "module/ib_core/parameters/netns_mode"
        if value is None:
            _unlink(path)
        else:
            _write(path, value)

    # --- devices ------------------------------------------------------------------------------
    def add_pci_device(self, name: str, pci: str, netdev: str, *, numa_node: int = 0,
                       vendor: str = "0x15b3", device: str = "0x101b", driver: str = "mlx5_core",
                       link_layer: str = "Ethernet", ports: int = 1, state: str = "ACTIVE",
                       pcie_root: str = "pci0000:00") -> FakeDevice:
        """An mlx5-style device: its PCI function with a netdev, and the RDMA device under it,
        below the PCIe root complex `pcie_root` (devices/<root>/<pci>, as the kernel lays it out)."""
        pci_dir = self.sys / "devices" / pcie_root / pci
        _write(pci_dir / "vendor", vendor)
        _write(pci_dir / "device", device)
        _write(pci_dir / "numa_node", str(numa_node))
        _write(pci_dir / "class", "0x020700" if link_layer == "InfiniBand" else "0x020000")
        drv = self.sys / "bus/pci/drivers" / driver
        drv.mkdir(parents=True, exist_ok=True)
        if not (pci_dir / "driver").is_symlink():
            _symlink(drv, pci_dir / "driver")
        if not (self.sys / "bus/pci/devices" / pci).is_symlink():
            _symlink(pci_dir, self.sys / "bus/pci/devices" / pci)
        self._add_netdev(pci_dir / "net" / netdev, netdev)
        folder = pci_dir / "infiniband" / name
        _symlink(pci_dir, folder / "device")
        dev = FakeDevice(name, netdev, folder, pci=pci, numa_node=numa_node, ports=ports)
        return self._finish(dev, pci_dir, link_layer, state)

    def add_soft_device(self, name: str, parent: str, *, link_layer: str = "Ethernet", ports: int = 1,
                        state: str = "ACTIVE", parent_pci: tuple[str, str] | None = None) -> FakeDevice:
        """An rxe-style soft device: no PCI device, a `parent` file naming its netdev. With
        `parent_pci` (root complex, PCI address) the netdev is a PCI NIC's, under that root, with
        its `device` link (as rxe made on a physical NIC's netdev), else a virtual one."""
        virtual = self.sys / "devices/virtual"
        if parent_pci is not None and not (self.sys / "class/net" / parent).exists():
            root, pci = parent_pci
            pci_dir = self.sys / "devices" / root / pci
            _write(pci_dir / "vendor", "0x1af4")
            _write(pci_dir / "device", "0x1041")
            _write(pci_dir / "numa_node", "-1")
            if not (self.sys / "bus/pci/devices" / pci).is_symlink():
                _symlink(pci_dir, self.sys / "bus/pci/devices" / pci)
            self._add_netdev(pci_dir / "net" / parent, parent)
            _symlink(pci_dir, pci_dir / "net" / parent / "device")
        elif not (virtual / "net" / parent).exists():
            self._add_netdev(virtual / "net" / parent, parent)
        folder = virtual / "infiniband" / name
        _write(folder / "parent", parent)
        return self._finish(FakeDevice(name, parent, folder, ports=ports), virtual, link_layer, state)

    def _add_netdev(self, folder: Path, name: str) -> None:
        index = len(list((self.sys / "class/net").iterdir())) + 2
        _write(folder / "ifindex", str(index))
        _write(folder / "address", f"02:00:00:00:{index // 256:02x}:{index % 256:02x}")
        _write(folder / "operstate", "up")
        _write(folder / "type", "1")
        if not (self.sys / "class/net" / name).is_symlink():
            _symlink(folder, self.sys / "class/net" / name)

    def _finish(self, dev: FakeDevice, parent_dir: Path, link_layer: str, state: str) -> FakeDevice:
        if dev.name in self.devices:
            raise ValueError(f"{dev.name} exists")
        _write(dev.folder / "node_type", "1: CA")
        _write(dev.folder / "node_guid", "0002:c903:0000:%04x" % (len(self.devices) + 1))
        for port in range(1, dev.ports + 1):
            p = dev.folder / "ports" / str(port)
            _write(p / "state", STATES[state])
            _write(p / "phys_state", PHYS[state])
            _write(p / "link_layer", link_layer)
            _write(p / "gids/0", "fe80:0000:0000:0000:0000:00ff:fe00:%04x" % (len(self.devices) + 1))
            _write(p / "gid_attrs/types/0", "RoCE v2" if link_layer == "Ethernet" else "IB/RoCE v1")
            if link_layer == "Ethernet":
                _write(p / "gid_attrs/ndevs/0", dev.netdev)
        dev.uverbs = self._free_number("infiniband_verbs", "uverbs")
        self._add_uverbs(dev, parent_dir)
        for port in range(1, dev.ports + 1):
            n = self._free_number("infiniband_mad", "umad")
            dev.mad.append(n)
            for kind in ("umad", "issm"):
                folder = parent_dir / "infiniband_mad" / f"{kind}{n}"
                _write(folder / "ibdev", dev.name)
                _write(folder / "port", str(port))
                _symlink(folder, self.sys / "class/infiniband_mad" / f"{kind}{n}")
                _write(self.dev / "infiniband" / f"{kind}{n}", "")
        self.devices[dev.name] = dev
        _symlink(dev.folder, self.sys / "class/infiniband" / dev.name)  # last: the device appears
        return dev

    def _free_number(self, cls: str, prefix: str) -> int:
        used = {int(p.name[len(prefix):]) for p in (self.sys / "class" / cls).glob(f"{prefix}*")}
        n = 0
        while n in used:
            n += 1
        return n

    def _parent_dir(self, dev: FakeDevice) -> Path:
        return dev.folder.parent.parent  # <pci dir> or devices/virtual

    def _add_uverbs(self, dev: FakeDevice, parent_dir: Path) -> None:
        folder = parent_dir / "infiniband_verbs" / f"uverbs{dev.uverbs}"
        _write(folder / "ibdev", dev.name)
        _write(folder / "abi_version", "1")
        _write(folder / "dev", f"231:{192 + dev.uverbs}")
        _symlink(folder, self.sys / "class/infiniband_verbs" / f"uverbs{dev.uverbs}")
        _write(self.dev / "infiniband" / f"uverbs{dev.uverbs}", "")

    def _remove_uverbs(self, dev: FakeDevice) -> None:
        _unlink(self.sys / "class/infiniband_verbs" / f"uverbs{dev.uverbs}")
        _unlink(self.dev / "infiniband" / f"uverbs{dev.uverbs}")
        shutil.rmtree(self._parent_dir(dev) / "infiniband_verbs" / f"uverbs{dev.uverbs}", ignore_errors=True)

    def remove_device(self, name: str, *, with_netdev: bool = False) -> FakeDevice:
        """Hot-unplug, or (with_netdev) a move of the device and its netdev into a pod's
        namespace: the device vanishes from this tree. add_*_device brings it back."""
        dev = self.devices.pop(name)
        _unlink(self.sys / "class/infiniband" / name)  # first: the device disappears
        if with_netdev:
            _unlink(self.sys / "class/net" / dev.netdev)
            parent = self._parent_dir(dev)
            shutil.rmtree(parent / "net" / dev.netdev, ignore_errors=True)
        self._remove_uverbs(dev)
        parent_dir = self._parent_dir(dev)
        for n in dev.mad:
            for kind in ("umad", "issm"):
                _unlink(self.sys / "class/infiniband_mad" / f"{kind}{n}")
                _unlink(self.dev / "infiniband" / f"{kind}{n}")
                shutil.rmtree(parent_dir / "infiniband_mad" / f"{kind}{n}", ignore_errors=True)
        shutil.rmtree(dev.folder, ignore_errors=True)
        return dev

    def set_port_state(self, name: str, state: str, port: int = 1) -> None:
        """ACTIVE / DOWN (/ INIT / ARMED)."""
        p = self.devices[name].folder / "ports" / str(port)
        _write(p / "state", STATES[state])
        _write(p / "phys_state", PHYS[state])

    def set_all_ports(self, state: str) -> None:
        for name, dev in self.devices.items():
            for port in range(1, dev.ports + 1):
                self.set_port_state(name, state, port)

    def renumber_uverbs(self, name: str, number: int | None = None) -> int:
        """Give the device a new uverbs number (as after a namespace round trip); the old
        /dev node goes away. Default: one above every number in use."""
        dev = self.devices[name]
        if number is None:
            used = [int(p.name[6:]) for p in (self.sys / "class/infiniband_verbs").glob("uverbs*")]
            number = max(used, default=-1) + 1
        self._remove_uverbs(dev)
        dev.uverbs = number
        self._add_uverbs(dev, self._parent_dir(dev))
        return number

    def unload_uverbs(self) -> None:
        """As `modprobe -r ib_uverbs`: every uverbs class entry and /dev node goes; the devices stay."""
        for dev in self.devices.values():
            if dev.uverbs >= 0:
                self._remove_uverbs(dev)

    def load_uverbs(self) -> None:
        """As `modprobe ib_uverbs` after unload_uverbs(): each device gets its uverbs back."""
        for dev in self.devices.values():
            if dev.uverbs >= 0 and not (self.sys / "class/infiniband_verbs" / f"uverbs{dev.uverbs}").exists():
                self._add_uverbs(dev, self._parent_dir(dev))

    # --- mlx5's real shape: RoCE LAG bonds and 255-entry GID tables ----------------------------
    def add_bond(self, name: str, members: list[str]) -> None:
        """A bonding device over existing netdevs, as drivers/net/bonding links it in sysfs:
        devices/virtual/net/<bond>/{bonding/slaves,lower_<m>} and each member's master/upper_<bond>."""
        folder = self.sys / "devices/virtual/net" / name
        self._add_netdev(folder, name)
        _write(folder / "bonding/slaves", " ".join(members))
        _write(folder / "bonding/mode", "802.3ad 4")
        for member in members:
            member_dir = (self.sys / "class/net" / member).resolve()
            _symlink(member_dir, folder / f"lower_{member}")
            _symlink(folder, member_dir / "master")
            _symlink(folder, member_dir / f"upper_{name}")

    def add_lag_device(self, name: str, pcis: tuple[str, str], members: tuple[str, str], bond: str, *,
                       numa_node: int = 0, table: int = 255) -> FakeDevice:
        """mlx5 under RoCE LAG (drivers/infiniband/hw/mlx5/main.c, lag/): two PF functions with
        one netdev each, bonded; ONE RDMA device `name` (mlx5_bond_N) under PF0's function, whose
        net/ folder (and port netdev) is the member PF0's, never the bond; the GID table is
        filled from the bond and its uppers. The second PF has no RDMA device of its own."""
        dev = self.add_pci_device(name, pcis[0], members[0], numa_node=numa_node, device="0x101d")
        pf1 = self.sys / "devices/pci0000:00" / pcis[1]
        _write(pf1 / "vendor", "0x15b3")
        _write(pf1 / "device", "0x101d")
        _write(pf1 / "numa_node", str(numa_node))
        _symlink(self.sys / "bus/pci/drivers/mlx5_core", pf1 / "driver")
        _symlink(pf1, self.sys / "bus/pci/devices" / pcis[1])
        self._add_netdev(pf1 / "net" / members[1], members[1])
        self.add_bond(bond, list(members))
        self.mlx5_gid_table(name, table=table, default_ndev=bond)
        return dev

    def mlx5_gid_table(self, name: str, port: int = 1, *, table: int = 255, default_ndev: str | None = None) -> None:
        """mlx5's table: `table` entries, two per address (RoCE v1 and v2), the default
        link-local GID at 0 (v1) and 1 (v2); empty entries read as zeros and have no attributes."""
        dev = self.devices[name]
        p = dev.folder / "ports" / str(port)
        ndev = default_ndev or dev.netdev
        default = (p / "gids/0").read_text().strip()
        shutil.rmtree(p / "gids")
        shutil.rmtree(p / "gid_attrs")
        for i in range(table):
            _write(p / f"gids/{i}", ZERO_GID)
        for i, kind in ((0, "IB/RoCE v1"), (1, "RoCE v2")):
            self._set_gid(p, i, default, kind, ndev)

    def soft_gid_table(self, name: str, port: int = 1, *, table: int = 1024) -> None:
        """Soft-RoCE's table: `table` entries, one (RoCE v2) per address; entry 0 as made."""
        p = self.devices[name].folder / "ports" / str(port)
        for i in range(1, table):
            if not (p / f"gids/{i}").exists():
                _write(p / f"gids/{i}", ZERO_GID)

    @staticmethod
    def _set_gid(port_dir: Path, index: int, gid: str, kind: str, ndev: str) -> None:
        _write(port_dir / f"gids/{index}", gid)
        _write(port_dir / f"gid_attrs/types/{index}", kind)
        _write(port_dir / f"gid_attrs/ndevs/{index}", ndev)

    def add_gid(self, name: str, gid: str, ndev: str, port: int = 1) -> int | None:
        """The kernel's part when an address appears on `ndev`: its GID in the first free entries
        (v1 then v2 where the table makes v1 GIDs); the v2 index, or None when the table is full
        (__ib_cache_gid_add: error=-28, the address stays)."""
        p = self.devices[name].folder / "ports" / str(port)
        kinds = ["IB/RoCE v1", "RoCE v2"] if (p / "gid_attrs/types/0").read_text().strip() == "IB/RoCE v1" \
            else ["RoCE v2"]
        free = [i for i in range(len(list((p / "gids").iterdir()))) if not (p / f"gid_attrs/ndevs/{i}").exists()]
        if len(free) < len(kinds):
            return None
        for index, kind in zip(free, kinds):
            self._set_gid(p, index, gid, kind, ndev)
        return free[len(kinds) - 1]

    def remove_gids_of(self, name: str, ndev: str, port: int = 1) -> int:
        """The address (or interface) went away: its entries are emptied; how many."""
        p = self.devices[name].folder / "ports" / str(port)
        gone = 0
        for path in list((p / "gid_attrs/ndevs").iterdir()):
            if path.read_text().strip() == ndev and int(path.name) > 1:
                index = int(path.name)
                _unlink(path)
                _unlink(p / f"gid_attrs/types/{index}")
                _write(p / f"gids/{index}", ZERO_GID)
                gone += 1
        return gone

    # --- lookups for assertions ---------------------------------------------------------------
    def uverbs_number(self, name: str) -> int:
        return self.devices[name].uverbs

    def uverbs_path(self, name: str) -> str:
        return f"/dev/infiniband/uverbs{self.devices[name].uverbs}"

    def mad_numbers(self, name: str) -> list[int]:
        return list(self.devices[name].mad)


# A Lingjun-style node (Alibaba's topology fixtures: mlx5_bond_0..N, each over two PF netdevs):
# RoCE LAG cards, each one RDMA device over a bond of its two ports, NUMA-interleaved.
LINGJUN_LAG = [
    # name,          PF0 / PF1 PCI,                     members,        bond,    numa
    ("mlx5_bond_0", ("0000:1a:00.0", "0000:1a:00.1"), ("eth1", "eth2"), "bond0", 0),
    ("mlx5_bond_1", ("0000:3b:00.0", "0000:3b:00.1"), ("eth3", "eth4"), "bond1", 0),
    ("mlx5_bond_2", ("0000:86:00.0", "0000:86:00.1"), ("eth5", "eth6"), "bond2", 1),
    ("mlx5_bond_3", ("0000:af:00.0", "0000:af:00.1"), ("eth7", "eth8"), "bond3", 1),
]


def lingjun_host(root: str | os.PathLike, netns_mode: str | None = "Y", *, cards: int = 4,
                 table: int = 255) -> FakeRdmaSysfs:
    """A node with `cards` RoCE LAG cards (mlx5_bond_N over bondN), 255-entry GID tables."""
    fake = FakeRdmaSysfs(root, netns_mode)
    for name, pcis, members, bond, numa in LINGJUN_LAG[:cards]:
        fake.add_lag_device(name, pcis, members, bond, numa_node=numa, table=table)
    return fake


# The standard test host: 8 PCI devices, 4 per NUMA node, interleaved in PCI order, with mixed
# vendors and link layers; plus one soft device without NUMA information.
STANDARD_PCI = [
    # name,     pci,            numa, netdev,      link layer,   vendor,   device,   driver
    ("mlx5_0", "0000:1a:00.0", 0, "ens1f0", "Ethernet", "0x15b3", "0x101b", "mlx5_core"),
    ("mlx5_1", "0000:3b:00.0", 1, "ens2f0", "Ethernet", "0x15b3", "0x101b", "mlx5_core"),
    ("mlx5_2", "0000:5e:00.0", 0, "ens3f0", "Ethernet", "0x15b3", "0x1017", "mlx5_core"),
    ("mlx5_3", "0000:86:00.0", 1, "ens4f0", "Ethernet", "0x15b3", "0x1017", "mlx5_core"),
    ("mlx5_4", "0000:af:00.0", 0, "ibp175s0", "InfiniBand", "0x15b3", "0x101b", "mlx5_core"),
    ("mlx5_5", "0000:b1:00.0", 1, "ibp177s0", "InfiniBand", "0x15b3", "0x101b", "mlx5_core"),
    ("irdma0", "0000:d8:00.0", 0, "ens7f0", "Ethernet", "0x8086", "0x1592", "ice"),
    ("irdma1", "0000:d9:00.0", 1, "ens8f0", "Ethernet", "0x8086", "0x1592", "ice"),
]
STANDARD_SOFT = [("rxe0", "eth0")]


def standard_host(root: str | os.PathLike, netns_mode: str | None = "Y", *,
                  soft: bool = True) -> FakeRdmaSysfs:
    """The standard 8-NIC host (plus rxe0 on eth0 when `soft`)."""
    fake = FakeRdmaSysfs(root, netns_mode)
    for name, pci, numa, netdev, ll, vendor, device, driver in STANDARD_PCI:
        fake.add_pci_device(name, pci, netdev, numa_node=numa, vendor=vendor, device=device,
                            driver=driver, link_layer=ll)
    if soft:
        for name, parent in STANDARD_SOFT:
            fake.add_soft_device(name, parent)
    return fake
