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


SHIPPED_ENTRY = REPO / "conf" / "rdma-netns-chained-entry.json"


def rail_subnet(rail: int) -> str:
    """Each rail is one L2 segment (a wire between the nodes, no router), hence one subnet."""
    return f"fd00:1{rail}::/64"


def node_address(rail: int, node: int) -> str:
    """The node's own address on the rail, from the fabric's address plan: node n in its own /112
    (the shipped rangeFromNodeAddress then gives its pods the rest of that /112)."""
    return f"fd00:1{rail}::{node}:1/64"


def node_range(rail: int, node: int) -> tuple[str, str]:
    """Each node's own slice of the rail's subnet: the /112 of its address, less the address."""
    return f"fd00:1{rail}::{node}:2", f"fd00:1{rail}::{node}:ffff"


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

    def give_node_addresses(self) -> None:
        """The node's own address on each rail (what the fabric's plan gives a node; a NIC that
        visited a pod comes back without it)."""
        for rail, nic in self.nics.items():
            self.run("ip", "address", "replace", node_address(rail, self.index), "dev", nic, "nodad")

    def static_ipam(self, rail: int) -> dict:
        """host-local with one planned address of the rail's subnet (the next pod gets the same one:
        address reuse); the static form an admin who plans addresses by hand keeps."""
        address = f"fd00:1{rail}::{self.index}:5"
        return {"type": "host-local", "dataDir": IPAM_DIR,
                "ranges": [[{"subnet": rail_subnet(rail), "rangeStart": address, "rangeEnd": address}]]}

    def shared_conf(self, link: str, network: str = "rails", single_rail0: bool = False) -> dict:
        """The shipped chained entry's address rule (rangeFromNodeAddress), the same bytes on both
        nodes: each node's pods take the /112 of its own address on the rail. The rail is flat L2,
        so the connected /64 reaches the other node's pods; the entry's route (fd00::/16 via the
        subnet's ::1, a router this rig does not have) is left out."""
        self.give_node_addresses()
        shipped = json.loads(SHIPPED_ENTRY.read_text())
        rails = [{"netdev": self.nics[r], "ifname": f"rdma{r}"} for r in range(RAILS)]
        if single_rail0:
            rails[0]["ipam"] = self.static_ipam(0)
        return {"cniVersion": "1.1.0", "name": network, "type": "rdma-netns", "mode": "shared", "link": link,
                "stateDir": STATE_DIR, "rails": rails, "rangeFromNodeAddress": shipped["rangeFromNodeAddress"],
                "pairing": False,
                "ipam": {"type": "host-local", "dataDir": IPAM_DIR}}

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


# Package scope: the two guests go down when this folder's tests are done. Idle under software
# emulation they still take about an eighth of a core each, which the later suites (the real
# cluster's emulated node above all) need.
@pytest.fixture(scope="package")
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
