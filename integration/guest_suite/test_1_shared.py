"""Shared RDMA mode on a real kernel: the plugin's rails get RoCE v2 GIDs and carry RDMA traffic.

Layout (see shared/real-rdma-kernel.md): rxe0 on the rail netdev v0 in the host is the node's
"RDMA NIC"; the plugin puts a macvlan/ipvlan of v0 in each pod and checks that the kernel gave
each pod address a RoCE v2 GID on rxe0. Soft-RoCE cannot receive through an upper device of
its netdev (real NICs can), so the traffic runs over an rxe created on each pod's own
interface, from inside the pod.
"""

from __future__ import annotations

import json

import pytest

from integration.guest_suite.conftest import (cluster_network, fresh_neighbours, in_pod, neighbour_state, pod_address,
                                              rc_exchange, rc_try, rping, sh, timed_cni)
from rdma_netns.kernel import rdma_sysfs
from rdma_netns.kernel.inet import Prefix

pytestmark = pytest.mark.guest


def shared_conf(lab, link: str, lower: str | None = None, **keys) -> dict:
    return {"cniVersion": "1.1.0", "name": f"shared-{link}", "type": "rdma-netns", "mode": "shared", "link": link,
            "stateDir": str(lab.tmp / "state"), "gidWaitMs": 5000, "pairing": False,
            "rails": [{"netdev": lower or f"v0{lab.tag}", "ifname": "rdma0", "ipam": lab.ipam("fd00:11::/64")}],
            **keys}


def gid_ndevs(device: str, address: str) -> list[str]:
    """The ndevs of the RoCE v2 GID entries of `device` whose content is `address`."""
    want = rdma_sysfs.gid_text(Prefix.parse(address))
    return [g.ndev for g in rdma_sysfs.gids(rdma_sysfs.RdmaPort(device, 1), 16)
            if g.gid == want and g.gid_type == "RoCE v2"]


@pytest.mark.parametrize("link", ["macvlan", "ipvlan"])
def test_shared_mode_two_pods_gids_and_rdma_traffic(lab, link):
    """macvlan: both pods on one NIC (v0). ipvlan: each pod on its own NIC (v0, v1: the two ends
    of one cable), because ipvlans share their lower's MAC and Soft-RoCE loops back every packet
    addressed to its own MAC, so two ipvlans of one lower cannot exchange RoCE on rxe.
    The QP data goes over TCP on the rail, which resolves the peers' MACs before the QP does:
    test_rc_with_no_traffic_on_the_rail_first is the case a job meets."""
    lab.veth(f"v0{lab.tag}", f"v1{lab.tag}")
    lowers = [f"v0{lab.tag}", f"v0{lab.tag}"] if link == "macvlan" else [f"v0{lab.tag}", f"v1{lab.tag}"]
    devices = {lower: f"rxe{lab.tag}{lower[1]}" for lower in lowers}
    for lower, device in devices.items():
        lab.rxe_on(device, lower)
    confs = [shared_conf(lab, link, lower) for lower in lowers]
    pods = [lab.pod(), lab.pod()]
    results = [timed_cni(f"shared-{link}", "ADD", conf, container_id=p, netns=f"/var/run/netns/{p}",
                         ifname="rdma0").ok() for p, conf in zip(pods, confs)]
    addresses = [pod_address(r) for r in results]
    for result, address, lower in zip(results, addresses, lowers):
        device = devices[lower]
        assert result["interfaces"][0]["pciID"] == device, "the result names the rail's RDMA device"
        # The kernel made the pod's address a RoCE v2 GID of the node's device, with the pod's
        # interface as its ndev, although that interface lives in another namespace.
        assert gid_ndevs(device, address) == ["rdma0"], address
    for pod, conf in zip(pods, confs):
        timed_cni(f"shared-{link}", "CHECK", conf, container_id=pod, netns=f"/var/run/netns/{pod}",
                  ifname="rdma0").ok()

    # The traffic path Soft-RoCE can carry: an rxe on each pod's own interface. The node's rxe
    # goes first, so that rdma_cm (which picks the device by the GID of the source address)
    # cannot choose it: Soft-RoCE on a lower device does not receive what arrives on its upper
    # devices (real NICs do).
    for device in devices.values():
        lab.rxe.remove(device)
        sh("rdma", "link", "delete", device)
    for i, pod in enumerate(pods):
        lab.rxe_on(f"rxp{lab.tag}{i}", "rdma0", pod=pod)
    verdict = rc_exchange(pods[0], addresses[0], pods[1], addresses[1],
                          server_dev=f"rxp{lab.tag}0", client_dev=f"rxp{lab.tag}1")
    assert verdict["bytes"] > 0
    rping(pods[0], addresses[0], pods[1], addresses[1])

    for i, (pod, conf) in enumerate(zip(pods, confs)):
        in_pod(pod, "rdma", "link", "delete", f"rxp{lab.tag}{i}")
        lab.rxe.remove(f"rxp{lab.tag}{i}")
        timed_cni(f"shared-{link}", "DEL", conf, container_id=pod, netns=f"/var/run/netns/{pod}",
                  ifname="rdma0").ok()
        assert set(lab_links(pod)) == {"lo"}


def test_del_removes_the_pods_gid(lab):
    lab.veth(f"v0{lab.tag}", f"v1{lab.tag}")
    device = f"rxe{lab.tag}"
    lab.rxe_on(device, f"v0{lab.tag}")
    conf = shared_conf(lab, "macvlan")
    pod = lab.pod()
    address = pod_address(timed_cni("shared-gid", "ADD", conf, container_id=pod, netns=f"/var/run/netns/{pod}",
                                     ifname="rdma0").ok())
    assert gid_ndevs(device, address) == ["rdma0"]
    timed_cni("shared-gid", "DEL", conf, container_id=pod, netns=f"/var/run/netns/{pod}", ifname="rdma0").ok()
    assert gid_ndevs(device, address) == []


