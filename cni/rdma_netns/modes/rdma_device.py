"""Exclusive mode chained after a plugin that moved the netdev (host-device, sriov): the network
has no IPAM of its own (it configures no address) and moves only the RDMA device into the pod,
passing the previous plugin's result on. Chained with IPAM (after the cluster's CNI), exclusive
mode moves whole NICs like a network of its own (exclusive.py).
"""

from __future__ import annotations

from rdma_netns.config.netconf import NetConfig
from rdma_netns.kernel import rdma_sysfs, rtnl
from rdma_netns.kernel.netlink import NetlinkSocket
from rdma_netns.modes.base import RDMA_DEVICE_LINK, Mode
from rdma_netns.modes.exclusive import move_rdma_device, rdma_device_visible
from rdma_netns.spec.errors import INVALID_CONFIG, NOT_GRANTED, RAIL_UNAVAILABLE, CniError

def applies(net: NetConfig) -> bool:
    """Does a chained exclusive attachment of `net` move only the RDMA device (no IPAM anywhere)?"""
    return not net.ipam and not any(e.ipam for e in net.rails or [])


class RdmaDeviceMode(Mode):
    __slots__ = ()

    name = "exclusive"
    link_kind = RDMA_DEVICE_LINK
    gids_in_pod = True
    grant_names_devices = True
    configures_addresses = False

    def chained_rails(self, ifname: str, prev: dict, net: NetConfig, device_id: str | None,
                      granted_ids: list[str] | None) -> list[dict]:
        """The state's rails: one, the RDMA device of the previous plugin's pod interface."""
        if not any(i.get("name") == ifname and i.get("sandbox") for i in prev.get("interfaces", [])):
            raise CniError(INVALID_CONFIG, f"chained exclusive mode needs the previous plugin's pod interface "
                           f"{ifname} in prevResult")
        device = _device_for_chained(net, device_id, granted_ids)
        return [{"ifname": ifname, "rdmaDevice": device, "rdmaOnly": True, "ipam": None}]

    def attach_chained(self, pod_netns_fd: int, rails: list[dict], prev: dict) -> None:
        """Move the device in and name it in the previous result's pod interface (pciID)."""
        for rail in rails:
            move_rdma_device(rail["rdmaDevice"], pod_netns_fd)
            for iface in prev.get("interfaces", []):
                if iface.get("name") == rail["ifname"] and iface.get("sandbox"):
                    iface["pciID"] = rdma_sysfs.pci_address_of_device(rail["rdmaDevice"]) or rail["rdmaDevice"]

    def find_in_pod(self, pod_sock: NetlinkSocket, rail_state: dict) -> rtnl.Link | None:
        return None  # the netdev belongs to the previous plugin

    def owns(self, link: rtnl.Link, rail_state: dict) -> bool:
        return False

    def detach(self, pod_sock: NetlinkSocket, link: rtnl.Link | None, rail_state: dict,
               host_netns_fd: int) -> None:
        if rail_state.get("rdmaDevice"):
            move_rdma_device(rail_state["rdmaDevice"], host_netns_fd, missing_ok=True)

    def check_in_pod(self, rail_state: dict) -> str | None:
        device = rail_state.get("rdmaDevice")
        if not device or not rdma_device_visible(device):
            return f"RDMA device {device} is not in the pod"
        return None


def _device_for_chained(net: NetConfig, device_id: str | None, granted_ids: list[str] | None) -> str:
    """Chained, the netdev is already in the pod: the RDMA device comes from deviceID, the pod's
    one granted unit, or the config."""
    entries = net.rails or []
    resource = net.resource_name
    if granted_ids is not None:
        if device_id and device_id not in granted_ids:
            raise CniError(NOT_GRANTED, f"runtimeConfig.deviceID {device_id} is not among the pod's "
                           f"{resource} units ({', '.join(granted_ids)})")
        if not device_id and len(granted_ids) != 1:
            raise CniError(NOT_GRANTED, f"the pod holds {len(granted_ids)} {resource} units; "
                           "a chained RDMA-device-only attachment moves one: pass runtimeConfig.deviceID")
        device_id = device_id or granted_ids[0]
    candidates = [device_id] if device_id else \
        [e.rdma_device or e.pci_address for e in entries[:1]]
    for candidate in filter(None, candidates):
        device = rdma_sysfs.device_by_id(candidate)
        if device:
            return device
        raise CniError(RAIL_UNAVAILABLE, f"no RDMA device {candidate} (or on PCI device {candidate}) on this node")
    raise CniError(INVALID_CONFIG, "chained exclusive mode needs runtimeConfig.deviceID or a rail with rdmaDevice "
                   "or pciAddress to know which RDMA device to move")
