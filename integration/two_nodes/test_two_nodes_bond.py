"""RoCE LAG across two nodes (issue 20): an 802.3ad bond per node over its two rail NICs, LACP
negotiated between the nodes, pods on the bond rail exchange RDMA, and traffic survives a link loss.

The rig wires rail r of node 1 to rail r of node 2 (integration/two_nodes/rig.py), so each node's
two NICs are two links to the same partner: an 802.3ad bond on each side is a real LACP pair (the
shape of a Lingjun node's `mlx5_bond_N` facing its switch pair). virtio-net reports no speed or
duplex, and 802.3ad makes a port of unknown duplex an individual link (its own aggregator), so the
fixture gives both NICs 10000/full first (virtio-net accepts that through ethtool, for bonding).
The node's RDMA device is an rxe made on a member (as mlx5 LAG reports a member port); the plugin
puts the pods on bond0 whichever way the rail names it. The traffic path is the one Soft-RoCE can
carry (test_two_nodes.py): the node's rxe removed, an rxe on each pod's own interface.

Runs after test_two_nodes.py and gives the rails back as it found them (un-bonded, up, own MACs,
no rxe), so the session's other tests are unaffected whatever order they run in.
"""

from __future__ import annotations

import json
import time

import pytest

from integration.two_nodes.conftest import FACTS, IPAM_DIR, STATE_DIR, RdmaNode, global_address
from integration.two_nodes.test_two_nodes import rc_across, remove_rxe, rping_across

pytestmark = pytest.mark.two_nodes

BOND = "bond0"
DEVICE = "rxeb"
SUBNET = "fd00:30::/64"
# 802.3ad port state bits (IEEE 802.1AX): synchronization, collecting, distributing
IN_SYNC = 0x08 | 0x10 | 0x20

# virtio-net's speed/duplex through the legacy ethtool ioctl (no ethtool binary on the nodes):
# ETHTOOL_GSET, change speed and duplex, ETHTOOL_SSET. Prints the result as sysfs shows it.
ETHTOOL_SET = r"""
import ctypes, fcntl, socket, struct, sys
name, speed, duplex = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
FMT = "=IIIHBBBBBBIIHBBI2I"  # struct ethtool_cmd
buf = ctypes.create_string_buffer(struct.calcsize(FMT))
def call(fields):
    data = struct.pack(FMT, *fields)
    ctypes.memmove(buf, data, len(data))
    ifr = struct.pack("16sP", name.encode(), ctypes.addressof(buf)) + bytes(16)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        fcntl.ioctl(s.fileno(), 0x8946, ifr)  # SIOCETHTOOL
    return list(struct.unpack(FMT, buf.raw))
got = call([1] + [0] * 17)  # ETHTOOL_GSET
got[0], got[3], got[12], got[4] = 2, speed & 0xFFFF, (speed >> 16) & 0xFFFF, duplex  # ETHTOOL_SSET
call(got)
print(open(f"/sys/class/net/{name}/speed").read().strip(), open(f"/sys/class/net/{name}/duplex").read().strip())
"""
SPEED_UNKNOWN, DUPLEX_UNKNOWN, DUPLEX_FULL = 0xFFFFFFFF, 0xFF, 1


def bond_mac(node: int) -> str:
    return f"52:54:00:b{node}:00:01"


def read(node: RdmaNode, path: str) -> str:
    return node.run("cat", path, check=False).stdout.strip()


def link_json(node: RdmaNode, name: str, pod: str | None = None) -> dict:
    cmd = ("ip", "-j", "-d", "link", "show", name)
    return json.loads((node.in_pod(pod, *cmd) if pod else node.run(*cmd)).stdout)[0]


