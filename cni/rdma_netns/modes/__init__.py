"""How a rail's interface gets into the pod and out again, one module per mode.

Every mode subclasses base.Mode (the protocol the commands talk to: capabilities such as
parent_must_be_up, gids_in_pod, configures_addresses, and prepare/attach/find_in_pod/owns/detach/
restore_host). Everything else about a rail (IPAM, addresses, routing, GID checks, state) is
common and lives in commands/ and rails/addressing.py. This module is the one place that maps the
config and a state's record to a mode:
- shared.py: a macvlan/ipvlan of the RDMA netdev per rail (kernel shared mode);
- exclusive.py: the whole NIC, netdev and RDMA device, moves into the pod (exclusive mode);
- rdma_device.py: exclusive, chained after a netdev plugin without IPAM: only the RDMA device moves.
A new link type is a new Mode module (or a new link kind of SharedMode) plus the config model.
Modules here may import rails/nics.py (the Rail they attach), config/netconf.py, kernel/, spec/,
mode_policy.py and faults.py; never commands/, which calls them.
"""

from __future__ import annotations

from rdma_netns import mode_policy
from rdma_netns.config.netconf import NetConfig
from rdma_netns.kernel import rdma_sysfs
from rdma_netns.modes.base import RDMA_DEVICE_LINK, Mode
from rdma_netns.modes.shared import SharedMode
from rdma_netns.spec.errors import WRONG_RDMA_MODE, CniError

__all__ = ["Mode", "RDMA_DEVICE_LINK", "effective_mode", "select", "for_state", "for_config"]


def effective_mode(configured: str, kernel: str | None) -> str:
    """The mode to run in (mode_policy's rule): `auto` follows the kernel; a mismatch is an
    error, not a guess."""
    mode = mode_policy.resolve(configured, kernel)
    problem = mode_policy.mismatch(mode, kernel)
    if problem:
        raise CniError(WRONG_RDMA_MODE, f"this network is configured for {configured} RDMA mode: {problem}",
                       f"{mode_policy.fix_hint(mode)}; or set \"mode\" to \"auto\"")
    return mode


def _build(name: str, link: str, link_mode: str | None) -> Mode:
    if name == "exclusive":  # imported only for it: shared mode's ADD does not load it
        from rdma_netns.modes.exclusive import ExclusiveMode

        return ExclusiveMode()
    return SharedMode(link, link_mode)


def select(net: NetConfig, chained: bool = False) -> Mode:
    """The mode for a new attachment: the config's, checked against the kernel's."""
    name = effective_mode(net.mode, rdma_sysfs.netns_mode())
    if chained and name == "exclusive":
        from rdma_netns.modes import rdma_device  # only chained exclusive attachments may be one

        if rdma_device.applies(net):
            return rdma_device.RdmaDeviceMode()
    return _build(name, net.link, net.link_mode)


def for_state(mode: str, link: str, rails: list[dict], net: NetConfig) -> Mode:
    """The mode an existing attachment was made in (its state's mode, link and rails say), for
    teardown and CHECK."""
    if link == RDMA_DEVICE_LINK or any(r.get("rdmaOnly") for r in rails):
        from rdma_netns.modes.rdma_device import RdmaDeviceMode

        return RdmaDeviceMode()
    return _build("exclusive" if mode == "exclusive" else "shared", link or net.link, net.link_mode)


def for_config(net: NetConfig) -> Mode:
    """Without state (DEL of an unknown attachment): the mode the config names, unchecked."""
    return _build("exclusive" if net.mode == "exclusive" else "shared", net.link, net.link_mode)
