"""The one reader of the kernel's RDMA sysfs, for the CNI plugin, the device plugin and the admin tool.

sysfs answers these without a NETLINK_RDMA round trip (and without importing pyroute2), which
keeps them cheap enough for every ADD and for the device plugin's once-a-second health pass.
Paths follow the kernel's layout: /sys/class/infiniband/<dev>/{device,parent,ports/<p>/...},
.../ports/<p>/gids/<i>, .../gid_attrs/{ndevs,types}/<i>, /sys/class/infiniband_{verbs,mad}/*/ibdev.

`RdmaSysfs(root)` reads the tree under `root` (the real /sys, a test tree, or a pod's sysfs view).
The module-level functions are the CNI's names for the same reads on `default`, whose root is
/sys, or $RDMA_NETNS_SYSFS_ROOT in a test build (testhooks.py); tests re-root it with
`use_root(path)` (or monkeypatch `default.root`). Standard library only, no dataclasses: the CNI hot path imports this module.
The device plugin's per-device record (PCI facts, char devices) is built in kernel/rdma_devices.py
from these reads.
"""

from __future__ import annotations

import posix
import time

from rdma_netns import testhooks
from rdma_netns.kernel.inet import Prefix
from rdma_netns.util import paths


def _realpath(path: str) -> str:
    """os.path.realpath, for the admin's and the device plugin's lookups (and one rare fallback of
    the CNI's): they load os, which the CNI's own path does not (util/paths.py)."""
    import os.path

    return os.path.realpath(path)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _read_raw(path: str) -> str | None:
    """_read without the file object: a third of its cost, for loops over whole GID tables
    (the device plugin reads every entry of every RoCE port each health interval)."""
    try:
        fd = posix.open(path, posix.O_RDONLY | posix.O_CLOEXEC)
    except OSError:
        return None
    try:
        return posix.read(fd, 256).decode(errors="replace").strip()
    except OSError:
        return None  # an empty GID entry: the kernel refuses the read itself
    finally:
        posix.close(fd)


def _list(path: str) -> list[str]:
    try:
        return sorted(posix.listdir(path))
    except OSError:
        return []


class RdmaPort:
    """One port of one RDMA device (sysfs numbers ports from 1)."""

    __slots__ = ("device", "port")

    def __init__(self, device: str, port: int) -> None:
        self.device, self.port = device, port

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RdmaPort) and (self.device, self.port) == (other.device, other.port)

    def __hash__(self) -> int:
        return hash((self.device, self.port))

    def __repr__(self) -> str:
        return f"RdmaPort({self.device!r}, {self.port})"


class GidUsage:
    """A RoCE port's GID table: entries in total, in use, taken per IP address, used by pods."""

    __slots__ = ("total", "used", "per_address", "in_pods")

    def __init__(self, total: int, used: int, per_address: int, in_pods: int = 0) -> None:
        self.total, self.used, self.per_address, self.in_pods = total, used, per_address, in_pods

    @property
    def free_addresses(self) -> int:
        """How many more IP addresses the table can turn into GIDs."""
        return max(0, self.total - self.used) // self.per_address

    @property
    def full(self) -> bool:
        return self.free_addresses == 0

    def __repr__(self) -> str:
        return f"GidUsage(used={self.used}/{self.total}, per_address={self.per_address}, in_pods={self.in_pods})"


class GidEntry:
    __slots__ = ("index", "gid", "gid_type", "ndev")

    def __init__(self, index: int, gid: str, gid_type: str, ndev: str) -> None:
        self.index, self.gid, self.gid_type, self.ndev = index, gid, gid_type, ndev


def gid_text(ip: Prefix) -> str:
    """How sysfs prints the RoCE v2 GID of an address (IPv4 as an IPv4-mapped IPv6 address)."""
    packed = ip.packed if ip.version == 6 else b"\0" * 10 + b"\xff\xff" + ip.packed
    return Prefix.from_bytes(packed).exploded()


def port_word(text: str) -> str:
    """sysfs prints a port's state as '4: ACTIVE' and phys_state as '5: LinkUp'; keep the name."""
    return text.split(":", 1)[1].strip() if ":" in text else text.strip()


