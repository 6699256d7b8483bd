"""The device plugin daemon (`rdma-netns-dp`) on a real kernel: real /sys, real /dev, Soft-RoCE.

Each test starts the installed daemon against a stand-in kubelet (tests/kubelet_standin.py: the
real v1beta1 Registration service on <dir>/device-plugins/kubelet.sock, then dialing the plugin,
a ListAndWatch stream and Allocate calls, as kubelet's device manager does). The rxe devices are
made by the Lab on a veth pair, so resources select them by name (`rdmaDevices` globs): whatever
else the guest has is left out.

What a container runtime does with an AllocateResponse is played by `unshare --mount`: a tmpfs over
/dev/infiniband holding only the returned nodes (mknod with the host node's major:minor, as runc
does for a container's devices), then Debian's pyverbs opens the devices from there.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from integration.guest_suite.conftest import REPO, SYSTEM_PYTHON, rdma_devices, record_timing, sh
import grpc

from tests.kubelet_standin import KubeletStandIn, PluginConnection

pytestmark = pytest.mark.guest

DP = str(Path(sys.executable).parent / "rdma-netns-dp")  # the venv's console script
RESOURCE = "rdma/hca"
SOCKET = "rdma-netns-rdma_hca.sock"
START_TIMEOUT = 240   # daemon start under TCG: imports of grpc and pydantic take 10-30 s there
RPC_TIMEOUT = 60
HEALTH_TIMEOUT = 60
INTERVAL = 0.5

# Runs in the confinement with Debian's python3 (the one python3-pyverbs is built for).
OPEN_DEVICES = r"""
import json, os, sys
out = {"dev_infiniband": sorted(os.listdir("/dev/infiniband"))}
from pyverbs.device import Context
from pyverbs.pd import PD
for name in sys.argv[1:]:
    try:
        ctx = Context(name=name)
        attr = ctx.query_device()
        port = ctx.query_port(1)
        pd = PD(ctx)
        out[name] = {"ok": True, "max_qp": attr.max_qp, "port_state": int(port.state)}
        pd.close()
        ctx.close()
    except Exception as exc:
        out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
print(json.dumps(out))
"""


class DevicePluginDaemon:
    """The installed rdma-netns-dp with a stand-in kubelet, in a test's temp folder."""

    def __init__(self, tmp: Path, mode: str, selectors: dict, extra_args: tuple[str, ...] = ()) -> None:
        self.tmp = tmp
        # Short: a unix socket path has at most 107 characters, pytest's tmp_path is long.
        self.kubelet_dir = Path(tempfile.mkdtemp(prefix="dp-kubelet-", dir="/tmp"))
        self.health_file = tmp / "dp-health.json"
        self.log_file = tmp / "dp.log"
        self.config = tmp / "dp-config.json"
        # One address per pod in the GID model keeps all 1000 units inside rxe's 1024 entries, so
        # these tests see every unit Healthy until they fill a table; the default (2: the pod's
        # address and its rail's link-local one) is the unit suite's (tests/unit/dp/test_gid_capacity.py).
        self.config.write_text(json.dumps({"resources": [{"name": RESOURCE, "selectors": selectors,
                                                          "addressesPerPod": 1}]}))
        self.kubelet = KubeletStandIn(self.kubelet_dir / "device-plugins", connect=False).start()
        self.plugin_socket = self.kubelet_dir / "device-plugins" / SOCKET
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [DP, "--config", str(self.config), "--kubelet-dir", str(self.kubelet_dir), "--mode", mode,
             "--health-interval", str(INTERVAL), "--health-file", str(self.health_file),
             "--cni-state-dir", str(tmp / "cni-state"), "--log-level", "info", *extra_args],
            stdout=subprocess.DEVNULL, stderr=open(self.log_file, "w"))
        self.conn: PluginConnection | None = None
        self.stopped = False
        self.socket_left = True

    def log(self) -> str:
        return self.log_file.read_text()[-4000:] if self.log_file.exists() else ""

    def connect(self) -> PluginConnection:
        """Wait for Register, then dial the endpoint it names (as kubelet does) and open ListAndWatch."""
        deadline = time.monotonic() + START_TIMEOUT
        while not self.kubelet.registrations:
            assert self.proc.poll() is None, f"rdma-netns-dp exited {self.proc.returncode}:\n{self.log()}"
            assert time.monotonic() < deadline, f"no Register after {START_TIMEOUT} s:\n{self.log()}"
            time.sleep(0.2)
        registration = self.kubelet.registrations[0].request
        assert registration.version == "v1beta1" and registration.resource_name == RESOURCE
        assert registration.endpoint == SOCKET
        assert self.kubelet.registrations[0].endpoint_existed, "the plugin served before it registered"
        self.conn = PluginConnection(self.kubelet_dir / "device-plugins" / registration.endpoint, RESOURCE,
                                     timeout=RPC_TIMEOUT)
        self.conn.wait_first(RPC_TIMEOUT)
        record_timing("dp start to first list", time.monotonic() - self.started)
        return self.conn

    def health(self) -> dict:
        """The health file, once it shows the resource registered."""
        deadline = time.monotonic() + HEALTH_TIMEOUT
        while True:
            try:
                status = json.loads(self.health_file.read_text())
                if status["resources"][RESOURCE]["registered"]:
                    return status
            except (OSError, ValueError, KeyError):
                pass
            assert time.monotonic() < deadline, f"health file never showed registered:\n{self.log()}"
            time.sleep(INTERVAL)

    def stop(self) -> int:
        """SIGTERM; the exit code. Records whether the plugin socket outlived the daemon."""
        if self.stopped:
            return self.proc.returncode
        self.stopped = True
        if self.conn is not None:
            self.conn.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.socket_left = self.plugin_socket.exists()
        self.kubelet.close()
        shutil.rmtree(self.kubelet_dir, ignore_errors=True)
        return self.proc.returncode


