"""rangeFromNodeAddress in real namespaces: one config for every node, each node's pods in the
block of its own address on the rail (issue 21).

A node is a network namespace; the many-node test joins several to one rail segment (a bridge in
a "fabric" namespace) and runs the installed plugin in each with the same config bytes, each
node keeping its own state and host-local leases (its own disk: a bind mount per call).
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import CNI_BIN_DIR, CniResult, plugin_path
from tests.netns.conftest import _need_root, ip, ipj

pytestmark = pytest.mark.netns

RULE = {"prefixLength": 112}


def rule_conf(node, **overrides: object) -> dict:
    conf = node.conf(rails=1)
    conf["rails"] = [{"netdev": "rail0", "ipam": {"type": "host-local", "dataDir": node.ipam_dir}}]
    conf["rangeFromNodeAddress"] = RULE
    conf.update(overrides)
    return conf


def give_node_address(node, address: str, dev: str = "rail0") -> None:
    ip("-n", node.name, "address", "add", address, "dev", dev, "nodad")


def pod_address(result: dict, ifname: str = "net1") -> ipaddress.IPv6Interface:
    index = next(i for i, iface in enumerate(result["interfaces"]) if iface["name"] == ifname)
    (address,) = [ipaddress.IPv6Interface(a["address"]) for a in result["ips"] if a["interface"] == index]
    return address


def records(node) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((Path(node.state_dir) / "rdmanet").glob("*.json"))]


def test_pods_get_addresses_of_the_node_block_with_the_rail_prefix(node):
    give_node_address(node, "fd00:10::3:1/64")
    conf = rule_conf(node)
    got = []
    for i in range(3):
        pod = node.pod()
        got.append(pod_address(node.cni("ADD", conf, pod, container_id=f"c{i}").ok()))
    assert [str(a) for a in got] == ["fd00:10::3:2/64", "fd00:10::3:3/64", "fd00:10::3:4/64"], \
        "the block's first address and the node's own are never handed out; the pods keep the rail's /64"
    (rail,) = records(node)[0]["rails"]
    assert rail["nodeRange"] == {"netdev": "rail0", "subnet": "fd00:10::/64", "block": "fd00:10::3:0/112",
                                 "nodeAddresses": ["fd00:10::3:1/128"]}
    assert rail["ipam"]["ranges"] == [[{"subnet": "fd00:10::/64", "rangeStart": "fd00:10::3:2",
                                        "rangeEnd": "fd00:10::3:ffff"}]]
    node.cni("CHECK", dict(conf, prevResult=node.cni("ADD", conf, node.pod(), container_id="c9").ok()),
             node.pods[-1], container_id="c9").ok()


def test_del_releases_from_the_recorded_range_after_the_node_address_changed(node):
    give_node_address(node, "fd00:10::3:1/64")
    conf = rule_conf(node)
    pod = node.pod()
    assert str(pod_address(node.cni("ADD", conf, pod).ok())) == "fd00:10::3:2/64"
    assert node.allocations() == ["fd00:10::3:2"]
    ip("-n", node.name, "address", "del", "fd00:10::3:1/64", "dev", "rail0")
    give_node_address(node, "fd00:10::4:1/64")  # renumbered (or gone: DEL needs only the record)
    node.cni("DEL", conf, pod).ok()
    assert node.allocations() == [] and records(node) == []
    pod = node.pod()
    assert str(pod_address(node.cni("ADD", conf, pod, container_id="c2").ok())) == "fd00:10::4:2/64"
    ip("-n", node.name, "address", "del", "fd00:10::4:1/64", "dev", "rail0")
    node.cni("DEL", conf, pod, container_id="c2").ok()
    assert node.allocations() == [] and records(node) == []


def test_a_rail_without_a_global_address_refuses_with_109_and_leaves_nothing(node):
    ip("-n", node.name, "address", "add", "fd00:10::3:1/64", "dev", "rail1", "nodad")  # another rail's
    conf = rule_conf(node)
    pod = node.pod()
    err = node.cni("ADD", conf, pod).error(109)
    assert "rail rail0 has no global IPv6 address" in err["msg"] and "rangeFromNodeAddress" in err["msg"]
    assert err["details"]
    assert set(node.links(pod)) == {"lo"} and node.allocations() == [] and records(node) == []
    status = node.cni("STATUS", conf).error(50)
    assert "no global IPv6 address" in status["msg"]
    node.cni("DEL", conf, pod).ok()  # the runtime's rollback DEL after the failed ADD


def test_several_blocks_are_refused_until_within_chooses(node):
    give_node_address(node, "fd00:10::3:1/64")
    give_node_address(node, "2001:db8:5::3:1/64")
    pod = node.pod()
    err = node.cni("ADD", rule_conf(node), pod).error(109)
    assert "2 blocks" in err["msg"]
    result = node.cni("ADD", rule_conf(node, rangeFromNodeAddress={"prefixLength": 112, "within": "2001:db8::/32"}),
                      pod).ok()
    assert str(pod_address(result)) == "2001:db8:5::3:2/64"


# ---------------------------------------------------------------- many nodes on one segment

NODES = 6
PODS_PER_NODE = 40
SEGMENT = "fd00:10::/64"


class Cluster:
    """NODES node namespaces, each with rail0 on one bridged segment, node n at fd00:10::n:1/64.

    Every node runs the plugin with the same config (same bytes), whose stateDir and dataDir are
    one path; each call bind-mounts the node's own folder there first, as each node has its disk."""

    def __init__(self, tmp: Path) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.fabric = f"rnt-fab-{self.tag}"
        self.shared = tmp / "node-disk"      # the path in the config
        self.shared.mkdir()
        self.nodes = [f"rnt-n{n}-{self.tag}" for n in range(1, NODES + 1)]
        self.disks = {name: tmp / f"disk-{n}" for n, name in enumerate(self.nodes, 1)}
        self.pods: list[str] = []
        ip("netns", "add", self.fabric)
        ip("-n", self.fabric, "link", "add", "br0", "type", "bridge")
        ip("-n", self.fabric, "link", "set", "br0", "up")
        for n, name in enumerate(self.nodes, 1):
            self.disks[name].mkdir()
            ip("netns", "add", name)
            ip("-n", name, "link", "set", "lo", "up")
            ip("-n", name, "link", "add", "rail0", "type", "veth", "peer", "name", f"p{n}", "netns", self.fabric)
            ip("-n", self.fabric, "link", "set", f"p{n}", "master", "br0", "up")
            ip("-n", name, "link", "set", "rail0", "up")
            ip("-n", name, "address", "add", f"fd00:10::{n}:1/64", "dev", "rail0", "nodad")
        self.conf = json.dumps({
            "cniVersion": "1.0.0", "name": "rdmanet", "type": "rdma-netns", "mode": "shared", "link": "macvlan",
            "requireRdma": False, "pairing": False, "stateDir": f"{self.shared}/state", "podInfoDir": f"{self.shared}/pods",
            "cdiSpecDir": f"{self.shared}/cdi", "rangeFromNodeAddress": RULE,
            "ipam": {"type": "host-local", "dataDir": f"{self.shared}/ipam"},
            "rails": [{"netdev": "rail0", "ifname": "rdma0"}]}).encode()

    def cni(self, node: str, command: str, pod: str, container_id: str) -> CniResult:
        env = {"CNI_COMMAND": command, "CNI_CONTAINERID": container_id, "CNI_NETNS": f"/var/run/netns/{pod}",
               "CNI_IFNAME": "rdma0", "CNI_PATH": CNI_BIN_DIR, "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
        # ip netns exec gives the call a mount namespace of its own: the node's disk is mounted there only
        cmd = ["ip", "netns", "exec", node, "sh", "-c", 'mount --bind "$0" "$1" && exec "$2"',
               str(self.disks[node]), str(self.shared), plugin_path()]
        return CniResult(subprocess.run(cmd, input=self.conf, env=env, capture_output=True, timeout=120))

    def leases(self, node: str) -> list[str]:
        folder = self.disks[node] / "ipam" / "rdmanet"
        return sorted(p.name for p in folder.iterdir() if p.name != "lock" and not p.name.startswith("last_")) \
            if folder.exists() else []

    def close(self) -> None:
        for name in self.pods + self.nodes + [self.fabric]:
            ip("netns", "del", name, check=False)


@pytest.fixture
def cluster(tmp_path: Path):
    _need_root()
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()


def test_many_nodes_with_one_config_never_hand_out_one_address_twice(cluster):
    jobs = []
    for n, node in enumerate(cluster.nodes, 1):
        for i in range(PODS_PER_NODE):
            pod = f"rnt-p{n}x{i}-{cluster.tag}"
            ip("netns", "add", pod)
            cluster.pods.append(pod)
            jobs.append((n, node, pod, f"{pod}-sandbox"))

    def add(job):
        n, node, pod, cid = job
        return n, pod, pod_address(cluster.cni(node, "ADD", pod, cid).ok(), "rdma0")

    with ThreadPoolExecutor(4) as pool:
        added = list(pool.map(add, jobs))
    addresses = [a.ip for _n, _pod, a in added]
    assert len(addresses) == NODES * PODS_PER_NODE == len(set(addresses)), "an address was handed out twice"
    node_addresses = {ipaddress.IPv6Address(f"fd00:10::{n}:1") for n in range(1, NODES + 1)}
    for n, _pod, address in added:
        assert address.network == ipaddress.IPv6Network(SEGMENT), "the pods keep the segment's prefix"
        assert address.ip in ipaddress.IPv6Network(f"fd00:10::{n}:0/112"), f"node {n}'s pod outside its block"
        assert address.ip not in node_addresses
    for node in cluster.nodes:
        assert len(cluster.leases(node)) == PODS_PER_NODE

    # The segment is one: the first node's first pod reaches the last node's last pod.
    first, last = added[0], added[-1]
    ping = subprocess.run(["ip", "netns", "exec", first[1], "ping", "-6", "-c", "2", "-W", "2",
                           str(last[2].ip)], capture_output=True, text=True)
    assert ping.returncode == 0, ping.stdout + ping.stderr

    with ThreadPoolExecutor(4) as pool:
        for result in pool.map(lambda job: cluster.cni(job[1], "DEL", job[2], job[3]), jobs):
            result.ok()
    for node in cluster.nodes:
        assert cluster.leases(node) == [], f"{node} kept leases after DEL"
        links = ipj("-n", node, "-d", "link")
        assert not [link for link in links if link.get("linkinfo", {}).get("info_kind") == "macvlan"]


def test_check_config_node_shows_this_node_range_or_why_not(node, tmp_path):
    """What an admin runs on a node before pods come: the range each rail will hand out."""
    from tests.conftest import installed_executable

    conf = rule_conf(node)
    conf["rails"].append({"netdev": "rail1", "ifname": "rdma1", "ipam": {"type": "host-local"}})
    path = tmp_path / "net.conf"
    path.write_text(json.dumps(conf))

    def check() -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", node.name, installed_executable(), "check-config", "--node",
                               str(path)], capture_output=True, text=True)

    give_node_address(node, "fd00:10::3:1/64")
    out = check()
    assert out.returncode == 1, out.stdout + out.stderr
    assert "rail 0 rdma0: rail0 (no RDMA device); pod range rail0: node address fd00:10::3:1/128 -> pods " \
           "fd00:10::3:2-fd00:10::3:ffff (65534 addresses, prefix /64)" in out.stdout
    assert "rail 1 rdma1: rail1 (no RDMA device); error 109: rail rail1 has no global IPv6 address" in out.stdout
    give_node_address(node, "fd00:11::3:1/64", dev="rail1")
    out = check()
    assert out.returncode == 0 and "on this node (ok)" in out.stdout, out.stdout + out.stderr
    assert "fd00:11::3:2-fd00:11::3:ffff" in out.stdout