class RdmaSysfs:
    """Reads the kernel's RDMA sysfs layout under `root`."""

    __slots__ = ("root",)

    def __init__(self, root: str = "/sys") -> None:
        self.root = root.rstrip("/") or "/"

    def __repr__(self) -> str:
        return f"RdmaSysfs({self.root!r})"

    # --- kernel-wide ----------------------------------------------------------------------------
    def subsystem_present(self) -> bool:
        """True when the kernel has an RDMA core (ib_core loaded)."""
        return paths.isdir(f"{self.root}/class/infiniband") or paths.isdir(f"{self.root}/module/ib_core")

    def rdma_cm_present(self) -> bool:
        """True when rdma_ucm is loaded: its misc device is what /dev/infiniband/rdma_cm opens.
        Read here, not in /dev, because the device plugin's container has no /dev of the host."""
        return paths.exists(f"{self.root}/class/misc/rdma_cm")

    def netns_mode(self) -> str | None:
        """'shared' or 'exclusive', read live from ib_core's netns_mode parameter (None: no RDMA core).

        The parameter is the kernel's own ib_devices_shared_netns flag, which RDMA_NLDEV_CMD_SYS_SET
        changes at run time, so this reflects the current mode, not only the boot value.
        """
        value = _read(f"{self.root}/module/ib_core/parameters/netns_mode")
        if value is None:
            return None
        return "shared" if value in ("Y", "1") else "exclusive"

    # --- devices and ports ----------------------------------------------------------------------
    def device_names(self) -> list[str]:
        """The RDMA devices this network namespace sees (in exclusive mode: only its own)."""
        return _list(f"{self.root}/class/infiniband")

    def has_device(self, device: str) -> bool:
        return paths.isdir(f"{self.root}/class/infiniband/{device}")

    def ports(self, device: str) -> list[int]:
        return sorted(int(p) for p in _list(f"{self.root}/class/infiniband/{device}/ports") if p.isdigit())

    def port_status(self, device: str, port: int) -> tuple[str, str, str]:
        """(state, phys_state, link_layer) of a port: ('ACTIVE', 'LinkUp', 'Ethernet'); '' when unreadable
        (link_layer then 'Ethernet', the only kind a soft device has)."""
        base = f"{self.root}/class/infiniband/{device}/ports/{port}"
        return (port_word(_read(f"{base}/state") or ""), port_word(_read(f"{base}/phys_state") or ""),
                _read(f"{base}/link_layer") or "Ethernet")

    def netdevs_of_device(self, device: str) -> list[str]:
        """The netdevs an RDMA device runs on; one rule for every program that asks.

        1. its PCI (or auxiliary) function's net/ folder: mlx5, irdma, bnxt_re and other hardware;
        2. else the `parent` file: soft devices (rxe, siw) name the netdev they were created on;
        3. else the netdev of a port's default GID (gid_attrs/ndevs/0): RoCE devices whose function
           shows no net/ folder here (a netdev in another namespace, drivers with no parent file).
        An InfiniBand device without IPoIB has none of these: [].
        """
        base = f"{self.root}/class/infiniband/{device}"
        found = _list(f"{base}/device/net")
        if found:
            return found
        parent = _read(f"{base}/parent")
        if parent:
            return [parent]
        for port in self.ports(device):
            ndev = _read(f"{base}/ports/{port}/gid_attrs/ndevs/0")
            if ndev:
                return [ndev]
        return []

    def device_of_netdev(self, netdev: str) -> RdmaPort | None:
        """The RDMA device and port whose netdev is `netdev`, if any; for a bond or any of its
        members, the device of one of the members (RoCE LAG: mlx5_bond_N reports PF0's port)."""
        rail = self.rail_netdev(netdev)
        candidates = {netdev, rail, *self.bond_members(rail)}
        for device in self.device_names():
            if candidates.intersection(self.netdevs_of_device(device)):
                return RdmaPort(device, (self.ports(device) or [1])[0])
        return None

    # --- bonds (RoCE LAG) -----------------------------------------------------------------------
    # Under LAG mlx5 registers one RDMA device (mlx5_bond_N) for both ports of a card; its
    # function's net/ folder and its port netdev name a member (a PF netdev), while the bond is the
    # netdev that carries the addresses, and the kernel fills the GID table from the bond and every
    # device stacked on it. A member cannot take a macvlan/ipvlan (EBUSY) nor leave the host
    # without breaking the LAG, so every rail on a bonded port is the bond. Soft-RoCE made on a
    # bond member reproduces the shape (its `parent` names the member).
    def bond_of(self, netdev: str) -> str | None:
        """The bond `netdev` is a member of (its `master` is a bonding device), else None."""
        try:
            master = paths.basename(posix.readlink(f"{self.root}/class/net/{netdev}/master"))
        except OSError:
            return None
        return master if self.is_bond(master) else None

    def is_bond(self, netdev: str) -> bool:
        return paths.isdir(f"{self.root}/class/net/{netdev}/bonding")

    def bond_members(self, netdev: str) -> list[str]:
        """A bond's members in the bonding driver's order ([] for anything else)."""
        if not self.is_bond(netdev):
            return []
        text = _read(f"{self.root}/class/net/{netdev}/bonding/slaves")
        if text:
            return text.split()
        return sorted(name[6:] for name in _list(f"{self.root}/class/net/{netdev}") if name.startswith("lower_"))

    def rail_netdev(self, netdev: str) -> str:
        """The netdev a rail on `netdev` uses: its bond when it is a bond member, else itself."""
        return self.bond_of(netdev) or netdev

    def rail_netdevs_of_device(self, device: str) -> list[str]:
        """The netdevs rails of an RDMA device use: its netdevs, each replaced by its bond."""
        return list(dict.fromkeys(self.rail_netdev(nd) for nd in self.netdevs_of_device(device)))

    def netdevs_of_pci(self, address: str) -> list[str]:
        """The netdevs of a PCI or auxiliary function: its net/ folder (mlx5, ice, ...), or that of
        a child device for drivers that put the netdev one level down (virtio-net: <pci>/virtioN/net)."""
        for bus in ("pci", "auxiliary"):
            base = f"{self.root}/bus/{bus}/devices/{address}"
            try:
                return sorted(posix.listdir(f"{base}/net"))
            except OSError:
                pass
            for child in _list(base):
                if child.startswith("virtio"):
                    found = _list(f"{base}/{child}/net")
                    if found:
                        return found
        return []

    def device_by_id(self, device_id: str) -> str | None:
        """An RDMA device named directly, or the one on a PCI/auxiliary device (deviceID conventions)."""
        if self.has_device(device_id):
            return device_id
        for bus in ("pci", "auxiliary"):
            found = _list(f"{self.root}/bus/{bus}/devices/{device_id}/infiniband")
            if found:
                return found[0]
        return None

    # --- the function behind a device -----------------------------------------------------------
    def pci_address_of_device(self, device: str) -> str | None:
        """The PCI (or auxiliary) device name behind an RDMA device, for the CNI result's pciID."""
        link = f"{self.root}/class/infiniband/{device}/device"
        try:
            target = posix.readlink(link)
        except OSError:
            return None
        name = paths.basename(target)
        # The kernel's link ends in the function's name; a relative one such as "../.." does not.
        return name if name not in ("", ".", "..") else paths.basename(_realpath(link))

    def function_of_device(self, device: str) -> tuple[str | None, str | None, str | None, str | None, int | None]:
        """(pci, vendor, device_id, driver, numa_node) of the function behind a device; all None for
        a soft device. `pci` is set only on the PCI bus (an auxiliary SF has no PCI address of its
        own); vendor and device ids are lower-case hex without 0x; numa_node None when unknown."""
        link = f"{self.root}/class/infiniband/{device}/device"
        if not (paths.islink(link) or paths.isdir(link)):
            return None, None, None, None, None
        real = _realpath(link)
        subsystem = f"{real}/subsystem"
        bus = paths.basename(_realpath(subsystem)) if paths.exists(subsystem) else None
        last = paths.basename(real)
        pci = last if bus == "pci" or (bus is None and _looks_like_pci(last)) else None
        driver_link = f"{real}/driver"
        driver = paths.basename(_realpath(driver_link)) if paths.exists(driver_link) else None
        numa_text = _read(f"{link}/numa_node")
        numa = int(numa_text) if numa_text and numa_text.lstrip("-").isdigit() and int(numa_text) >= 0 else None
        return pci, _hex_id(_read(f"{link}/vendor")), _hex_id(_read(f"{link}/device")), driver, numa

    def char_devices(self, cls: str) -> dict[str, list[tuple[str, int | None]]]:
        """Char devices of a class (infiniband_verbs: uverbsN; infiniband_mad: umadN, issmN) by RDMA
        device: [(name, port or None)]. The kernel renumbers them when a device changes namespace."""
        found: dict[str, list[tuple[str, int | None]]] = {}
        base = f"{self.root}/class/{cls}"
        for name in _list(base):
            ibdev = _read(f"{base}/{name}/ibdev")
            if not ibdev:
                continue  # abi_version and other plain files of the class
            port = _read(f"{base}/{name}/port")
            found.setdefault(ibdev, []).append((name, int(port) if port and port.isdigit() else None))
        return found

    # --- GIDs -----------------------------------------------------------------------------------
    def find_gid(self, port: RdmaPort, ip: Prefix, limit: int | None = None) -> GidEntry | None:
        """The RoCE v2 GID entry for `ip` on `port`, found by content (indexes vary by layout).
        The whole table by default: on Soft-RoCE (1024 entries) a busy node's pods sit beyond 256."""
        want = gid_text(ip)
        base = f"{self.root}/class/infiniband/{port.device}/ports/{port.port}"
        try:
            count = len(posix.listdir(f"{base}/gids"))
        except OSError:
            return None
        if limit is not None:
            count = min(limit, count)
        for index in range(count):
            if _read(f"{base}/gids/{index}") != want:
                continue
            gid_type = _read(f"{base}/gid_attrs/types/{index}") or ""
            if gid_type != "RoCE v2":
                continue
            return GidEntry(index, want, gid_type, _read(f"{base}/gid_attrs/ndevs/{index}") or "")
        return None

    def gids(self, port: RdmaPort, limit: int = 16) -> list[GidEntry]:
        """The non-empty GID entries among the first `limit` (a full table is 256-1024 entries and
        slow to read on soft devices)."""
        base = f"{self.root}/class/infiniband/{port.device}/ports/{port.port}"
        out = []
        for index in range(limit):
            gid = _read(f"{base}/gids/{index}")
            if gid is None:
                break
            if gid.replace("0", "").replace(":", ""):
                out.append(GidEntry(index, gid, _read(f"{base}/gid_attrs/types/{index}") or "",
                                    _read(f"{base}/gid_attrs/ndevs/{index}") or ""))
        return out

    def gid_usage(self, port: RdmaPort) -> GidUsage | None:
        """How full a RoCE port's GID table is, read from sysfs; None when it has no table here.

        An entry is in use when its gid_attrs/ndevs file answers (the kernel refuses the read of an
        empty entry); reading only that file keeps a pass at one read per entry (255 on mlx5, 1024
        on rxe). Entries per address: 2 when the port also makes RoCE v1 GIDs (mlx5, whose reserved
        default GID takes indexes 0 and 1), else 1 (rxe, RoCE v2 only). `in_pods`: entries whose
        netdev is not in this namespace (the pods' interfaces; the host's own addresses are not).
        """
        base = f"{self.root}/class/infiniband/{port.device}/ports/{port.port}"
        try:
            total = len(posix.listdir(f"{base}/gids"))
        except OSError:
            return None
        here = set(_list(f"{self.root}/class/net"))
        used = in_pods = 0
        for index in range(total):
            ndev = _read_raw(f"{base}/gid_attrs/ndevs/{index}")
            if ndev is None:
                continue
            used += 1
            if ndev not in here:
                in_pods += 1
        types = {_read(f"{base}/gid_attrs/types/{i}") for i in (0, 1)}
        return GidUsage(total, used, 2 if "IB/RoCE v1" in types else 1, in_pods)

    def netdevs_here(self) -> list[str]:
        """The netdevs of this network namespace (class/net): a GID entry whose ndev is not among
        them belongs to an interface in another namespace (a pod's)."""
        return _list(f"{self.root}/class/net")

    def used_gids(self, port: RdmaPort) -> list[GidEntry]:
        """Every entry in use (its gid_attrs/ndevs answers, as gid_usage counts them), with its GID,
        type and netdev: the whole table, one read per entry and three per used one."""
        base = f"{self.root}/class/infiniband/{port.device}/ports/{port.port}"
        try:
            total = len(posix.listdir(f"{base}/gids"))
        except OSError:
            return []
        out = []
        for index in range(total):
            ndev = _read_raw(f"{base}/gid_attrs/ndevs/{index}")
            if ndev is None:
                continue
            out.append(GidEntry(index, _read(f"{base}/gids/{index}") or "", _read(f"{base}/gid_attrs/types/{index}")
                                or "", ndev.strip()))
        return out

    def missing_gid_facts(self, device: str, port: int, address: str) -> dict:
        """What a port has when the GID of `address` did not appear (plain data: it may be read in
        a child with a pod's sysfs view): its table's use, and the address's entries of another
        GID type (mlx5 with RoCE v2 off makes only v1)."""
        rdma_port = RdmaPort(device, port)
        usage = self.gid_usage(rdma_port)
        want = gid_text(Prefix.parse(address))
        base = f"{self.root}/class/infiniband/{device}/ports/{port}"
        other = []
        if usage is not None:
            other = [_read(f"{base}/gid_attrs/types/{i}") or "?" for i in range(usage.total)
                     if _read(f"{base}/gids/{i}") == want]
        return {"total": usage.total if usage else 0, "used": usage.used if usage else 0,
                "perAddress": usage.per_address if usage else 1, "full": bool(usage and usage.full),
                "otherTypes": other}

    def wait_for_gids(self, wanted: list[tuple[str, int, str]], timeout: float) -> list[int | None]:
        """For each (device, port, address text): the index of its RoCE v2 GID, polled until found or
        `timeout`; None where none appeared. Plain data in and out, so it can run in a child
        process that sees a pod's sysfs (kernel/netns_sysfs.py)."""
        deadline = time.monotonic() + timeout
        found: list[int | None] = [None] * len(wanted)
        while True:
            for i, (device, port, address) in enumerate(wanted):
                if found[i] is None:
                    entry = self.find_gid(RdmaPort(device, port), Prefix.parse(address))
                    found[i] = entry.index if entry else None
            if all(f is not None for f in found) or time.monotonic() > deadline:
                return found
            time.sleep(0.002)


