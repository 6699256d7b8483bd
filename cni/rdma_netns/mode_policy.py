"""The one rule for the kernel's RDMA netns mode, shared by the CNI plugin, the device plugin and
the admin tool, so the three can never disagree about which mode a node runs in.

Plain strings in and out ('shared', 'exclusive', 'auto'; the kernel's mode or None when the
kernel has no RDMA core): each caller turns a mismatch into its own kind of failure (a CNI error,
Unhealthy units, an admin message).
"""

from __future__ import annotations

MODES = ("shared", "exclusive")
MODPROBE_VALUE = {"shared": 1, "exclusive": 0}


def resolve(configured: str, kernel: str | None) -> str:
    """The mode to run in: `auto` follows the kernel (shared without an RDMA core)."""
    if configured == "auto":
        return kernel or "shared"
    return configured


def mismatch(wanted: str, kernel: str | None) -> str | None:
    """Why `wanted` cannot run on this kernel now; None when the kernel agrees or has no RDMA
    core (plain netdevs work in either mode)."""
    if kernel is None or kernel == wanted:
        return None
    return f"the kernel's RDMA netns mode is {kernel} but {wanted} mode is needed"


def fix_hint(wanted: str) -> str:
    """How a node admin makes the kernel run in `wanted` mode (a live change needs no other
    network namespace to exist, so on a live node it means the next boot)."""
    return (f"run `rdma-netns mode set {wanted} --persist` (it writes `options ib_core "
            f"netns_mode={MODPROBE_VALUE[wanted]}` to /etc/modprobe.d) and reboot, or set it before "
            "pods run")