@pytest.fixture
def start_dp(tmp_path):
    daemons: list[DevicePluginDaemon] = []

    def start(mode: str, selectors: dict) -> DevicePluginDaemon:
        daemon = DevicePluginDaemon(tmp_path, mode, selectors)
        daemons.append(daemon)
        return daemon

    yield start
    for daemon in daemons:
        daemon.stop()


def rxe_pair(lab) -> tuple[str, str, str, str]:
    """Two rxe devices on the two ends of a veth pair: (dev a, dev b, netdev a, netdev b)."""
    sh("modprobe", "rdma_ucm", check=False)  # /dev/infiniband/rdma_cm
    va, vb = f"d0{lab.tag}", f"d1{lab.tag}"
    lab.veth(va, vb)
    a, b = f"rxe{lab.tag}a", f"rxe{lab.tag}b"
    lab.rxe_on(a, va)
    lab.rxe_on(b, vb)
    return a, b, va, vb


def uverbs_of(device: str) -> tuple[str, str]:
    """(uverbsN, "major:minor") of an RDMA device, from /sys/class/infiniband_verbs."""
    base = Path("/sys/class/infiniband_verbs")
    for entry in sorted(base.iterdir()):
        ibdev = entry / "ibdev"
        if ibdev.exists() and ibdev.read_text().strip() == device:
            return entry.name, (entry / "dev").read_text().strip()
    raise AssertionError(f"{device} has no uverbs char device in {base}")


def netlink_chardev(device: str) -> tuple[str, int, int]:
    """The kernel's own answer over NETLINK_RDMA (RDMA_NLDEV_CMD_GET_CHARDEV), independent of sysfs."""
    from rdma_netns.kernel.rdma_nldev import RdmaNetlink

    with RdmaNetlink() as rdma:
        found = rdma.chardev(rdma.device(device).index, "uverbs")
    return found.name, found.major, found.minor


def check_char_device(path: str, major_minor: str) -> None:
    st = os.stat(path)
    assert stat.S_ISCHR(st.st_mode), f"{path} is not a char device"
    assert f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}" == major_minor, (path, major_minor)


