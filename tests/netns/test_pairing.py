"""Pairing with kubelet's grants (PodResources API) in real namespaces, with real gRPC kubelets.

A pod granted `rdma/hca` gets its rails; a pod not granted keeps only what the previous plugin
gave it; exclusive mode moves exactly the NICs kubelet granted. Kubelet is the stand-in
(tests/kubelet_standin.py) serving the real v1.PodResourcesLister over a unix socket; the broker
path runs the real rdma-netns-dp daemon.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import CNI_BIN_DIR
from tests.kubelet_standin import PodResourcesStandIn
from tests.netns.conftest import ip, ipj

pytestmark = pytest.mark.netns

RESOURCE = "rdma/hca"


@pytest.fixture
def short_tmp():
    """Unix socket paths must stay under 108 bytes: pytest's tmp_path can be longer."""
    folder = Path(tempfile.mkdtemp(prefix="rnp-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def kubelet(short_tmp):
    with PodResourcesStandIn(short_tmp / "pod-resources.sock") as standin:
        yield standin


def k8s_args(name: str, namespace: str = "team-a", uid: str = "0b5c7c1e-uid") -> dict:
    return {"CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name};"
                        f"K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID={uid}"}


def primary_result(node, pod: str) -> dict:
    """What a cluster CNI (the first plugin of the conflist) hands on: eth0 with an IPv4 address."""
    return {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "mac": "02:00:00:00:00:01",
                                                   "sandbox": node.netns_path(pod)}],
            "ips": [{"address": "10.244.1.7/24", "gateway": "10.244.1.1", "interface": 0}],
            "dns": {"nameservers": ["10.96.0.10"]}}


def paired(node, kubelet, version: str = "1.0.0", rails: int = 1, **extra) -> dict:
    """A config that pairs with the stand-in. The timeout is generous (the default is 2 s):
    the Python stand-in on a loaded 2-core CI machine is far slower than kubelet."""
    extra.setdefault("podResourcesTimeoutMs", 5000)
    return node.conf(rails=rails, version=version, resourceName=RESOURCE,
                     podResourcesSocket=str(kubelet.socket), podGrantsSocket="", **extra)


