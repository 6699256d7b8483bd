"""Two nodes, each its own kernel, joined rail by rail: pods on different nodes, set up by the
installed plugin as a runtime runs it, exchange RDMA traffic over the plugin's rails.

Runs on the host; every step runs inside one of the two guests (integration/two_nodes/rig.py).
"""

from __future__ import annotations

import json
import time

import pytest

from integration.two_nodes.conftest import (
    FACTS,
    RAILS,
    STATE_DIR,
    SYSTEM_PYTHON,
    TRAFFIC,
    RdmaNode,
    global_address,
    node_address,
    node_range,
)
from integration.two_nodes.rig import Reply

pytestmark = pytest.mark.two_nodes


def rxe_on_rails(node: RdmaNode) -> None:
    """Soft-RoCE on each rail NIC: the node's RDMA devices, as a RoCE NIC's driver registers them."""
    present = node.rdma_devices()
    for rail, nic in node.nics.items():
        if f"rxe{rail}" not in present:
            node.run("rdma", "link", "add", f"rxe{rail}", "type", "rxe", "netdev", nic)


def remove_rxe(node: RdmaNode) -> None:
    for name in node.rdma_devices():
        node.run("rdma", "link", "delete", name, check=False)


def rc_across(server: RdmaNode, server_pod: str, server_addr: str, client: RdmaNode, client_pod: str,
              client_addr: str, server_dev: str | None = None, client_dev: str | None = None,
              oob: tuple[str, str] | None = None) -> dict:
    """An RC queue pair between the two pods: WRITE + SEND of known patterns, every byte checked by
    the receiver (integration/traffic/rc_exchange.py, pyverbs). The QP data goes over TCP between
    the rail addresses, or with `oob` (server's, client's address) over IPv4, as perftest's does."""
    tool = str(TRAFFIC / "rc_exchange.py")
    serving = server.node.spawn("ip", "netns", "exec", server_pod, SYSTEM_PYTHON, tool, "server",
                                "--addr", server_addr, "--timeout", "240",
                                *(["--device", server_dev] if server_dev else []),
                                *(["--oob-addr", oob[0]] if oob else []))
    out = client.in_pod(client_pod, SYSTEM_PYTHON, tool, "client", "--addr", client_addr, "--peer", server_addr,
                        "--timeout", "240", *(["--device", client_dev] if client_dev else []),
                        *(["--oob-addr", oob[1], "--oob-peer", oob[0]] if oob else []),
                        timeout=300, check=False)
    served = serving.wait(300)
    assert out.rc == 0 and served.rc == 0, \
        f"RC exchange failed: client {out.rc} {out.stdout} {out.stderr} | server {served.rc} {served.stdout} {served.stderr}"
    verdict = json.loads(served.stdout.strip().splitlines()[-1])
    assert verdict["ok"] is True and verdict["bytes"] > 0
    return verdict


def rping_try(server: RdmaNode, server_pod: str, server_addr: str, client: RdmaNode, client_pod: str,
              client_addr: str, count: int = 5, within: float = 150) -> tuple[bool, Reply, Reply]:
    """rping (rdma_cm: address and route resolution, CM connect, validated RDMA READ/WRITE):
    (both sides finished `count` validated pings, client's reply, server's reply)."""
    serving = server.node.spawn("timeout", str(int(within) + 50), "ip", "netns", "exec", server_pod, "rping", "-s",
                                "-a", server_addr, "-C", str(count), "-V", "-v")
    deadline = time.monotonic() + within
    while True:  # rping cannot say "listening": retry while the server starts
        out = client.in_pod(client_pod, "timeout", "60", "rping", "-c", "-a", server_addr, "-I", client_addr,
                            "-C", str(count), "-V", "-v", timeout=90, check=False)
        if out.rc == 0 or time.monotonic() > deadline:
            break
        time.sleep(2)
    if out.rc != 0:
        server.run("pkill", "-f", f"rping -s -a {server_addr}", check=False)
    served = serving.wait(within + 60)
    return out.rc == 0 and served.rc == 0 and out.stdout.count("ping data:") == count, out, served


