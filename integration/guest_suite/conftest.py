"""Guest-side fixtures: run inside the QEMU guest (integration/guest/run-suite.sh), as root, on a
Debian 7.x kernel with a real RDMA subsystem (Soft-RoCE). Every test builds its own veths,
rxe devices and pod namespaces and removes them again."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.conftest import run_plugin

REPO = Path(__file__).resolve().parents[2]
TRAFFIC = REPO / "integration" / "traffic"
SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's, for which python3-pyverbs is built
RESULTS = Path(os.environ.get("GUEST_RESULTS", "/tmp"))


def sh(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stdout} {proc.stderr}")
    return proc


def in_pod(pod: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return sh("ip", "netns", "exec", pod, *args, **kw)


def rdma_devices(pod: str | None = None) -> list[str]:
    cmd = ["rdma", "-j", "dev"]
    out = in_pod(pod, *cmd).stdout if pod else sh(*cmd).stdout
    return sorted(d["ifname"] for d in json.loads(out or "[]"))


def record_timing(name: str, seconds: float) -> None:
    """Per-call ADD/DEL wall times inside the guest, collected for the report."""
    with open(RESULTS / "timings.jsonl", "a") as f:
        f.write(json.dumps({"name": name, "ms": round(seconds * 1000, 1)}) + "\n")


def timed_cni(label: str, command: str, conf: dict, **kw):
    start = time.monotonic()
    result = run_plugin(command, conf, timeout=300, **kw)
    record_timing(f"{label} {command}", time.monotonic() - start)
    return result


class Lab:
    """Veth rails, rxe devices and pods of one test, torn down in reverse order."""

    def __init__(self, tmp: Path) -> None:
        self.tag = uuid.uuid4().hex[:4]
        self.tmp = tmp
        self.pods: list[str] = []
        self.links: list[str] = []
        self.rxe: list[str] = []

    def veth(self, a: str, b: str) -> None:
        sh("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        self.links.append(a)
        for name in (a, b):
            sh("ip", "link", "set", name, "up")

    def rxe_on(self, name: str, netdev: str, pod: str | None = None) -> None:
        cmd = ("rdma", "link", "add", name, "type", "rxe", "netdev", netdev)
        in_pod(pod, *cmd) if pod else sh(*cmd)
        self.rxe.append(name)

    def pod(self) -> str:
        name = f"gp{self.tag}{len(self.pods)}"
        sh("ip", "netns", "add", name)
        sh("ip", "-n", name, "link", "set", "lo", "up")
        self.pods.append(name)
        return name

    def ipam(self, subnet: str) -> dict:
        return {"type": "host-local", "dataDir": str(self.tmp / "ipam"), "ranges": [[{"subnet": subnet}]]}

    def close(self) -> None:
        for name in self.rxe:
            sh("rdma", "link", "delete", name, check=False)
        for pod in self.pods:
            sh("ip", "netns", "del", pod, check=False)
        for link in self.links:
            sh("ip", "link", "del", link, check=False)


@pytest.fixture
def lab(tmp_path: Path):
    sh("modprobe", "rdma_rxe")
    lab = Lab(tmp_path)
    try:
        yield lab
    finally:
        lab.close()


def pod_address(result: dict, index: int = 0) -> str:
    return result["ips"][index]["address"].split("/")[0]


def rc_exchange(server_pod: str, server_addr: str, client_pod: str, client_addr: str,
                server_dev: str | None = None, client_dev: str | None = None,
                oob: tuple[str, str] | None = None) -> dict:
    """Real RDMA traffic: an RC queue pair moves a known buffer from one pod to the other and the
    receiver checks every byte (integration/traffic/rc_exchange.py, pyverbs). The QP data goes over
    TCP between the rail addresses, or with `oob` (server's, client's side-channel address) over
    another network, as a job's launcher sends it over eth0."""
    ok, client, server = rc_try(server_pod, server_addr, client_pod, client_addr, server_dev, client_dev, oob)
    assert ok, f"RC exchange failed: client {client} | server {server}"
    return server