def recording_cni_path(folder: Path) -> tuple[str, Path]:
    """A CNI_PATH whose host-local records each call before running the real one."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    log = folder / "ipam-calls"
    wrapper = bin_dir / "host-local"
    wrapper.write_text(f"#!/bin/sh\necho \"$CNI_COMMAND $CNI_IFNAME\" >> {log}\nexec {CNI_BIN_DIR}/host-local\n")
    wrapper.chmod(0o755)
    return str(bin_dir), log


def test_granted_pod_gets_its_rail_and_a_pod_not_granted_keeps_only_its_cluster_network(node, kubelet):
    granted, plain = node.pod(), node.pod()
    kubelet.set_pod("team-a", "trainer", {"main": {RESOURCE: ["hca-0007"]}})
    kubelet.set_pod("team-a", "web", {"main": {"nvidia.com/gpu": ["GPU-1"]}})

    prev = primary_result(node, granted)
    conf = paired(node, kubelet, prevResult=prev)
    result = node.cni("ADD", conf, granted, ifname="eth0", container_id="sbx1",
                      extra_env=k8s_args("trainer")).ok()
    assert [i["name"] for i in result["interfaces"]] == ["eth0", "rdma0"]
    assert result["ips"][0] == prev["ips"][0]
    assert ":" in result["ips"][1]["address"] and result["ips"][1]["interface"] == 1
    assert "rdma0" in node.links(granted)
    assert ("Get", "team-a", "trainer") in kubelet.calls

    prev_plain = primary_result(node, plain)
    out = node.cni("ADD", paired(node, kubelet, prevResult=prev_plain), plain, ifname="eth0",
                   container_id="sbx2", extra_env=k8s_args("web"))
    assert out.ok() == prev_plain, "a pod without the resource gets the previous result back unchanged"
    assert set(node.links(plain)) == {"lo"}
    assert len(node.allocations()) == 1, "no address was leased for the pod without the resource"
    assert not (Path(node.state_dir) / "rdmanet" / "sbx2:eth0.json").exists()

    # CHECK and DEL get the final result of the chain as prevResult, as runtimes send it.
    for pod, cid, final in ((granted, "sbx1", result), (plain, "sbx2", prev_plain)):
        conf_for = paired(node, kubelet, prevResult=final)
        node.cni("CHECK", conf_for, pod, ifname="eth0", container_id=cid, extra_env=k8s_args("x")).ok()
        node.cni("DEL", conf_for, pod, ifname="eth0", container_id=cid).ok()
        node.cni("DEL", paired(node, kubelet), None, ifname="eth0", container_id=cid, netns="").ok()
    assert node.allocations() == []
    assert "rdma0" not in node.links(granted)
    assert sorted(p.name for p in (Path(node.state_dir) / "rdmanet").glob("*.json")) == []


def test_a_config_that_does_not_say_whether_it_pairs_is_refused(node, kubelet):
    """Issue 36: the shipped Multus NetworkAttachmentDefinition had no resourceName, so any pod
    that named the network got rails, fabric addresses and GID entries without rdma/hca. A config
    without resourceName is refused unless it says "pairing": false; the keys Multus adds for its
    resourceName annotation (deviceID, pciBusID) are accepted and change nothing."""
    pod = node.pod()
    unsaid = node.conf(prevResult=primary_result(node, pod))
    del unsaid["pairing"]
    for command in ("ADD", "CHECK"):
        err = node.cni(command, unsaid, pod, ifname="eth0", container_id="sbx9", extra_env=k8s_args("web")).error(7)
        assert "resourceName is missing" in err["msg"] and '"pairing": false' in err["msg"], err
    assert set(node.links(pod)) == {"lo"} and node.allocations() == [] and node.attachment_records() == []
    node.cni("DEL", unsaid, pod, ifname="eth0", container_id="sbx9").ok()  # DEL always succeeds
    # Multus with the annotation: the pod's grant decides, whatever deviceID Multus picked
    kubelet.set_pod("team-a", "trainer", {"main": {RESOURCE: ["hca-0003"]}})
    conf = dict(paired(node, kubelet, prevResult=primary_result(node, pod)), deviceID="hca-0003", pciBusID="hca-0003")
    result = node.cni("ADD", conf, pod, ifname="eth0", container_id="sbx9", extra_env=k8s_args("trainer")).ok()
    assert [i["name"] for i in result["interfaces"]] == ["eth0", "rdma0"]
    node.cni("DEL", conf, pod, ifname="eth0", container_id="sbx9").ok()
    assert node.allocations() == [] and node.attachment_records() == []


@pytest.mark.parametrize("get_mode", ["enabled", "disabled", "unimplemented"])
def test_every_kubelet_generation_is_understood(node, kubelet, get_mode):
    """kubelet 1.28+ with the Get gate on, 1.27-1.33 with it off (UNKNOWN "disabled"), < 1.27
    (UNIMPLEMENTED): the last two are asked with List."""
    kubelet.get_mode = get_mode
    kubelet.set_pod("team-a", "other", {"main": {RESOURCE: ["hca-0001"]}})
    kubelet.set_pod("team-b", "trainer", {"main": {}})
    kubelet.set_pod("team-a", "trainer", {"main": {RESOURCE: ["hca-0002"]}},
                    init_containers={"setup": {RESOURCE: ["hca-0003"]}})
    pod = node.pod()
    node.cni("ADD", paired(node, kubelet), pod, ifname="eth0", extra_env=k8s_args("trainer")).ok()
    assert "eth0" in node.links(pod)
    methods = [c[0] for c in kubelet.calls]
    assert methods == (["Get"] if get_mode == "enabled" else ["Get", "List"])
    # team-b/trainer has the same name in another namespace and no grant: it is not attached.
    other = node.pod()
    node.cni("ADD", paired(node, kubelet), other, ifname="eth0", container_id="c2",
             extra_env=k8s_args("trainer", namespace="team-b")).error(108)
    assert set(node.links(other)) == {"lo"}


def test_init_container_grants_count(node, kubelet):
    kubelet.set_pod("team-a", "job", {"main": {}}, init_containers={"warmup": {RESOURCE: ["hca-0009"]}})
    pod = node.pod()
    node.cni("ADD", paired(node, kubelet), pod, ifname="eth0", extra_env=k8s_args("job")).ok()
    assert "eth0" in node.links(pod)


def test_pods_only_network_without_a_grant_is_a_clear_error(node, kubelet):
    kubelet.set_pod("team-a", "web", {"main": {}})
    pod = node.pod()
    err = node.cni("ADD", paired(node, kubelet), pod, ifname="eth0", extra_env=k8s_args("web")).error(108)
    assert RESOURCE in err["msg"]
    assert set(node.links(pod)) == {"lo"} and node.allocations() == []


def test_kubelet_unreachable_unknown_pod_or_missing_pod_args_attach_nothing(node, kubelet, short_tmp):
    pod = node.pod()
    prev = primary_result(node, pod)
    gone = node.conf(resourceName=RESOURCE, podResourcesSocket=str(short_tmp / "no-kubelet.sock"),
                     podGrantsSocket="", prevResult=prev)
    err = node.cni("ADD", gone, pod, ifname="eth0", extra_env=k8s_args("trainer")).error(107)
    assert "unreachable" in err["msg"] and "no-kubelet.sock" in err["msg"]
    err = node.cni("ADD", paired(node, kubelet, prevResult=prev), pod, ifname="eth0",
                   extra_env=k8s_args("nobody")).error(107)
    assert "team-a/nobody" in err["msg"]
    err = node.cni("ADD", paired(node, kubelet, prevResult=prev), pod, ifname="eth0",
                   extra_env={"CNI_ARGS": "IgnoreUnknown=1"}).error(4)
    assert "K8S_POD_NAME" in err["msg"]
    assert set(node.links(pod)) == {"lo"} and node.allocations() == []
    assert list((Path(node.state_dir) / "rdmanet").glob("*.json")) == []


def test_slow_kubelet_fails_within_the_timeout(node, kubelet):
    kubelet.set_pod("team-a", "trainer", {"main": {RESOURCE: ["hca-0001"]}})
    kubelet.delay = 3.0
    pod = node.pod()
    started = time.monotonic()
    err = node.cni("ADD", paired(node, kubelet, podResourcesTimeoutMs=300), pod, ifname="eth0",
                   extra_env=k8s_args("trainer")).error(107)
    elapsed = time.monotonic() - started
    assert "timeout" in err["msg"]
    assert elapsed < 2.0, f"ADD took {elapsed:.2f} s with a 0.3 s PodResources timeout"
    assert set(node.links(pod)) == {"lo"} and node.allocations() == []


def test_del_and_check_need_no_kubelet(node, kubelet):
    kubelet.set_pod("team-a", "trainer", {"main": {RESOURCE: ["hca-0001"]}})
    pod = node.pod()
    conf = paired(node, kubelet)
    node.cni("ADD", conf, pod, ifname="eth0", extra_env=k8s_args("trainer")).ok()
    kubelet.close()  # kubelet restarted, or has forgotten the pod
    node.cni("CHECK", conf, pod, ifname="eth0").ok()
    node.cni("DEL", conf, pod, ifname="eth0").ok()
    assert "eth0" not in node.links(pod) and node.allocations() == []


def test_repeated_del_does_not_run_ipam_again(node, kubelet, short_tmp):
    """containerd sends DEL on StopPodSandbox and again (netns '', no prevResult) on Remove."""
    cni_path, calls = recording_cni_path(short_tmp)
    kubelet.set_pod("team-a", "trainer", {"main": {RESOURCE: ["hca-0001"]}})
    pod = node.pod()
    conf = paired(node, kubelet, rails=2)
    node.cni("ADD", conf, pod, cni_path=cni_path, extra_env=k8s_args("trainer")).ok()
    node.cni("DEL", conf, pod, cni_path=cni_path).ok()
    after_first = calls.read_text().split("\n")
    # the two rails' host-local configs differ only in their ranges: one call serves both (rails/ipam.py)
    assert [line for line in after_first if line] == ["ADD rdma0", "DEL rdma0"]
    for _ in range(2):
        node.cni("DEL", conf, None, netns="", cni_path=cni_path).ok()
    assert calls.read_text().split("\n") == after_first, "a repeated DEL ran IPAM again"
    assert node.allocations() == []
    # A new ADD of the same attachment is not confused by the marker, and its DEL releases again.
    node.cni("ADD", conf, pod, cni_path=cni_path, extra_env=k8s_args("trainer")).ok()
    node.cni("DEL", conf, pod, netns="", cni_path=cni_path).ok()
    assert node.allocations() == []


def test_gc_drops_markers_of_attachments_the_runtime_no_longer_lists(node, kubelet):
    kubelet.set_pod("team-a", "web", {"main": {}})
    pod = node.pod()
    prev = primary_result(node, pod)
    node.cni("ADD", paired(node, kubelet, prevResult=prev), pod, ifname="eth0", container_id="keep",
             extra_env=k8s_args("web")).ok()
    node.cni("ADD", paired(node, kubelet, prevResult=prev), pod, ifname="eth0", container_id="gone",
             extra_env=k8s_args("web")).ok()
    released = Path(node.state_dir) / "rdmanet" / "released"
    assert sorted(p.name for p in released.iterdir() if ":" in p.name) == ["gone:eth0", "keep:eth0"]
    for p in released.iterdir():
        assert p.stat().st_mode & 0o777 == 0o600
    gc = paired(node, kubelet, version="1.1.0")
    gc["cni.dev/valid-attachments"] = [{"containerID": "keep", "ifname": "eth0"}]
    node.cni("GC", gc, None, netns="", container_id="").ok()
    assert sorted(p.name for p in released.iterdir() if ":" in p.name) == ["keep:eth0"]


# ------------------------------------------------------------------ exclusive mode


def fake_pci_sysfs(root: Path, functions: dict[str, str]) -> str:
    """A sysfs tree where each PCI function owns one of the node's rail netdevs."""
    for address, netdev in functions.items():
        (root / "bus" / "pci" / "devices" / address / "net" / netdev).mkdir(parents=True)
    return str(root)


