"""Exclusive mode's netdev half, on this kernel: the rail's netdev itself moves into the pod
(renamed), gets the pod's addresses, and goes back under its own name on DEL.

These machines have no RDMA subsystem, so requireRdma is off and no RDMA device moves; the
real-kernel suite (integration/) covers the RDMA device moves with Soft-RoCE.
"""

from __future__ import annotations


import pytest

from tests.netns.conftest import ip, ipj

pytestmark = pytest.mark.netns


def host_link(node, name: str) -> dict | None:
    return next((lk for lk in ipj("-n", node.name, "link") if lk["ifname"] == name), None)


def exclusive(node, rails: int = 1, **kw) -> dict:
    return node.conf(rails=rails, mode="exclusive", **kw)


def test_add_moves_the_netdev_in_and_del_brings_it_back(node):
    pod = node.pod()
    before = host_link(node, "rail0")
    result = node.cni("ADD", exclusive(node), pod).ok()
    assert host_link(node, "rail0") is None, "the NIC left the host"
    link = node.links(pod)["net1"]
    assert link["address"] == before["address"] == result["interfaces"][0]["mac"]
    assert "UP" in link["flags"]
    (addr,) = node.addresses(pod, "net1")
    assert not addr.get("tentative")
    node.cni("CHECK", exclusive(node), pod).ok()

    node.cni("DEL", exclusive(node), pod).ok()
    after = host_link(node, "rail0")
    assert after is not None and after["address"] == before["address"]
    assert "UP" in after["flags"], "its admin state is restored"
    assert set(node.links(pod)) == {"lo"}
    assert node.allocations() == []
    node.cni("DEL", exclusive(node), pod).ok()


def test_a_down_nic_may_be_given_and_comes_back_down(node):
    pod = node.pod()
    ip("-n", node.name, "link", "set", "rail0", "down")
    node.cni("ADD", exclusive(node), pod).ok()
    node.cni("DEL", exclusive(node), pod).ok()
    assert "UP" not in host_link(node, "rail0")["flags"]


def test_failure_on_a_later_rail_moves_the_first_back(node):
    pod = node.pod()
    ip("-n", pod, "link", "add", "rdma1", "type", "veth", "peer", "name", "other")
    node.cni("ADD", exclusive(node, rails=2), pod).error(102)
    assert host_link(node, "rail0") is not None and host_link(node, "rail1") is not None
    assert set(node.links(pod)) == {"lo", "rdma1", "other"}
    assert node.allocations() == []


def test_host_name_taken_meanwhile(node):
    pod = node.pod()
    mac = host_link(node, "rail0")["address"]
    node.cni("ADD", exclusive(node), pod).ok()
    ip("-n", node.name, "link", "add", "rail0", "type", "veth", "peer", "name", "squatter")
    result = node.cni("DEL", exclusive(node), pod)
    result.ok()
    back = [lk for lk in ipj("-n", node.name, "link") if lk.get("address") == mac]
    assert len(back) == 1, "the NIC is home, under another name, and DEL says which"
    assert f"came back as {back[0]['ifname']}" in result.stderr


def test_del_after_the_pod_namespace_died(node):
    """A veth is destroyed with the namespace (a physical NIC would come back: real-kernel suite)."""
    pod = node.pod()
    node.cni("ADD", exclusive(node), pod).ok()
    ip("netns", "del", pod)
    result = node.cni("DEL", exclusive(node), pod)
    result.ok()
    assert "not back in the host" in result.stderr
    assert node.allocations() == []
    assert node.attachment_records() == []


def test_chained_exclusive_needs_the_previous_interface_and_an_rdma_device(node):
    pod = node.pod()
    prev = {"cniVersion": "1.0.0", "interfaces": [{"name": "other", "sandbox": node.netns_path(pod)}], "ips": []}
    rdma_only = exclusive(node, prevResult=prev)  # no IPAM: the previous plugin moved the netdev
    for rail in rdma_only["rails"]:
        del rail["ipam"]
    node.cni("ADD", rdma_only, pod).error(7)
    prev["interfaces"][0]["name"] = "net1"
    err = node.cni("ADD", dict(rdma_only, prevResult=prev, runtimeConfig={"deviceID": "mlx5_9"}), pod).error(101)
    assert "mlx5_9" in err["msg"]
    assert node.attachment_records() == []
