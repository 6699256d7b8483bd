"""Bad input and failures: a clear JSON error with the spec's code, and nothing left behind."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.netns.conftest import ip

pytestmark = pytest.mark.netns


def assert_untouched(node, pod: str) -> None:
    assert set(node.links(pod)) == {"lo"}, "the pod must be as before the failed ADD"
    assert node.allocations() == [], "no IPAM lease may survive a failed ADD"
    state = Path(node.state_dir) / "rdmanet"
    assert not state.exists() or [p for p in state.iterdir() if p.name != "released"] == []


def test_malformed_json_is_a_decode_error(node):
    pod = node.pod()
    node.cni("ADD", b"{not json", pod).error(6)
    node.cni("ADD", b"[1, 2]", pod).error(6)
    node.cni("ADD", b"\xff\xfe", pod).error(6)


@pytest.mark.parametrize("version", ["0.2.0", "9.9.9", "1.0", "", None])
def test_unsupported_cni_version(node, version):
    pod = node.pod()
    conf = node.conf()
    conf["cniVersion"] = version
    err = node.cni("ADD", conf, pod).error(1)
    assert "version" in err["msg"].lower()


def test_unknown_field_is_named(node):
    pod = node.pod()
    err = node.cni("ADD", node.conf(railz=[]), pod).error(7)
    assert "railz" in err["msg"] and "unknown field" in err["msg"]
    conf = node.conf()
    conf["rails"][0]["netdevice"] = "x"
    err = node.cni("ADD", conf, pod).error(7)
    assert "rails.0.netdevice" in err["msg"]


@pytest.mark.parametrize("bad", [
    {"mode": "turbo"},
    {"link": "bridge"},
    {"linkMode": "l2"},  # an ipvlan mode on a macvlan
    {"rails": [{"netdev": "rail0", "rdmaDevice": "mlx5_0", "ipam": {"type": "host-local"}}]},
    {"rails": [{"pciAddress": "not-a-pci", "ipam": {"type": "host-local"}}]},
    {"rails": [{"netdev": "../../etc", "ipam": {"type": "host-local"}}]},
    {"rails": [{"netdev": "rail0"}]},  # no IPAM anywhere (shared mode)
    {"rails": [{"netdev": "rail0"}], "mode": "exclusive"},  # not chained: needs IPAM too (checked at ADD)
    {"rails": []},
    {"stateDir": "relative/path"},
    {"name": "bad/name"},
])
def test_invalid_config_values(node, bad):
    pod = node.pod()
    conf = node.conf()
    conf.update(bad)
    node.cni("ADD", conf, pod).error(7)
    assert_untouched(node, pod)


@pytest.mark.parametrize("env,code", [
    ({"CNI_COMMAND": "EXPLODE"}, 4),
    ({"CNI_CONTAINERID": ""}, 4),
    ({"CNI_CONTAINERID": "../../etc/passwd"}, 4),
    ({"CNI_CONTAINERID": "-leading-dash"}, 4),
    ({"CNI_IFNAME": "this-name-is-too-long"}, 4),
    ({"CNI_IFNAME": "../x"}, 4),
    ({"CNI_IFNAME": ""}, 4),
    ({"CNI_NETNS": "relative/ns"}, 4),
    ({"CNI_NETNS": "/var/run/netns/../netns/x"}, 4),
    ({"CNI_ARGS": "IgnoreUnknown"}, 4),
])
def test_invalid_environment(node, env, code):
    pod = node.pod()
    node.cni("ADD", node.conf(), pod, extra_env=env).error(code)
    assert_untouched(node, pod)


def test_missing_netns_and_not_a_netns(node, tmp_path):
    node.cni("ADD", node.conf(), netns="/var/run/netns/does-not-exist").error(4)
    regular = tmp_path / "file"
    regular.write_text("")
    err = node.cni("ADD", node.conf(), netns=str(regular)).error(4)
    assert "not a network namespace" in err["msg"]
    assert node.allocations() == []


def test_host_namespace_as_pod_is_refused(node):
    err = node.cni("ADD", node.conf(), netns=f"/var/run/netns/{node.name}").error(4)
    assert "host" in err["msg"]
    assert node.allocations() == []


def test_missing_and_down_rail(node):
    pod = node.pod()
    conf = node.conf()
    conf["rails"][0]["netdev"] = "nosuchdev"
    err = node.cni("ADD", conf, pod).error(101)
    assert "nosuchdev" in err["msg"]
    ip("-n", node.name, "link", "set", "rail0", "down")
    err = node.cni("ADD", node.conf(), pod).error(101)
    assert "down" in err["msg"]
    assert_untouched(node, pod)


def test_ifname_already_in_the_pod_rolls_back(node):
    pod = node.pod()
    ip("-n", pod, "link", "add", "net1", "type", "veth", "peer", "name", "other")
    err = node.cni("ADD", node.conf(), pod).error(102)
    assert "net1" in err["msg"]
    assert node.links(pod)["net1"]["linkinfo"]["info_kind"] == "veth", "the pod's own interface is untouched"
    assert node.allocations() == []


def test_failure_on_the_second_rail_rolls_back_the_first(node):
    pod = node.pod()
    conf = node.conf(rails=2)
    ip("-n", pod, "link", "add", "rdma1", "type", "veth", "peer", "name", "other")  # rail 1 cannot be created
    node.cni("ADD", conf, pod).error(102)
    assert set(node.links(pod)) == {"lo", "rdma1", "other"}, "rail 0's macvlan was removed again"
    assert [r for r in json.loads(ip("-j", "-6", "-n", pod, "rule").stdout) if r.get("src", "all") != "all"] == []
    assert node.allocations() == []


def test_ipam_exhausted_rolls_back(node):
    pod_a, pod_b = node.pod(), node.pod()
    conf = node.conf(rails=2)
    conf["rails"][1]["ipam"] = node.ipam("fd00:2::/64", rangeStart="fd00:2::10", rangeEnd="fd00:2::10")
    node.cni("ADD", conf, pod_a, container_id="a").ok()
    err = node.cni("ADD", conf, pod_b, container_id="b").error(105)
    assert "fd00:2" in err["msg"] or "no IP" in err["msg"] or "addresses" in err["msg"]
    assert set(node.links(pod_b)) == {"lo"}
    assert len(node.allocations()) == 2, "only pod a's two leases remain"


def test_ipam_plugin_missing(node, tmp_path):
    pod = node.pod()
    conf = node.conf()
    conf["rails"][0]["ipam"]["type"] = "no-such-ipam"
    err = node.cni("ADD", conf, pod).error(105)
    assert "not found" in err["msg"]
    assert_untouched(node, pod)


def test_ipam_type_cannot_escape_cni_path(node):
    pod = node.pod()
    conf = node.conf()
    conf["rails"][0]["ipam"]["type"] = "../../bin/sh"
    node.cni("ADD", conf, pod).error(7)


def test_require_rdma_on_a_kernel_without_rdma(node):
    if os.path.isdir("/sys/class/infiniband"):
        pytest.skip("this kernel has an RDMA subsystem")
    pod = node.pod()
    err = node.cni("ADD", node.conf(requireRdma=True), pod).error(104)
    assert "RDMA" in err["msg"]
    assert_untouched(node, pod)


def test_add_twice_is_refused_and_keeps_the_first(node):
    pod = node.pod()
    node.cni("ADD", node.conf(), pod).ok()
    node.cni("ADD", node.conf(), pod).error(102)
    node.cni("CHECK", node.conf(), pod).ok()


def test_runtime_config_checked(node):
    pod = node.pod()
    node.cni("ADD", node.conf(runtimeConfig={"mac": "zz:zz"}), pod).error(7)
    node.cni("ADD", node.conf(runtimeConfig={"deviceID": "../../x"}), pod).error(7)
    node.cni("ADD", node.conf(runtimeConfig={"deviceID": "0000:99:00.0"}), pod).error(101)
    node.cni("ADD", node.conf(runtimeConfig={"ips": ["not-an-ip"]}), pod).error(7)
    node.cni("ADD", node.conf(runtimeConfig="x"), pod).error(7)
    assert_untouched(node, pod)


def test_interrupted_add_is_cleaned_by_the_next_add(node):
    """State written before the first change lets a later ADD undo a crashed one."""
    pod = node.pod()
    node.cni("ADD", node.conf(), pod).ok()
    state_file = next((Path(node.state_dir) / "rdmanet").iterdir())
    state = json.loads(state_file.read_text())
    state["phase"] = "adding"  # as if the plugin had been killed before it finished
    state_file.write_text(json.dumps(state))
    result = node.cni("ADD", node.conf(), pod).ok()
    assert len(node.allocations()) == 1
    assert node.links(pod)["net1"]["address"] == result["interfaces"][0]["mac"]
