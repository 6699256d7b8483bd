"""rdma-netns under containerd's CRI, the path kubelet really takes: a private containerd 1.6
(Debian 12) driven over CRI v1 (RunPodSandbox / StopPodSandbox / RemovePodSandbox /
PodSandboxStatus / ListPodSandbox), Debian's bridge + host-local IPv4 as the primary plugin, and
rdma-netns chained after it or alone, on veth rails in the root netns (rig.py).

Every test proves what the pod got (interfaces and addresses in its netns, the pod IP containerd
reports) and that Stop + Remove leave nothing: no sandbox, no netns file, no IPv4 or IPv6 lease, no
rdma-netns state (its "released" markers are expected), no libcni result cache, no macvlan on a
rail, no veth on the bridge. test_cni_calls_as_design_states asserts on what containerd sent.

Skipped without root or containerd; with CI=true set that is a failure instead.
"""

from __future__ import annotations

import ipaddress
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from integration.cri.api.runtime.v1 import api_pb2 as cri
from integration.cri.conftest import REPORT, record
from integration.cri.cri_client import Pod
from integration.cri.rig import HERE, ContainerdRig, Network, in_subnet
from tests.kubelet_standin import PodResourcesStandIn

pytestmark = pytest.mark.cri

SAMPLE = HERE / "containerd-1.6-cni-calls.sample.json"
K8S_ARGS = {"IgnoreUnknown", "K8S_POD_NAMESPACE", "K8S_POD_NAME", "K8S_POD_INFRA_CONTAINER_ID", "K8S_POD_UID"}


# -- helpers ----------------------------------------------------------------------------------------

def run_ready(rig: ContainerdRig, kind: str, label: str = "p", pod=None) -> tuple[str, object]:
    """RunPodSandbox; the sandbox must be READY. Records the call's time under `kind`."""
    pod = pod or rig.new_pod(label)
    sandbox_id, seconds = rig.run_pod(pod)
    record(f"RunPodSandbox, {kind}", seconds)
    status = rig.cri.pod_status(sandbox_id).status
    assert status.state == cri.SANDBOX_READY, f"{sandbox_id} not ready: {status}"
    assert (status.metadata.name, status.metadata.namespace, status.metadata.uid) == (pod.name, pod.namespace, pod.uid)
    return sandbox_id, pod


def _pod_of(rig: ContainerdRig, sandbox_id: str) -> Pod:
    meta = rig.cri.pod_status(sandbox_id).status.metadata
    return Pod(name=meta.name, namespace=meta.namespace, uid=meta.uid, attempt=meta.attempt)


def address(cidrs: list[str]) -> str:
    assert len(cidrs) == 1, f"expected one address, got {cidrs}"
    return str(ipaddress.ip_interface(cidrs[0]).ip)


def assert_clean(rig: ContainerdRig, network: Network, sandbox_ids: list[str]) -> None:
    left = rig.leftovers(network, sandbox_ids)
    assert not any(left.values()), f"left behind: { {k: v for k, v in left.items() if v} }"
    if any(p["type"] == "rdma-netns" for p in network.conflist["plugins"]):
        released = rig.rdma_state / network.name / "released"
        markers = set(os.listdir(released)) if released.exists() else set()
        missing = [sid for sid in sandbox_ids if f"{sid}:eth0" not in markers]
        assert not missing, f"no 'released' marker for {missing} (markers: {sorted(markers)})"


def remove_all(rig: ContainerdRig, sandbox_ids: list[str], threads: int = 1) -> None:
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(rig.stop_remove, sandbox_ids))


def record_plugin_times(rig: ContainerdRig, sandbox_ids: list[str], label: str) -> None:
    """rdma-netns's own ADD/DEL times, from the recorder's clock around the plugin."""
    ids = set(sandbox_ids)
    for call in rig.calls():
        if call.env.get("CNI_CONTAINERID") not in ids or call.seconds is None:
            continue
        what = call.command if call.command != "DEL" else (
            "DEL (with netns)" if call.env.get("CNI_NETNS") else "DEL (CNI_NETNS='')")
        record(f"rdma-netns {what} as containerd ran it, {label}", call.seconds)
        if call.cpu_seconds is not None:
            record(f"rdma-netns {what} CPU time, {label}", call.cpu_seconds)


# -- a. the primary plugin alone --------------------------------------------------------------------

