"""The startup option "RDMA for non-hostNetwork pods": the kernel's RDMA netns mode must be the
one the node's CNI mode needs (shared for macvlan/ipvlan rails, exclusive for moved devices).

The rule itself (auto, what counts as a mismatch, how to fix one) is rdma_netns.mode_policy, the
same the CNI plugin and the admin tool apply; this module adds what the daemon does about it.
The kernel refuses a change (EBUSY) while any other network namespace exists, so the daemon
can only set it on a fresh node, before pods run; otherwise it says which namespaces block it
and how to make it stick at boot. While the modes differ, the resource's units are Unhealthy:
a pod scheduled there would get RDMA devices that do not work the way its network expects.

Setting the mode is the only thing here that needs CAP_NET_ADMIN (NETLINK_RDMA SYS_SET); checking
it reads sysfs. So the DaemonSet sets it in an init container (`rdma-netns-dp kernel-mode`) and
runs the long-lived daemon with `--no-ensure-kernel-mode` and no capabilities at all.
"""

from __future__ import annotations

import logging

from rdma_netns import mode_policy
from rdma_netns.kernel.rdma_sysfs import RdmaSysfs

log = logging.getLogger("rdma_netns_dp.kernel_mode")


def resolve(configured: str, sysfs: RdmaSysfs) -> str:
    """The mode the resources run in: the configured one, or the kernel's when 'auto'."""
    return mode_policy.resolve(configured, sysfs.netns_mode())


def mismatch(wanted: str, sysfs: RdmaSysfs) -> str | None:
    """Why devices cannot be offered in `wanted` mode now (None when the kernel agrees)."""
    why = mode_policy.mismatch(wanted, sysfs.netns_mode())
    if why is None:
        return None
    return f"{why}: {mode_policy.fix_hint(wanted)} (--ensure-kernel-mode makes this daemon set it at start)"


# ensure()'s outcomes. BLOCKED is a node's ordinary state once pods run (the daemon then marks the
# units Unhealthy); FAILED is not: the kernel refused for another reason (no CAP_NET_ADMIN, ...).
AS_NEEDED, SET, NO_RDMA, BLOCKED, FAILED = "as-needed", "set", "no-rdma", "blocked", "failed"


def ensure(wanted: str, sysfs: RdmaSysfs) -> str:
    """Set the kernel's mode to `wanted` if it differs and nothing blocks it; log and return the
    outcome (one of the constants above)."""
    current = sysfs.netns_mode()
    if current is None:
        log.warning("no RDMA subsystem in this kernel (ib_core not loaded): RDMA netns mode not checked")
        return NO_RDMA
    if mode_policy.mismatch(wanted, current) is None:
        log.info("kernel RDMA netns mode is as needed", extra={"mode": current})
        return AS_NEEDED
    from rdma_netns.kernel.netns import other_namespaces
    from rdma_netns.kernel.rdma_nldev import RdmaBusy, RdmaError, RdmaNetlink

    blockers = other_namespaces()
    if blockers:
        log.error("cannot set the kernel RDMA netns mode: other network namespaces exist (the kernel "
                  "would answer EBUSY); %s", mode_policy.fix_hint(wanted),
                  extra={"mode": current, "wanted": wanted, "blocking": blockers[:10]})
        return BLOCKED
    try:
        with RdmaNetlink() as rdma:
            rdma.set_netns_mode(wanted)
    except RdmaBusy as exc:
        log.error("cannot set the kernel RDMA netns mode: %s", exc, extra={"wanted": wanted})
        return BLOCKED
    except (RdmaError, OSError) as exc:
        log.error("setting the kernel RDMA netns mode failed: %s", exc, extra={"wanted": wanted})
        return FAILED
    log.info("kernel RDMA netns mode set", extra={"mode": wanted, "was": current})
    return SET
