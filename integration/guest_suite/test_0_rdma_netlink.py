"""The NETLINK_RDMA client against the real kernel: integration/guest/check_rdma_netlink.py
(devices, ports and char devices against `rdma` and sysfs, the mode switch and its EBUSY, moves
into a pod and back, the errno of every refusal, through RdmaNetlink and the CNI hot path's
device_index/move_device, all in kernel/rdma_nldev.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from integration.guest_suite.conftest import REPO

pytestmark = pytest.mark.guest


def test_rdma_netlink_clients_against_the_kernel():
    proc = subprocess.run([sys.executable, str(REPO / "integration" / "guest" / "check_rdma_netlink.py")],
                          capture_output=True, text=True, timeout=900)
    failed = [line for line in proc.stdout.splitlines() if ": FAIL" in line]
    assert proc.returncode == 0 and not failed, "\n".join(failed) + "\n" + proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "0 failed" in proc.stdout
