"""A resource's device list as kubelet sees it, rebuilt from each discovery pass.

Shared mode: N interchangeable units ("hca-0000"...) backed by every selected device; they are
Healthy while at least one selected device has an ACTIVE port (sharedHealth "any", the default),
or only while every one has (sharedHealth "all"). Exclusive mode: one unit per RDMA
device, ID = PCI address (stable across renames) or name, with its NUMA node.

Shared mode also stops at what the rails' GID tables can still wire: every pod address on a rail
takes a GID entry or two, and a full table silently takes no more (mlx5: 255 entries, 2 per
address), leaving a pod with a rail but no GID. So no more units are Healthy than the pods
already wired plus the pods the fullest table still takes, the lowest-numbered ones.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from rdma_netns.kernel.rdma_devices import RdmaDevice
from rdma_netns.kernel.rdma_sysfs import GidUsage, RdmaPort
from rdma_netns_dp.config import ResourceConfig
from rdma_netns_dp.selection import matches

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


@dataclass(frozen=True)
class Unit:
    """One advertised device ID."""

    id: str
    healthy: bool
    numa_node: int | None = None


class UnknownDevice(LookupError):
    """kubelet asked for IDs this resource never advertised (or no longer has)."""


@dataclass(frozen=True)
class GidCapacity:
    """How many pods the selected RoCE ports' GID tables allow: `units` in all (pods already
    wired plus `more`), from `ports`' usage as read in one discovery pass."""

    units: int
    more: int
    ports: tuple[tuple[RdmaPort, GidUsage], ...]

    def describe(self) -> str:
        used = ", ".join(f"{p.device} port {p.port} {u.used}/{u.total} entries used" for p, u in self.ports)
        return f"GID tables allow {self.more} more pods on this node: {used}"

    def as_json(self) -> dict:
        return {"units": self.units, "morePods": self.more,
                "ports": [{"device": p.device, "port": p.port, "used": u.used, "total": u.total,
                           "perAddress": u.per_address, "inPods": u.in_pods} for p, u in self.ports]}


def roce_ports(devices: Iterable[RdmaDevice]) -> list[RdmaPort]:
    """The RoCE ports of `devices`, those with a GID per address: Ethernet link layer, not iWARP
    (whose one-entry table the kernel fills from the MAC: it would read as full)."""
    return [RdmaPort(d.name, p.number) for d in devices if not d.iwarp
            for p in d.ports if p.link_layer.lower() == "ethernet"]