def test_exclusive_moves_exactly_the_granted_nics(node, kubelet, short_tmp):
    sysfs = fake_pci_sysfs(short_tmp / "sys", {"0000:3b:00.0": "rail0", "0000:5e:00.0": "rail1"})
    env = {"RDMA_NETNS_SYSFS_ROOT": sysfs}
    conf = paired(node, kubelet, mode="exclusive", rails=2)
    conf["rails"] = [{"pciAddress": "0000:3b:00.0", "ipam": node.ipam("fd00:1::/64")},
                     {"pciAddress": "0000:5e:00.0", "ipam": node.ipam("fd00:2::/64")}]
    kubelet.set_pod("team-a", "trainer", {"main": {RESOURCE: ["0000:5e:00.0"]}})
    pod = node.pod()
    result = node.cni("ADD", conf, pod, ifname="eth0", extra_env={**env, **k8s_args("trainer")}).ok()
    assert [i["name"] for i in result["interfaces"]] == ["eth0"]
    host = {link["ifname"] for link in ipj("-n", node.name, "link")}
    assert "rail0" in host and "rail1" not in host, "only the granted NIC leaves the node"
    assert result["interfaces"][0]["mac"] == node.links(pod)["eth0"]["address"]

    kubelet.set_pod("team-a", "stranger", {"main": {RESOURCE: ["0000:99:00.0"]}})
    other = node.pod()
    err = node.cni("ADD", conf, other, ifname="eth0", container_id="c2",
                   extra_env={**env, **k8s_args("stranger")}).error(108)
    assert "0000:99:00.0" in err["msg"]
    assert set(node.links(other)) == {"lo"}
    assert "rail0" in {link["ifname"] for link in ipj("-n", node.name, "link")}

    node.cni("DEL", conf, pod, ifname="eth0", extra_env=env).ok()
    host = {link["ifname"] for link in ipj("-n", node.name, "link")}
    assert {"rail0", "rail1"} <= host


