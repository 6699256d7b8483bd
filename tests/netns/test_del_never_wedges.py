"""Issue 16, point 1: DEL succeeds from the attachment's own state whatever else is wrong.

A failed DEL wedges the pod under containerd 1.6 (sandbox UNKNOWN, the primary plugin's DEL
never runs), so a config the plugin would refuse on ADD, a gone netns or gone rails must not
stop teardown. Only what is unsafe is refused, with a message saying so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.netns.conftest import ip, ipj

pytestmark = pytest.mark.netns


def refused_variants(conf: dict) -> dict[str, dict]:
    """Configs this version refuses on ADD: a newer version's key, values out of range."""
    return {
        "unknown-key": dict(conf, newKey=1),
        "out-of-range": dict(conf, routeTableBase=0, gidWaitMs=-5),
        "bad-mode": dict(conf, mode="turbo"),
        "bad-rails": dict(conf, rails=[{"netdev": "rail0", "rdmaDevice": "x"}]),
    }


def added(node, conf: dict | None = None) -> tuple[str, dict]:
    pod = node.pod()
    conf = conf or node.conf()
    node.cni("ADD", conf, pod).ok()
    assert node.links(pod).get("net1") and node.allocations() and node.attachment_records()
    return pod, conf


def pod_rules(pod: str) -> list[dict]:
    return [r for r in ipj("-6", "-n", pod, "rule") if r.get("src", "all") != "all"]


def assert_gone(node, pod: str | None) -> None:
    assert node.allocations() == [], "a lease leaked"
    assert node.attachment_records() == [], "the state stayed"
    if pod is not None:
        assert "net1" not in node.links(pod)
        assert pod_rules(pod) == []


@pytest.mark.parametrize("variant", ["unknown-key", "out-of-range", "bad-mode", "bad-rails"])
def test_del_with_a_refused_config_tears_down_from_state(node, variant):
    pod, conf = added(node)
    bad = refused_variants(conf)[variant]
    node.cni("ADD", bad, node.pod(), container_id="other").error(7)  # ADD keeps refusing it
    check = node.cni("CHECK", bad, pod).error(7)
    assert "invalid network config" in check["msg"]

    result = node.cni("DEL", bad, pod)
    result.ok()
    assert "would refuse" in result.stderr and "from the attachment's state" in result.stderr
    assert_gone(node, pod)
    # The repeats containerd sends (no netns) take the released/ fast path, with the same config.
    node.cni("DEL", bad, netns="").ok()
    node.cni("DEL", bad, pod).ok()
    assert (Path(node.state_dir) / "rdmanet" / "released" / "c1:net1").exists()


def test_del_with_a_different_valid_mode_and_routing_uses_what_add_recorded(node):
    pod, conf = added(node)
    state = json.loads((Path(node.state_dir) / "rdmanet" / "c1:net1.json").read_text())
    assert state["format"] == 2
    assert state["teardown"]["routeTableBase"] == 100 and state["teardown"]["rulePriorityBase"] == 1000
    assert pod_rules(pod), "ADD made no source rule"
    changed = dict(conf, mode="exclusive", routeTableBase=5000, rulePriorityBase=2000, link="ipvlan")
    node.cni("DEL", changed, pod).ok()
    assert_gone(node, pod)


def test_del_with_a_refused_config_when_netns_and_rails_are_gone(node):
    pod, conf = added(node)
    ip("netns", "del", pod)
    node.pods.remove(pod)
    ip("-n", node.name, "link", "del", "rail0")
    node.cni("DEL", dict(conf, newKey={"x": 1}), netns=f"/var/run/netns/{pod}").ok()
    assert_gone(node, None)


def test_del_with_an_emptied_netns_mount_point_is_a_gone_netns(node, tmp_path):
    """containerd unmounts the netns before removing its file: an empty file means gone."""
    pod, conf = added(node)
    empty = tmp_path / "cni-unmounted"
    empty.write_bytes(b"")
    node.cni("DEL", dict(conf, newKey=1), netns=str(empty)).ok()
    assert node.allocations() == [] and node.attachment_records() == []


@pytest.mark.parametrize("kind", ["directory", "file-with-content", "mount-namespace"])
def test_del_refuses_a_path_that_is_not_a_netns(node, tmp_path, kind):
    pod, conf = added(node)
    path = {"directory": tmp_path, "mount-namespace": Path("/proc/self/ns/mnt")}.get(kind)
    if path is None:
        path = tmp_path / "file"
        path.write_text("not a namespace")
    err = node.cni("DEL", dict(conf, newKey=1), netns=str(path)).error(4)
    assert "not a network namespace" in err["msg"]
    assert node.attachment_records() and node.allocations(), "a refused DEL changed something"
    node.cni("DEL", conf, pod).ok()
    assert_gone(node, pod)


