"""How a rail's interface gets into the pod and out again, one module per RDMA netns mode.

A mode implements prepare (facts to record before any change), attach (host -> pod), owns,
detach (pod -> host, run inside the pod) and restore_host (run in the host afterwards, also
when the pod's namespace is already gone). Everything else about a rail (IPAM, addresses,
routing, GID checks, state) is common and lives in plugin.py and addressing.py.
"""

from __future__ import annotations

from rdma_netns.kernel import rdma_sysfs
from rdma_netns.modes.exclusive import ExclusiveMode
from rdma_netns.modes.shared import SharedMode
from rdma_netns.spec.errors import WRONG_RDMA_MODE, CniError

Mode = SharedMode | ExclusiveMode


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


def _build(name: str, net: dict) -> Mode:
    return ExclusiveMode() if name == "exclusive" else SharedMode(net["link"], net["linkMode"])


def select(net: dict) -> Mode:
    """The mode for a new attachment: the config's, checked against the kernel's."""
    return _build(effective_mode(net["mode"], rdma_sysfs.netns_mode()), net)


def for_state(state: dict, net: dict) -> Mode:
    """The mode an existing attachment was made in (its state says), for teardown and CHECK."""
    if state.get("mode") == "exclusive":
        return ExclusiveMode()
    return SharedMode(state.get("link") or net["link"], net["linkMode"])