def lacp(node: RdmaNode) -> dict:
    """What the bond negotiated: its aggregator, the partner's MAC, and per member its aggregator
    and actor/partner port states. One guest command for all the files: under emulation every
    command is a round trip of a second or more, and the wait below polls this."""
    base = f"/sys/class/net/{BOND}/bonding"
    files = [f"{base}/ad_aggregator", f"{base}/ad_num_ports", f"{base}/ad_partner_mac"]
    for nic in node.nics.values():
        slave = f"/sys/class/net/{nic}/bonding_slave"
        files += [f"{slave}/ad_aggregator_id", f"{slave}/ad_actor_oper_port_state",
                  f"{slave}/ad_partner_oper_port_state", f"/sys/class/net/{nic}/operstate"]
    out = node.run("grep", "-H", "", *files, check=False).stdout  # "path:value" per readable file
    value = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    members = {}
    for nic in node.nics.values():
        slave = f"/sys/class/net/{nic}/bonding_slave"
        members[nic] = {"aggregator": value.get(f"{slave}/ad_aggregator_id", ""),
                        "actor": int(value.get(f"{slave}/ad_actor_oper_port_state") or 0),
                        "partner": int(value.get(f"{slave}/ad_partner_oper_port_state") or 0),
                        "up": value.get(f"/sys/class/net/{nic}/operstate", "")}
    return {"aggregator": value.get(f"{base}/ad_aggregator", ""), "ports": value.get(f"{base}/ad_num_ports", ""),
            "partnerMac": value.get(f"{base}/ad_partner_mac", ""), "members": members}


def aggregated(node: RdmaNode, peer_mac: str, nics: list[str]) -> bool:
    """`nics` (and only they) distribute in the bond's aggregator, with the peer node as partner."""
    state = lacp(node)
    if state["partnerMac"] != peer_mac or state["ports"] != str(len(nics)):
        return False
    return all(state["members"][nic]["aggregator"] == state["aggregator"]
               and state["members"][nic]["actor"] & IN_SYNC == IN_SYNC
               and state["members"][nic]["partner"] & IN_SYNC == IN_SYNC for nic in nics)