def lab_links(pod: str) -> list[str]:
    return [link["ifname"] for link in json.loads(in_pod(pod, "ip", "-j", "link").stdout)]


def test_shared_mode_refuses_a_rail_without_rdma_device(lab):
    lab.veth(f"v0{lab.tag}", f"v1{lab.tag}")  # no rxe on it
    pod = lab.pod()
    err = timed_cni("shared-norxe", "ADD", shared_conf(lab, "macvlan"), container_id=pod,
                    netns=f"/var/run/netns/{pod}", ifname="rdma0").error(104)
    assert f"v0{lab.tag}" in err["msg"]


def wired_pods(lab, **keys) -> tuple[list[str], list[str], list[dict]]:
    """Two pods on one NIC (macvlan) wired by the plugin, each then given an rxe on its own rail
    interface (the path Soft-RoCE can carry, as above): (pods, their rail addresses, configs)."""
    lab.veth(f"v0{lab.tag}", f"v1{lab.tag}")
    node_device = f"rxe{lab.tag}0"
    lab.rxe_on(node_device, f"v0{lab.tag}")
    conf = shared_conf(lab, "macvlan", **keys)
    pods = [lab.pod(), lab.pod()]
    addresses = [pod_address(timed_cni("shared-macvlan", "ADD", conf, container_id=p, netns=f"/var/run/netns/{p}",
                                       ifname="rdma0").ok()) for p in pods]
    lab.rxe.remove(node_device)
    sh("rdma", "link", "delete", node_device)
    for i, pod in enumerate(pods):
        lab.rxe_on(f"rxp{lab.tag}{i}", "rdma0", pod=pod)
    return pods, addresses, [conf, conf]


def rail_state(pod: str) -> str:
    """The pod's rail addresses and IPv6 neighbours, for failure messages."""
    return " ".join(in_pod(pod, *cmd).stdout.strip().replace("\n", "; ") for cmd in (
        ("ip", "-6", "-br", "addr", "show", "dev", "rdma0"), ("ip", "-6", "neigh", "show", "dev", "rdma0"),
        ("ip", "-br", "link", "show", "dev", "rdma0")))


def link_locals(pod: str) -> list[dict]:
    out = json.loads(in_pod(pod, "ip", "-j", "-6", "addr", "show", "dev", "rdma0").stdout)
    return [a for a in out[0]["addr_info"] if a.get("scope") == "link"] if out else []


def test_rc_with_no_traffic_on_the_rail_first(lab):
    """As a job connects: QP data over eth0 (IPv4), no packet on the rail before, neighbour tables
    empty. Moving the QP to RTR resolves the peer's MAC by itself, with a neighbour solicitation
    from the rail's link-local address, which the plugin keeps (and out of DAD) by default."""
    pods, addresses, _confs = wired_pods(lab)
    for pod in pods:
        lls = link_locals(pod)
        assert lls and not any(ll.get("tentative") for ll in lls), \
            f"a link-local address that can source a solicitation at once: {lls} {rail_state(pod)}"
    oob = cluster_network(pods)
    for pod in pods:
        fresh_neighbours(pod, "rdma0")
    assert neighbour_state(pods[0], "rdma0", addresses[1]) == []
    ok, client, server = rc_try(pods[0], addresses[0], pods[1], addresses[1],
                                server_dev=f"rxp{lab.tag}0", client_dev=f"rxp{lab.tag}1", oob=oob)
    assert ok, f"client {client} | server {server} | {rail_state(pods[0])} | {rail_state(pods[1])}"
    assert server["bytes"] > 0
    assert neighbour_state(pods[0], "rdma0", addresses[1]), "the QP resolved its peer on the rail"


def test_without_link_local_only_a_peer_other_traffic_resolved_connects(lab):
    """With "linkLocal": false, the same two pods and the same QP: RTR fails (the kernel sends no
    solicitation without a link-local source) and the peer's neighbour entry stays unresolved.
    Then, apart, the rail-traffic-first case: the QP data over TCP on the rail resolves both ends
    (and TCP keeps confirming them) and the same QP connects, which is how a test that talks over
    the rail first hides the bug. A ping alone hides it only for seconds: the first time the entry
    needs confirming (NUD_PROBE) the kernel again has no source to solicit from, and it fails."""
    pods, addresses, _confs = wired_pods(lab, linkLocal=False)
    assert [link_locals(pod) for pod in pods] == [[], []]
    oob = cluster_network(pods)
    for pod in pods:
        fresh_neighbours(pod, "rdma0")
    devices = {"server_dev": f"rxp{lab.tag}0", "client_dev": f"rxp{lab.tag}1"}
    ok, client, server = rc_try(pods[0], addresses[0], pods[1], addresses[1], oob=oob, **devices)
    assert not ok, f"connected without a link-local address: {server}"
    assert "RTR" in server.get("error", ""), f"the server's QP should fail at RTR: {server} | {client}"
    assert "REACHABLE" not in neighbour_state(pods[0], "rdma0", addresses[1]), rail_state(pods[0])

    ok, client, server = rc_try(pods[0], addresses[0], pods[1], addresses[1], **devices)
    assert ok, f"client {client} | server {server} | {rail_state(pods[0])} | {rail_state(pods[1])}"
