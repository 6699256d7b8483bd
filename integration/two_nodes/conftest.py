"""Fixtures of the two-node suite: both guests booted once per session, and node helpers that
run the installed plugin in a guest the way a runtime does (env + config on stdin)."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest

from integration.conftest import GUEST_REPORT
from integration.two_nodes.rig import RAILS, REPO, Node, NodeError, Reply, TwoNodes

KERNEL_ENV = Path(os.environ.get("RDMA_NETNS_KERNEL_CACHE", "/var/cache/rdma-netns-kernel")) / "kernel.env"
GUEST_BIN = "/run/rn2/bin"            # the node's CNI bin folder (a tmpfs in the guest)
STATE_DIR = "/run/rn2/state"
IPAM_DIR = "/run/rn2/ipam"
CNI_PATH = f"{GUEST_BIN}:/usr/lib/cni"
TRAFFIC = REPO / "integration" / "traffic"
SYSTEM_PYTHON = "/usr/bin/python3"   # Debian's, for which python3-pyverbs is built

CALL_TIMES: dict[str, list[float]] = {}
FACTS: list[str] = []


def rail_subnet(rail: int) -> str:
    """Each rail is one L2 segment (a wire between the nodes, no router), hence one subnet."""
    return f"fd00:1{rail}::/64"


def node_range(rail: int, node: int) -> tuple[str, str]:
    """Each node's own slice of the rail's subnet, as a cluster's per-node IPAM ranges are."""
    return f"fd00:1{rail}::{node}:1", f"fd00:1{rail}::{node}:ffff"


class RdmaNode:
    """A node of the rig with the plugin installed: pods, CNI calls, the node's rail NICs."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.index = node.index
        self.peer_index = 2 if node.index == 1 else 1
        self.nics = node.nics
        self.plugin = f"{GUEST_BIN}/rdma-netns"
        self.pods: list[str] = []

    def run(self, *argv: str, **kw) -> Reply:
        return self.node.run(*argv, **kw)

    def in_pod(self, pod: str, *argv: str, **kw) -> Reply:
        return self.node.in_pod(pod, *argv, **kw)

    def install(self) -> None:
        """As install-launcher puts it in a node's CNI bin folder."""
        self.run("mkdir", "-p", GUEST_BIN)
        self.run(str(REPO / ".venv" / "bin" / "rdma-netns"), "install-launcher", self.plugin)

    def pod(self, name: str) -> str:
        self.run("ip", "netns", "add", name)
        self.run("ip", "-n", name, "link", "set", "lo", "up")
        self.pods.append(name)
        return name

    def delete_pod(self, name: str) -> None:
        self.run("ip", "netns", "del", name, check=False)
        if name in self.pods:
            self.pods.remove(name)

    def cni(self, command: str, conf: dict, pod: str, ifname: str, label: str, plugin: str | None = None) -> Reply:
        env = {"CNI_COMMAND": command, "CNI_CONTAINERID": f"{pod}-sandbox", "CNI_NETNS": f"/var/run/netns/{pod}",
               "CNI_IFNAME": ifname, "CNI_PATH": CNI_PATH}
        reply = self.run(plugin or self.plugin, input=json.dumps(conf), env=env, timeout=300, check=False)
        CALL_TIMES.setdefault(f"{label} {command}", []).append(reply.seconds * 1000)
        return reply

    def cni_ok(self, command: str, conf: dict, pod: str, ifname: str, label: str, **kw) -> dict | None:
        reply = self.cni(command, conf, pod, ifname, label, **kw)
        assert reply.rc == 0, f"{self.node.name}: {command} failed ({reply.rc}): {reply.stdout} {reply.stderr}"
        return json.loads(reply.stdout) if reply.stdout.strip() else None

    def ipam(self, rail: int, single: bool = False) -> dict:
        """host-local with this node's own range of the rail's subnet. The rail is flat L2, so the
        connected route reaches the other node's range: an extra route would get host-local's
        default gateway (the subnet's ::1, a router this rig does not have) and break it."""
        start, end = node_range(rail, self.index)
        if single:  # one address only: the next pod gets the same one (address reuse)
            start = end = f"fd00:1{rail}::{self.index}:5"
        return {"type": "host-local", "dataDir": IPAM_DIR,
                "ranges": [[{"subnet": rail_subnet(rail), "rangeStart": start, "rangeEnd": end}]]}

    def shared_conf(self, link: str, network: str = "rails", single_rail0: bool = False) -> dict:
        rails = [{"netdev": self.nics[r], "ifname": f"rdma{r}", "ipam": self.ipam(r, single_rail0 and r == 0)}
                 for r in range(RAILS)]
        return {"cniVersion": "1.1.0", "name": network, "type": "rdma-netns", "mode": "shared", "link": link,
                "stateDir": STATE_DIR, "rails": rails}

    def leftovers(self, network: str) -> dict[str, list]:
        """What a DEL may not leave behind: sub-interfaces, attachment records, address leases."""
        links = json.loads(self.run("ip", "-j", "-d", "link").stdout)
        subs = [link["ifname"] for link in links
                if link.get("linkinfo", {}).get("info_kind") in ("macvlan", "ipvlan")]
        records = self.files(f"{STATE_DIR}/{network}", "*.json")
        leases = [p for p in self.files(f"{IPAM_DIR}/{network}", "*")
                  if p != "lock" and not p.startswith("last_reserved_ip")]
        netns = self.run("ip", "netns", "list").stdout.split()
        return {"sub-interfaces": subs, "records": records, "leases": leases, "namespaces": netns}

    def files(self, folder: str, pattern: str) -> list[str]:
        """Names in `folder` matching `pattern` (none when the folder does not exist)."""
        out = self.run("find", folder, "-maxdepth", "1", "-type", "f", "-name", pattern, check=False)
        return sorted(line.rsplit("/", 1)[-1] for line in out.stdout.split())

    def gid_ndevs(self, device: str, address: str) -> list[str]:
        """The ndevs of the device's RoCE v2 GID entries whose GID is `address`, read by the
        project's own sysfs reader (the first 16 entries: all of rxe's take minutes under emulation)."""
        script = ("import json,sys\n"
                  "from rdma_netns.kernel import rdma_sysfs\n"
                  "from rdma_netns.kernel.inet import Prefix\n"
                  "want = rdma_sysfs.gid_text(Prefix.parse(sys.argv[2]))\n"
                  "print(json.dumps([g.ndev for g in rdma_sysfs.gids(rdma_sysfs.RdmaPort(sys.argv[1], 1), 16)\n"
                  "                  if g.gid == want and g.gid_type == 'RoCE v2']))\n")
        return json.loads(self.run(str(REPO / ".venv" / "bin" / "python"), "-c", script, device, address).stdout)

    def rdma_devices(self, pod: str | None = None) -> list[str]:
        out = (self.in_pod(pod, "rdma", "-j", "dev") if pod else self.run("rdma", "-j", "dev")).stdout
        return sorted(d["ifname"] for d in json.loads(out or "[]"))


