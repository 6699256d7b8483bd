"""rdma/hca through DRA on the real cluster: the chart's DRA mode on the host node (its veth rails
and fake RDMA devices, integration/cluster/host_rdma.py), the real scheduler making and allocating
the claims, the real kubelet preparing them through the driver's gRPC API.

- the driver publishes the node's rails as a ResourceSlice and the node advertises no rdma/hca;
- the seed's Job (`rdma/hca: 1`, unchanged) runs through the DeviceClass's extendedResourceName:
  the scheduler made each pod's claim, each pod has exactly its claim's rail, with CDI's settings
  for that rail, and the claim's status.devices shows the pod's interface, addresses and MAC;
- a ResourceClaimTemplate for two rails gives the pod both;
- a claim for a GPU and a rail with matchAttribute resource.kubernetes.io/pcieRoot gets the rail
  under its GPU's root (GPUs of a fake DRA driver, integration/cluster/fake_gpu_driver.py; each
  host rail's NIC under a root of its own), and a GPU under a root with no NIC leaves the pod
  Pending with the scheduler's reason;
- the rails' GID entries are consumable capacity: with a rail offering two pods' entries
  (dra.gidEntriesLimit), a third pod stays Pending with the scheduler's reason and starts when one
  of the first two is deleted;
- the driver's pod and kubelet restart with prepared claims: the pods keep their rails, no claim
  is prepared twice, a new pod still starts;
- helm uninstall removes the DeviceClass; the slice goes with the driver's node objects.
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from integration.cluster import manifests, namespaces
from integration.cluster.conftest import REPORT
from integration.cluster.fake_gpu_driver import DRIVER as GPU_DRIVER
from integration.cluster.host_rdma import RAILS, rail_netdev, rail_pci
from integration.cluster.layout import API_PORT, CONTROL_IP, HOST_NODE, REPO

pytestmark = pytest.mark.cluster

CHART = REPO / "deploy" / "helm" / "rdma-netns"
NAMESPACE = "dra"
DRIVER = "rdma-netns.io"
CLASS = "rdma-netns-io-rails"
RAIL_LIST = [{"netdev": rail_netdev(r), "ifname": f"rdma{r}"} for r in range(RAILS)]
ENTRIES_PER_POD = 2  # Soft-RoCE: one GID entry per address; a pod's own and link-local address
RAIL_SCRIPT = r"""
for i in /sys/class/net/*; do echo "if ${i##*/}"; done
[ -f /etc/nccl.conf ] && while read -r line; do case $line in NCCL_*) echo "nccl $line";; esac; done < /etc/nccl.conf
for d in /dev/infiniband/*; do [ -e "$d" ] && echo "dev $d"; done
exit 0
"""
SLEEP = "trap 'exit 0' TERM; while :; do sleep 1; done"
# Reports, then stays up: a finished pod's claims are released, so they are read while it runs.
REPORT_AND_WAIT = RAIL_SCRIPT.replace("exit 0", "") + "echo reported\n" + SLEEP


def image_values(image) -> list[str]:
    repository, digest = image.pinned.split("@")
    return ["--set", f"image.repository={repository}", "--set", f"image.digest={digest}"]


def dp_pod(cluster) -> dict:
    (pod,) = [p for p in cluster.get("pods", "-n", "kube-system", "-l", "app.kubernetes.io/name=rdma-netns-dp")["items"]
              if not p["metadata"].get("deletionTimestamp")]
    return pod


def ds_ready(cluster) -> bool:
    status = cluster.get("ds", "rdma-netns-dp", "-n", "kube-system")["status"]
    return status.get("numberReady", 0) == 1 and status.get("updatedNumberScheduled", 0) == 1


def driver_log(cluster) -> list[dict]:
    text = cluster.kubectl("logs", "-n", "kube-system", dp_pod(cluster)["metadata"]["name"], "-c", "rdma-netns-dp").stdout
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def report(cluster, pod: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in cluster.kubectl("logs", "-n", NAMESPACE, pod).stdout.splitlines():
        kind, _, rest = line.partition(" ")
        out.setdefault(kind, []).append(rest)
    return out


def slices(cluster) -> list[dict]:
    return [s for s in cluster.get("resourceslices")["items"] if s["spec"]["driver"] == DRIVER]


def claim_pod(image: str, name: str, rails: int, script: str = SLEEP) -> list[dict]:
    """A pod with a ResourceClaimTemplate asking for `rails` rails of the DeviceClass."""
    template = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": f"{name}-rails", "namespace": NAMESPACE},
                "spec": {"spec": {"devices": {"requests": [
                    {"name": "rails", "exactly": {"deviceClassName": CLASS, "count": rails}}]}}}}
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE},
           "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 2,
                    "resourceClaims": [{"name": "rails", "resourceClaimTemplateName": f"{name}-rails"}],
                    "containers": [{"name": "app", "image": image, "command": ["/bin/sh", "-c", script],
                                    "resources": {"claims": [{"name": "rails"}]}}]}}
    return [template, pod]


def apply(cluster, objects: list[dict]) -> None:
    cluster.kubectl("apply", "-f", "-", stdin="\n---\n".join(json.dumps(o) for o in objects))


def phase(cluster, pod: str) -> str:
    return cluster.get("pod", pod, "-n", NAMESPACE)["status"].get("phase", "")


def pod_claims(cluster, pod: str) -> list[dict]:
    """The ResourceClaims reserved for the pod (made from its template or by the scheduler)."""
    uid = cluster.get("pod", pod, "-n", NAMESPACE)["metadata"]["uid"]
    return [c for c in cluster.get("resourceclaims", "-n", NAMESPACE)["items"]
            if any(r.get("uid") == uid for r in c.get("status", {}).get("reservedFor") or [])]


@pytest.fixture(scope="module")
def dra(cluster, release_image):
    """The chart with dra.enabled on the host node; each rail offers two pods' GID entries."""
    cluster.helm("install", "rdma-netns", str(CHART), "-n", "kube-system", "--set-json",
                 f"rails={json.dumps(RAIL_LIST)}", "--set", "dra.enabled=true",
                 "--set", f"dra.gidEntriesLimit={2 * ENTRIES_PER_POD}",
                 # no kube-proxy in this cluster: the driver's hostNetwork pod reaches the API server directly
                 "--set", f"dra.apiServer={CONTROL_IP}:{API_PORT}", *image_values(release_image))
    cluster.kubectl("label", "node", HOST_NODE, "rdma-netns.io/rdma=true")
    began = time.monotonic()
    cluster.wait_for("the DRA DaemonSet Ready", lambda: ds_ready(cluster), timeout=300)
    cluster.wait_for("the node's ResourceSlice", lambda: len(slices(cluster)) == 1, timeout=60)
    REPORT.append(f"DRA mode: DaemonSet Ready and the node's ResourceSlice published {time.monotonic() - began:.1f} s "
                  "after labelling")
    cluster.kubectl("create", "namespace", NAMESPACE)
    yield release_image
    cluster.helm("uninstall", "rdma-netns", "-n", "kube-system", "--wait", timeout=300)


def test_the_driver_publishes_the_nodes_rails_and_no_rdma_hca_units(cluster, dra):
    (published,) = slices(cluster)
    spec = published["spec"]
    assert (spec["nodeName"], spec["pool"]["name"], spec["pool"]["resourceSliceCount"]) == (HOST_NODE, HOST_NODE, 1)
    assert published["metadata"]["ownerReferences"][0]["kind"] == "Node"
    devices = {d["name"]: d for d in spec["devices"]}
    assert sorted(devices) == [f"rxe{r}" for r in range(RAILS)]
    for r in range(RAILS):
        device = devices[f"rxe{r}"]
        assert device["attributes"]["rdmaDevice"] == {"string": f"rxe{r}"}
        assert device["attributes"]["netdev"] == {"string": rail_netdev(r)}
        assert device["attributes"]["resource.kubernetes.io/pcieRoot"] == {"string": rail_pci(r)[0]}
        assert device["allowMultipleAllocations"] is True
        capacity = device["capacity"]["gidEntries"]
        assert capacity["value"] == str(2 * ENTRIES_PER_POD)
        assert capacity["requestPolicy"]["validValues"] == [str(ENTRIES_PER_POD)]
    assert "rdma/hca" not in cluster.get("node", HOST_NODE)["status"].get("allocatable", {})
    (device_class,) = [c for c in cluster.get("deviceclasses")["items"] if c["metadata"]["name"] == CLASS]
    assert device_class["spec"]["extendedResourceName"] == "rdma/hca"
    status = json.loads(cluster.kubectl("exec", "-n", "kube-system", dp_pod(cluster)["metadata"]["name"], "-c",
                                        "rdma-netns-dp", "--", "cat", "/run/rdma-netns-dp/health.json").stdout)
    assert status["dra"]["registered"] is True and status["dra"]["devices"] == RAILS, status["dra"]
    REPORT.append("kubectl get resourceslice (the rails, excerpt): " + json.dumps(devices["rxe0"]))


def test_the_seed_job_runs_unchanged_through_the_extended_resource(cluster, dra):
    name = "seed-dra"
    # The pods stay up after their report: the scheduler's claim goes with a finished pod.
    job = manifests.training_job(dra.pinned, name, REPORT_AND_WAIT, pods=2)
    began = time.monotonic()
    cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", stdin=json.dumps(job))

    def reported() -> bool:
        pods = cluster.get("pods", "-n", NAMESPACE, "-l", f"job-name={name}")["items"]
        return len(pods) == 2 and all(p["status"].get("phase") == "Running" and "reported" in report(
            cluster, p["metadata"]["name"]) for p in pods)
    cluster.wait_for("both pods Running and reported", reported, timeout=300)
    REPORT.append(f"the seed's Job (rdma/hca: 1 each, through DRA): both pods Running {time.monotonic() - began:.1f} s "
                  "after apply")
    pods = cluster.get("pods", "-n", NAMESPACE, "-l", f"job-name={name}")["items"]
    for pod in pods:
        pod_name = pod["metadata"]["name"]
        made = pod["status"].get("extendedResourceClaimStatus") or {}
        assert made.get("resourceClaimName"), f"the scheduler made no claim for {pod_name}: {pod['status']}"
        # The driver writes the claim's device status on its next pass after the pod's ADD.
        cluster.wait_for("the claim's networkData", lambda: any(
            d.get("networkData") for d in cluster.get("resourceclaim", made["resourceClaimName"], "-n", NAMESPACE)
            ["status"].get("devices") or []), timeout=30)
        claim = cluster.get("resourceclaim", made["resourceClaimName"], "-n", NAMESPACE)
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert (result["driver"], result["pool"]) == (DRIVER, HOST_NODE)
        assert result.get("consumedCapacity", {}).get("gidEntries") == str(ENTRIES_PER_POD), result
        rail = int(result["device"].removeprefix("rxe"))
        got = report(cluster, pod_name)
        assert set(got["if"]) == {"lo", "eth0", f"rdma{rail}"}, got  # its claim's rail, no other
        nccl = dict(line.split("=", 1) for line in got.get("nccl", []))
        assert nccl.get("NCCL_IB_HCA") == f"=rxe{rail}:1", got
        assert nccl.get("NCCL_IB_GID_INDEX", "").isdigit(), got
        (device_status,) = claim["status"].get("devices") or [{}]
        network = device_status.get("networkData", {})
        assert network.get("interfaceName") == f"rdma{rail}", claim["status"]
        assert any(ip.startswith(f"fd00:1{rail}:") for ip in network.get("ips", [])), network
        assert network.get("hardwareAddress"), network
        REPORT.append(f"{pod_name}: claim {made['resourceClaimName']} -> {result['device']}, interfaces "
                      f"{sorted(got['if'])}, NCCL_IB_HCA={nccl['NCCL_IB_HCA']} NCCL_IB_GID_INDEX="
                      f"{nccl['NCCL_IB_GID_INDEX']}; claim status.devices networkData {json.dumps(network)}")
    cluster.kubectl("delete", "job", name, "-n", NAMESPACE, "--cascade=foreground", "--wait=true", timeout=120)


def test_a_claims_config_this_driver_does_not_know_fails_the_pod_with_the_reason(cluster, dra):
    """Opaque config for this driver is checked at prepare: a typo is the pod's event, not ignored."""
    template, pod = claim_pod(dra.pinned, "bad-config", 1)
    template["spec"]["spec"]["devices"]["config"] = [{"requests": ["rails"], "opaque": {
        "driver": DRIVER, "parameters": {"apiVersion": "rdma-netns.io/v1alpha1", "kind": "RailConfig",
                                         "linkTyp": "ipvlan"}}}]
    apply(cluster, [template, pod])

    def refused() -> str:
        events = cluster.get("events", "-n", NAMESPACE, "--field-selector", "involvedObject.name=bad-config")["items"]
        return next((e["message"] for e in events if "unknown fields" in e.get("message", "")), "")
    cluster.wait_for("the pod's event with the driver's reason", lambda: bool(refused()), timeout=120)
    assert phase(cluster, "bad-config") == "Pending"
    REPORT.append(f"a claim with a mistyped RailConfig: the pod stays Pending, its event: {refused()[:300]}")
    cluster.kubectl("delete", "pod", "bad-config", "-n", NAMESPACE, "--wait=true")


def test_a_claim_for_two_rails_gives_the_pod_both(cluster, dra):
    apply(cluster, claim_pod(dra.pinned, "two-rails", 2, REPORT_AND_WAIT))
    cluster.wait_for("the pod Running and reported", lambda: phase(cluster, "two-rails") == "Running"
                     and "reported" in report(cluster, "two-rails"), timeout=180)
    got = report(cluster, "two-rails")
    # kubelet shows the devices' health (the driver's DRAResourceHealth stream) in the status of a
    # container that names the claim, one entry per CDI device ID: a claim's rails share the
    # claim's one CDI device, so one entry stands for them (pkg/kubelet/cm/dra/manager.go).
    waited = cluster.wait_for("the rails' health in the pod's status", lambda: '"Healthy"' in json.dumps(
        cluster.get("pod", "two-rails", "-n", NAMESPACE)["status"]["containerStatuses"][0]
        .get("allocatedResourcesStatus", [])), timeout=60)
    REPORT.append("kubelet's allocatedResourcesStatus of the two-rail pod: " + json.dumps(
        cluster.get("pod", "two-rails", "-n", NAMESPACE)["status"]["containerStatuses"][0]["allocatedResourcesStatus"])
                  + f" ({waited:.1f} s after it was Running)")
    assert set(got["if"]) == {"lo", "eth0", *(f"rdma{r}" for r in range(RAILS))}, got
    nccl = dict(line.split("=", 1) for line in got.get("nccl", []))
    assert nccl.get("NCCL_IB_HCA") == "=" + ",".join(f"rxe{r}:1" for r in range(RAILS)), got
    assert len([d for d in got["dev"] if "uverbs" in d]) == RAILS, got
    cluster.kubectl("delete", "pod", "two-rails", "-n", NAMESPACE, "--wait=true")


@pytest.fixture(scope="module")
def fake_gpus(cluster, dra):
    """gpu-0 and gpu-1 under rail 0's and rail 1's roots, gpu-9 under a root with no NIC."""
    gpus = [["gpu-0", rail_pci(0)[0]], ["gpu-1", rail_pci(1)[0]], ["gpu-9", "pci0000:f0"]]
    namespaces.spawn(cluster.layout, "fake-gpu-driver", [
        sys.executable, "-m", "integration.cluster.fake_gpu_driver", "--kubeconfig", str(cluster.layout.admin_kubeconfig),
        "--node", HOST_NODE, "--gpus", json.dumps(gpus)], env={"PYTHONPATH": str(REPO)})
    apply(cluster, [{"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": GPU_DRIVER},
                     "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{GPU_DRIVER}"'}}]}}])
    cluster.wait_for("the fake GPUs' slice", lambda: any(s["spec"]["driver"] == GPU_DRIVER
                                                         for s in cluster.get("resourceslices")["items"]), timeout=60)
    yield
    namespaces.stop(cluster.layout, "fake-gpu-driver")


def aligned_pod(image: str, name: str, gpu: int) -> list[dict]:
    """A pod whose claim asks for GPU number `gpu` and one rail under the same PCIe root."""
    template, pod = claim_pod(image, name, 1, REPORT_AND_WAIT)
    template["spec"]["spec"]["devices"] = {
        "requests": [
            {"name": "gpu", "exactly": {"deviceClassName": GPU_DRIVER, "count": 1, "selectors": [
                {"cel": {"expression": f'device.attributes["{GPU_DRIVER}"].index == {gpu}'}}]}},
            {"name": "rails", "exactly": {"deviceClassName": CLASS, "count": 1}}],
        "constraints": [{"requests": ["gpu", "rails"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}]}
    return [template, pod]


def test_a_rail_aligned_with_a_gpu_lands_under_its_root(cluster, dra, fake_gpus):
    apply(cluster, aligned_pod(dra.pinned, "aligned", 1))
    cluster.wait_for("the aligned pod Running and reported", lambda: phase(cluster, "aligned") == "Running"
                     and "reported" in report(cluster, "aligned"), timeout=180)
    got = report(cluster, "aligned")
    assert set(got["if"]) == {"lo", "eth0", "rdma1"}, got  # rail 1: the one under gpu-1's root
    (claim,) = pod_claims(cluster, "aligned") or [None]
    results = {r["request"]: r["device"] for r in claim["status"]["allocation"]["devices"]["results"]}
    assert results == {"gpu": "gpu-1", "rails": "rxe1"}, results
    REPORT.append(f"GPU-NIC alignment: claim {results} (pcieRoot {rail_pci(1)[0]}), the pod's rails {sorted(got['if'])}")
    apply(cluster, aligned_pod(dra.pinned, "misaligned", 2))
    time.sleep(5)
    pod = cluster.get("pod", "misaligned", "-n", NAMESPACE)
    (condition,) = [c for c in pod["status"].get("conditions", []) if c["type"] == "PodScheduled"]
    assert condition["status"] == "False" and condition["reason"] == "Unschedulable", condition
    REPORT.append(f"GPU-NIC alignment impossible (gpu-9 under a root with no NIC): Pending, scheduler: "
                  f"{condition['message']}")
    cluster.kubectl("delete", "pod", "aligned", "misaligned", "-n", NAMESPACE, "--wait=true")


def test_gid_entries_are_capacity_the_scheduler_respects(cluster, dra):
    """Each rail offers two pods' entries: two pods of two rails fit, the third waits for one."""
    for name in ("cap-a", "cap-b", "cap-c"):
        apply(cluster, claim_pod(dra.pinned, name, RAILS))
        if name != "cap-c":
            cluster.wait_for(f"{name} Running", lambda: phase(cluster, name) == "Running", timeout=180)
    time.sleep(5)
    pod = cluster.get("pod", "cap-c", "-n", NAMESPACE)
    assert pod["status"].get("phase") == "Pending" and not pod["spec"].get("nodeName"), pod["status"]
    (condition,) = [c for c in pod["status"].get("conditions", []) if c["type"] == "PodScheduled"]
    assert condition["status"] == "False" and condition["reason"] == "Unschedulable", condition
    REPORT.append(f"consumable capacity: the third pod Pending, scheduler: {condition['message']}")
    cluster.kubectl("delete", "pod", "cap-a", "-n", NAMESPACE, "--wait=true")
    waited = cluster.wait_for("cap-c Running once cap-a left", lambda: phase(cluster, "cap-c") == "Running",
                              timeout=180)
    REPORT.append(f"consumable capacity: the third pod Running {waited:.1f} s after the first was deleted")


def test_driver_and_kubelet_restarts_keep_prepared_claims(cluster, dra):
    """cap-b and cap-c hold prepared claims: a new driver pod and a restarted kubelet lose
    nothing and prepare nothing twice."""
    claims = {c["metadata"]["uid"] for p in ("cap-b", "cap-c") for c in pod_claims(cluster, p)}
    assert len(claims) == 2
    before = dp_pod(cluster)["metadata"]["name"]
    cluster.kubectl("delete", "pod", before, "-n", "kube-system", "--wait=true")
    cluster.wait_for("the driver's new pod Ready", lambda: dp_pod(cluster)["metadata"]["name"] != before
                     and ds_ready(cluster), timeout=300)
    cluster.restart_kubelet()
    cluster.wait_for("the node Ready again", lambda: cluster.node_ready(HOST_NODE), timeout=120)
    time.sleep(10)  # kubelet prepares its running pods' claims again after a restart
    for name in ("cap-b", "cap-c"):
        assert phase(cluster, name) == "Running"
        out = cluster.kubectl("exec", "-n", NAMESPACE, name, "--", "/bin/sh", "-c",
                              "for i in /sys/class/net/*; do echo ${i##*/}; done").stdout.split()
        assert {f"rdma{r}" for r in range(RAILS)} <= set(out), out
    prepared = [e for e in driver_log(cluster) if e.get("msg") == "claim prepared"]
    assert not prepared, f"the new driver prepared again what its checkpoint held: {prepared}"
    apply(cluster, claim_pod(dra.pinned, "after-restart", 1, RAIL_SCRIPT))
    cluster.kubectl("delete", "pod", "cap-b", "-n", NAMESPACE, "--wait=true")
    cluster.wait_for("a new pod starts after the restarts", lambda: phase(cluster, "after-restart") == "Succeeded",
                     timeout=180)
    REPORT.append("driver pod and kubelet restarted with 2 prepared claims: pods kept their rails, nothing prepared twice")