def confined_open(tmp: Path, nodes: list, devices: list[str]) -> dict:
    """Open `devices` with pyverbs in a mount namespace whose /dev/infiniband holds only `nodes`
    (the DeviceSpecs Allocate returned)."""
    script = tmp / "open_devices.py"
    script.write_text(OPEN_DEVICES)
    lines = ["set -e", "mount -t tmpfs -o mode=755 dp-test /dev/infiniband"]
    for node in nodes:
        st = os.stat(node.host_path)
        assert node.container_path.startswith("/dev/infiniband/"), node.container_path
        lines.append(f"mknod -m 666 {node.container_path} c {os.major(st.st_rdev)} {os.minor(st.st_rdev)}")
    lines.append(f"exec {SYSTEM_PYTHON} {script} {' '.join(devices)}")
    proc = sh("unshare", "--mount", "--propagation", "private", "--", "sh", "-c", "\n".join(lines),
              check=False, timeout=300)
    assert proc.returncode == 0, f"confined pyverbs run failed: {proc.stdout} {proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_dp_shared_advertises_the_real_rxe_devices_and_allocates_their_uverbs(lab, start_dp):
    a, b, va, vb = rxe_pair(lab)
    dp = start_dp("shared", {"rdmaDevices": [f"rxe{lab.tag}*"]})
    conn = dp.connect()
    assert conn.options.pre_start_required is False
    # shared too: the lowest-numbered units first, so pods hold the ones the GID cap keeps Healthy
    assert conn.options.get_preferred_allocation_available is True
    first = conn.latest
    assert first.ids() == [f"hca-{i:04d}" for i in range(1000)]
    assert set(first.health().values()) == {"Healthy"}, dp.log()
    status = dp.health()
    capacity = status["resources"][RESOURCE].pop("gidCapacity")
    assert status["resources"][RESOURCE] == {"registered": True, "devices": 1000, "healthy": 1000}
    # Soft-RoCE's real tables: 1024 entries, one per address; a few taken by the host's addresses
    assert sorted(p["device"] for p in capacity["ports"]) == sorted([a, b])
    assert all((p["total"], p["perAddress"]) == (1024, 1) and 1 <= p["used"] < 8 for p in capacity["ports"])
    assert capacity["units"] == capacity["morePods"] > 1000, capacity
    assert status["mode"] == "shared" and status["blocked"] is None

    response = conn.allocate(["hca-0000", "hca-0001"], timeout=RPC_TIMEOUT)
    assert len(response.container_responses) == 1
    container = response.container_responses[0]
    # The kernel's view, two ways: `rdma dev` lists the devices, sysfs and NETLINK_RDMA the char devices.
    assert {a, b} <= set(rdma_devices())
    expected = {}
    for device in (a, b):
        uverbs, major_minor = uverbs_of(device)
        name, major, minor = netlink_chardev(device)
        assert (name, f"{major}:{minor}") == (uverbs, major_minor), "sysfs and NETLINK_RDMA agree"
        expected[f"/dev/infiniband/{uverbs}"] = major_minor
    got = {d.container_path: d for d in container.devices}
    assert set(got) == set(expected) | {"/dev/infiniband/rdma_cm"}, got
    assert len(container.devices) == len(got), "no duplicate DeviceSpecs"
    for path, spec in got.items():
        assert spec.host_path == path and spec.permissions == "rw"
    for path, major_minor in expected.items():
        check_char_device(path, major_minor)
    assert stat.S_ISCHR(os.stat("/dev/infiniband/rdma_cm").st_mode)
    envs = dict(container.envs)
    assert envs["RDMA_NETNS_RESOURCE"] == RESOURCE
    assert envs["RDMA_NETNS_DEVICES"] == f"{a},{b}"
    assert envs["RDMA_NETNS_NETDEVS"] == ",".join(sorted([va, vb]))
    assert envs["RDMA_NETNS_UVERBS"] == ",".join(f"/dev/infiniband/{uverbs_of(d)[0]}" for d in (a, b))

    assert dp.stop() == 0, dp.log()
    assert not dp.socket_left and not dp.health_file.exists(), "SIGTERM removed the socket and health file"


