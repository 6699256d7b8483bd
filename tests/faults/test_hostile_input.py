"""Hostile input: property tests (hypothesis, bounded) over the CNI stdin JSON, CNI_ARGS and the
CNI_* environment, and targeted attacks (path traversal, host interface names, namespaces that
are not namespaces, symlinks in the state folder, deviceIDs of NICs that are not rails or that
are in another pod).

The invariant everywhere: stdout is exactly one JSON object (a result, or an error with a
documented code: never 999, never a traceback), the plugin exits within a time limit, and after
an error the node and the pod are exactly as before (helpers.snapshot). An ADD that succeeds
must be undone exactly by its DEL.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.hypothesis_profiles import examples

from tests.conftest import plugin_path
from tests.faults.helpers import assert_json_answer, assert_same, rail_links, snapshot, state_files, write_script
from tests.netns.conftest import Node, _need_root, ip, ipj

pytestmark = pytest.mark.netns

TIME_LIMIT = 15  # seconds for one invocation (a warm one takes ~40 ms)
PROPERTY = settings(max_examples=examples(60), deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def hnode(tmp_path_factory):
    """One node for all property examples (each example leaves it as it found it)."""
    _need_root()
    base = tmp_path_factory.mktemp("hostile")
    n = Node(base)
    n.pod_name = n.pod()
    n.base = base
    (base / "regular").write_text("not a namespace")
    (base / "dir").mkdir()
    os.symlink(Node.netns_path(n.pod_name), base / "link-to-pod")
    os.symlink(Node.netns_path(n.name), base / "link-to-node")
    os.symlink(base / "missing", base / "dangling")
    n.cni("VERSION", n.conf(rails=2)).ok()
    try:
        yield n
    finally:
        n.close()


def exercise(node, command: str, conf, *, env: dict | None = None, container_id: str = "c1",
             ifname: str = "net1", netns: str | None = None) -> None:
    """Run one invocation and check the invariant; undo a successful ADD with its DEL."""
    pod = node.pod_name
    before = snapshot(node, [pod])
    path = Node.netns_path(pod) if netns is None else netns
    result = node.cni(command, conf, netns=path, container_id=container_id, ifname=ifname, extra_env=env,
                      timeout=TIME_LIMIT)
    assert_json_answer(result)
    if result.code != 0:
        assert_same(node, before, [pod], timeout=0.2)
        return
    if command == "ADD":
        undo = node.cni("DEL", conf, netns=path, container_id=container_id, ifname=ifname, extra_env=env,
                        timeout=TIME_LIMIT)
        assert undo.code == 0, (undo.stdout, undo.stderr)
    assert_same(node, before, [pod], timeout=1.0)


# ------------------------------------------------------------------ stdin JSON

json_leaf = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) |
             st.text(max_size=20) | st.sampled_from(["", "1.1.0", "rdma-netns", "shared", "exclusive", "rail0",
                                                      "lo", "../../etc", "host-local", "x" * 5000]))
json_values = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4) |
                           st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=20)
COMMANDS = st.sampled_from(["ADD", "DEL", "CHECK"])


@PROPERTY
@given(command=COMMANDS, value=json_values)
def test_any_json_value_on_stdin(hnode, command, value):
    exercise(hnode, command, json.dumps(value))


@PROPERTY
@given(command=COMMANDS, data=st.binary(max_size=300))
def test_any_bytes_on_stdin(hnode, command, data):
    exercise(hnode, command, data)


# Keys a mutation may touch. stateDir and ipam.dataDir are left alone: a valid random path would
# make the plugin (or host-local) write outside the test's folders.
TOP_KEYS = ["cniVersion", "name", "type", "mode", "link", "linkMode", "rails", "ipam", "requireRdma", "gidWaitMs",
            "routeTableBase", "rulePriorityBase", "ipamTimeoutSeconds", "lockTimeoutSeconds", "mtu", "dns",
            "runtimeConfig", "args", "prevResult", "capabilities", "pairing", "resourceName", "deviceID"]
RAIL_KEYS = ["netdev", "rdmaDevice", "pciAddress", "ifname", "ipam", "mtu"]
hostile_values = (json_values | st.sampled_from([
    "lo", "rail0", "rail1", "rail0p", "rail0 ", "ra\u00efl0", "rail0/../rail1", "-1", 0, -1, 2**31, 2**63, 1e308,
    True, [], {}, {"type": "host-local"}, {"type": "../host-local"}, "x" * 100000, "\u202e\u0000x",
    {"deviceID": "0000:00:00.0"}, {"mac": "ff:ff:ff:ff:ff:ff"}, {"ips": ["::1/128"]}, {"mac": "00:00:00:00:00:00"},
    {"ips": ["fd00:1::5/64"]}, 65536, 1279, 9000, "ipvlan", "macvlan", "auto", "passthru", "l3s",
    json.loads("[" * 200 + "]" * 200)]))


@st.composite
def mutated_config(draw):
    node_conf = draw(st.sampled_from(["one", "two"]))
    conf = json.loads(json.dumps(CONF_TEMPLATE[node_conf]))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["top", "rail", "drop", "unknown", "ipam"]))
        if op == "top":
            conf[draw(st.sampled_from(TOP_KEYS))] = draw(hostile_values)
        elif op == "rail" and isinstance(conf.get("rails"), list) and conf["rails"]:
            rail = conf["rails"][draw(st.integers(0, len(conf["rails"]) - 1))]
            if isinstance(rail, dict):
                rail[draw(st.sampled_from(RAIL_KEYS))] = draw(hostile_values)
        elif op == "drop":
            conf.pop(draw(st.sampled_from(TOP_KEYS + ["stateDir"])), None)
        elif op == "unknown":
            conf[draw(st.text(min_size=1, max_size=30))] = draw(hostile_values)
        elif op == "ipam" and isinstance(conf.get("rails"), list) and conf["rails"]:
            rail = conf["rails"][0]
            if isinstance(rail, dict) and isinstance(rail.get("ipam"), dict):
                rail["ipam"][draw(st.sampled_from(["type", "ranges", "routes", "x"]))] = draw(hostile_values)
    if "stateDir" not in conf:
        conf["stateDir"] = CONF_TEMPLATE["one"]["stateDir"]  # never the real /var/lib/cni
    return conf


CONF_TEMPLATE: dict[str, dict] = {}


@PROPERTY
@given(command=COMMANDS, conf=mutated_config())
def test_mutated_valid_config(hnode, command, conf):
    if not CONF_TEMPLATE:
        CONF_TEMPLATE.update(one=hnode.conf(), two=hnode.conf(rails=2))
    exercise(hnode, command, conf)


@pytest.fixture(scope="module", autouse=True)
def _templates(hnode):
    CONF_TEMPLATE.update(one=hnode.conf(), two=hnode.conf(rails=2))


@pytest.mark.parametrize("depth", [100_000, 5_000])
def test_deeply_nested_json(hnode, depth):
    data = json.dumps(hnode.conf())[:-1].encode() + b', "x": ' + b"[" * depth + b"]" * depth + b"}"
    result = hnode.cni("ADD", data, hnode.pod_name, timeout=TIME_LIMIT)
    assert_json_answer(result)
    assert result.json["code"] in (6, 7)


# ------------------------------------------------------------------ CNI_ARGS and the environment

env_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=60)
cni_args = env_text | st.lists(st.tuples(st.sampled_from(["IgnoreUnknown", "IP", "MAC", "K8S_POD_NAME", "x", ""]),
                                         st.sampled_from(["1", "true", "fd00:1::9", "fd00:9::1", "02:00:00:00:00:01",
                                                          "zz", "", "a=b", "../../x"]) | env_text),
                               max_size=4).map(lambda kv: ";".join(f"{k}={v}" for k, v in kv))


@PROPERTY
@given(command=COMMANDS, args=cni_args)
def test_cni_args(hnode, command, args):
    exercise(hnode, command, hnode.conf(), env={"CNI_ARGS": args})


@pytest.mark.parametrize("args", ["x=1", "IP=zz"])
def test_cni_args_refused_by_ipam_leave_no_state(node, args):
    pod = node.pod()
    conf = node.conf()
    node.cni("VERSION", conf).ok()
    before = snapshot(node, [pod])
    node.cni("ADD", conf, pod, extra_env={"CNI_ARGS": args}).error(105)
    try:
        assert state_files(node) == {}, "a failed ADD that changed nothing left its state"
        node.cni("DEL", conf, pod, extra_env={"CNI_ARGS": args}).ok()  # the runtime's DEL has the same args
    finally:
        node.cni("DEL", conf, pod)
    assert_same(node, before, [pod])


@pytest.mark.parametrize("bad,code", [({"type": "macvlan"}, 105), ({"ranges": "lo"}, 7)])
def test_ipam_config_refused_on_add_and_del_leaves_no_state(node, bad, code):
    pod = node.pod()
    conf = node.conf()
    conf["rails"][0]["ipam"].update(bad)
    node.cni("VERSION", conf).ok()
    before = snapshot(node, [pod])
    node.cni("ADD", conf, pod).error(code)
    del_result = node.cni("DEL", conf, pod)
    for f in (Path(node.state_dir) / "rdmanet").glob("*.json"):  # leave the node clean either way
        f.unlink()
    assert del_result.code == 0, f"the runtime's DEL cannot finish: {del_result.stdout}"
    assert_same(node, before, [pod])


# Found by test_mutated_valid_config (CI, issue 36): `"ranges": -1` on a rail crashed ADD with
# 999 "TypeError: object of type 'int' has no len()" in rails/ipam.py, reached from hold_shared. Every
# IPAM key the plugin reads itself is type-checked before use: code 7, naming the key.
@pytest.mark.parametrize("rails,bad,key", [
    (1, {"ranges": -1}, "ranges"),
    (2, {"ranges": -1}, "ranges"),  # two host-local rails: the shared-call planning (hold_shared)
    (2, {"ranges": [-1]}, "ranges.0"),
    (2, {"ranges": [[{"subnet": 5}]]}, "ranges.0.0.subnet"),
    (1, {"ranges": [["fd00:1::/64"]]}, "ranges.0.0"),
    (1, {"routes": {"dst": "fd00::/16"}}, "routes"),
    (1, {"routes": [{"gw": "fd00:1::1"}]}, "routes.0"),
    (1, {"subnet": 64}, "subnet"),
    (1, {"dataDir": 5}, "dataDir"),
])
def test_ipam_key_of_the_wrong_type_is_a_config_error(node, rails, bad, key):
    pod = node.pod()
    conf = node.conf(rails=rails)
    conf["rails"][0]["ipam"].update(bad)
    before = snapshot(node, [pod])
    err = node.cni("ADD", conf, pod).error(7)
    assert f"rails.0.ipam: {key} " in err["msg"] + " " + err.get("details", ""), err
    assert node.cni("DEL", conf, pod).code == 0
    assert_same(node, before, [pod])


HOSTILE_IDS = ["../../x", "..", ".", "a/../../b", "a" * 300, "a" * 256, "c1:net1", "-x", "c1\n", "c\u00e9",
               "x" * 10000, "c1 ", " c1"]
HOSTILE_IFNAMES = ["rail0", "rail1", "rail0p", "lo", "eth0", "../x", ".", "..", "a" * 16, "a" * 15, "x:y", "x y",
                   "\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e98", "net1\n", "rdma0", "all", "default"]


def hostile_netns(node) -> list[str]:
    b = node.base
    return ["", "/proc/self/ns/net", "/proc/thread-self/ns/net", "/proc/self/ns/mnt", "/proc/self/ns/pid",
            f"/var/run/netns/{node.name}", str(b / "regular"), str(b / "dir"), str(b / "link-to-pod"),
            str(b / "link-to-node"), str(b / "dangling"), "/dev/null", "/", "/var/run/netns/../netns/x",
            "/var/run/netns//x", "/" + "a" * 5000, "relative", f"/var/run/netns/{node.pod_name}/"]


@PROPERTY
@given(command=COMMANDS, data=st.data())
def test_environment_values(hnode, command, data):
    cid = data.draw(st.sampled_from(HOSTILE_IDS) | st.just("c1") | env_text.filter(bool), "CNI_CONTAINERID")
    ifname = data.draw(st.sampled_from(HOSTILE_IFNAMES) | st.just("net1") | env_text.filter(bool), "CNI_IFNAME")
    netns = data.draw(st.sampled_from(hostile_netns(hnode) + [Node.netns_path(hnode.pod_name)]) |
                      env_text.map(lambda t: str(hnode.base / t)), "CNI_NETNS")
    mode = data.draw(st.sampled_from(["shared", "exclusive"]), "mode")
    exercise(hnode, command, hnode.conf(mode=mode), container_id=cid, ifname=ifname, netns=netns)


def test_fifo_as_netns_is_refused_quickly(hnode):
    fifo = hnode.base / "fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    try:
        result = hnode.cni("ADD", hnode.conf(), netns=str(fifo), timeout=5)
    except subprocess.TimeoutExpired:
        raise AssertionError("the plugin hung on a FIFO as CNI_NETNS") from None
    result.error(4)


# ------------------------------------------------------------------ host interfaces are never taken


def host_link(node, name: str) -> dict | None:
    return next((lk for lk in ipj("-n", node.name, "link") if lk["ifname"] == name), None)


@pytest.mark.parametrize("mode", ["shared", "exclusive"])
def test_ifname_equal_to_a_host_rail_name(node, mode):
    """CNI_IFNAME names the host's other rail: the pod gets an interface of that name; the host's
    rail1 is never touched; DEL restores everything."""
    pod = node.pod()
    conf = node.conf(mode=mode)
    node.cni("VERSION", conf).ok()
    before = snapshot(node, [pod])
    rail1 = host_link(node, "rail1")
    node.cni("ADD", conf, pod, ifname="rail1").ok()
    assert host_link(node, "rail1") == rail1
    assert rail_links(node, pod) == {"rail1"}
    node.cni("DEL", conf, pod, ifname="rail1").ok()
    assert_same(node, before, [pod])


@pytest.mark.parametrize("mode", ["shared", "exclusive"])
def test_rail_naming_lo_is_refused(node, mode):
    pod = node.pod()
    conf = node.conf(mode=mode)
    conf["rails"][0]["netdev"] = "lo"
    node.cni("VERSION", conf).ok()
    before = snapshot(node, [pod])
    result = node.cni("ADD", conf, pod)
    assert_json_answer(result, allow_ok=False)
    try:
        assert_same(node, before, [pod], timeout=0.5)
    finally:
        node.cni("DEL", conf, pod)


@pytest.mark.parametrize("netns", ["node", "/proc/self/ns/net"])
def test_del_never_deletes_a_host_interface(node, netns):
    """A host-side macvlan on a rail (as other tools make) survives a DEL pointed at the host."""
    ip("-n", node.name, "link", "add", "link", "rail0", "name", "net1", "type", "macvlan")
    before = snapshot(node)
    path = f"/var/run/netns/{node.name}" if netns == "node" else netns
    result = node.cni("DEL", node.conf(), netns=path)
    assert_json_answer(result)
    assert host_link(node, "net1") is not None, "DEL deleted the host's own macvlan net1"
    assert_same(node, before)


# deviceID: the plugin resolves PCI addresses through /sys/bus/pci/devices/<addr>/net. These
# veths have no PCI device, so the plugin runs with a fake PCI folder bind-mounted over that one
# in a private mount namespace (inside the node namespace).

def pci_wrapper(node, tmp_path: Path, mapping: dict[str, str]) -> tuple[str, Path]:
    fake = tmp_path / "fake-pci"
    for address, netdev in mapping.items():
        (fake / address / "net" / netdev).mkdir(parents=True)
    wrapper = write_script(tmp_path / "wrap", "rdma-netns",
                           f"exec unshare -m --propagation private sh -c "
                           f"'mount --bind {fake} /sys/bus/pci/devices && exec {plugin_path()}'\n")
    return str(wrapper), fake


def test_device_id_of_a_nic_that_is_not_a_rail_is_refused(node, tmp_path):
    ip("-n", node.name, "link", "add", "other0", "type", "veth", "peer", "name", "other0p")
    ip("-n", node.name, "link", "set", "other0", "up")
    plugin, _ = pci_wrapper(node, tmp_path, {"0000:aa:00.0": "rail0", "0000:bb:00.0": "rail1",
                                             "0000:cc:00.0": "other0"})
    pod = node.pod()
    conf = node.conf(rails=2, mode="exclusive", runtimeConfig={"deviceID": "0000:cc:00.0"})
    node.cni("VERSION", conf).ok()
    before = snapshot(node, [pod])
    err = node.cni("ADD", conf, pod, plugin=plugin).error(7)
    assert "0000:cc:00.0" in err["msg"]
    assert_same(node, before, [pod])
    # and naming a rail narrows the attachment to it
    ok = node.cni("ADD", dict(conf, runtimeConfig={"deviceID": "0000:bb:00.0"}), pod, plugin=plugin).ok()
    assert host_link(node, "rail1") is None and host_link(node, "rail0") is not None
    # the pod's only network: its one rail is named CNI_IFNAME (rail 0's name here), as a CRI needs
    assert [i["name"] for i in ok["interfaces"]] == ["rdma0"]
    node.cni("DEL", conf, pod, plugin=plugin).ok()
    assert_same(node, before, [pod])


def test_device_id_of_a_non_rail_nic_with_a_single_rail(node, tmp_path):
    ip("-n", node.name, "link", "add", "other0", "type", "veth", "peer", "name", "other0p")
    plugin, _ = pci_wrapper(node, tmp_path, {"0000:aa:00.0": "rail0", "0000:cc:00.0": "other0"})
    pod = node.pod()
    conf = node.conf(mode="exclusive", runtimeConfig={"deviceID": "0000:cc:00.0"})
    node.cni("VERSION", conf).ok()
    before = snapshot(node, [pod])
    result = node.cni("ADD", conf, pod, plugin=plugin)
    taken = host_link(node, "other0") is None
    if result.code == 0:
        node.cni("DEL", conf, pod, plugin=plugin).ok()
    assert not taken, "ADD moved other0, a NIC that is not a configured rail, into the pod"
    assert result.code != 0
    assert_same(node, before, [pod])


def test_exclusive_device_id_of_a_nic_in_another_pod_is_refused(node, tmp_path):
    plugin, fake = pci_wrapper(node, tmp_path, {"0000:aa:00.0": "rail0", "0000:bb:00.0": "rail1"})
    pod_a, pod_b = node.pod(), node.pod()
    conf = node.conf(rails=2, mode="exclusive", runtimeConfig={"deviceID": "0000:aa:00.0"})
    node.cni("ADD", conf, pod_a, container_id="a", plugin=plugin).ok()
    assert rail_links(node, pod_a) == {"rdma0"}
    before = snapshot(node, [pod_a, pod_b])
    node.cni("ADD", conf, pod_b, container_id="b", plugin=plugin).error(101)  # the fake still lists rail0
    (fake / "0000:aa:00.0" / "net" / "rail0").rmdir()  # as the kernel shows it: the NIC left the host
    node.cni("ADD", conf, pod_b, container_id="b", plugin=plugin).error(101)
    assert_same(node, before, [pod_a, pod_b])
    node.cni("CHECK", conf, pod_a, container_id="a", plugin=plugin).ok()
    node.cni("DEL", conf, pod_a, container_id="a", plugin=plugin).ok()
    assert host_link(node, "rail0") is not None


# ------------------------------------------------------------------ symlinks in the state folder


def test_symlinked_state_file_is_not_followed(node, tmp_path):
    """A planted <cid>:<ifname>.json symlink (to a crafted "interrupted ADD" state that would make
    the plugin move the host's rail1) is neither read nor written through."""
    pod = node.pod()
    conf = node.conf()
    node.cni("ADD", conf, pod).ok()
    node.cni("DEL", conf, pod).ok()
    bait = tmp_path / "bait.json"
    bait_text = json.dumps({"format": 1, "phase": "adding", "mode": "exclusive", "link": "netdev",
                            "containerID": "c1", "ifname": "net1", "netns": f"/var/run/netns/{node.name}",
                            "network": "rdmanet", "rails": [{"ifname": "net1", "netdev": "rail1", "ipam": None,
                                                             "hostName": "stolen", "hostMac": "00:00:00:00:00:01"}]})
    bait.write_text(bait_text)
    link = Path(node.state_dir) / "rdmanet" / "c1:net1.json"
    os.symlink(bait, link)
    before_rail1 = host_link(node, "rail1")
    node.cni("ADD", conf, pod).ok()
    assert not link.is_symlink(), "the state replaced the symlink (rename), it did not write through it"
    assert bait.read_text() == bait_text
    assert host_link(node, "rail1") == before_rail1
    node.cni("DEL", conf, pod).ok()
    assert bait.read_text() == bait_text and rail_links(node, pod) == set()


def test_symlinked_network_folder_is_refused(node, tmp_path):
    pod = node.pod()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    Path(node.state_dir).mkdir(parents=True)
    os.symlink(elsewhere, Path(node.state_dir) / "rdmanet")
    before = snapshot(node, [pod])
    err = node.cni("ADD", node.conf(), pod).error(5)
    assert "symlink" in err["msg"]
    assert list(elsewhere.iterdir()) == []
    assert_same(node, before, [pod])


def test_symlinked_lock_file_is_refused(node, tmp_path):
    pod = node.pod()
    conf = node.conf()
    node.cni("ADD", conf, pod).ok()
    node.cni("DEL", conf, pod).ok()
    target = tmp_path / "lock-target"
    locks = Path(node.state_dir) / "locks"
    assert [f.name for f in locks.iterdir() if ":" in f.name] == []  # DEL took its lock file along
    os.symlink(target, locks / "c1:net1")  # the attachment's lock file (per attachment since issue 15)
    before = snapshot(node, [pod])
    result = node.cni("ADD", conf, pod)
    assert not target.exists(), "the lock was created through the symlink"
    assert_same(node, before, [pod])
    result.error(5)