# ------------------------------------------------------------------ through the device plugin's broker


def test_through_the_device_plugins_broker_and_without_it(node):
    """The real rdma-netns-dp daemon answers the plugin on its grants socket (no grpc import in
    the CNI); with the daemon gone the plugin asks kubelet itself."""
    from tests.dp.conftest import Host

    host = Host("Y")
    try:
        pod_resources = PodResourcesStandIn(host.kubelet.pod_resources_socket).start()
        host.kubelet.pod_resources = pod_resources
        broker = host.base / "grants.sock"
        daemon, _ = host.start_registered("--mode", "shared", "--resource-name", RESOURCE,
                                          "--pod-grants-socket", str(broker))
        deadline = time.monotonic() + 10
        while not broker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        grants = host.kubelet.admit_pod("team-a", "trainer", {"main": {RESOURCE: 1}})
        assert len(grants["main"][RESOURCE]) == 1
        conf = node.conf(resourceName=RESOURCE, podResourcesSocket=str(pod_resources.socket),
                         podGrantsSocket=str(broker), podResourcesTimeoutMs=5000)
        pod = node.pod()
        node.cni("ADD", conf, pod, ifname="eth0", extra_env=k8s_args("trainer")).ok()
        assert "eth0" in node.links(pod)
        assert "trainer" in daemon.stderr(), "the broker answered (and logged) the query"

        daemon.terminate()
        assert not broker.exists()
        pod2 = node.pod()
        node.cni("ADD", conf, pod2, ifname="eth0", container_id="c2", extra_env=k8s_args("trainer")).ok()
        assert "eth0" in node.links(pod2)
        for p, cid in ((pod, "c1"), (pod2, "c2")):
            node.cni("DEL", conf, p, ifname="eth0", container_id=cid).ok()
        assert node.allocations() == []
        pod_resources.close()
    finally:
        host.close()