def test_dp_confined_container_opens_only_its_device_and_port_down_turns_units_unhealthy(lab, start_dp):
    a, b, va, vb = rxe_pair(lab)
    dp = start_dp("shared", {"rdmaDevices": [a]})  # one device: its port decides the units' health
    conn = dp.connect()
    assert set(conn.latest.health().values()) == {"Healthy"}, dp.log()

    container = conn.allocate(["hca-0007"], timeout=RPC_TIMEOUT).container_responses[0]
    uverbs_a, _ = uverbs_of(a)
    uverbs_b, _ = uverbs_of(b)
    assert sorted(d.container_path for d in container.devices) == sorted(
        [f"/dev/infiniband/{uverbs_a}", "/dev/infiniband/rdma_cm"])
    assert container.envs["RDMA_NETNS_DEVICES"] == a

    opened = confined_open(lab.tmp, list(container.devices), [a, b])
    print(f"confined pyverbs: {json.dumps(opened)}")
    assert opened["dev_infiniband"] == sorted([uverbs_a, "rdma_cm"]), opened
    assert opened[a]["ok"] is True and opened[a]["max_qp"] > 0, opened
    assert opened[b]["ok"] is False, f"{b} was not allocated but opened: {opened}"
    assert uverbs_b not in opened["dev_infiniband"]

    # Health: the selected device's link goes down -> every unit Unhealthy; up -> Healthy again.
    # A few rounds at random moments against the daemon's poll (the latency is 0..1 interval).
    rng = random.Random()
    downs, ups = [], []
    for _ in range(3):
        time.sleep(rng.uniform(0, INTERVAL))
        start = time.monotonic()
        sh("ip", "link", "set", va, "down")
        down_at = time.monotonic()  # the link is down once `ip` returned
        update = conn.wait_for(lambda u: set(u.health().values()) == {"Unhealthy"}, HEALTH_TIMEOUT,
                               "all units Unhealthy after the link went down")
        assert len(update.devices) == 1000
        seconds = max(0.0, update.time - down_at)
        downs.append(seconds)
        record_timing("dp port-down to Unhealthy", seconds)
        print(f"port down -> Unhealthy: {seconds:.2f} s (ip link took {down_at - start:.2f} s; "
              f"interval {INTERVAL} s)")
        state = Path(f"/sys/class/infiniband/{a}/ports/1/state").read_text().strip()
        assert state.endswith("DOWN"), state
        assert dp.health()["resources"][RESOURCE]["healthy"] == 0

        time.sleep(rng.uniform(0, INTERVAL))
        sh("ip", "link", "set", va, "up")
        up_at = time.monotonic()
        update = conn.wait_for(lambda u: set(u.health().values()) == {"Healthy"}, HEALTH_TIMEOUT,
                               "all units Healthy after the link came back")
        ups.append(max(0.0, update.time - up_at))
        record_timing("dp port-up to Healthy", ups[-1])
    print(f"port down -> Unhealthy: {', '.join(f'{s:.2f}' for s in downs)} s; "
          f"port up -> Healthy: {', '.join(f'{s:.2f}' for s in ups)} s")
    assert dp.stop() == 0, dp.log()


def test_dp_exclusive_mode_follows_the_kernel_mode(lab, start_dp):
    """Exclusive mode advertises one unit per rxe device (ID = its name: no PCI address). The kernel
    runs in shared mode here (switching needs a namespace-free guest, see test_3), so the units are
    Unhealthy and the health file says why; were the kernel exclusive, they would be Healthy."""
    a, b, _, _ = rxe_pair(lab)
    kernel = Path("/sys/module/ib_core/parameters/netns_mode").read_text().strip()
    dp = start_dp("exclusive", {"rdmaDevices": [f"rxe{lab.tag}*"]})
    conn = dp.connect()
    assert conn.options.get_preferred_allocation_available is True
    health = conn.latest.health()
    assert sorted(health) == [a, b], health
    status = dp.health()
    if kernel == "N":
        assert set(health.values()) == {"Healthy"}
        assert status["blocked"] is None
    else:
        assert set(health.values()) == {"Unhealthy"}, dp.log()
        assert status["resources"][RESOURCE]["healthy"] == 0
        assert "shared" in status["blocked"] and "exclusive" in status["blocked"], status
    container = conn.allocate([b], timeout=RPC_TIMEOUT).container_responses[0]
    assert sorted(d.container_path for d in container.devices) == sorted(
        [f"/dev/infiniband/{uverbs_of(b)[0]}", "/dev/infiniband/rdma_cm"])
    with pytest.raises(grpc.RpcError) as refused:
        conn.allocate([f"rxe{lab.tag}z"], timeout=RPC_TIMEOUT)
    assert refused.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
    assert f"rxe{lab.tag}z" in refused.value.details()
    assert dp.proc.poll() is None, "the daemon survived the bad request"
    assert dp.stop() == 0, dp.log()
