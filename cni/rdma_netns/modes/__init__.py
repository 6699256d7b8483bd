"""How a rail's interface gets into the pod and out again, one module per RDMA netns mode.

A mode implements attach/detach/owns (see shared.py); everything else about a rail (IPAM,
addresses, routing, GID checks, state) is common and lives in plugin.py and addressing.py.
"""

from __future__ import annotations

from rdma_netns.kernel import rdma_sysfs
from rdma_netns.modes.shared import SharedMode
from rdma_netns.spec.errors import NOT_IMPLEMENTED, WRONG_RDMA_MODE, CniError


def effective_mode(configured: str, kernel: str | None) -> str:
    """The mode to run in: `auto` follows the kernel; a mismatch is an error, not a guess."""
    if configured == "auto":
        return kernel or "shared"
    if kernel is not None and kernel != configured:
        raise CniError(
            WRONG_RDMA_MODE,
            f"this network is configured for {configured} RDMA mode but the kernel's RDMA netns mode is {kernel}",
            f"set the node's mode at boot with `options ib_core netns_mode={1 if configured == 'shared' else 0}` "
            "in /etc/modprobe.d (a change needs no other network namespace to exist), or set \"mode\" to \"auto\"",
        )
    return configured


def select(net: dict) -> SharedMode:
    mode = effective_mode(net["mode"], rdma_sysfs.netns_mode())
    if mode == "exclusive":
        raise CniError(NOT_IMPLEMENTED, "exclusive RDMA mode is not available in this build yet",
                       "use shared mode (the kernel default)")
    return SharedMode(net["link"], net["linkMode"])