def test_primary_alone_pod_ip_is_eth0(rig):
    net = rig.use_network("primary")
    sandboxes = []
    for _ in range(3):
        sid, _pod = run_ready(rig, "bridge only")
        sandboxes.append(sid)
        links = rig.pod_addresses(sid)
        assert set(links) == {"eth0"}, links
        ip4 = address(links["eth0"]["inet"])
        assert in_subnet(ip4, net.subnet4)
        network = rig.cri.pod_status(sid).status.network
        assert network.ip == ip4 and list(network.additional_ips) == []
    assert len(rig.bridge_ports(net.bridge)) == 3
    remove_all(rig, sandboxes)
    assert_clean(rig, net, sandboxes)


# -- b. bridge + rdma-netns chained -----------------------------------------------------------------

def test_chained_eth0_and_rdma0_then_double_del_leaves_nothing(rig):
    net = rig.use_network("chained")
    sandboxes = []
    for _ in range(3):
        sid, _pod = run_ready(rig, "bridge + rdma-netns chained")
        sandboxes.append(sid)
        links = rig.pod_addresses(sid)
        assert set(links) == {"eth0", "rdma0"}, links
        ip4, ip6 = address(links["eth0"]["inet"]), address(links["rdma0"]["inet6"])
        assert in_subnet(ip4, net.subnet4) and in_subnet(ip6, net.rail_subnets[0])
        assert links["eth0"]["inet6"] == [] and links["rdma0"]["inet"] == []
        network = rig.cri.pod_status(sid).status.network
        # The pod IP is CNI_IFNAME's only: the rail's IPv6 is not the pod's address.
        assert network.ip == ip4 and list(network.additional_ips) == [], network
        state = rig.rdma_state / net.name
        assert [p.name for p in state.glob(f"{sid}:*.json")] == [f"{sid}:eth0.json"]

    first = sandboxes[0]
    # A container of the pod (CreateContainer/StartContainer/ExecSync) sees the same two interfaces.
    seen = rig.cri.exec_in_pod(first, _pod_of(rig, first), rig.image.name, ["/bin/busybox", "ip", "-o", "addr"])
    assert seen.exit_code == 0, seen.stderr
    lines = seen.stdout.decode().splitlines()
    for ifname, addrs in rig.pod_addresses(first).items():
        for cidr in addrs["inet"] + addrs["inet6"]:
            assert any(f" {ifname} " in line and f" {cidr} " in line for line in lines), (ifname, cidr, lines)
    rig.cri.stop_pod(first)
    dels = [c for c in rig.calls_for(first) if c.command == "DEL"]
    assert len(dels) == 1 and dels[0].env["CNI_NETNS"] and dels[0].rc == 0
    assert not (rig.rdma_state / net.name / f"{first}:eth0.json").exists(), "state kept after DEL"
    rig.cri.remove_pod(first)
    dels = [c for c in rig.calls_for(first) if c.command == "DEL"]
    assert [c.env["CNI_NETNS"] for c in dels][1:] == [""] and all(c.rc == 0 for c in dels), \
        [(c.env["CNI_NETNS"], c.rc) for c in dels]
    remove_all(rig, sandboxes[1:])
    assert_clean(rig, net, sandboxes)
    record_plugin_times(rig, sandboxes, "sequential")


# -- c. rdma-netns alone: the documented standalone set-up ------------------------------------------

@pytest.mark.parametrize("rails", [1, 2])
def test_standalone_pod_ip_is_rail0_on_cni_ifname(rig, rails):
    net = rig.use_network("standalone", rails=rails)
    sid, _pod = run_ready(rig, f"rdma-netns alone, {rails} rail(s)")
    links = rig.pod_addresses(sid)
    assert "eth0" in links and len(links) == rails, links
    ip6 = address(links["eth0"]["inet6"])
    assert in_subnet(ip6, net.rail_subnets[0]), f"eth0 holds {ip6}, not rail 0's subnet {net.rail_subnets[0]}"
    others = {name: v for name, v in links.items() if name != "eth0"}
    for i, (name, v) in enumerate(sorted(others.items()), start=1):
        assert in_subnet(address(v["inet6"]), net.rail_subnets[i]), (name, v)
    network = rig.cri.pod_status(sid).status.network
    assert network.ip == ip6, network
    remove_all(rig, [sid])
    assert_clean(rig, net, [sid])


# -- d. containerd restarted with live pods ---------------------------------------------------------

