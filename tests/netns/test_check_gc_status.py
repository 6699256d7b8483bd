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


FAKE_IPAM_11 = r'''#!/usr/bin/env python3
# A spec-1.1 IPAM stand-in: leases fd00:1::<n> from a counter, records STATUS and GC calls.
import json, os, sys
log = os.environ["FAKE_IPAM_LOG"]
conf = json.load(sys.stdin)
cmd = os.environ["CNI_COMMAND"]
with open(log, "a") as f:
    f.write(json.dumps({"cmd": cmd, "ifname": os.environ.get("CNI_IFNAME"), "conf": conf}) + "\n")
if cmd == "VERSION":
    print(json.dumps({"cniVersion": "1.1.0", "supportedVersions": ["1.0.0", "1.1.0"]}))
elif cmd == "ADD":
    n = sum(1 for _ in open(log))
    print(json.dumps({"cniVersion": conf["cniVersion"], "ips": [{"address": f"fd00:1::{n:x}/64"}]}))
elif cmd == "STATUS" and os.path.exists(log + ".broken"):
    print(json.dumps({"cniVersion": "1.1.0", "code": 50, "msg": "address pool unreachable"}))
    sys.exit(1)
'''


@pytest.fixture
def fake_ipam(tmp_path):
    folder = tmp_path / "cni-bin"
    folder.mkdir()
    plugin = folder / "fake-ipam"
    plugin.write_text(FAKE_IPAM_11)
    plugin.chmod(0o755)
    log = tmp_path / "ipam.log"
    return folder, log


def ipam_calls(log, cmd):
    import json
    return [json.loads(line) for line in log.read_text().splitlines() if json.loads(line)["cmd"] == cmd]


def test_status_and_gc_reach_a_1_1_ipam(node, fake_ipam):
    folder, log = fake_ipam
    conf = node.conf(rails=2)
    for rail in conf["rails"]:
        rail["ipam"] = {"type": "fake-ipam"}
    env = {"FAKE_IPAM_LOG": str(log)}
    path = f"{folder}:/usr/lib/cni"
    node.cni("STATUS", conf, cni_path=path, extra_env=env).ok()
    assert len(ipam_calls(log, "STATUS")) == 1, "one STATUS per distinct IPAM config"
    (log.parent / (log.name + ".broken")).write_text("")
    err = node.cni("STATUS", conf, cni_path=path, extra_env=env).error(50)
    assert "address pool unreachable" in err["msg"]

    keep, gone = node.pod(), node.pod()
    node.cni("ADD", conf, keep, container_id="keep", cni_path=path, extra_env=env).ok()
    node.cni("ADD", conf, gone, container_id="gone", cni_path=path, extra_env=env).ok()
    gc = dict(conf, **{"cni.dev/valid-attachments": [{"containerID": "keep", "ifname": "rdma0"}]})
    node.cni("GC", gc, cni_path=path, extra_env=env).ok()
    dels = ipam_calls(log, "DEL")
    assert sorted(d["ifname"] for d in dels) == ["rdma0", "rdma1"], "the stale pod's two rails were released"
    (call,) = ipam_calls(log, "GC")
    assert call["conf"]["cniVersion"] == "1.1.0"
    assert sorted(a["ifname"] for a in call["conf"]["cni.dev/valid-attachments"]) == ["rdma0", "rdma1"]
    assert {a["containerID"] for a in call["conf"]["cni.dev/valid-attachments"]} == {"keep"}
