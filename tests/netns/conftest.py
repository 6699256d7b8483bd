"""Real network namespaces: a private "node" namespace with veth-backed rails, and pods.

The plugin runs inside the node namespace (`ip netns exec`, which also gives it that
namespace's /sys), so the machine's own interfaces are never touched. IPAM is Debian's real
host-local plugin.
"""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.conftest import CNI_BIN_DIR, run_plugin


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def ipj(*args: str) -> list:
    out = ip("-j", *args).stdout
    return json.loads(out) if out.strip() else []


def _need_root() -> None:
    if os.geteuid() != 0 or not os.path.exists(f"{CNI_BIN_DIR}/host-local"):
        if os.environ.get("CI"):
            pytest.fail("the netns suite needs root and containernetworking-plugins; CI must provide both")
        pytest.skip("needs root and Debian's containernetworking-plugins")


class Node:
    """A node namespace with rails rail0..railN-1 (veth, peer up) and helpers to run the plugin."""

    def __init__(self, tmp: Path, rails: int = 2) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.name = f"rnt-node-{self.tag}"
        self.pods: list[str] = []
        self.state_dir = str(tmp / "state")
        self.ipam_dir = str(tmp / "ipam")
        self.pods_dir = str(tmp / "pods")
        self.cdi_dir = str(tmp / "cdi")
        ip("netns", "add", self.name)
        ip("-n", self.name, "link", "set", "lo", "up")
        for i in range(rails):
            ip("-n", self.name, "link", "add", f"rail{i}", "type", "veth", "peer", "name", f"rail{i}p")
            ip("-n", self.name, "link", "set", f"rail{i}", "up")
            ip("-n", self.name, "link", "set", f"rail{i}p", "up")

    def pod(self) -> str:
        name = f"rnt-pod-{self.tag}-{len(self.pods)}"
        ip("netns", "add", name)
        ip("-n", name, "link", "set", "lo", "up")
        self.pods.append(name)
        return name

    @staticmethod
    def netns_path(pod: str) -> str:
        return f"/var/run/netns/{pod}"

    def ipam(self, subnet: str, **extra: object) -> dict:
        return {"type": "host-local", "dataDir": self.ipam_dir, "ranges": [[{"subnet": subnet, **extra}]]}

    def conf(self, rails: int = 1, version: str = "1.1.0", **overrides: object) -> dict:
        conf = {
            "cniVersion": version, "name": "rdmanet", "type": "rdma-netns", "mode": "shared",
            "requireRdma": False, "stateDir": self.state_dir,
            # the published pod info stays in the test's folder, not the machine's /run and /var/run/cdi
            "podInfoDir": self.pods_dir, "cdiSpecDir": self.cdi_dir,
            "rails": [{"netdev": f"rail{i}", "ipam": self.ipam(f"fd00:{i + 1}::/64")} for i in range(rails)],
        }
        if rails > 1:
            for i, rail in enumerate(conf["rails"]):
                rail["ifname"] = f"rdma{i}"
        conf.update(overrides)
        if not conf.get("resourceName") and "pairing" not in overrides:
            conf["pairing"] = False  # no kubelet here: unpaired on purpose (a config must say so)
        return conf

    def cni(self, command: str, conf: dict | bytes | str, pod: str | None = None, container_id: str = "c1",
            ifname: str | None = None, netns: str | None = None, **kw: object):
        """Run the plugin. CNI_IFNAME defaults to net1, or, for a multi-rail config that names its
        rails, to rail 0's name (as the pod's only network the plugin names rail 0 CNI_IFNAME)."""
        if ifname is None:
            ifname = "net1"
            if isinstance(conf, dict) and len(conf.get("rails") or []) > 1:
                ifname = conf["rails"][0].get("ifname") or ifname
        path = netns if netns is not None else (self.netns_path(pod) if pod else "")
        return run_plugin(command, conf, container_id=container_id, netns=path, ifname=ifname,
                          node_netns=self.name, **kw)

    def allocations(self, network: str = "rdmanet") -> list[str]:
        """host-local's allocation files (one per leased address)."""
        folder = Path(self.ipam_dir) / network
        if not folder.exists():
            return []
        return sorted(p.name for p in folder.iterdir() if p.name not in ("lock",) and
                      not p.name.startswith("last_reserved_ip"))

    def attachment_records(self, network: str = "rdmanet") -> list[str]:
        """The plugin's per-attachment state files (released/ markers are not records)."""
        return sorted(p.name for p in (Path(self.state_dir) / network).glob("*.json"))

    def links(self, pod: str) -> dict[str, dict]:
        return {link["ifname"]: link for link in ipj("-d", "-n", pod, "link")}

    def addresses(self, pod: str, ifname: str) -> list[dict]:
        out = ipj("-n", pod, "addr", "show", "dev", ifname)
        return [a for a in out[0]["addr_info"] if a.get("scope") == "global"] if out else []

    def close(self) -> None:
        for pod in self.pods:
            ip("netns", "del", pod, check=False)
        ip("netns", "del", self.name, check=False)


@pytest.fixture
def node(tmp_path: Path):
    _need_root()
    n = Node(tmp_path)
    try:
        yield n
    finally:
        n.close()