def test_containerd_restart_keeps_pods_then_removal_leaves_nothing(rig):
    net = rig.use_network("chained")
    sandboxes = [run_ready(rig, "bridge + rdma-netns chained")[0] for _ in range(3)]
    before = {sid: (rig.cri.pod_status(sid).status.network.ip, rig.pod_addresses(sid)) for sid in sandboxes}
    seconds = rig.restart()
    REPORT.append(f"containerd restart (SIGKILL, start, CRI ready) with 3 live pods: {seconds:.2f} s")
    listed = {s.id: s.state for s in rig.cri.list_pods()}
    assert all(listed.get(sid) == cri.SANDBOX_READY for sid in sandboxes), listed
    ready = {s.id for s in rig.cri.list_pods(ready_only=True)}
    assert set(sandboxes) <= ready
    for sid in sandboxes:
        assert (rig.cri.pod_status(sid).status.network.ip, rig.pod_addresses(sid)) == before[sid]
    adds = [c for c in rig.calls() if c.command == "ADD" and c.env.get("CNI_CONTAINERID") in sandboxes]
    assert len(adds) == 3, "a restart must not ADD again"
    remove_all(rig, sandboxes)
    for sid in sandboxes:
        dels = [c for c in rig.calls_for(sid) if c.command == "DEL"]
        assert len(dels) >= 2 and all(c.rc == 0 for c in dels), [(c.env["CNI_NETNS"], c.rc, c.stdout) for c in dels]
    assert_clean(rig, net, sandboxes)


# -- e. 16 sandboxes at once ------------------------------------------------------------------------

def test_sixteen_concurrent_sandboxes(rig):
    """Two bursts of 16 on one network: the first right after the conflist appeared (every ADD
    validates the new config at once), the second on a config the plugin has seen."""
    net = rig.use_network("chained")
    for label in ("new config", "config seen before"):
        pods = [rig.new_pod(f"b{i}") for i in range(16)]
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=16) as pool:
            results = list(pool.map(rig.run_pod, pods))
        wall = time.perf_counter() - start
        record(f"16 concurrent RunPodSandbox (wall), {label}", wall)
        sandboxes = [sid for sid, _ in results]
        v4, v6 = set(), set()
        for sid in sandboxes:
            status = rig.cri.pod_status(sid).status
            assert status.state == cri.SANDBOX_READY
            links = rig.pod_addresses(sid)
            assert set(links) == {"eth0", "rdma0"}, (sid, links)
            v4.add(address(links["eth0"]["inet"]))
            v6.add(address(links["rdma0"]["inet6"]))
            assert status.network.ip in v4
        assert len(v4) == len(v6) == 16, "addresses handed out twice"
        start = time.perf_counter()
        remove_all(rig, sandboxes, threads=16)
        record(f"16 concurrent Stop+Remove (wall), {label}", time.perf_counter() - start)
        assert_clean(rig, net, sandboxes)
        record_plugin_times(rig, sandboxes, f"16 concurrent, {label}")


# -- f. what containerd sends -----------------------------------------------------------------------

def _save_sample(rig: ContainerdRig, sandbox_id: str, path: Path) -> None:
    """The recorded calls of one sandbox, IDs shortened to 12 characters and the rig folder as $RIG."""
    def shorten(text: str) -> str:
        return text.replace(sandbox_id, sandbox_id[:12]).replace(str(rig.work), "$RIG")

    sample = [{"command": c.command, "env": {k: shorten(v) for k, v in sorted(c.env.items())},
               "cniArgs": dict(sorted((k, shorten(v)) for k, v in c.cni_args().items())),
               "stdin": json.loads(shorten(c.stdin.decode())), "exit": c.rc,
               "stdout": json.loads(shorten(c.stdout)) if c.stdout.strip() else None}
              for c in rig.calls_for(sandbox_id)]
    path.write_text(json.dumps(sample, indent=2) + "\n")


def test_cni_calls_as_design_states(rig, tmp_path):
    net = rig.use_network("chained")
    sid, pod = run_ready(rig, "bridge + rdma-netns chained")
    netns = rig.netns_path(sid)
    assert netns.startswith(str(rig.state)), netns
    (add,) = rig.calls_for(sid)
    assert add.command == "ADD" and add.rc == 0
    assert add.env["CNI_IFNAME"] == "eth0" and add.env["CNI_NETNS"] == netns and add.env["CNI_CONTAINERID"] == sid
    args = add.cni_args()
    assert set(args) == K8S_ARGS, args
    assert args == {"IgnoreUnknown": "1", "K8S_POD_NAMESPACE": pod.namespace, "K8S_POD_NAME": pod.name,
                    "K8S_POD_INFRA_CONTAINER_ID": sid, "K8S_POD_UID": pod.uid}
    conf = add.conf
    assert conf["cniVersion"] == "1.0.0" and conf["name"] == net.name and conf["type"] == "rdma-netns"
    prev = conf["prevResult"]
    assert [i["name"] for i in prev["interfaces"] if i.get("sandbox")] == ["eth0"]
    assert [ip["address"].split("/")[0] for ip in prev["ips"]] == [rig.cri.pod_status(sid).status.network.ip]

    rig.cri.stop_pod(sid)
    rig.cri.remove_pod(sid)
    calls = rig.calls_for(sid)
    assert [c.command for c in calls] == ["ADD", "DEL", "DEL"], [c.command for c in calls]
    first, again = calls[1], calls[2]
    assert first.env["CNI_NETNS"] == netns and "prevResult" in first.conf
    assert again.env["CNI_NETNS"] == "" and "prevResult" not in again.conf
    for call in (first, again):
        assert call.rc == 0 and call.env["CNI_IFNAME"] == "eth0" and set(call.cni_args()) == K8S_ARGS
    assert_clean(rig, net, [sid])

    _save_sample(rig, sid, tmp_path / "containerd-cni-calls.json")
    if os.environ.get("RDMA_NETNS_CRI_SAMPLE"):
        _save_sample(rig, sid, Path(os.environ["RDMA_NETNS_CRI_SAMPLE"]))
    REPORT.append(f"containerd {rig.containerd.label}: the same calls, recorded in {tmp_path / 'containerd-cni-calls.json'}"
                  f" (1.6's repository copy: {SAMPLE})")