def wait_for(what: str, predicate, seconds: float, detail) -> float:
    """Poll until predicate() holds; the seconds it took (a failure says what was seen last)."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() < start + seconds, f"{what} after {seconds} s: {detail()}"
        time.sleep(1)
    return time.monotonic() - start


class LacpPair:
    """bond0 (802.3ad, fast LACP) over both rail NICs of each node, and rxeb on a member."""

    def __init__(self, nodes: list[RdmaNode]) -> None:
        self.nodes = nodes
        self.before = {n.index: {nic: link_json(n, nic)["address"] for nic in n.nics.values()} for n in nodes}
        self.macs: dict[int, str] = {}
        for node in nodes:
            remove_rxe(node)  # the per-rail rxe of the other tests: the NICs become members
            node.run("modprobe", "bonding")  # missing bonding fails the test, never skips it
            node.run("ip", "link", "del", BOND, check=False)  # one the module may have made at load
            for nic in node.nics.values():
                out = node.run("/usr/bin/python3", "-c", ETHTOOL_SET, nic, "10000", str(DUPLEX_FULL)).stdout.split()
                assert out == ["10000", "full"], f"{node.node.name} {nic}: speed/duplex stayed {out}"
            # The bond's MAC is LACP's system ID. Given none, it gets a random one, and two guests of
            # one kernel booted at once (no entropy source under emulation) can draw the same: each
            # bond then takes the other's LACPDUs for its own ("An illegal loopback occurred on
            # slave") and never aggregates. So each node's bond gets its own, as a NIC has.
            node.run("ip", "link", "add", BOND, "address", bond_mac(node.index), "type", "bond", "mode", "802.3ad",
                     "miimon", "100", "lacp_rate", "fast", "xmit_hash_policy", "layer3+4")
            for nic in node.nics.values():
                node.run("ip", "link", "set", nic, "down")
                node.run("ip", "link", "set", nic, "master", BOND)
            node.run("ip", "link", "set", BOND, "up")
            self.macs[node.index] = link_json(node, BOND)["address"]
            assert self.macs[node.index] == bond_mac(node.index), f"bond0 took {self.macs[node.index]}"
        took = {}
        for node in nodes:
            peer = self.macs[node.peer_index]
            # LACP (fast: a PDU a second) agrees within seconds; the bound is for a slow CI machine
            took[node.node.name] = round(wait_for(
                f"{node.node.name}: LACP did not aggregate both links with {peer}",
                lambda: aggregated(node, peer, list(node.nics.values())), 240,
                lambda: (lacp(node), node.run("dmesg", check=False).stdout.splitlines()[-15:])), 1)
        FACTS.append(json.dumps({"name": "802.3ad between the nodes", "seconds to aggregate": took,
                                 "value": {n.node.name: lacp(n) for n in nodes}}))

    def member(self, node: RdmaNode) -> str:
        return node.nics[0]

    def ensure_device(self, node: RdmaNode) -> None:
        """rxeb on the first member (a test's traffic step removes it)."""
        if DEVICE not in node.rdma_devices():
            node.run("rdma", "link", "add", DEVICE, "type", "rxe", "netdev", self.member(node))
        parent = read(node, f"/sys/class/infiniband/{DEVICE}/parent")
        assert parent == self.member(node), f"rxeb reports the member as its netdev, not {parent}"

    def close(self) -> None:
        problems = []
        for node in self.nodes:
            remove_rxe(node)
            node.run("ip", "link", "del", BOND, check=False)
            for nic in node.nics.values():
                node.run("ip", "link", "set", nic, "nomaster", check=False)
                if link_json(node, nic)["address"] != self.before[node.index][nic]:
                    node.run("ip", "link", "set", nic, "address", self.before[node.index][nic], check=False)
                node.run("/usr/bin/python3", "-c", ETHTOOL_SET, nic, str(SPEED_UNKNOWN), str(DUPLEX_UNKNOWN),
                         check=False)
                node.run("ip", "link", "set", nic, "up", check=False)  # as the session fixture left them
                link = link_json(node, nic)
                if link["address"] != self.before[node.index][nic] or "master" in link or "UP" not in link["flags"]:
                    problems.append(f"{node.node.name} {nic}: {link['address']} {link['flags']} {link.get('master')}")
        assert not problems, f"the rails did not come back as they were: {problems}"


@pytest.fixture(scope="module")
def lacp_pair(two_nodes):
    pair = LacpPair(two_nodes)
    try:
        yield pair
    finally:
        pair.close()


def bond_conf(node: RdmaNode, link: str, network: str) -> dict:
    """Node 1 names the rail by its bond, node 2 by its RDMA device: both mean bond0."""
    start, end = f"fd00:30::{node.index}:1", f"fd00:30::{node.index}:ffff"
    rail = {"netdev": BOND} if node.index == 1 else {"rdmaDevice": DEVICE}
    rail.update(ifname="rdma0", ipam={"type": "host-local", "dataDir": IPAM_DIR,
                                      "ranges": [[{"subnet": SUBNET, "rangeStart": start, "rangeEnd": end}]]})
    return {"cniVersion": "1.1.0", "name": network, "type": "rdma-netns", "mode": "shared", "link": link,
            "stateDir": STATE_DIR, "rails": [rail], "pairing": False}


def tx(node: RdmaNode) -> dict[str, int]:
    return {nic: node.node.counters(nic)["tx"] for nic in node.nics.values()}


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {nic: after[nic] - before[nic] for nic in after}


@pytest.mark.parametrize("link", ["ipvlan", "macvlan"])
def test_pods_on_802_3ad_bonds_exchange_rdma_and_survive_a_link_loss(two_nodes, lacp_pair, link):
    node1, node2 = two_nodes
    network = f"lag-{link}"
    for node in two_nodes:
        lacp_pair.ensure_device(node)
    confs = [bond_conf(node, link, network) for node in two_nodes]
    pods = [node1.pod(f"la-{link}"), node2.pod(f"lb-{link}")]
    results: list[dict] = []
    down: str | None = None
    try:
        for node, conf, pod in zip(two_nodes, confs, pods):
            results.append(node.cni_ok("ADD", conf, pod, "rdma0", f"lag-{link}"))
        addresses = [global_address(r, 0) for r in results]
        for node, conf, pod, result, address in zip(two_nodes, confs, pods, results, addresses):
            iface = next(i for i in result["interfaces"] if i["name"] == "rdma0")
            assert iface["pciID"] == DEVICE, "the result names the bond's RDMA device"
            inner = link_json(node, "rdma0", pod)
            assert inner["linkinfo"]["info_kind"] == link
            assert inner.get("link_index") == link_json(node, BOND)["ifindex"], "the pod's interface is on bond0"
            assert node.gid_ndevs(DEVICE, address) == ["rdma0"], \
                "the pod's address is a RoCE v2 GID of the member's RDMA device, the pod's interface its ndev"
            node.cni_ok("CHECK", dict(conf, prevResult=result), pod, "rdma0", f"lag-{link}")

        for node in two_nodes:
            remove_rxe(node)
        for node, pod in zip(two_nodes, pods):
            node.in_pod(pod, "rdma", "link", "add", "rxp0", "type", "rxe", "netdev", "rdma0")
        before = tx(node1)
        verdict = rc_across(node2, pods[1], addresses[1], node1, pods[0], addresses[0],
                            server_dev="rxp0", client_dev="rxp0")
        used = delta(before, tx(node1))
        rping_across(node2, pods[1], addresses[1], node1, pods[0], addresses[0])
        FACTS.append(json.dumps({"name": f"{link} over 802.3ad: RC across nodes", "bytes": verdict["bytes"],
                                 "node1 member tx": used}))

        # Link loss: the member that carried the traffic goes down on node 1; node 2's LACP (fast
        # rate: 3 s) takes its end of that wire out of the aggregator; the RC exchange goes on the other.
        down = max(used, key=used.get)
        other = next(nic for nic in node1.nics.values() if nic != down)
        peer_down = node2.nics[next(r for r, nic in node1.nics.items() if nic == down)]
        peer_other = next(nic for nic in node2.nics.values() if nic != peer_down)
        node1.run("ip", "link", "set", down, "down")
        for node, keep in ((node1, other), (node2, peer_other)):
            peer = lacp_pair.macs[node.peer_index]
            wait_for(f"{node.node.name}: the bond kept the lost link", lambda: aggregated(node, peer, [keep]), 180,
                     lambda: lacp(node))
        before = tx(node1)
        verdict = rc_across(node2, pods[1], addresses[1], node1, pods[0], addresses[0],
                            server_dev="rxp0", client_dev="rxp0")
        used = delta(before, tx(node1))
        assert used[down] == 0 and used[other] > 0, f"after the loss of {down} traffic left by {used}"
        FACTS.append(json.dumps({"name": f"{link} over 802.3ad: RC after {down} went down", "bytes": verdict["bytes"],
                                 "node1 member tx": used}))
        node1.run("ip", "link", "set", down, "up")
        for node in two_nodes:
            peer = lacp_pair.macs[node.peer_index]
            wait_for(f"{node.node.name}: the link did not rejoin", lambda: aggregated(node, peer, list(node.nics.values())),
                     240, lambda: lacp(node))
        down = None
    finally:
        if down:
            node1.run("ip", "link", "set", down, "up", check=False)
        for node, conf, pod in zip(two_nodes, confs, pods):
            node.in_pod(pod, "rdma", "link", "delete", "rxp0", check=False)
            if pod in node.pods:
                node.cni_ok("DEL", conf, pod, "rdma0", f"lag-{link}")
                node.delete_pod(pod)
    for node in two_nodes:
        assert node.leftovers(network) == {"sub-interfaces": [], "records": [], "leases": [], "namespaces": []}
