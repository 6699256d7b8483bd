"""RDMA facts read from sysfs: which RDMA device backs a netdev, its GID table, the netns mode.

sysfs answers these without a NETLINK_RDMA round trip (and without importing pyroute2), which
keeps them cheap enough for every ADD. Paths follow the kernel's layout:
/sys/class/infiniband/<dev>/ports/<p>/gids/<i>, .../gid_attrs/{ndevs,types}/<i>.
"""

from __future__ import annotations

import os
import time

from rdma_netns.kernel.inet import Prefix

# Tests point this at a kernel-shaped tree (PCI functions, RDMA devices) on machines without
# RDMA hardware; a node never sets it.
SYSFS = os.environ.get("RDMA_NETNS_SYSFS_ROOT") or "/sys"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def subsystem_present() -> bool:
    """True when the kernel has an RDMA core (ib_core loaded)."""
    return os.path.isdir(f"{SYSFS}/class/infiniband") or os.path.isdir(f"{SYSFS}/module/ib_core")


def netns_mode() -> str | None:
    """'shared' or 'exclusive', read live from ib_core's netns_mode parameter (None: no RDMA core).

    The parameter is the kernel's own ib_devices_shared_netns flag, which RDMA_NLDEV_CMD_SYS_SET
    changes at run time, so this reflects the current mode, not only the boot value.
    """
    value = _read(f"{SYSFS}/module/ib_core/parameters/netns_mode")
    if value is None:
        return None
    return "shared" if value in ("Y", "1") else "exclusive"


def devices() -> list[str]:
    try:
        return sorted(os.listdir(f"{SYSFS}/class/infiniband"))
    except OSError:
        return []


def ports(device: str) -> list[int]:
    try:
        return sorted(int(p) for p in os.listdir(f"{SYSFS}/class/infiniband/{device}/ports") if p.isdigit())
    except OSError:
        return []


def netdevs_of_device(device: str) -> list[str]:
    """The netdevs an RDMA device runs on: its PCI function's netdevs, or a soft device's parent."""
    base = f"{SYSFS}/class/infiniband/{device}"
    try:
        found = sorted(os.listdir(f"{base}/device/net"))
    except OSError:
        found = []
    if found:
        return found
    parent = _read(f"{base}/parent")  # rxe, siw: the netdev they were created on
    if parent:
        return [parent]
    for port in ports(device):
        ndev = _read(f"{base}/ports/{port}/gid_attrs/ndevs/0")
        if ndev:
            return [ndev]
    return []


class RdmaPort:
    __slots__ = ("device", "port")

    def __init__(self, device: str, port: int) -> None:
        self.device, self.port = device, port

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RdmaPort) and (self.device, self.port) == (other.device, other.port)

    def __repr__(self) -> str:
        return f"RdmaPort({self.device!r}, {self.port})"


def device_of_netdev(netdev: str) -> RdmaPort | None:
    """The RDMA device and port whose netdev is `netdev`, if any."""
    for device in devices():
        if netdev in netdevs_of_device(device):
            return RdmaPort(device, (ports(device) or [1])[0])
    return None


def netdevs_of_pci(address: str) -> list[str]:
    for bus in ("pci", "auxiliary"):
        try:
            return sorted(os.listdir(f"{SYSFS}/bus/{bus}/devices/{address}/net"))
        except OSError:
            continue
    return []


def device_by_id(device_id: str) -> str | None:
    """An RDMA device named directly, or the one on a PCI/auxiliary device (deviceID conventions)."""
    if os.path.isdir(f"{SYSFS}/class/infiniband/{device_id}"):
        return device_id
    for bus in ("pci", "auxiliary"):
        try:
            found = sorted(os.listdir(f"{SYSFS}/bus/{bus}/devices/{device_id}/infiniband"))
        except OSError:
            continue
        if found:
            return found[0]
    return None


def gid_text(ip: Prefix) -> str:
    """How sysfs prints the RoCE v2 GID of an address (IPv4 as an IPv4-mapped IPv6 address)."""
    packed = ip.packed if ip.version == 6 else b"\0" * 10 + b"\xff\xff" + ip.packed
    return Prefix.from_bytes(packed).exploded()


class GidEntry:
    __slots__ = ("index", "gid", "gid_type", "ndev")

    def __init__(self, index: int, gid: str, gid_type: str, ndev: str) -> None:
        self.index, self.gid, self.gid_type, self.ndev = index, gid, gid_type, ndev


def find_gid(port: RdmaPort, ip: Prefix, limit: int = 256) -> GidEntry | None:
    """The RoCE v2 GID entry for `ip` on `port`, found by content (indexes vary by layout)."""
    want = gid_text(ip)
    base = f"{SYSFS}/class/infiniband/{port.device}/ports/{port.port}"
    try:
        count = min(limit, len(os.listdir(f"{base}/gids")))
    except OSError:
        return None
    for index in range(count):
        if _read(f"{base}/gids/{index}") != want:
            continue
        gid_type = _read(f"{base}/gid_attrs/types/{index}") or ""
        if gid_type != "RoCE v2":
            continue
        return GidEntry(index, want, gid_type, _read(f"{base}/gid_attrs/ndevs/{index}") or "")
    return None


def gids(port: RdmaPort, limit: int = 16) -> list[GidEntry]:
    """The non-empty GID entries among the first `limit` (a full table is 256-1024 entries and
    slow to read on soft devices)."""
    base = f"{SYSFS}/class/infiniband/{port.device}/ports/{port.port}"
    out = []
    for index in range(limit):
        gid = _read(f"{base}/gids/{index}")
        if gid is None:
            break
        if gid.replace("0", "").replace(":", ""):
            out.append(GidEntry(index, gid, _read(f"{base}/gid_attrs/types/{index}") or "",
                                _read(f"{base}/gid_attrs/ndevs/{index}") or ""))
    return out


def pci_address_of_device(device: str) -> str | None:
    """The PCI (or auxiliary) device name behind an RDMA device, for the result's pciID."""
    try:
        target = os.readlink(f"{SYSFS}/class/infiniband/{device}/device")
    except OSError:
        return None
    return os.path.basename(target)


def wait_for_gids(wanted: list[tuple[str, int, str]], timeout: float) -> list[int | None]:
    """For each (device, port, address text): the index of its RoCE v2 GID, polled until found or
    `timeout`; None where none appeared. Plain data in and out, so it can run in a child
    process that sees a pod's sysfs (kernel/netns_sysfs.py)."""
    deadline = time.monotonic() + timeout
    found: list[int | None] = [None] * len(wanted)
    while True:
        for i, (device, port, address) in enumerate(wanted):
            if found[i] is None:
                entry = find_gid(RdmaPort(device, port), Prefix.parse(address))
                found[i] = entry.index if entry else None
        if all(f is not None for f in found) or time.monotonic() > deadline:
            return found
        time.sleep(0.002)