def rping_across(server: RdmaNode, server_pod: str, server_addr: str, client: RdmaNode, client_pod: str,
                 client_addr: str, count: int = 5) -> Reply:
    ok, out, served = rping_try(server, server_pod, server_addr, client, client_pod, client_addr, count)
    assert ok, f"rping failed: client {out.rc} ({out.stdout.count('ping data:')} pings) {out.stdout[-400:]} " \
               f"{out.stderr[-400:]} | server {served.rc} {served.stdout[-400:]} {served.stderr[-400:]}"
    return out


def test_both_nodes_booted_and_every_rail_is_a_wire_between_them(two_nodes):
    node1, node2 = two_nodes
    for rail in range(RAILS):
        peer_ll = json.loads(node2.run("ip", "-j", "-6", "addr", "show", "dev", node2.nics[rail], "scope", "link").stdout)
        ll = peer_ll[0]["addr_info"][0]["local"]
        node1.run("ping", "-6", "-c", "2", "-W", "5", f"{ll}%{node1.nics[rail]}", timeout=60)
        other = node2.nics[1 - rail]
        other_ll = json.loads(node2.run("ip", "-j", "-6", "addr", "show", "dev", other, "scope", "link").stdout)
        unreachable = node1.run("ping", "-6", "-c", "1", "-W", "2",
                                f"{other_ll[0]['addr_info'][0]['local']}%{node1.nics[rail]}", check=False)
        assert unreachable.rc != 0, f"rail {rail} also reaches node 2's rail {1 - rail}: the wires are crossed"


@pytest.mark.parametrize("link", ["macvlan", "ipvlan"])
def test_shared_pods_on_two_nodes_exchange_rdma_on_every_rail(two_nodes, link):
    node1, node2 = two_nodes
    for node in two_nodes:
        rxe_on_rails(node)
    network = f"rails-{link}"
    confs = [node.shared_conf(link, network=network) for node in two_nodes]
    assert confs[0] == confs[1], "one config for both nodes: no per-node ranges"
    pods = [node1.pod(f"a-{link}"), node2.pod(f"b-{link}")]
    results: list[dict] = []
    try:
        for node, conf, pod in zip(two_nodes, confs, pods):
            results.append(node.cni_ok("ADD", conf, pod, "rdma0", f"shared-{link}"))
        for node, conf, pod, result in zip(two_nodes, confs, pods, results):
            for rail in range(RAILS):
                address = global_address(result, rail)
                assert address == node_range(rail, node.index)[0], \
                    "each node hands out the /112 of its own address on the rail, its address left out"
                iface = next(i for i in result["interfaces"] if i["name"] == f"rdma{rail}")
                assert iface["pciID"] == f"rxe{rail}", "the result names the rail's RDMA device"
                assert node.gid_ndevs(f"rxe{rail}", address) == [f"rdma{rail}"], \
                    "the pod's address is a RoCE v2 GID of the node's device, the pod's interface its ndev"
            node.cni_ok("CHECK", dict(conf, prevResult=result), pod, "rdma0", f"shared-{link}")
        # The traffic path Soft-RoCE can carry (as in the one-node suite): an rxe on each pod's own
        # interface, the node's rxe removed first. Soft-RoCE on a lower device does not receive
        # what arrives on its upper devices; a RoCE NIC does.
        for node in two_nodes:
            remove_rxe(node)
        for node, pod in zip(two_nodes, pods):
            for rail in range(RAILS):
                node.in_pod(pod, "rdma", "link", "add", f"rxp{rail}", "type", "rxe", "netdev", f"rdma{rail}")
        for rail in range(RAILS):
            a, b = global_address(results[0], rail), global_address(results[1], rail)
            # As a job connects: QP data over IPv4 (these guests have no other network between
            # pods), no IPv6 packet on the rail before, neighbour tables forgotten. The QP resolves
            # its peer itself, from the rail's link-local address.
            oob = (f"10.8{rail}.0.2", f"10.8{rail}.0.1")
            for node, pod, v4 in zip(two_nodes, pods, reversed(oob)):
                node.in_pod(pod, "ip", "addr", "add", f"{v4}/24", "dev", f"rdma{rail}")
                node.in_pod(pod, "ip", "-6", "neigh", "flush", "dev", f"rdma{rail}")
            verdict = rc_across(node2, pods[1], b, node1, pods[0], a, server_dev=f"rxp{rail}", client_dev=f"rxp{rail}",
                                oob=oob)
            FACTS.append(json.dumps({"name": f"{link} rail {rail} RC across nodes", "bytes": verdict["bytes"],
                                     "gid_index": verdict["gid_index"], "transfer_s": verdict.get("transfer_s")}))
            out = rping_across(node2, pods[1], b, node1, pods[0], a)
            FACTS.append(json.dumps({"name": f"{link} rail {rail} rping across nodes",
                                     "pings": out.stdout.count("ping data:"), "seconds": out.seconds}))
    finally:
        for node, conf, pod in zip(two_nodes, confs, pods):
            for rail in range(RAILS):
                node.in_pod(pod, "rdma", "link", "delete", f"rxp{rail}", check=False)
            node.cni_ok("DEL", conf, pod, "rdma0", f"shared-{link}")
            node.delete_pod(pod)
    for node in two_nodes:
        assert node.leftovers(network) == {"sub-interfaces": [], "records": [], "leases": [], "namespaces": []}