def global_address(result: dict, rail: int) -> str:
    """The pod's address on a rail, from the CNI result (each rail has one IPv6 address)."""
    iface = next(i for i, item in enumerate(result["interfaces"]) if item["name"] == f"rdma{rail}" and item.get("sandbox"))
    return next(ip["address"].split("/")[0] for ip in result["ips"] if ip.get("interface") == iface)


@pytest.fixture(scope="session")
def two_nodes(tmp_path_factory):
    if not KERNEL_ENV.exists():
        message = f"no guest kernel ({KERNEL_ENV} missing): run sudo integration/guest/fetch-kernel.sh"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    rig = TwoNodes(tmp_path_factory.mktemp("two-nodes"))
    try:
        try:
            rig.boot()
        except NodeError as err:
            pytest.fail(f"two-node rig: {err}")  # a guest that does not boot fails the suite, never skips it
        per_node = ", ".join(f"{n.name} {n.booted_s:.0f} s" for n in rig.nodes)
        GUEST_REPORT.append(f"two-node rig: both guests up {rig.boot_s:.0f} s after launch ({per_node}; one vCPU "
                            f"each, booted at once); consoles in {rig.nodes[0].results.parent}")
        nodes = [RdmaNode(n) for n in rig.nodes]
        for node in nodes:
            node.install()
            for nic in node.nics.values():
                node.run("ip", "link", "set", nic, "up")
        yield nodes
    finally:
        rig.close()
        for name, ms in sorted(CALL_TIMES.items()):
            GUEST_REPORT.append(f"  {name:<30} median {statistics.median(ms):8.0f} ms  (n={len(ms)}, min {min(ms):.0f})")
        GUEST_REPORT.extend(f"  {fact}" for fact in FACTS)


@pytest.fixture(autouse=True)
def no_pod_outlives_its_test(two_nodes):
    """A failed test must not leave namespaces behind: the exclusive test's mode switch needs none."""
    yield
    for node in two_nodes:
        for pod in list(node.pods):
            node.delete_pod(pod)
