"""Exclusive mode end to end, with the guest kernel BOOTED in exclusive mode (ib_core.netns_mode=0
on its command line: integration/test_real_kernel.py's second boot, run-suite.sh exclusive-boot).

One flow, as a node runs it: the device plugin (the installed rdma-netns-dp, exclusive resource,
CDI on, its grants broker) advertises two Soft-RoCE devices; the stand-in kubelet admits pods
through the plugin's real Allocate and publishes the grants through its PodResources API; the CNI
(rdma-netns with resourceName, asking the broker) moves exactly the granted RDMA device into each
pod; a process in the pod, given only the device nodes of the CDI device Allocate named (resolved
as a runtime does at container creation, after the move), opens it with pyverbs and moves checked
RC traffic to the other pod.

Soft-RoCE layout (shared/real-rdma-kernel.md): rxe is deleted by the kernel whenever its netdev
changes namespace, so the netdev is moved into the pod first (Debian's host-device, as an SR-IOV
set-up's first plugin does), the rxe device is created on it from inside the pod (it registers in
the initial namespace, where the device plugin sees it), and rdma-netns, chained, moves the
RDMA device kubelet granted.

These tests must run only in that boot: they fail (never skip) when the kernel is not exclusive.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from integration.guest_suite.conftest import (RESULTS, SYSTEM_PYTHON, TRAFFIC, in_pod, rdma_devices, record_timing,
                                              sh, timed_cni)
from integration.guest_suite.exclusive import (OPEN, booted_exclusive, cdi_device_nodes,  # noqa: F401
                                               confined, host_device_add, host_device_del, kernel_uverbs,
                                               kernel_uverbs_host, rc_exchange, stop_daemon)
from tests.conftest import run_plugin
from tests.kubelet_standin import KubeletStandIn, PodResourcesStandIn

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("booted_exclusive")]

DP = str(Path(sys.executable).parent / "rdma-netns-dp")
RESOURCE = "rdma/hca"
SLUG = "rdma_hca"
START_TIMEOUT = 240   # grpc + pydantic imports under TCG
RPC_TIMEOUT = 60
INTERVAL = 0.5


def record(name: str, value: object) -> None:
    """Facts for the report (what rxe refused, which node the container got), one JSON line each."""
    with open(RESULTS / "exclusive-boot-facts.jsonl", "a") as f:
        f.write(json.dumps({"name": name, "value": value}) + "\n")


class Node:
    """Device plugin daemon + stand-in kubelet (Registration, admission, PodResources) + CNI config."""

    def __init__(self, tmp: Path, tag: str) -> None:
        self.tmp = tmp
        self.tag = tag
        self.base = Path(tempfile.mkdtemp(prefix="h13-", dir="/tmp"))  # short: socket paths
        self.pod_resources = PodResourcesStandIn(self.base / "k" / "pod-resources" / "kubelet.sock")
        self.kubelet = KubeletStandIn(self.base / "k" / "device-plugins", pod_resources=self.pod_resources).start()
        self.broker = self.base / "g" / "pod-grants.sock"
        self.cdi_dir = self.base / "cdi"
        self.state_dir = tmp / "state"
        self.log_file = tmp / "dp.log"
        config = tmp / "dp.json"
        config.write_text(json.dumps({"resources": [{"name": RESOURCE,
                                                     "selectors": {"rdmaDevices": [f"rxg{tag}*"]}}]}))
        self.proc = subprocess.Popen(
            [DP, "--config", str(config), "--kubelet-dir", str(self.base / "k"), "--mode", "exclusive",
             "--health-interval", str(INTERVAL), "--health-file", str(tmp / "health.json"),
             "--cni-state-dir", str(self.state_dir), "--cdi", "--cdi-dir", str(self.cdi_dir),
             "--pod-grants-socket", str(self.broker), "--log-level", "info"],
            stdout=subprocess.DEVNULL, stderr=open(self.log_file, "w"))

    def log(self) -> str:
        return self.log_file.read_text()[-4000:]

    def plugin(self):
        try:
            return self.kubelet.plugin(RESOURCE, timeout=START_TIMEOUT)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.log()}") from None

    def conf(self, prev: dict) -> dict:
        return {"cniVersion": "1.0.0", "name": "rdma-excl", "type": "rdma-netns", "mode": "exclusive",
                "resourceName": RESOURCE, "podResourcesSocket": str(self.pod_resources.socket),
                "podGrantsSocket": str(self.broker), "podResourcesTimeoutMs": 10000,
                "stateDir": str(self.state_dir), "prevResult": prev}

    def cdi_nodes(self, cdi_name: str) -> list[dict]:
        """The nodes a runtime makes for the CDI name Allocate returned."""
        return cdi_device_nodes(self.cdi_dir / f"rdma-netns-{SLUG}.json", cdi_name)

    def close(self) -> None:
        shutil.copy(self.log_file, RESULTS / "exclusive-boot-dp.log")  # the daemon's side, for the report
        stop_daemon(self.proc)
        self.kubelet.close()
        self.pod_resources.close()
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """One daemon for the module: its start (grpc and pydantic imports) takes a minute under TCG.
    It selects every rxe device named rxg*; each test makes its own."""
    n = Node(tmp_path_factory.mktemp("node"), "")
    try:
        yield n
    finally:
        n.close()


def pod_args(pod: str) -> dict:
    return {"CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME={pod};"
                        f"K8S_POD_INFRA_CONTAINER_ID={pod};K8S_POD_UID=uid-{pod}"}


def test_granted_devices_move_into_their_pods_and_carry_rc_traffic(lab, node):
    tag = lab.tag
    health_file = node.tmp / "health.json"
    nics = (f"xa{tag}", f"xb{tag}")
    lab.veth(*nics)
    pods = [f"pa{tag}", f"pb{tag}"]
    for pod in pods:
        sh("ip", "netns", "add", pod)
        sh("ip", "-n", pod, "link", "set", "lo", "up")
        lab.pods.append(pod)
    devices = [f"rxg{tag}a", f"rxg{tag}b"]
    addresses = ["fd00:51::1", "fd00:51::2"]
    prevs = []
    for pod, nic, device, address in zip(pods, nics, devices, addresses):
        prevs.append(host_device_add(pod, nic, f"{address}/64"))
        in_pod(pod, "rdma", "link", "add", device, "type", "rxe", "netdev", "net1")
    assert set(devices) <= set(rdma_devices()), "new rxe devices register in the initial namespace"

    # The device plugin's exclusive resource, with the kernel in exclusive mode: both Healthy.
    plugin = node.plugin()
    first = plugin.wait_for(lambda u: set(u.ids()) == set(devices), RPC_TIMEOUT, "both rxe devices listed")
    assert set(first.health().values()) == {"Healthy"}, node.log()
    assert json.loads(health_file.read_text())["blocked"] is None

    # kubelet admits pod a (1 unit) through the plugin's Allocate, then pod b.
    allocated_at = time.monotonic()
    granted_a = node.kubelet.admit_pod("ns", pods[0], {"main": {RESOURCE: 1}})["main"][RESOURCE]
    response_a = plugin.allocate(granted_a, timeout=RPC_TIMEOUT).container_responses[0]
    assert granted_a == [devices[0]], f"kubelet's choice (sorted, one NUMA-less node): {granted_a}"
    assert [c.name for c in response_a.cdi_devices] == [f"rdma-netns.io/{SLUG}={devices[0]}"]
    assert list(response_a.devices) == [], "CDI: no DeviceSpecs"
    uverbs_at_allocate = kernel_uverbs_host(devices[0])

    # The pod's network: rdma-netns (chained, paired) moves exactly the granted RDMA device.
    conf_a = node.conf(prevs[0])
    timed_cni("exclusive-paired", "ADD", conf_a, container_id=pods[0], netns=f"/var/run/netns/{pods[0]}",
              ifname="net1", extra_env=pod_args(pods[0])).ok()
    assert rdma_devices(pods[0]) == [devices[0]]
    assert devices[0] not in rdma_devices() and devices[1] in rdma_devices(), "the other device stays"
    # The container is created now: the runtime resolves the CDI name Allocate returned.
    nodes_a = node.cdi_nodes(response_a.cdi_devices[0].name)
    uverbs_now = kernel_uverbs(pods[0], devices[0])
    assert {(n["major"], n["minor"]) for n in nodes_a if "uverbs" in n["path"]} == {uverbs_now}, \
        f"the CDI entry names the node the kernel gave {devices[0]} in the pod: {nodes_a} vs {uverbs_now}"
    record("uverbs at Allocate / in the pod after the move", [uverbs_at_allocate, list(uverbs_now)])
    script = lab.tmp / "open.py"
    script.write_text(OPEN)
    opened = sh(*confined(pods[0], nodes_a, SYSTEM_PYTHON, str(script), *devices), timeout=300)
    usable_after = time.monotonic() - allocated_at
    result = json.loads(opened.stdout.strip().splitlines()[-1])
    assert result[devices[0]]["ok"] is True, result
    assert result[devices[1]]["ok"] is False, f"the other device must not open in pod a: {result}"
    record_timing("allocate to usable device in pod", usable_after)
    record("allocate to usable device in pod (s)", round(usable_after, 2))

    # The device plugin while the device is away: still listed, Healthy; Allocate of it refused.
    time.sleep(3 * INTERVAL)
    assert plugin.latest.health() == {devices[0]: "Healthy", devices[1]: "Healthy"}, node.log()
    with pytest.raises(grpc.RpcError) as away:
        plugin.allocate([devices[0]], timeout=RPC_TIMEOUT)
    assert "not on the node now" in away.value.details()

    granted_b = node.kubelet.admit_pod("ns", pods[1], {"main": {RESOURCE: 1}})["main"][RESOURCE]
    assert granted_b == [devices[1]]
    response_b = plugin.allocate(granted_b, timeout=RPC_TIMEOUT).container_responses[0]
    conf_b = node.conf(prevs[1])
    timed_cni("exclusive-paired", "ADD", conf_b, container_id=pods[1], netns=f"/var/run/netns/{pods[1]}",
              ifname="net1", extra_env=pod_args(pods[1])).ok()
    assert rdma_devices(pods[1]) == [devices[1]] and not set(devices) & set(rdma_devices())
    nodes_b = node.cdi_nodes(response_b.cdi_devices[0].name)

    # Checked RC traffic between the two confined processes.
    verdict = rc_exchange(pods, [nodes_a, nodes_b], addresses, devices)
    record("rc_exchange", verdict)

    # rdma_cm: what rxe allows after a namespace move, recorded with the kernel's own words.
    rping = sh("bash", str(TRAFFIC / "rdma_cm_check.sh"), "--server-netns", pods[0], "--server-addr", addresses[0],
               "--client-netns", pods[1], "--client-addr", addresses[1], "--count", "3", "--timeout", "45",
               check=False, timeout=120)
    dmesg = [line for line in sh("dmesg").stdout.splitlines()
             if re.search(r"GSI QP|ib_mad|QP1|rxe", line)]
    record("rdma_cm in exclusive mode", {"rc": rping.returncode, "out": rping.stdout[-600:], "dmesg": dmesg[-8:]})
    print(f"rdma_cm in exclusive mode: exit {rping.returncode}; dmesg: {dmesg[-8:]}")
    if rping.returncode != 0:
        assert any("GSI QP exists" in line or "Couldn't create ib_mad QP1" in line for line in dmesg), \
            f"rdma_cm failed without rxe's recorded refusal: {rping.stdout} {dmesg}"

    for pod, conf in zip(pods, (conf_a, conf_b)):
        run_plugin("CHECK", conf, container_id=pod, netns=f"/var/run/netns/{pod}", ifname="net1",
                   extra_env=pod_args(pod), timeout=300).ok()

    # DEL returns each device; the device plugin sees it back on the host (Allocate works again)
    # and Healthy.
    for pod, conf, device in zip(pods, (conf_a, conf_b), devices):
        timed_cni("exclusive-paired", "DEL", conf, container_id=pod, netns=f"/var/run/netns/{pod}",
                  ifname="net1", extra_env=pod_args(pod)).ok()
        assert device in rdma_devices() and rdma_devices(pod) == []
        run_plugin("DEL", conf, container_id=pod, netns="", ifname="net1", timeout=300).ok()  # containerd's repeat
        deadline = time.monotonic() + RPC_TIMEOUT
        while True:
            try:
                again = plugin.allocate([device], timeout=RPC_TIMEOUT).container_responses[0]
                break
            except grpc.RpcError as exc:
                assert time.monotonic() < deadline, f"{device} never came back to the plugin: {exc.details()}"
                time.sleep(INTERVAL)
        assert [c.name for c in again.cdi_devices] == [f"rdma-netns.io/{SLUG}={device}"]
        assert plugin.latest.health()[device] == "Healthy"
        node.kubelet.forget_pod("ns", pod)
    assert not list((node.state_dir / "rdma-excl").glob("*.json")), "DEL cleaned the state"
    lab.rxe.extend(devices)


def test_pod_whose_namespace_died_first_gives_its_nic_and_device_back(lab, node):
    """The guest's virtio NIC (a physical NIC: the kernel hands it back when its namespace dies).
    The pod dies without DEL; DEL then succeeds from the state, the NIC is on the host again under
    its own name, and the device plugin stops counting the device as in a pod. Soft-RoCE itself is
    deleted by the kernel when its netdev leaves the namespace (a real NIC's RDMA device comes back
    with it, see test_2): the plugin drops that unit rather than keeping a device that is gone."""
    from integration.guest_suite.test_2_exclusive import virtio_nics

    nics = virtio_nics()
    assert len(nics) >= 2, "the exclusive boot must have --net-loop's two virtio NICs"
    nic = nics[1]
    mac = json.loads(sh("ip", "-j", "link", "show", nic).stdout)[0]["address"]
    pod = f"pd{lab.tag}"
    sh("ip", "netns", "add", pod)
    lab.pods.append(pod)
    prev = host_device_add(pod, nic, "fd00:52::1/64")
    device = f"rxg{lab.tag}d"
    in_pod(pod, "rdma", "link", "add", device, "type", "rxe", "netdev", "net1")
    plugin = node.plugin()
    plugin.wait_for(lambda u: device in u.ids(), RPC_TIMEOUT, "the rxe device listed")
    assert node.kubelet.admit_pod("ns", pod, {"main": {RESOURCE: 1}})["main"][RESOURCE] == [device]
    conf = node.conf(prev)
    timed_cni("exclusive-paired", "ADD", conf, container_id=pod, netns=f"/var/run/netns/{pod}", ifname="net1",
              extra_env=pod_args(pod)).ok()
    assert rdma_devices(pod) == [device]
    time.sleep(3 * INTERVAL)
    assert plugin.latest.health()[device] == "Healthy", "away in the pod: still listed"

    sh("ip", "netns", "del", pod)
    lab.pods.remove(pod)
    timed_cni("exclusive-paired", "DEL", conf, container_id=pod, netns=f"/var/run/netns/{pod}", ifname="net1",
              extra_env=pod_args(pod)).ok()
    host_device_del(pod, nic, "")  # its namespace is gone: as containerd's later DELs send it
    assert not list((node.state_dir / "rdma-excl").glob("*.json")), "DEL cleaned the state"
    deadline = time.monotonic() + 30
    while True:
        links = {lk["ifname"]: lk.get("address") for lk in json.loads(sh("ip", "-j", "link", "show").stdout)}
        back = sorted(name for name, address in links.items() if address == mac)
        if back or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert back, f"the NIC ({mac}) did not come back to the host: {links}"
    time.sleep(2)  # udev may still rename it (it raced a rename here once)
    links = {lk["ifname"]: lk.get("address") for lk in json.loads(sh("ip", "-j", "link", "show").stdout)}
    back = sorted(name for name, address in links.items() if address == mac)
    assert back, f"the NIC ({mac}) left the host again: {links}"
    record("NIC back after its pod died (names with its MAC)", back)
    if nic not in back and nic not in links:  # came back under the pod's name: give it its own
        sh("ip", "link", "set", back[0], "name", nic, check=False)
    assert device not in rdma_devices(), "rxe is deleted with its netdev's namespace change"
    plugin.wait_for(lambda u: device not in u.ids(), RPC_TIMEOUT, "the deleted rxe device dropped")
    node.kubelet.forget_pod("ns", pod)