def gid_capacity(usage: Mapping[RdmaPort, GidUsage], addresses_per_pod: int) -> GidCapacity | None:
    """The pods the GID tables allow: the most pods wired on any port (ceil, as a pod's entries
    may be partly gone) plus the fewest more any port takes; None when no table was read."""
    if not usage:
        return None
    per_pod = {p: u.per_address * addresses_per_pod for p, u in usage.items()}
    wired = max(-(-u.in_pods // per_pod[p]) for p, u in usage.items())
    more = min(max(0, u.total - u.used) // per_pod[p] for p, u in usage.items())
    return GidCapacity(wired + more, more, tuple(usage.items()))


class Pool:
    """Thread-safe current state of one resource; ListAndWatch streams wait on `changed`."""

    def __init__(self, resource: ResourceConfig, mode: str) -> None:
        self.resource = resource
        self.mode = mode
        self.changed = threading.Condition()
        self.version = 0
        self.units: tuple[Unit, ...] = ()
        self.devices: tuple[RdmaDevice, ...] = ()     # selected devices present on the node
        self.in_pods: frozenset[str] = frozenset()    # exclusive: selected devices inside pods
        self.blocked_reason: str | None = None        # all units Unhealthy, and why
        self.gid_capacity: GidCapacity | None = None   # shared: what the GID tables allow, if read
        self._by_id: dict[str, RdmaDevice] = {}
        self._known: dict[str, Unit] = {}            # exclusive: name -> last unit of devices seen

    @property
    def shared(self) -> bool:
        return self.mode == "shared"

    def select(self, discovered: Iterable[RdmaDevice]) -> tuple[RdmaDevice, ...]:
        """The discovered devices this resource's selectors take."""
        return tuple(d for d in discovered if matches(d, self.resource.selectors))

    def gid_ports(self, discovered: Iterable[RdmaDevice]) -> list[RdmaPort]:
        """Shared mode: the ports whose GID tables bound this pool, for the caller to read (sysfs,
        outside the lock) and hand to update()."""
        return roce_ports(self.select(discovered)) if self.shared else []

    def update(self, discovered: list[RdmaDevice], in_pods: set[str] | None = None,
               blocked_reason: str | None = None, gids: Mapping[RdmaPort, GidUsage] | None = None) -> bool:
        """Replace the state from a discovery pass; True (and waiters woken) when kubelet must hear.
        `gids`: the GID usage of (at least) gid_ports(discovered) that could be read."""
        selected = self.select(discovered)
        capacity = None
        if self.shared:
            usage = {p: gids[p] for p in roce_ports(selected) if p in gids} if gids else {}
            capacity = gid_capacity(usage, self.resource.addressesPerPod)
            units = self._shared_units(selected, blocked_reason, capacity)
            away: frozenset[str] = frozenset()
        else:
            units_list = []
            for d in selected:
                self._known[d.name] = Unit(d.stable_id, True, d.numa_node)
                units_list.append(Unit(d.stable_id, blocked_reason is None and d.healthy, d.numa_node))
            present = {d.name for d in selected}
            away = frozenset(n for n in (in_pods or set()) if n in self._known and n not in present)
            # Moved into a pod by the CNI plugin: still this node's device, in use, not removed;
            # Healthy by the same rule as the rest (the host cannot read its ports any more), so
            # a wrong kernel mode makes every unit Unhealthy, away ones included.
            units_list += [Unit(self._known[n].id, blocked_reason is None, self._known[n].numa_node)
                           for n in sorted(away)]
            units = tuple(sorted(units_list, key=lambda u: u.id))
        with self.changed:
            self.devices = selected
            self.in_pods = away
            self._by_id = {d.stable_id: d for d in selected}
            self.gid_capacity = capacity
            if units == self.units and blocked_reason == self.blocked_reason:
                return False
            self.units = units
            self.blocked_reason = blocked_reason
            self.version += 1
            self.changed.notify_all()
            return True

    def _shared_units(self, selected: tuple[RdmaDevice, ...], blocked_reason: str | None,
                      capacity: GidCapacity | None) -> tuple[Unit, ...]:
        """sharedUnits units, Healthy by the sharedHealth rule up to the GID capacity: the lowest
        numbers, which GetPreferredAllocation hands out first, so pods hold the Healthy ones."""
        ports_ok = all if self.resource.sharedHealth == "all" else any  # "all": no DOWN device in a unit
        healthy = blocked_reason is None and bool(selected) and ports_ok(d.healthy for d in selected)
        count = self.resource.sharedUnits if capacity is None else capacity.units
        return tuple(Unit(f"hca-{i:04d}", healthy and i < count) for i in range(self.resource.sharedUnits))

    def snapshot(self) -> tuple[int, tuple[Unit, ...]]:
        with self.changed:
            return self.version, self.units

    def wait_for_change(self, seen_version: int, timeout: float) -> tuple[int, tuple[Unit, ...]]:
        with self.changed:
            self.changed.wait_for(lambda: self.version != seen_version, timeout)
            return self.version, self.units

    def wake_all(self) -> None:
        """Let waiting streams re-check whether they should end (server stopping)."""
        with self.changed:
            self.changed.notify_all()

    def devices_for(self, ids: list[str]) -> list[RdmaDevice]:
        """The RDMA devices behind the IDs kubelet allocated (shared: all selected devices)."""
        with self.changed:
            advertised = {u.id for u in self.units}
            unknown = [i for i in ids if i not in advertised]
            if unknown:
                raise UnknownDevice(f"{self.resource.name}: unknown device IDs {unknown}")
            if self.shared:
                return list(self.devices)
            missing = [i for i in ids if i not in self._by_id]
            if missing:
                raise UnknownDevice(f"{self.resource.name}: devices {missing} are not on the node now "
                                    "(inside another pod's network namespace or removed)")
            return [self._by_id[i] for i in dict.fromkeys(ids)]

    def known_names(self) -> set[str]:
        """Exclusive mode: every device name this pool has ever advertised."""
        with self.changed:
            return set(self._known)

    def unit_order(self) -> dict[str, int]:
        """Each advertised ID's place in the list (shared: hca-0000 is 0)."""
        with self.changed:
            return {u.id: i for i, u in enumerate(self.units)}

    def numa_of(self) -> dict[str, int | None]:
        with self.changed:
            return {u.id: u.numa_node for u in self.units}

    def healthy_count(self) -> int:
        with self.changed:
            return sum(1 for u in self.units if u.healthy)
