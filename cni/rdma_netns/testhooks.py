"""Test-only hooks, honoured only by a test build of the plugin.

The test suites run the installed plugin on machines without RDMA hardware and kill it at chosen
steps, through three environment variables (VARIABLES): a kernel-shaped sysfs tree
(RDMA_NETNS_SYSFS_ROOT), a /dev beside it (RDMA_NETNS_DEV_ROOT, the device paths written into CDI
specs) and crash points (RDMA_NETNS_FAULT_AT, faults.py). On a node they would let whoever sets the
container runtime's environment change what a pod's containers get, or stop ADD halfway. So the
plugin ignores them (and says so on stderr) unless its own package folder holds MARKER, a file that
only a test install writes: scripts/setup.sh and the suites' conftest for the test venv,
`scripts/build-image.sh --test-hooks` for the deploy suite's images, never install.sh or a release
image. Switching them on thus takes write access to the installed code (root's), which the
runtime's environment alone never gives.
"""

from __future__ import annotations

import posix
from _stat import S_ISREG

from rdma_netns.spec.env import process_environ

FAULT_AT = "RDMA_NETNS_FAULT_AT"
SYSFS_ROOT = "RDMA_NETNS_SYSFS_ROOT"
DEV_ROOT = "RDMA_NETNS_DEV_ROOT"
VARIABLES = (FAULT_AT, SYSFS_ROOT, DEV_ROOT)
MARKER = "TEST-HOOKS-ENABLED"

_state: dict[str, bool] = {}  # "enabled", and each variable already said to be ignored


def marker_path() -> str:
    """Where a test build keeps its marker: beside this module, in the installed package."""
    return f"{__file__.rpartition('/')[0]}/{MARKER}"


def enabled() -> bool:
    """Is this install a test build? (one lstat, the first time a hook variable is set)"""
    if "enabled" not in _state:
        try:
            _state["enabled"] = S_ISREG(posix.lstat(marker_path()).st_mode)
        except OSError:
            _state["enabled"] = False
    return _state["enabled"]


def get(name: str) -> str:
    """The hook variable `name` from the environment; "" when it is unset or this is no test build."""
    value = process_environ().get(name, "")
    if not value or enabled():
        return value
    if name not in _state:
        _state[name] = True
        import sys

        sys.stderr.write(f"rdma-netns: {name} is a test hook; ignored (this install is not a test build)\n")
    return ""