def chain_into_bridge(tmp_path: Path, conf: dict) -> tuple[Path, object]:
    """A primary conflist (bridge) in tmp_path/net.d with the config's entry chained into it."""
    from rdma_netns.admin import cni_conf

    conf_dir, state = tmp_path / "net.d", cni_conf.State(tmp_path / "cni-conf")
    conf_dir.mkdir(exist_ok=True)
    (conf_dir / "10-bridge.conflist").write_text(json.dumps(
        {"cniVersion": "1.0.0", "name": "pods", "plugins": [{"type": "bridge"}]}))
    entry = {k: v for k, v in conf.items() if k not in ("cniVersion", "name")}
    assert cni_conf.insert(conf_dir, entry, state) in ("inserted", "updated")
    return conf_dir, state


def readiness(node, tmp_path: Path) -> subprocess.CompletedProcess:
    """`cni-conf show --require-entry --require-node-fit` on the node, as a probe runs it."""
    from tests.conftest import installed_executable

    return subprocess.run(["ip", "netns", "exec", node.name, installed_executable(), "cni-conf", "show",
                           "--conf-dir", str(tmp_path / "net.d"), "--state-dir", str(tmp_path / "cni-conf"),
                           "--require-entry", "--require-node-fit"], capture_output=True, text=True)