def _hex_id(text: str | None) -> str | None:
    return text.lower().removeprefix("0x") if text else None


def _looks_like_pci(name: str) -> bool:
    parts = name.split(":")
    return len(parts) == 3 and "." in parts[2]


# Tests point this at a kernel-shaped tree (PCI functions, RDMA devices) on machines without RDMA
# hardware, in-process with use_root() and in CNI subprocesses with the variable, which only a test
# build honours (testhooks.py).
default = RdmaSysfs(testhooks.get(testhooks.SYSFS_ROOT) or "/sys")


def use_root(root: str) -> str:
    """Re-root the default reader (tests); returns the previous root so a test can put it back."""
    previous, default.root = default.root, RdmaSysfs(root).root
    return previous


# The CNI's names for the default reader's reads (kept stable for commands/, rails/nics.py, modes/).
def subsystem_present() -> bool:
    return default.subsystem_present()


def netns_mode() -> str | None:
    return default.netns_mode()


def devices() -> list[str]:
    return default.device_names()


def ports(device: str) -> list[int]:
    return default.ports(device)


def netdevs_of_device(device: str) -> list[str]:
    return default.netdevs_of_device(device)


def device_of_netdev(netdev: str) -> RdmaPort | None:
    return default.device_of_netdev(netdev)


def netdevs_of_pci(address: str) -> list[str]:
    return default.netdevs_of_pci(address)


def device_by_id(device_id: str) -> str | None:
    return default.device_by_id(device_id)


def pci_address_of_device(device: str) -> str | None:
    return default.pci_address_of_device(device)


def find_gid(port: RdmaPort, ip: Prefix, limit: int | None = None) -> GidEntry | None:
    return default.find_gid(port, ip, limit)


def gid_usage(port: RdmaPort) -> GidUsage | None:
    return default.gid_usage(port)


def rail_netdev(netdev: str) -> str:
    return default.rail_netdev(netdev)


def rail_netdevs_of_device(device: str) -> list[str]:
    return default.rail_netdevs_of_device(device)


def bond_members(netdev: str) -> list[str]:
    return default.bond_members(netdev)


def gids(port: RdmaPort, limit: int = 16) -> list[GidEntry]:
    return default.gids(port, limit)


def wait_for_gids(wanted: list[tuple[str, int, str]], timeout: float) -> list[int | None]:
    return default.wait_for_gids(wanted, timeout)
