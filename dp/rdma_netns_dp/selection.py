"""Which discovered RDMA devices belong to a resource (the config's selectors)."""

from __future__ import annotations

from fnmatch import fnmatchcase

from rdma_netns.kernel.rdma_devices import RdmaDevice
from rdma_netns_dp.config import Selectors


def _any_glob(values: tuple[str, ...] | list[str], patterns: list[str]) -> bool:
    return any(fnmatchcase(value, pattern) for value in values for pattern in patterns)


def matches(device: RdmaDevice, selectors: Selectors) -> bool:
    """True when every non-empty selector list matches the device (OR within a list)."""
    if selectors.rdmaDevices and not _any_glob([device.name], selectors.rdmaDevices):
        return False
    # netdevs: its own, or under RoCE LAG its bond's or the bond's members' (bond0 picks mlx5_bond_0)
    if selectors.netdevs and not _any_glob(device.related_netdevs, selectors.netdevs):
        return False
    if selectors.vendors and device.vendor not in selectors.vendors:
        return False
    if selectors.deviceIDs and device.device_id not in selectors.deviceIDs:
        return False
    if selectors.drivers and not _any_glob([device.driver or ""], selectors.drivers):
        return False
    if selectors.linkTypes and not device.link_types & set(selectors.linkTypes):
        return False
    return True
