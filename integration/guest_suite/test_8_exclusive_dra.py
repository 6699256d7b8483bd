"""Exclusive mode through DRA, on the kernel booted exclusive (ib_core.netns_mode=0): the real
kube-apiserver and kube-scheduler (control_plane.py) allocate the guest's Soft-RoCE devices from
the ResourceSlice the real DRA driver (rdma-netns-dp, dra.enabled) publishes, and the CNI moves
exactly the allocated device into each pod.

- in exclusive mode a device takes one claim: two pods get the two devices, a third pod stays
  Pending with the scheduler's reason;
- the test plays kubelet's part as kubelet v1.37.2 does it (plugin-watcher registration with its
  1 s GetInfo and 5 s notify deadlines, NodePrepareResources and NodeUnprepareResources with its
  45 s call deadline, then the CNI with the pod's UID in CNI_ARGS); that part is the same in both
  kernel modes and runs against the real kubelet in integration/cluster/test_dra.py;
- the claim's CDI device names the pod's own uverbs node, a "container" given only those nodes
  opens its device and not the other, RC traffic runs between the pods, the claim's status shows
  the pod's interface, the slice keeps a device listed while it is in a pod, and DEL plus
  unprepare leave nothing;
- a slice deleted behind the driver's back is written again (its watch on the real API server).

Soft-RoCE's way into a pod is test_5's (exclusive.py): host-device moves the netdev, rxe is made
again on it inside the pod (it registers in the initial namespace), rdma-netns moves it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest

from integration.guest_suite.conftest import RESULTS, SYSTEM_PYTHON, in_pod, rdma_devices, record_timing, sh, timed_cni
from integration.guest_suite.control_plane import ControlPlane
from integration.guest_suite.exclusive import (OPEN, booted_exclusive, cdi_device_nodes,  # noqa: F401
                                               confined, host_device_add, kernel_uverbs, rc_exchange,
                                               stop_daemon)
from rdma_netns.publish.pod_cdi import spec_path
from rdma_netns_dp.api.dra.v1 import api_pb2 as dra_pb2
from rdma_netns_dp.api.dra.v1 import api_pb2_grpc as dra_grpc
from rdma_netns_dp.api.pluginregistration.v1 import api_pb2 as reg_pb2
from rdma_netns_dp.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from rdma_netns_dp.dra import kube_api
from tests.conftest import run_plugin

pytestmark = [pytest.mark.guest, pytest.mark.usefixtures("booted_exclusive")]

DP = str(Path(sys.executable).parent / "rdma-netns-dp")
DRIVER = "rdma-netns.io"
CLASS = "rdma-netns-io-rails"
NODE = "excl-guest"
NAMESPACE = "default"
CDI_KIND = "rdma-netns.io/pod"
# kubelet v1.37.2: pkg/kubelet/pluginmanager/operationexecutor/operation_generator.go (GetInfo 1 s,
# NotifyRegistrationStatus 5 s), pkg/kubelet/cm/dra/plugin/dra_plugin.go (defaultClientCallTimeout).
GET_INFO_TIMEOUT, NOTIFY_TIMEOUT, CALL_TIMEOUT = 1, 5, 45
START_TIMEOUT = 240   # the driver's grpc and pydantic imports under TCG
SCHEDULE_TIMEOUT = 180
INTERVAL = 0.5


def record(name: str, value: object) -> None:
    with open(RESULTS / "exclusive-boot-facts.jsonl", "a") as f:
        f.write(json.dumps({"name": f"DRA: {name}", "value": value}) + "\n")


class DraNode:
    """The DRA driver as the chart runs it (its own kubelet folder, CDI folder, broker) and the
    kubelet side of its gRPC API."""

    def __init__(self, tmp: Path, kubeconfig: Path, selector: str) -> None:
        self.tmp = tmp
        self.base = Path(tempfile.mkdtemp(prefix="h8-", dir="/tmp"))  # short: socket paths
        self.kubelet_dir = self.base / "k"
        self.broker = self.base / "g" / "pod-grants.sock"
        self.cdi_dir = self.base / "cdi"
        self.state_dir = tmp / "state"
        self.log_file = tmp / "dp.log"
        config = tmp / "dp.json"
        config.write_text(json.dumps({
            "resources": [{"name": "rdma/hca", "selectors": {"rdmaDevices": [selector]}}],
            "dra": {"enabled": True, "nodeName": NODE, "kubeconfig": str(kubeconfig)}}))
        self.proc = subprocess.Popen(
            [DP, "--config", str(config), "--kubelet-dir", str(self.kubelet_dir), "--mode", "exclusive",
             "--health-interval", str(INTERVAL), "--health-file", str(tmp / "health.json"),
             "--cni-state-dir", str(self.state_dir), "--cdi", "--cdi-dir", str(self.cdi_dir),
             "--pod-grants-socket", str(self.broker), "--log-level", "info"],
            stdout=subprocess.DEVNULL, stderr=open(self.log_file, "w"))
        self.channel: grpc.Channel | None = None

    def log(self) -> str:
        return self.log_file.read_text()[-4000:]

    def register(self) -> None:
        """The plugin watcher's handshake: GetInfo on the registration socket (retried, as the
        watcher's reconciler does), the answer checked, NotifyRegistrationStatus."""
        socket = self.kubelet_dir / "plugins_registry" / f"{DRIVER}-reg.sock"
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            assert self.proc.poll() is None, f"the driver exited:\n{self.log()}"
            if socket.exists():
                try:
                    with grpc.insecure_channel(f"unix://{socket}") as channel:
                        stub = reg_grpc.RegistrationStub(channel)
                        info = stub.GetInfo(reg_pb2.InfoRequest(), timeout=GET_INFO_TIMEOUT)
                        assert (info.type, info.name) == ("DRAPlugin", DRIVER), info
                        assert list(info.supported_versions) == ["v1.DRAPlugin", "v1.DRAResourceHealth"], info
                        stub.NotifyRegistrationStatus(reg_pb2.RegistrationStatus(plugin_registered=True),
                                                      timeout=NOTIFY_TIMEOUT)
                        endpoint = info.endpoint
                        break
                except grpc.RpcError:
                    pass
            assert time.monotonic() < deadline, f"the driver never registered:\n{self.log()}"
            time.sleep(INTERVAL)
        self.channel = grpc.insecure_channel(f"unix://{endpoint}")
        self.stub = dra_grpc.DRAPluginStub(self.channel)

    def prepare(self, claim: dict) -> dra_pb2.NodePrepareResourceResponse:
        meta = claim["metadata"]
        request = dra_pb2.NodePrepareResourcesRequest(
            claims=[dra_pb2.Claim(namespace=meta["namespace"], uid=meta["uid"], name=meta["name"])])
        answer = self.stub.NodePrepareResources(request, timeout=CALL_TIMEOUT).claims[meta["uid"]]
        assert not answer.error, answer.error
        return answer

    def unprepare(self, claim: dict) -> None:
        meta = claim["metadata"]
        request = dra_pb2.NodeUnprepareResourcesRequest(
            claims=[dra_pb2.Claim(namespace=meta["namespace"], uid=meta["uid"], name=meta["name"])])
        answer = self.stub.NodeUnprepareResources(request, timeout=CALL_TIMEOUT).claims[meta["uid"]]
        assert not answer.error, answer.error

    def cni_conf(self, prev: dict) -> dict:
        return {"cniVersion": "1.0.0", "name": "rdma-excl-dra", "type": "rdma-netns", "mode": "exclusive",
                "resourceName": "rdma/hca", "podGrantsSocket": str(self.broker),
                "podResourcesSocket": str(self.kubelet_dir / "pod-resources" / "kubelet.sock"),
                "podResourcesTimeoutMs": 10000, "cdiSpecDir": str(self.cdi_dir), "cdiKind": CDI_KIND,
                "podInfoDir": str(self.tmp / "pod-info"), "stateDir": str(self.state_dir), "prevResult": prev}

    def cdi_nodes(self, cdi_id: str) -> list[dict]:
        """The nodes a runtime makes for the claim's CDI device."""
        return cdi_device_nodes(Path(spec_path(str(self.cdi_dir), cdi_id.split("=", 1)[1])), cdi_id)

    def close(self) -> None:
        shutil.copy(self.log_file, RESULTS / "exclusive-dra-dp.log")
        if self.channel is not None:
            self.channel.close()
        stop_daemon(self.proc)
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture
def control_plane(tmp_path):
    plane = ControlPlane(tmp_path / "k8s")
    started = time.monotonic()
    try:
        plane.start()
        record("control plane up (s)", round(time.monotonic() - started, 1))
        api = plane.api
        plane.add_node(NODE)
        api.create(kube_api.device_classes_path(), {
            "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": CLASS},
            "spec": {"selectors": [{"cel": {"expression": f"device.driver == {DRIVER!r}"}}]}})
        yield plane
    finally:
        plane.stop()