def test_each_rail_source_routes_across_nodes(two_nodes):
    """Traffic from a pod's rail-1 address leaves by rail 1 even when the pod's main table sends the
    peer's rail-1 range out of rail 0 (as a cluster's default route or another rail's route would)."""
    node1, node2 = two_nodes
    for node in two_nodes:
        rxe_on_rails(node)
    confs = [node.shared_conf("macvlan", network="rails-routing") for node in two_nodes]
    pods = [node1.pod("a-routing"), node2.pod("b-routing")]
    results = [node.cni_ok("ADD", conf, pod, "rdma0", "shared-macvlan")
               for node, conf, pod in zip(two_nodes, confs, pods)]
    try:
        a1, b1 = global_address(results[0], 1), global_address(results[1], 1)
        start, _end = node_range(1, 2)
        decoy = start.rsplit(":", 1)[0] + ":0/112"   # node 2's rail-1 range, more specific than the rail's /64
        node1.in_pod(pods[0], "ip", "-6", "route", "add", decoy, "dev", "rdma0")
        before = {r: node1.node.counters(node1.nics[r]) for r in range(RAILS)}
        node1.in_pod(pods[0], "ping", "-6", "-c", "20", "-i", "0.05", "-W", "5", "-I", a1, b1, timeout=120)
        after = {r: node1.node.counters(node1.nics[r]) for r in range(RAILS)}
        sent = {r: after[r]["tx"] - before[r]["tx"] for r in range(RAILS)}
        FACTS.append(json.dumps({"name": "rail-1 source, 20 pings: packets out of node 1's NICs", "value": sent}))
        assert sent[1] >= 20 and sent[0] < 5, f"rail-1 traffic left by the wrong NIC: {sent}"
        # The decoy is a live path: unbound traffic follows the main table out of rail 0 (and finds
        # nobody there with that address), which is what the per-rail rule keeps RDMA traffic from.
        before0 = node1.node.counters(node1.nics[0])["tx"]
        unbound = node1.in_pod(pods[0], "ping", "-6", "-c", "3", "-i", "0.2", "-W", "2", b1, check=False)
        assert unbound.rc != 0 and node1.node.counters(node1.nics[0])["tx"] - before0 >= 3
    finally:
        for node, conf, pod in zip(two_nodes, confs, pods):
            node.cni_ok("DEL", conf, pod, "rdma0", "shared-macvlan")
            node.delete_pod(pod)