# -- g. pairing with kubelet's PodResources (contracts A and C) -------------------------------------

@pytest.fixture
def pod_resources(rig):
    standin = PodResourcesStandIn(rig.work / f"kubelet-{os.urandom(3).hex()}" / "pod-resources" / "kubelet.sock")
    with standin:
        yield standin


def _paired_network(rig: ContainerdRig, standin: PodResourcesStandIn) -> Network:
    return rig.use_network("chained", resourceName="rdma/hca", podResourcesSocket=str(standin.socket),
                           podGrantsSocket="")


def test_pairing_granted_pod_gets_rdma0_ungranted_only_eth0(rig, pod_resources):
    net = _paired_network(rig, pod_resources)
    granted, plain = rig.new_pod("granted"), rig.new_pod("plain")
    pod_resources.set_pod(granted.namespace, granted.name, {"c": {"rdma/hca": ["hca-0001"]}})
    pod_resources.set_pod(plain.namespace, plain.name, {"c": {"example.com/gpu": ["gpu-0"]}})

    sid_granted, _ = run_ready(rig, "paired, granted", pod=granted)
    links = rig.pod_addresses(sid_granted)
    assert set(links) == {"eth0", "rdma0"}, links
    assert in_subnet(address(links["rdma0"]["inet6"]), net.rail_subnets[0])
    assert rig.cri.pod_status(sid_granted).status.network.ip == address(links["eth0"]["inet"])

    sid_plain, _ = run_ready(rig, "paired, not granted", pod=plain)
    links = rig.pod_addresses(sid_plain)
    assert set(links) == {"eth0"}, links
    assert rig.cri.pod_status(sid_plain).status.network.ip == address(links["eth0"]["inet"])
    assert not (rig.rdma_state / net.name / f"{sid_plain}:eth0.json").exists()

    asked = {(ns, name) for _method, ns, name in pod_resources.calls}
    assert {(granted.namespace, granted.name), (plain.namespace, plain.name)} <= asked, pod_resources.calls
    remove_all(rig, [sid_granted, sid_plain])
    assert_clean(rig, net, [sid_granted, sid_plain])


def test_pairing_pod_unknown_to_kubelet_fails_and_rolls_back_cleanly(rig, pod_resources):
    """Pod unknown to kubelet: ADD fails (107), containerd's rollback DEL must succeed, so the
    sandbox is gone and the bridge's IPv4 lease is released (a failing DEL would wedge it)."""
    import grpc

    net = _paired_network(rig, pod_resources)
    pod = rig.new_pod("unknown")
    with pytest.raises(grpc.RpcError) as failed:
        rig.run_pod(pod)
    assert "107" in failed.value.details() or "kubelet" in failed.value.details().lower(), failed.value.details()
    ours = [c for c in rig.calls() if c.cni_args().get("K8S_POD_NAME") == pod.name]
    assert [c.command for c in ours][:2] == ["ADD", "DEL"], [c.command for c in ours]
    assert ours[0].rc != 0 and json.loads(ours[0].stdout)["code"] == 107
    assert all(c.rc == 0 for c in ours[1:]), [(c.command, c.rc, c.stdout) for c in ours]
    sandbox_ids = sorted({c.env["CNI_CONTAINERID"] for c in ours})
    assert not [s for s in rig.cri.list_pods() if s.metadata.name == pod.name]
    left = rig.leftovers(net, sandbox_ids)
    assert not any(left.values()), left
