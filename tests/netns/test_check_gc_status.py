"""CHECK finds real differences, GC releases what the runtime no longer lists, STATUS tells the truth."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.netns.conftest import ip

pytestmark = pytest.mark.netns


def added(node, rails: int = 1, **kw):
    pod = node.pod()
    conf = node.conf(rails=rails, **kw)
    result = node.cni("ADD", conf, pod).ok()
    return pod, conf, result


def test_check_passes_on_a_fresh_attachment_with_prev_result(node):
    pod, conf, result = added(node, rails=2)
    node.cni("CHECK", dict(conf, prevResult=result), pod).ok()


@pytest.mark.parametrize("damage,what", [
    (lambda pod, ifname, addr: ip("-n", pod, "link", "set", ifname, "down"), "down"),
    (lambda pod, ifname, addr: ip("-n", pod, "addr", "del", addr, "dev", ifname), "address"),
    (lambda pod, ifname, addr: ip("-n", pod, "-6", "rule", "del", "from", addr.split("/")[0]), "rule"),
    (lambda pod, ifname, addr: ip("-n", pod, "link", "del", ifname), "no interface"),
    (lambda pod, ifname, addr: ip("-n", pod, "-6", "route", "flush", "table", "all", "dev", ifname), "route"),
])
def test_check_notices_damage(node, damage, what):
    pod, conf, result = added(node)
    damage(pod, "net1", result["ips"][0]["address"])
    err = node.cni("CHECK", conf, pod).error(106)
    assert what in err["msg"], err


def test_check_prev_result_must_list_our_interface(node):
    pod, conf, result = added(node)
    result["interfaces"] = []
    node.cni("CHECK", dict(conf, prevResult=result), pod).error(106)


def test_check_rules(node):
    pod, conf, _ = added(node)
    node.cni("CHECK", node.conf(version="0.3.1"), pod).error(1)
    node.cni("CHECK", conf, pod, container_id="unknown").error(3)


def test_gc_releases_only_stale_attachments(node):
    conf = node.conf()
    keep_pod, gone_pod = node.pod(), node.pod()
    node.cni("ADD", conf, keep_pod, container_id="keep").ok()
    node.cni("ADD", conf, gone_pod, container_id="gone").ok()
    assert len(node.allocations()) == 2
    gc_conf = dict(conf, **{"cni.dev/valid-attachments": [{"containerID": "keep", "ifname": "net1"}]})
    node.cni("GC", gc_conf).ok()
    assert "net1" not in node.links(gone_pod)
    assert len(node.allocations()) == 1
    assert [p.name for p in (Path(node.state_dir) / "rdmanet").iterdir()] == ["keep:net1.json"]
    node.cni("CHECK", conf, keep_pod, container_id="keep").ok()


def test_gc_of_an_attachment_whose_netns_is_gone_and_older_key(node):
    conf = node.conf()
    pod = node.pod()
    node.cni("ADD", conf, pod, container_id="old").ok()
    ip("netns", "del", pod)
    node.cni("GC", dict(conf, **{"cni.dev/attachments": []})).ok()
    assert node.allocations() == []


def test_gc_needs_the_list_and_version_1_1(node):
    node.cni("GC", node.conf()).error(7)
    node.cni("GC", node.conf(version="1.0.0", **{"cni.dev/valid-attachments": []})).error(1)


def test_status(node):
    ok = node.cni("STATUS", node.conf(rails=2))
    assert ok.code == 0 and ok.stdout == ""
    ip("-n", node.name, "link", "set", "rail1", "down")
    err = node.cni("STATUS", node.conf(rails=2)).error(50)
    assert "rail1" in err["msg"]
    conf = node.conf()
    conf["rails"][0]["ipam"]["type"] = "missing-ipam"
    node.cni("STATUS", conf).error(50)
    node.cni("STATUS", node.conf(version="1.0.0")).error(1)


def test_version(node):
    result = node.cni("VERSION", {"cniVersion": "1.1.0"}).ok()
    assert result["supportedVersions"] == ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]