def test_a_node_whose_rail_has_no_address_refuses_and_leaves_nothing(two_nodes):
    """rangeFromNodeAddress never guesses: without the node's own address on a rail, no range."""
    node = two_nodes[1]
    conf = node.shared_conf("macvlan", network="rails-noaddr")
    node.run("ip", "address", "del", node_address(1, node.index), "dev", node.nics[1])
    pod = node.pod("b-noaddr")
    try:
        reply = node.cni("ADD", conf, pod, "rdma0", "shared-macvlan")
        err = json.loads(reply.stdout)
        assert reply.rc != 0 and err["code"] == 109, reply.stdout + reply.stderr
        assert f"rail {node.nics[1]} has no global IPv6 address within fd00::/16" in err["msg"]
        node.cni_ok("DEL", conf, pod, "rdma0", "shared-macvlan")  # the runtime's rollback DEL
        FACTS.append(json.dumps({"name": "a rail without its node address", "code": err["code"], "msg": err["msg"]}))
    finally:
        node.delete_pod(pod)
        node.give_node_addresses()
    assert node.leftovers("rails-noaddr") == {"sub-interfaces": [], "records": [], "leases": [], "namespaces": []}


def neighbour(node: RdmaNode, pod: str, ifname: str, address: str) -> dict | None:
    entries = json.loads(node.in_pod(pod, "ip", "-j", "-6", "neigh", "show", "dev", ifname).stdout or "[]")
    return next((e for e in entries if e.get("dst") == address), None)


def test_a_reused_address_with_a_new_mac_is_reached_at_once_from_the_other_node(two_nodes):
    node1, node2 = two_nodes
    for node in two_nodes:
        rxe_on_rails(node)
    conf1 = node1.shared_conf("macvlan", network="rails-reuse")
    conf2 = node2.shared_conf("macvlan", network="rails-reuse", single_rail0=True)
    client = node1.pod("a-reuse")
    r1 = node1.cni_ok("ADD", conf1, client, "rdma0", "shared-macvlan")
    a0 = global_address(r1, 0)
    old_pod = node2.pod("b-reuse-old")
    old = node2.cni_ok("ADD", conf2, old_pod, "rdma0", "shared-macvlan")
    target = global_address(old, 0)
    old_mac = json.loads(node2.in_pod(old_pod, "ip", "-j", "link", "show", "rdma0").stdout)[0]["address"]
    try:
        node1.in_pod(client, "ping", "-6", "-c", "2", "-W", "5", "-I", a0, target, timeout=60)
        assert neighbour(node1, client, "rdma0", target)["lladdr"] == old_mac
        node2.cni_ok("DEL", conf2, old_pod, "rdma0", "shared-macvlan")
        node2.delete_pod(old_pod)
        new_pod = node2.pod("b-reuse-new")
        new = node2.cni_ok("ADD", conf2, new_pod, "rdma0", "shared-macvlan")
        assert global_address(new, 0) == target, "host-local handed the released address to the new pod"
        new_mac = json.loads(node2.in_pod(new_pod, "ip", "-j", "link", "show", "rdma0").stdout)[0]["address"]
        assert new_mac != old_mac
        # Before any traffic: node 1's pod already maps the address to the new MAC (the new pod's
        # unsolicited neighbour advertisement, Override set); without it the entry would keep the
        # old MAC until it went stale and unicast probes failed (seconds of loss for RDMA and IP).
        entry = neighbour(node1, client, "rdma0", target)
        assert entry is not None and entry["lladdr"] == new_mac, f"node 1 still maps {target} to {entry}"
        first = node1.in_pod(client, "ping", "-6", "-c", "1", "-W", "2", "-I", a0, target, check=False)
        assert first.rc == 0, f"the first packet to the new pod was lost: {first.stdout} {first.stderr}"
        FACTS.append(json.dumps({"name": "reused address: node 1's entry before any traffic",
                                 "value": {"old": old_mac, "new": new_mac, "entry": entry.get("state")}}))
        node2.cni_ok("DEL", conf2, new_pod, "rdma0", "shared-macvlan")
        node2.delete_pod(new_pod)
    finally:
        node1.cni_ok("DEL", conf1, client, "rdma0", "shared-macvlan")
        node1.delete_pod(client)
        for pod in list(node2.pods):
            node2.cni_ok("DEL", conf2, pod, "rdma0", "shared-macvlan")
            node2.delete_pod(pod)
    for node in two_nodes:
        assert node.leftovers("rails-reuse") == {"sub-interfaces": [], "records": [], "leases": [], "namespaces": []}