def claim_body(name: str) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "rail", "exactly": {"deviceClassName": CLASS, "count": 1}}]}}}


def pod_body(name: str, claim: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"resourceClaims": [{"name": "rails", "resourceClaimName": claim}],
                     "containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                     "resources": {"claims": [{"name": "rails"}]}}]}}


def cni_args(pod: dict) -> dict:
    meta = pod["metadata"]
    return {"CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE={meta['namespace']};K8S_POD_NAME={meta['name']};"
                        f"K8S_POD_INFRA_CONTAINER_ID={meta['name']};K8S_POD_UID={meta['uid']}"}


def our_slices(api) -> list[dict]:
    return api.list(kube_api.resource_slices_path(), field_selector=f"spec.nodeName={NODE}")["items"]


def slice_devices(api) -> dict[str, dict]:
    return {d["name"]: d for s in our_slices(api) for d in s["spec"].get("devices", [])}


def test_the_scheduler_gives_each_device_one_claim_and_the_cni_moves_exactly_it(lab, control_plane, tmp_path):
    api = control_plane.api
    tag = lab.tag
    nics = {f"rxd{tag}a": f"ya{tag}", f"rxd{tag}b": f"yb{tag}"}  # rdma device -> netdev
    addresses = {f"rxd{tag}a": "fd00:58::1", f"rxd{tag}b": "fd00:58::2"}
    lab.veth(*nics.values())
    for device, netdev in nics.items():
        sh("rdma", "link", "add", device, "type", "rxe", "netdev", netdev)
    node = DraNode(tmp_path, control_plane.admin_kubeconfig, f"rxd{tag}*")
    try:
        node.register()
        # The slice: both devices, one claim each (no allowMultipleAllocations, no capacity).
        devices = control_plane.wait_for("the node's ResourceSlice with both devices",
                                         lambda: (d := slice_devices(api)) and set(d) == set(nics) and d, START_TIMEOUT)
        for device in devices.values():
            assert "allowMultipleAllocations" not in device and "capacity" not in device, device
            assert device["attributes"]["kernelMode"] == {"string": "exclusive"}, device
            assert "taints" not in device, device
        record("slice devices", sorted(devices))

        # Someone deletes the slice: the driver's watch on the real API server sees it and writes
        # the slice again (a new object), with nothing on the node changing meanwhile.
        (gone,) = our_slices(api)
        api.delete(kube_api.resource_slices_path(gone["metadata"]["name"]))
        deleted_at = time.monotonic()
        control_plane.wait_for("the deleted slice written again", lambda: [
            s for s in our_slices(api) if s["metadata"]["uid"] != gone["metadata"]["uid"]
            and {d["name"] for d in s["spec"].get("devices", [])} == set(nics)], 60)
        record("deleted slice written again after (s)", round(time.monotonic() - deleted_at, 1))

        # Three pods, one claim each: the real scheduler allocates the two devices and no more.
        claims = {}
        for p in ("a", "b", "c"):
            api.create(kube_api.resource_claims_path(NAMESPACE), claim_body(f"rails-{p}{tag}"))
            api.create(f"/api/v1/namespaces/{NAMESPACE}/pods", pod_body(f"p{p}{tag}", f"rails-{p}{tag}"))

        def verdicts() -> dict | None:
            """Each pod: bound to the node, or the scheduler's reason; None while one is undecided."""
            out = {}
            for p in ("a", "b", "c"):
                pod = api.get(f"/api/v1/namespaces/{NAMESPACE}/pods/p{p}{tag}")
                reasons = [c.get("message") for c in pod.get("status", {}).get("conditions", [])
                           if c["type"] == "PodScheduled" and c["status"] == "False" and c.get("message")]
                if pod["spec"].get("nodeName") == NODE:
                    out[p] = pod
                elif reasons:
                    out[p] = reasons[0]
            return out if len(out) == 3 and sum(isinstance(v, dict) for v in out.values()) >= 2 else None

        created = time.monotonic()
        decided = control_plane.wait_for("two pods bound and the scheduler's verdict on the third", verdicts,
                                         SCHEDULE_TIMEOUT)
        record("two pods bound after (s)", round(time.monotonic() - created, 1))
        pods = {p: v for p, v in decided.items() if isinstance(v, dict)}
        pending = {p: v for p, v in decided.items() if isinstance(v, str)}
        assert len(pods) == 2 and len(pending) == 1, f"a device that has a claim got another: {decided}"
        (message,) = pending.values()
        assert "cannot allocate all claims" in message, message
        record("third pod", message)
        # The test's two pods, whichever the scheduler chose: "a" and "b" from here on.
        pods = dict(zip(("a", "b"), pods.values()))
        claim_names = {p: pod["spec"]["resourceClaims"][0]["resourceClaimName"] for p, pod in pods.items()}
        allocated = {}
        for p in ("a", "b"):
            claim = api.get(kube_api.resource_claims_path(NAMESPACE, claim_names[p]))
            results = claim["status"]["allocation"]["devices"]["results"]
            assert [(r["driver"], r["pool"]) for r in results] == [(DRIVER, NODE)], results
            assert [r["uid"] for r in claim["status"].get("reservedFor", [])] == [pods[p]["metadata"]["uid"]], claim
            claims[p], allocated[p] = claim, results[0]["device"]
        assert sorted(allocated.values()) == sorted(nics), f"each device to one claim: {allocated}"

        # kubelet prepares each pod's claim, then the runtime runs the network: host-device moves
        # the device's netdev, rxe is made again on it, rdma-netns moves the claim's device.
        netns, prevs, cdi_ids = {}, {}, {}
        for p in ("a", "b"):
            device = allocated[p]
            prepared_at = time.monotonic()
            answer = node.prepare(claims[p])
            record_timing("exclusive-dra prepare", time.monotonic() - prepared_at)
            uid = claims[p]["metadata"]["uid"]
            assert [(d.pool_name, d.device_name, list(d.request_names)) for d in answer.devices] == \
                [(NODE, device, ["rail"])], answer
            cdi_ids[p] = list(answer.devices[0].cdi_device_ids)
            assert cdi_ids[p] == [f"{CDI_KIND}=claim-{uid}"], cdi_ids[p]
            netns[p] = f"dx{p}{tag}"
            sh("ip", "netns", "add", netns[p])
            sh("ip", "-n", netns[p], "link", "set", "lo", "up")
            lab.pods.append(netns[p])
            prevs[p] = host_device_add(netns[p], nics[device], f"{addresses[device]}/64")
            in_pod(netns[p], "rdma", "link", "add", device, "type", "rxe", "netdev", "net1")
            timed_cni("exclusive-dra", "ADD", node.cni_conf(prevs[p]), container_id=netns[p],
                      netns=f"/var/run/netns/{netns[p]}", ifname="net1", extra_env=cni_args(pods[p])).ok()
            assert rdma_devices(netns[p]) == [device], "the pod holds its claim's device and no other"
        assert not set(nics) & set(rdma_devices()), "both devices are in their pods"
        assert len(list((node.state_dir / "rdma-excl-dra").glob("*.json"))) >= 2, "each ADD kept its state"
        lab.rxe.extend(nics)

        # Away in pods, both devices stay in the slice (the scheduler must not lose them).
        time.sleep(4 * INTERVAL)
        assert set(slice_devices(api)) == set(nics), node.log()

        # The claim's CDI device: the uverbs node of the device as the kernel numbers it in the pod;
        # a container given only those nodes opens its device and not the other.
        script = lab.tmp / "open.py"
        script.write_text(OPEN)
        nodes = {}
        for p in ("a", "b"):
            device = allocated[p]
            other = next(d for d in nics if d != device)
            nodes[p] = node.cdi_nodes(cdi_ids[p][0])
            uverbs = kernel_uverbs(netns[p], device)
            assert {(n["major"], n["minor"]) for n in nodes[p] if "uverbs" in n["path"]} == {uverbs}, nodes[p]
            opened = sh(*confined(netns[p], nodes[p], SYSTEM_PYTHON, str(script), device, other), timeout=300)
            result = json.loads(opened.stdout.strip().splitlines()[-1])
            assert result[device]["ok"] is True and result[other]["ok"] is False, result

        # The claim's status: the driver wrote the pod's interface (KEP-4817).
        def network_data(p: str):
            claim = api.get(kube_api.resource_claims_path(NAMESPACE, claim_names[p]))
            entries = claim.get("status", {}).get("devices") or []
            return entries[0].get("networkData") if entries else None

        for p in ("a", "b"):
            data = control_plane.wait_for(f"claim {claim_names[p]}'s networkData", lambda p=p: network_data(p), 60)
            assert data["interfaceName"] == "net1", data
            assert f"{addresses[allocated[p]]}/64" in data.get("ips", []), data
        record("networkData", network_data("a"))

        # RC between the two confined processes, as a job connects (exclusive.rc_exchange).
        order = ("a", "b")
        verdict = rc_exchange([netns[p] for p in order], [nodes[p] for p in order],
                              [addresses[allocated[p]] for p in order], [allocated[p] for p in order])
        record("rc_exchange", verdict)

        # DEL gives each device back; kubelet unprepares; nothing of the claims is left.
        for p in ("a", "b"):
            conf = node.cni_conf(prevs[p])
            timed_cni("exclusive-dra", "DEL", conf, container_id=netns[p], netns=f"/var/run/netns/{netns[p]}",
                      ifname="net1", extra_env=cni_args(pods[p])).ok()
            assert allocated[p] in rdma_devices() and rdma_devices(netns[p]) == []
            node.unprepare(claims[p])
            run_plugin("DEL", conf, container_id=netns[p], netns="", ifname="net1", timeout=300).ok()
        checkpoint = json.loads((node.kubelet_dir / "plugins" / DRIVER / "checkpoint.json").read_text())
        assert not checkpoint.get("claims"), checkpoint
        assert not list(node.cdi_dir.glob("*claim-*")), sorted(p.name for p in node.cdi_dir.iterdir())
        assert not list((node.state_dir / "rdma-excl-dra").glob("*.json")), "DEL cleaned the state"
    finally:
        node.close()