def test_cni_args_pod_identity_reaches_kubelet_verbatim(node, kubelet):
    kubelet.set_pod("ns-1", "pod.with-dots", {"c": {RESOURCE: ["hca-0000"]}})
    pod = node.pod()
    node.cni("ADD", paired(node, kubelet), pod, ifname="eth0",
             extra_env=k8s_args("pod.with-dots", namespace="ns-1")).ok()
    assert kubelet.calls == [("Get", "ns-1", "pod.with-dots")]
    state = json.loads((Path(node.state_dir) / "rdmanet" / "c1:eth0.json").read_text())
    assert state["phase"] == "ready"
    assert os.stat(Path(node.state_dir) / "rdmanet" / "c1:eth0.json").st_mode & 0o777 == 0o600
    ip("-n", pod, "link", "show", "eth0")


def test_status_says_when_kubelet_is_not_there(node, kubelet, short_tmp):
    node.cni("STATUS", paired(node, kubelet, version="1.1.0"), None, netns="", container_id="").ok()
    gone = dict(paired(node, kubelet, version="1.1.0"), podResourcesSocket=str(short_tmp / "no-kubelet.sock"))
    err = node.cni("STATUS", gone, None, netns="", container_id="").error(50)
    assert "no-kubelet.sock" in err["msg"]
