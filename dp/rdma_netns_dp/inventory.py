"""A resource's device list as kubelet sees it, rebuilt from each discovery pass.

Shared mode: N interchangeable units ("hca-0000"...) backed by every selected device; they are
Healthy while at least one selected device has an ACTIVE port (sharedHealth "any", the default),
or only while every one has (sharedHealth "all"). Exclusive mode: one unit per RDMA
device, ID = PCI address (stable across renames) or name, with its NUMA node.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from rdma_netns.kernel.rdma_devices import RdmaDevice
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
        self._by_id: dict[str, RdmaDevice] = {}
        self._known: dict[str, Unit] = {}            # exclusive: name -> last unit of devices seen

    @property
    def shared(self) -> bool:
        return self.mode == "shared"

    def update(self, discovered: list[RdmaDevice], in_pods: set[str] | None = None,
               blocked_reason: str | None = None) -> bool:
        """Replace the state from a discovery pass; True (and waiters woken) when kubelet must hear."""
        selected = tuple(d for d in discovered if matches(d, self.resource.selectors))
        if self.shared:
            ports_ok = all if self.resource.sharedHealth == "all" else any  # "all": no DOWN device in a unit
            healthy = blocked_reason is None and bool(selected) and ports_ok(d.healthy for d in selected)
            units = tuple(Unit(f"hca-{i:04d}", healthy) for i in range(self.resource.sharedUnits))
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
            if units == self.units and blocked_reason == self.blocked_reason:
                return False
            self.units = units
            self.blocked_reason = blocked_reason
            self.version += 1
            self.changed.notify_all()
            return True

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

    def numa_of(self) -> dict[str, int | None]:
        with self.changed:
            return {u.id: u.numa_node for u in self.units}

    def healthy_count(self) -> int:
        with self.changed:
            return sum(1 for u in self.units if u.healthy)