def set_mode(node: RdmaNode, mode: str) -> None:
    deadline = time.monotonic() + 90
    while True:  # pod namespaces of earlier tests may take a moment to be dismantled (EBUSY until then)
        out = node.run(node.plugin, "mode", "set", mode, check=False)
        if out.rc == 0:
            return
        assert time.monotonic() < deadline, f"{node.node.name}: mode set {mode}: {out.stderr}"
        time.sleep(2)


def test_exclusive_pods_on_two_nodes_each_own_a_nic_and_exchange_rdma(two_nodes):
    """Exclusive mode, chained after host-device (the form Soft-RoCE allows: rxe is deleted when its
    netdev changes namespace, so the pod's RDMA device is made on the NIC once it is in the pod and
    the plugin moves that device in; a RoCE NIC's device would move with its netdev instead)."""
    for node in two_nodes:
        remove_rxe(node)
        set_mode(node, "exclusive")
    pods, confs, addresses, devices = [], [], [], []
    try:
        for node in two_nodes:
            pod = node.pod(f"x{node.index}")
            address = f"fd00:20::{node.index}"
            hostdev = {"cniVersion": "1.0.0", "name": "hostdev", "type": "host-device", "device": node.nics[0],
                       "ipam": {"type": "static", "addresses": [{"address": f"{address}/64"}]}}
            prev = node.cni_ok("ADD", hostdev, pod, "net1", "host-device", plugin="/usr/lib/cni/host-device")
            device = f"rxp{node.index}"
            node.in_pod(pod, "rdma", "link", "add", device, "type", "rxe", "netdev", "net1")
            conf = {"cniVersion": "1.1.0", "name": "rdma-excl", "type": "rdma-netns", "mode": "exclusive",
                    "stateDir": STATE_DIR, "prevResult": prev, "runtimeConfig": {"deviceID": device},
                    "pairing": False}
            result = node.cni_ok("ADD", conf, pod, "net1", "exclusive-chained")
            assert result["interfaces"][0]["pciID"] == device
            assert node.rdma_devices(pod) == [device] and device not in node.rdma_devices()
            pods.append(pod)
            confs.append((hostdev, dict(conf, prevResult=result)))
            addresses.append(address)
            devices.append(device)
        node1, node2 = two_nodes
        verdict = rc_across(node2, pods[1], addresses[1], node1, pods[0], addresses[0],
                            server_dev=devices[1], client_dev=devices[0])
        FACTS.append(json.dumps({"name": "exclusive RC across nodes", "bytes": verdict["bytes"],
                                 "device": verdict["device"], "gid_index": verdict["gid_index"]}))
        # rdma_cm: what rxe allows once its device changed namespace, with the kernel's own words
        ok, out, served = rping_try(node2, pods[1], addresses[1], node1, pods[0], addresses[0], count=3, within=40)
        refusals = [line for node in two_nodes for line in node.run("dmesg").stdout.splitlines()
                    if "Couldn't create ib_mad QP1" in line or "GSI QP exists" in line]
        FACTS.append(json.dumps({"name": "exclusive rping across nodes", "ok": ok, "client_rc": out.rc,
                                 "server_rc": served.rc, "rxe refusals": refusals[-4:]}))
        assert ok or refusals, f"rping failed without rxe's recorded refusal: {out.stdout} {out.stderr} {served.stderr}"
    finally:
        for node, pod, (hostdev, conf) in zip(two_nodes, pods, confs):
            node.cni_ok("DEL", conf, pod, "net1", "exclusive-chained")
            node.cni_ok("DEL", hostdev, pod, "net1", "host-device", plugin="/usr/lib/cni/host-device")
        for node in two_nodes:
            for pod in list(node.pods):
                node.delete_pod(pod)
            for device in node.rdma_devices():
                node.run("rdma", "link", "delete", device, check=False)
            node.run("ip", "link", "set", node.nics[0], "up", check=False)
            set_mode(node, "shared")
    for node in two_nodes:
        assert node.nics[0] in node.run("ls", "/sys/class/net").stdout.split(), "host-device gave the NIC back"
