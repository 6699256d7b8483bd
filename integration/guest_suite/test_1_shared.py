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

from integration.guest_suite.conftest import in_pod, pod_address, rc_exchange, rping, sh, timed_cni
from rdma_netns.kernel import rdma_sysfs
from rdma_netns.kernel.inet import Prefix

pytestmark = pytest.mark.guest


def shared_conf(lab, link: str, lower: str | None = None) -> dict:
    return {"cniVersion": "1.1.0", "name": f"shared-{link}", "type": "rdma-netns", "mode": "shared", "link": link,
            "stateDir": str(lab.tmp / "state"), "gidWaitMs": 5000, "pairing": False,
            "rails": [{"netdev": lower or f"v0{lab.tag}", "ifname": "rdma0", "ipam": lab.ipam("fd00:11::/64")}]}


def gid_ndevs(device: str, address: str) -> list[str]:
    """The ndevs of the RoCE v2 GID entries of `device` whose content is `address`."""
    want = rdma_sysfs.gid_text(Prefix.parse(address))
    return [g.ndev for g in rdma_sysfs.gids(rdma_sysfs.RdmaPort(device, 1), 16)
            if g.gid == want and g.gid_type == "RoCE v2"]


@pytest.mark.parametrize("link", ["macvlan", "ipvlan"])
def test_shared_mode_two_pods_gids_and_rdma_traffic(lab, link):
    """macvlan: both pods on one NIC (v0). ipvlan: each pod on its own NIC (v0, v1: the two ends
    of one cable), because ipvlans share their lower's MAC and Soft-RoCE loops back every packet
    addressed to its own MAC, so two ipvlans of one lower cannot exchange RoCE on rxe."""
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
