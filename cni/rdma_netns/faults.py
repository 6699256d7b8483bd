"""Test-only crash points: prove that a plugin killed at any step of ADD leaves nothing that
the next DEL, ADD or GC cannot undo.

`RDMA_NETNS_FAULT_AT=<point>` in the plugin's environment makes the process SIGKILL itself when
it reaches that point (the way an OOM kill or a node agent would end it: no cleanup, no finally).
Points: state-written, ipam-<i>, attached-<i>, addressed-<i> (i: the rail's position),
netdev-moved-<ifname> (exclusive: between the netdev's and the RDMA device's moves),
before-ready, before-result. Unset (always, in production), a
point costs one dictionary lookup. A test hook: honoured only by a test build (testhooks.py).
"""

from __future__ import annotations

import posix

from rdma_netns import testhooks

VARIABLE = testhooks.FAULT_AT


def point(name: str) -> None:
    if testhooks.get(VARIABLE) == name:
        posix.kill(posix.getpid(), 9)