def test_the_sidecars_readiness_probe_fails_until_the_entry_fits_this_node(node, tmp_path):
    """`cni-conf show --require-node-fit` (the DaemonSet's cni-conf-watch readiness probe): the
    entry chained into the primary resolves on this node as ADD would, or the pod is not Ready.
    A fabric on another prefix than rangeFromNodeAddress.within is the case it exists for."""
    conf = rule_conf(node, rangeFromNodeAddress={"prefixLength": 112, "within": "fd00:10::/32"})
    give_node_address(node, "fd20:10::3:1/64")  # the node's address on another fabric prefix
    chain_into_bridge(tmp_path, conf)
    out = readiness(node, tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "not ready: on this node every RDMA pod's ADD would fail" in out.stderr
    assert "error 109: rail rail0 has no global IPv6 address within fd00:10::/32" in out.stderr, out.stderr
    give_node_address(node, "fd00:10::3:1/64")
    out = readiness(node, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_watch_keeps_the_readiness_file_the_daemonsets_probe_reads(node, tmp_path):
    """`cni-conf watch --ready-file` (the DaemonSet's sidecar) answers the same question in its own
    process, and the manifest's shell probe reads the answer: not Ready while the node's fabric
    address is outside rangeFromNodeAddress.within, Ready within the check interval once it fits."""
    from tests.conftest import installed_executable
    from tests.unit.test_manifests import FileProbe, container, daemonset

    conf = rule_conf(node, rangeFromNodeAddress={"prefixLength": 112, "within": "fd00:10::/32"})
    entry = tmp_path / "entry.json"
    entry.write_text(json.dumps({k: v for k, v in conf.items() if k not in ("cniVersion", "name")}))
    give_node_address(node, "fd20:10::3:1/64")
    conf_dir, ready = tmp_path / "net.d", tmp_path / "ready"
    conf_dir.mkdir()
    (conf_dir / "10-bridge.conflist").write_text(json.dumps(
        {"cniVersion": "1.0.0", "name": "pods", "plugins": [{"type": "bridge"}]}))
    probe = FileProbe(container(daemonset()["spec"]["template"]["spec"], "cni-conf-watch")["readinessProbe"], ready)
    switch_on = {"RDMA_FOR_NON_HOSTNETWORK_PODS": "true"}
    watch = subprocess.Popen(["ip", "netns", "exec", node.name, installed_executable(), "cni-conf", "watch",
                              "--conf-dir", str(conf_dir), "--state-dir", str(tmp_path / "cni-conf"),
                              "--entry", str(entry), "--interval", "0.1", "--ready-file", str(ready),
                              "--ready-interval", "0.2"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def probe_until(code: int) -> subprocess.CompletedProcess:
        deadline = time.monotonic() + 15
        while (out := probe.run(switch_on)).returncode != code:
            assert watch.poll() is None, watch.stdout.read()
            assert time.monotonic() < deadline, f"the probe still exits {out.returncode}: {out.stdout}"
            time.sleep(0.1)
        return out

    try:
        assert probe.run(switch_on).returncode == 1
        deadline = time.monotonic() + 15
        while not ready.exists():
            assert watch.poll() is None and time.monotonic() < deadline, watch.stdout.read()
            time.sleep(0.05)
        out = probe.run(switch_on)
        assert out.returncode == 1, out.stdout
        assert "error 109: rail rail0 has no global IPv6 address within fd00:10::/32" in out.stdout, out.stdout
        give_node_address(node, "fd00:10::3:1/64")
        probe_until(0)
        assert ready.read_text() == "ready\n"
    finally:
        watch.terminate()
        log, _ = watch.communicate(timeout=30)
    assert watch.returncode == 0, log
    assert "not ready: on this node every RDMA pod's ADD would fail" in log and "\nrdma-netns cni-conf: ready" in log, log



def test_readiness_follows_adds_rule_per_rail(node, tmp_path):
    """A rail with its own ipam ranges is static for ADD (rail_range_rule): the readiness check and
    `status` must not ask it for a node address either, and a rail's own rule wins over the
    top-level one, as in ADD."""
    conf = rule_conf(node, rangeFromNodeAddress={"prefixLength": 112, "within": "fd00:10::/32"})
    conf["rails"].append({"netdev": "rail1", "ifname": "rdma1",
                          "ipam": {"type": "host-local", "ranges": [[{"subnet": "fd99:1::/64"}]]}})
    give_node_address(node, "fd00:10::3:1/64")  # rail0 fits; rail1 has no fabric address at all
    chain_into_bridge(tmp_path, conf)
    out = readiness(node, tmp_path)
    assert out.returncode == 0, out.stderr
    # rail1's own rule (another prefix) is what ADD applies to it: no address there, not ready.
    conf["rails"][1] = {"netdev": "rail1", "ifname": "rdma1", "ipam": {"type": "host-local"},
                        "rangeFromNodeAddress": {"prefixLength": 112, "within": "fd00:20::/32"}}
    chain_into_bridge(tmp_path, conf)
    out = readiness(node, tmp_path)
    assert out.returncode == 1 and "rail 1: error 109" in out.stderr and "fd00:20::/32" in out.stderr, out.stderr
