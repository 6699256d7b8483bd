"""The node-wide GID order lock (gid_order.Lockstep) across real processes, and the link-local
wait in a real namespace.

Kernel GIDs are not visible without RDMA hardware on this host: that pods get equal indexes is
proven in the real-kernel guest (integration/guest_suite/test_6_pod_gids.py). Here: the lock
serialises the phase across processes, never deadlocks (a stuck holder costs at most the
timeout), never leaks (one fixed file, no fds, a killed holder's lock is free at once).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rdma_netns.kernel import netns, rtnl
from rdma_netns.kernel.netlink import NetlinkSocket
from rdma_netns.rails import gid_order
from tests.netns.conftest import _need_root, ip

HOLD = (
    "import sys, time\n"
    "from rdma_netns.rails import gid_order\n"
    "state, log, hold, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])\n"
    "with gid_order.Lockstep(state, timeout) as lock:\n"
    "    start = time.time()\n"
    "    print('HELD' if lock.waited is not None else 'UNLOCKED', flush=True)\n"
    "    time.sleep(hold)\n"
    "    end = time.time()\n"
    "with open(log, 'a') as f:\n"
    "    f.write(f'{start} {end} {lock.waited is not None}\\n')\n"
)


def holder(state: Path, log: Path, hold: float, timeout: float = 30.0) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOLD, str(state), str(log), str(hold), str(timeout)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_held(proc: subprocess.Popen) -> None:
    assert proc.stdout.readline().strip() == "HELD"


def test_the_lock_serialises_the_phase_across_processes(tmp_path):
    state, log = tmp_path / "state", tmp_path / "log"
    procs = [holder(state, log, 0.05) for _ in range(6)]
    for proc in procs:
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    spans = sorted(tuple(float(x) for x in line.split()[:2]) for line in log.read_text().splitlines())
    assert len(spans) == 6
    assert all(line.endswith("True") for line in log.read_text().splitlines()), "every process got the lock"
    for (_s1, e1), (s2, _e2) in zip(spans, spans[1:]):
        assert s2 >= e1, f"two processes were inside the phase at once: {spans}"
    assert os.listdir(state / "locks") == ["gid-order"], "one fixed file, nothing else left behind"


def test_a_stuck_holder_costs_at_most_the_timeout_and_never_deadlocks(tmp_path, capfd):
    state, log = tmp_path / "state", tmp_path / "log"
    stuck = holder(state, log, 30.0)
    try:
        wait_held(stuck)
        start = time.monotonic()
        with gid_order.Lockstep(str(state), 0.3) as lock:
            assert lock.waited is None, "went on without the lock"
        assert 0.3 <= time.monotonic() - start < 3
        assert "going on without it" in capfd.readouterr().err
    finally:
        stuck.kill()
        stuck.wait()


def test_a_killed_holder_frees_the_lock_at_once(tmp_path):
    state, log = tmp_path / "state", tmp_path / "log"
    proc = holder(state, log, 30.0)
    wait_held(proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    start = time.monotonic()
    with gid_order.Lockstep(str(state), 5.0) as lock:
        assert lock.waited is not None
    assert time.monotonic() - start < 1


def test_no_fd_leak_and_reentry_after_release(tmp_path):
    state = str(tmp_path / "state")
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        with gid_order.Lockstep(state, 1.0) as lock:
            assert lock.fd >= 0
        assert lock.fd == -1
    try:
        with gid_order.Lockstep(state, 1.0):
            raise RuntimeError("an ADD step failed inside the phase")
    except RuntimeError:
        pass
    with gid_order.Lockstep(state, 0.1) as lock:  # released by the failure above
        assert lock.waited is not None
    assert len(os.listdir("/proc/self/fd")) == before


def test_inactive_without_rdma_devices_touches_nothing(tmp_path):
    with gid_order.Lockstep(str(tmp_path / "state"), 1.0, active=False) as lock:
        assert lock.fd == -1
    assert not (tmp_path / "state").exists()


def test_an_unusable_state_folder_does_not_fail_the_call(tmp_path, capfd):
    (tmp_path / "state").write_text("a file where the folder should be")
    with gid_order.Lockstep(str(tmp_path / "state"), 1.0) as lock:
        assert lock.waited is None
    assert "GID indexes may differ" in capfd.readouterr().err


@pytest.fixture
def pod_ns():
    _need_root()
    name = f"rnt-gido-{os.getpid()}"
    ip("netns", "add", name)
    ip("-n", name, "link", "add", "ra", "type", "veth", "peer", "name", "rb")
    ip("-n", name, "link", "add", "rc", "type", "veth", "peer", "name", "rd")
    fd = netns.open_netns(f"/var/run/netns/{name}")
    try:
        yield name, fd
    finally:
        os.close(fd)
        ip("netns", "del", name, check=False)


def test_wait_for_link_local_after_links_go_up(pod_ns):
    name, fd = pod_ns
    with netns.inside(fd), NetlinkSocket() as sock:
        with open("/proc/sys/net/ipv6/conf/rc/disable_ipv6", "w") as f:
            f.write("1")  # an IPv4-only rail: no link-local address will come, so none is awaited
        for peer in ("rb", "rd"):
            rtnl.set_link_up(sock, rtnl.get_link(sock, peer).index)
        links = [rtnl.get_link(sock, n) for n in ("ra", "rc")]
        for link in links:
            rtnl.set_link_up(sock, link.index)
        start = time.monotonic()
        assert gid_order.wait_for_link_local(sock, links, 5.0) == []
        assert time.monotonic() - start < 4.5, "returned when ra had its address, not at the timeout"
        assert gid_order.expects_link_local("ra") and not gid_order.expects_link_local("rc")
        lls = [a for a in rtnl.list_addresses(sock) if a.index == links[0].index
               and a.interface.packed[:2] == b"\xfe\x80"]
        assert lls, "ra has its link-local address when the wait returns"


def test_wait_for_link_local_gives_up_at_the_timeout(pod_ns):
    name, fd = pod_ns
    with netns.inside(fd), NetlinkSocket() as sock:
        link = rtnl.get_link(sock, "ra")  # stays down: the kernel gives it no link-local address
        start = time.monotonic()
        assert gid_order.wait_for_link_local(sock, [link], 0.2) == ["ra"]
        assert 0.2 <= time.monotonic() - start < 2
        with open("/proc/sys/net/ipv6/conf/ra/addr_gen_mode", "w") as f:
            f.write("1")  # none: nothing to wait for
        assert gid_order.wait_for_link_local(sock, [link], 5.0) == []