def rc_try(server_pod: str, server_addr: str, client_pod: str, client_addr: str,
           server_dev: str | None = None, client_dev: str | None = None,
           oob: tuple[str, str] | None = None) -> tuple[bool, dict, dict]:
    """rc_exchange without the verdict: (server verified every byte, client's report, server's report)."""
    tool = str(TRAFFIC / "rc_exchange.py")
    server_cmd = ["ip", "netns", "exec", server_pod, SYSTEM_PYTHON, tool, "server", "--addr", server_addr,
                  "--timeout", "240"] + (["--device", server_dev] if server_dev else [])
    client_cmd = ["ip", "netns", "exec", client_pod, SYSTEM_PYTHON, tool, "client", "--addr", client_addr,
                  "--peer", server_addr, "--timeout", "240"] + (["--device", client_dev] if client_dev else [])
    if oob is not None:
        server_cmd += ["--oob-addr", oob[0]]
        client_cmd += ["--oob-addr", oob[1], "--oob-peer", oob[0]]
    server = subprocess.Popen(server_cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        client = subprocess.run(client_cmd, capture_output=True, text=True, timeout=300)
        s_out, s_err = server.communicate(timeout=300)
    finally:
        if server.poll() is None:
            server.kill()
    reports = [_last_json(out, err, code) for out, err, code in
               ((client.stdout, client.stderr, client.returncode), (s_out, s_err, server.returncode))]
    return client.returncode == 0 and server.returncode == 0 and reports[1].get("ok") is True, *reports


def _last_json(out: str, err: str, code: int) -> dict:
    lines = out.strip().splitlines()
    try:
        report = json.loads(lines[-1]) if lines else {}
    except ValueError:
        report = {"raw": out[-400:]}
    return {**report, "exit": code, "stderr": err[-400:]}


def cluster_network(pods: list[str], subnet: str = "10.99.0") -> list[str]:
    """Each of two pods' eth0, joined by a veth: the cluster network a job's launcher exchanges QP
    data over (never the rail). Returns their IPv4 addresses; gone with the pods' namespaces."""
    a, b = pods
    sh("ip", "link", "add", "eth0", "netns", a, "type", "veth", "peer", "name", "eth0", "netns", b)
    addresses = [f"{subnet}.1", f"{subnet}.2"]
    for pod, address in zip(pods, addresses):
        in_pod(pod, "ip", "addr", "add", f"{address}/24", "dev", "eth0")
        in_pod(pod, "ip", "link", "set", "eth0", "up")
    return addresses


def fresh_neighbours(pod: str, ifname: str) -> None:
    """Forget every IPv6 neighbour of the pod's rail: the QP must resolve its peer by itself."""
    in_pod(pod, "ip", "-6", "neigh", "flush", "dev", ifname)
    left = json.loads(in_pod(pod, "ip", "-j", "-6", "neigh", "show", "dev", ifname).stdout or "[]")
    assert [n for n in left if "PERMANENT" not in n.get("state", [])] == [], f"{pod} {ifname}: {left}"


def neighbour_state(pod: str, ifname: str, address: str) -> list[str]:
    """The pod's neighbour-table state of `address` on `ifname` ([] when it has no entry)."""
    for entry in json.loads(in_pod(pod, "ip", "-j", "-6", "neigh", "show", "dev", ifname).stdout or "[]"):
        if entry.get("dst") == address:
            return entry.get("state", [])
    return []


def rping(server_pod: str, server_addr: str, client_pod: str, client_addr: str) -> None:
    """rdma_cm between the pods' IPv6 addresses (address/route resolution, CM connect, data check)."""
    out = sh("bash", str(TRAFFIC / "rdma_cm_check.sh"), "--server-netns", server_pod, "--server-addr", server_addr,
             "--client-netns", client_pod, "--client-addr", client_addr, "--count", "5", "--timeout", "240",
             check=False, timeout=300)
    assert out.returncode == 0, f"rping failed: {out.stdout} {out.stderr}"