def test_del_refuses_the_plugins_own_netns(node):
    pod, conf = added(node)
    err = node.cni("DEL", dict(conf, newKey=1), netns=f"/var/run/netns/{node.name}").error(4)
    assert "own (host) namespace" in err["msg"]
    node.cni("DEL", conf, pod).ok()


@pytest.mark.parametrize("name,state_dir", [("../etc", None), ("", None), (None, "relative/state"),
                                            (None, "/tmp/../etc")])
def test_del_refuses_a_config_that_would_leave_the_state_folder(node, name, state_dir):
    pod, conf = added(node)
    bad = dict(conf, newKey=1)
    if name is not None:
        bad["name"] = name
    if state_dir is not None:
        bad["stateDir"] = state_dir
    err = node.cni("DEL", bad, pod).error(7)
    assert "DEL cannot find this network's state" in err["msg"]
    node.cni("DEL", conf, pod).ok()
    assert_gone(node, pod)


def test_del_with_a_refused_config_and_no_state_succeeds(node):
    """containerd's rollback DEL after an ADD it refused: nothing was taken, nothing to do."""
    pod = node.pod()
    bad = dict(node.conf(), newKey=1)
    node.cni("ADD", bad, pod).error(7)
    result = node.cni("DEL", bad, pod)
    result.ok()
    assert "no state" in result.stderr
    node.cni("DEL", bad, netns="").ok()


def test_del_of_a_format_1_state_uses_the_config_and_defaults(node):
    """States written by 0.1.0 record no teardown settings."""
    pod, conf = added(node)
    path = Path(node.state_dir) / "rdmanet" / "c1:net1.json"
    state = json.loads(path.read_text())
    del state["teardown"]
    state["format"] = 1
    path.write_text(json.dumps(state))
    node.cni("DEL", dict(conf, newKey=1), pod).ok()
    assert_gone(node, pod)


def test_del_of_a_newer_state_with_unknown_fields(node):
    """A state written by a later version (format 3, fields this one does not know)."""
    pod, conf = added(node, node.conf(routeTableBase=300, rulePriorityBase=3000))
    path = Path(node.state_dir) / "rdmanet" / "c1:net1.json"
    state = json.loads(path.read_text())
    state["format"] = 3
    state["futureField"] = {"a": [1, 2]}
    state["teardown"]["futureKnob"] = "x"
    state["rails"][0]["futureRailField"] = True
    path.write_text(json.dumps(state))
    assert {r["priority"] for r in pod_rules(pod)} == {3000}
    node.cni("DEL", node.conf(), pod).ok()  # today's config says 100/1000: the state's 300/3000 win
    assert_gone(node, pod)


def test_del_ignores_a_bad_cni_args_mac(node):
    pod, conf = added(node)
    node.cni("DEL", conf, pod, extra_env={"CNI_ARGS": "IgnoreUnknown=1;MAC=zz"}).ok()
    assert_gone(node, pod)


def test_del_when_the_recorded_netns_path_is_no_longer_a_netns(node, tmp_path):
    """The state's path was a netns at ADD; whatever is there now, the pod's namespace is gone:
    DEL (with an empty CNI_NETNS, as on RemovePodSandbox) still releases everything."""
    pod, conf = added(node)
    path = Path(node.state_dir) / "rdmanet" / "c1:net1.json"
    state = json.loads(path.read_text())
    reused = tmp_path / "reused"
    reused.write_text("something else now")
    state["netns"] = str(reused)
    path.write_text(json.dumps(state))
    node.cni("DEL", dict(conf, newKey=1), netns="").ok()
    assert node.allocations() == [] and node.attachment_records() == []


def test_a_state_of_an_unknown_major_format_is_not_checked_but_deleted(node):
    """Issue 15: STATE_FORMAT is checked on read. A record of another major (an incompatible
    writer) is refused by CHECK with a clear error; DEL still undoes what the fields it knows say."""
    pod, conf = added(node)
    path = Path(node.state_dir) / "rdmanet" / "c1:net1.json"
    state = json.loads(path.read_text())
    state["formatMajor"] = 2
    state["format"] = 1
    path.write_text(json.dumps(state))
    err = node.cni("CHECK", conf, pod).error(1)
    assert "format major 2" in err["msg"] and "DEL still works" in err["details"]
    result = node.cni("DEL", conf, pod)
    result.ok()
    assert "format major 2" in result.stderr
    assert_gone(node, pod)
