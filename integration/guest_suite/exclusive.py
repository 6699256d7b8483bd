"""What the exclusive-boot tests share: the kernel booted exclusive, Soft-RoCE's way into a pod
(Debian's host-device moves the netdev first: rxe is deleted whenever its netdev changes
namespace), and a "container" of a pod that sees only the char devices a CDI entry names."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
from pathlib import Path

import pytest

from integration.guest_suite.conftest import SYSTEM_PYTHON, TRAFFIC, cluster_network, fresh_neighbours, in_pod, sh
from tests.conftest import run_plugin


@pytest.fixture
def booted_exclusive():
    """The kernel must have come up exclusive (not switched by a test): fail, never skip."""
    sh("modprobe", "rdma_rxe")
    sh("modprobe", "rdma_ucm", check=False)
    assert "ib_core.netns_mode=0" in Path("/proc/cmdline").read_text(), "the guest was not booted exclusive"
    assert Path("/sys/module/ib_core/parameters/netns_mode").read_text().strip() == "N"
    assert "netns exclusive" in sh("rdma", "system", "show").stdout
    yield


def host_device_add(pod: str, device: str, address: str) -> dict:
    conf = {"cniVersion": "1.0.0", "name": "hostdev", "type": "host-device", "device": device,
            "ipam": {"type": "static", "addresses": [{"address": address}]}}
    return run_plugin("ADD", conf, container_id=pod, netns=f"/var/run/netns/{pod}", ifname="net1",
                      timeout=120, plugin="/usr/lib/cni/host-device").ok()


def host_device_del(pod: str, device: str, netns: str) -> None:
    conf = {"cniVersion": "1.0.0", "name": "hostdev", "type": "host-device", "device": device,
            "ipam": {"type": "static", "addresses": []}}
    run_plugin("DEL", conf, container_id=pod, netns=netns, ifname="net1", timeout=120,
               plugin="/usr/lib/cni/host-device").ok()


def kernel_uverbs(pod: str, device: str) -> tuple[int, int]:
    """major:minor of the device's uverbs node, as the pod's own sysfs shows it now."""
    out = in_pod(pod, "sh", "-c", "for f in /sys/class/infiniband_verbs/uverbs*; do "
                 "echo $(cat $f/ibdev 2>/dev/null) $(cat $f/dev); done").stdout
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == device:
            major, minor = parts[1].split(":")
            return int(major), int(minor)
    raise AssertionError(f"{device} has no uverbs node in {pod}: {out}")


def confined(pod: str, nodes: list[dict], *command: str) -> list[str]:
    """A 'container' of the pod: its netns, and a /dev/infiniband holding only `nodes` (mknod with
    the numbers the runtime got from the CDI spec, as runc does)."""
    lines = ["set -e", "mount -t tmpfs -o mode=755 h13 /dev/infiniband"]
    for n in nodes:
        assert n["path"].startswith("/dev/infiniband/"), n
        lines.append(f"mknod -m 666 {n['path']} c {n['major']} {n['minor']}")
    lines.append('exec "$@"')
    return ["ip", "netns", "exec", pod, "unshare", "--mount", "--propagation", "private", "--",
            "sh", "-c", "\n".join(lines), "confined", *command]


OPEN = r"""
import json, os, sys
from pyverbs.device import Context
from pyverbs.pd import PD
out = {"dev_infiniband": sorted(os.listdir("/dev/infiniband"))}
for name in sys.argv[1:]:
    try:
        ctx = Context(name=name)
        pd = PD(ctx)
        out[name] = {"ok": True, "port_state": int(ctx.query_port(1).state)}
        pd.close(); ctx.close()
    except Exception as exc:
        out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
print(json.dumps(out))
"""




def kernel_uverbs_host(device: str) -> list[int]:
    for entry in sorted(Path("/sys/class/infiniband_verbs").iterdir()):
        ibdev = entry / "ibdev"
        if ibdev.exists() and ibdev.read_text().strip() == device:
            return [int(x) for x in (entry / "dev").read_text().split(":")]
    raise AssertionError(f"{device} has no uverbs node on the host")


def cdi_device_nodes(spec_file: Path, cdi_name: str) -> list[dict]:
    """What a runtime does with a CDI name at container creation: the device's deviceNodes plus
    the spec-wide ones, major:minor from stat(hostPath) (the spec gives no numbers)."""
    kind, name = cdi_name.split("=", 1)
    spec = json.loads(spec_file.read_text())
    assert spec["kind"] == kind
    entry = next((d for d in spec["devices"] if d["name"] == name), None)
    assert entry is not None, f"{cdi_name} is not in the CDI spec: {spec}"
    nodes = entry["containerEdits"].get("deviceNodes", []) + spec.get("containerEdits", {}).get("deviceNodes", [])
    out = []
    for node in nodes:
        st = os.stat(node["hostPath"])
        assert stat.S_ISCHR(st.st_mode), node
        out.append({"path": node["path"], "major": os.major(st.st_rdev), "minor": os.minor(st.st_rdev)})
    return out


def rc_exchange(pods: list[str], nodes: list[list[dict]], addresses: list[str], devices: list[str]) -> dict:
    """Checked RC traffic between two confined processes (verbs) over the pods' own devices, as a
    job connects: QP data over eth0 (IPv4), no packet on the rail before, neighbours forgotten.
    The first pod serves; returns the server's verdict."""
    oob = cluster_network(pods)
    for pod in pods:
        fresh_neighbours(pod, "net1")
    tool = str(TRAFFIC / "rc_exchange.py")
    server = subprocess.Popen(confined(pods[0], nodes[0], SYSTEM_PYTHON, tool, "server", "--addr", addresses[0],
                                       "--device", devices[0], "--timeout", "240", "--oob-addr", oob[0]),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        client = sh(*confined(pods[1], nodes[1], SYSTEM_PYTHON, tool, "client", "--addr", addresses[1],
                              "--peer", addresses[0], "--device", devices[1], "--timeout", "240",
                              "--oob-addr", oob[1], "--oob-peer", oob[0]),
                    check=False, timeout=300)
        s_out, s_err = server.communicate(timeout=300)
    finally:
        if server.poll() is None:
            server.kill()
    assert client.returncode == 0 and server.returncode == 0, \
        f"RC exchange failed: {client.stdout} {client.stderr} | {s_out} {s_err}"
    verdict = json.loads(s_out.strip().splitlines()[-1])
    assert verdict["ok"] is True
    return verdict


def stop_daemon(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM, as kubelet stops the DaemonSet's container; SIGKILL when it does not exit in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
