"""The seed's procedure on a real Kubernetes (kube-apiserver, controller manager, scheduler and
kubelet of the pinned release, containerd 1.7 with CDI): the DaemonSet applied with kubectl as
written (image and rails edited), the node's `rdma/hca` capacity, Pod Security, the seed's Job
without hostNetwork, a pod without rdma/hca, kubelet restarted, and the uninstall.

The node is this machine (integration/cluster/host_rdma.py: veth rails, fake RDMA devices at /sys
of the node), so the pods get rails, char devices and NCCL/UCX settings exactly as on an RDMA
node, but move no RDMA traffic: the real-kernel suites do that."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from integration.cluster import manifests
from integration.cluster.conftest import REPORT
from integration.cluster.host_rdma import RAILS
from integration.cluster.layout import HOST_NODE, REPO

pytestmark = pytest.mark.cluster

NAMESPACE = "ml"
DS = "rdma-netns-dp"
# What a Job's pod prints for the test: its interfaces and addresses, char devices, and the
# settings CDI gave it; then it exits 0 (the Job completes).
REPORT_SCRIPT = r"""
for i in /sys/class/net/*; do echo "if ${i##*/}"; done
while read -r a idx plen scope flags name; do echo "inet6 $name $a $scope"; done < /proc/net/if_inet6
for d in /dev/infiniband/*; do [ -e "$d" ] && echo "dev $d"; done
env | while read -r line; do case $line in NCCL_*|UCX_*) echo "env $line";; esac; done
[ -f /etc/nccl.conf ] && while read -r line; do case $line in NCCL_*) echo "nccl $line";; esac; done < /etc/nccl.conf
exit 0
"""


def apply(cluster, text: str, *args: str) -> str:
    return cluster.kubectl("apply", "-f", "-", *args, stdin=text).stdout


PRIMARY = "/etc/cni/net.d/10-local-pods.conflist"


def rails_primary_conflist(cluster) -> dict:
    return json.loads(cluster.node_path(PRIMARY).read_text())


def pod_report(cluster, pod: str, namespace: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in cluster.kubectl("logs", "-n", namespace, pod).stdout.splitlines():
        kind, _, rest = line.partition(" ")
        out.setdefault(kind, []).append(rest)
    return out


def ds_line(cluster) -> str:
    return cluster.kubectl("get", "ds", DS, "-n", "kube-system").stdout


def ds_counts(cluster) -> tuple[int, int]:
    status = cluster.get("ds", DS, "-n", "kube-system")["status"]
    return status.get("desiredNumberScheduled", 0), status.get("numberReady", 0)


@pytest.fixture(scope="module")
def primary_bytes(cluster) -> bytes:
    return cluster.node_path(PRIMARY).read_bytes()


@pytest.fixture(scope="module")
def installed(cluster, release_image, primary_bytes):
    """docs/install.md's steps: apply the DaemonSet, label the RDMA nodes; wait until Ready."""
    apply(cluster, manifests.daemonset(release_image.pinned))
    time.sleep(3)  # the DaemonSet controller has seen the DaemonSet: no node carries the label yet
    desired, _ = ds_counts(cluster)
    assert desired == 0, "a node without rdma-netns.io/rdma=true got a device-plugin pod"
    began = time.monotonic()
    cluster.kubectl("label", "node", HOST_NODE, "rdma-netns.io/rdma=true")
    cluster.wait_for("the DaemonSet Ready on the labelled node", lambda: ds_counts(cluster) == (1, 1), timeout=300)
    REPORT.append(f"DaemonSet Ready {time.monotonic() - began:.1f} s after the node was labelled:\n"
                  + ds_line(cluster).rstrip())
    cluster.kubectl("create", "namespace", NAMESPACE)
    return release_image


def test_the_cluster_runs_the_pinned_release(cluster):
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == "v1.37.2"
    node = cluster.get("node", HOST_NODE)
    assert node["status"]["nodeInfo"]["kubeletVersion"] == "v1.37.2"
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://1.7.")


def test_daemonset_ready_on_labelled_nodes_and_capacity(cluster, installed):
    desired, ready = ds_counts(cluster)
    assert (desired, ready) == (1, 1), ds_line(cluster)
    cluster.wait_for("rdma/hca in the node's allocatable",
                     lambda: cluster.get("node", HOST_NODE)["status"]["allocatable"].get("rdma/hca") == "1k",
                     timeout=120)
    status = cluster.get("node", HOST_NODE)["status"]
    assert status["capacity"]["rdma/hca"] == "1k"
    assert status["allocatable"]["rdma/hca"] == "1k"
    excerpt = yaml.safe_dump({"capacity": {"rdma/hca": status["capacity"]["rdma/hca"]},
                              "allocatable": {"rdma/hca": status["allocatable"]["rdma/hca"]}})
    REPORT.append(f"kubectl get node {HOST_NODE} -o yaml (excerpt):\n{excerpt.rstrip()}")
    # The chained entry is in the node's primary conflist (the switch on), the cluster CNI first.
    plugins = rails_primary_conflist(cluster)["plugins"]
    assert [p["type"] for p in plugins] == ["bridge", "portmap", "rdma-netns"]


def test_pod_security_baseline_refuses_the_job_and_privileged_admits_it(cluster, installed):
    job = manifests.training_job(installed.pinned, "psa-check", "true", machine_caps_only=False)
    for level in ("baseline", "privileged"):
        namespace = f"psa-{level}"
        cluster.kubectl("create", "namespace", namespace)
        cluster.kubectl("label", "namespace", namespace, f"pod-security.kubernetes.io/enforce={level}")
        pod = manifests.pod_of(job, "psa-check", namespace)
        proc = cluster.kubectl("create", "--dry-run=server", "-f", "-", stdin=json.dumps(pod), check=False)
        if level == "baseline":
            assert proc.returncode != 0
            assert ('violates PodSecurity "baseline:latest": non-default capabilities (container "train" must '
                    'not include "IPC_LOCK", "SYS_RESOURCE" in securityContext.capabilities.add)') in proc.stderr
            REPORT.append(f"Pod Security baseline refuses the seed's Job pod: {proc.stderr.strip()}")
        else:
            assert proc.returncode == 0, proc.stderr
    # The chart's `helm test` pod asks for rdma/hca with no privilege: "restricted" admits it.
    cluster.kubectl("create", "namespace", "psa-restricted")
    cluster.kubectl("label", "namespace", "psa-restricted", "pod-security.kubernetes.io/enforce=restricted")
    rendered = cluster.helm("template", "rdma-netns", str(REPO / "deploy" / "helm" / "rdma-netns"),
                            "--namespace", "psa-restricted", "--show-only", "templates/tests/rails-check.yaml").stdout
    proc = cluster.kubectl("create", "--dry-run=server", "-f", "-", stdin=rendered, check=False)
    assert proc.returncode == 0, proc.stderr


def test_the_seed_job_without_host_network_gets_rails_devices_and_settings(cluster, installed):
    name = "wdl-train"
    job = manifests.training_job(installed.pinned, name, REPORT_SCRIPT, pods=2)
    began = time.monotonic()
    apply(cluster, json.dumps(job), "-n", NAMESPACE)
    cluster.wait_for("the Job complete", lambda: cluster.get("job", name, "-n", NAMESPACE)["status"]
                     .get("succeeded", 0) == 2, timeout=300)
    REPORT.append(f"the seed's Job (2 pods, rdma/hca: 1, no hostNetwork) complete in {time.monotonic() - began:.1f} s")
    pods = cluster.get("pods", "-n", NAMESPACE, "-l", f"job-name={name}")["items"]
    assert len(pods) == 2
    gid_indexes = set()
    for pod in pods:
        report = pod_report(cluster, pod["metadata"]["name"], NAMESPACE)
        interfaces = {line for line in report.get("if", [])}
        assert interfaces == {"lo", "eth0", *(f"rdma{r}" for r in range(RAILS))}, report
        for r in range(RAILS):
            globals_ = [a for a in report["inet6"] if a.startswith(f"rdma{r} ") and a.endswith(" 00")]
            assert globals_, f"rdma{r} has no global address: {report['inet6']}"
            link_locals = [a for a in report["inet6"] if a.startswith(f"rdma{r} fe80")]
            assert link_locals, f"rdma{r} has no link-local address (RoCE over IPv6 needs one)"
        assert any(d.startswith("/dev/infiniband/uverbs") for d in report["dev"]), report["dev"]
        # Through CDI as the real kubelet passes it (the CRI CDIDevices field): UCX's settings as
        # environment, NCCL's as /etc/nccl.conf (a variable in the pod spec still wins).
        env = dict(line.split("=", 1) for line in report.get("env", []))
        nccl = dict(line.split("=", 1) for line in report.get("nccl", []))
        hcas = ",".join(f"rxe{r}:1" for r in range(RAILS))
        assert env.get("UCX_NET_DEVICES") == hcas, report
        assert nccl.get("NCCL_IB_HCA") == f"={hcas}", report
        assert nccl.get("NCCL_IB_GID_INDEX") == env.get("UCX_IB_GID_INDEX"), report
        gid_indexes.add(nccl["NCCL_IB_GID_INDEX"])
        REPORT.append(f"pod {pod['metadata']['name']}: interfaces {sorted(interfaces)}, "
                      f"{len(report['dev'])} char devices, NCCL_IB_HCA={nccl['NCCL_IB_HCA']} "
                      f"NCCL_IB_GID_INDEX={nccl['NCCL_IB_GID_INDEX']} UCX_NET_DEVICES={env['UCX_NET_DEVICES']}")
    assert all(i.isdigit() for i in gid_indexes)
    # The broker asked the real kubelet with Get (v1.37 serves it; older kubelets get List).
    ds_pod = cluster.get("pods", "-n", "kube-system", "-l", "app.kubernetes.io/name=rdma-netns-dp")["items"][0]
    grants = [json.loads(line) for line in cluster.kubectl(
        "logs", "-n", "kube-system", ds_pod["metadata"]["name"], "-c", "rdma-netns-dp").stdout.splitlines()
        if '"pod grant"' in line]
    assert grants and {g.get("via") for g in grants if g.get("found")} == {"Get"}, grants


def test_a_pod_without_rdma_gets_only_eth0(cluster, installed):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain", "namespace": NAMESPACE},
           "spec": {"restartPolicy": "Never", "containers": [
               {"name": "app", "image": installed.pinned, "command": ["/bin/sh", "-c", REPORT_SCRIPT]}]}}
    apply(cluster, json.dumps(pod))
    cluster.wait_for("the plain pod done", lambda: cluster.get("pod", "plain", "-n", NAMESPACE)["status"]
                     ["phase"] == "Succeeded", timeout=180)
    report = pod_report(cluster, "plain", NAMESPACE)
    assert set(report["if"]) == {"lo", "eth0"}, report
    assert "dev" not in report and "env" not in report, report


def test_the_seed_job_with_host_network_gets_its_char_devices(cluster, installed):
    """The seed's own Job (hostNetwork: true): no rails (not a pod network), but the units' char
    devices through the device plugin, as before rdma-netns."""
    job = manifests.training_job(installed.pinned, "wdl-train-hostnet", REPORT_SCRIPT, pods=1, host_network=True)
    apply(cluster, json.dumps(job), "-n", NAMESPACE)
    cluster.wait_for("the hostNetwork Job complete", lambda: cluster.get("job", "wdl-train-hostnet", "-n", NAMESPACE)
                     ["status"].get("succeeded", 0) == 1, timeout=300)
    (pod,) = cluster.get("pods", "-n", NAMESPACE, "-l", "job-name=wdl-train-hostnet")["items"]
    report = pod_report(cluster, pod["metadata"]["name"], NAMESPACE)
    assert any(d.startswith("/dev/infiniband/uverbs") for d in report["dev"]), report
    assert not {f"rdma{r}" for r in range(RAILS)} & set(report["if"]), report


def test_kubelet_restarted_registers_again_and_running_pods_keep_rails(cluster, installed):
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "keeps-rails", "namespace": NAMESPACE},
           "spec": {"containers": [{"name": "app", "image": installed.pinned,
                                    "command": ["/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 1; done"],
                                    "resources": {"limits": {"rdma/hca": "1"}}}]}}
    apply(cluster, json.dumps(pod))
    cluster.wait_for("the granted pod Running", lambda: cluster.get("pod", "keeps-rails", "-n", NAMESPACE)
                     ["status"]["phase"] == "Running", timeout=180)
    rails = cluster.kubectl("exec", "-n", NAMESPACE, "keeps-rails", "--", "cat", "/proc/net/if_inet6").stdout
    registrations = dp_registrations(cluster)
    began = time.monotonic()
    cluster.restart_kubelet()
    # kubelet starts with no device plugins: the plugin sees its socket go and registers again.
    cluster.wait_for("the plugin registered again", lambda: dp_registrations(cluster) > registrations, timeout=180)
    cluster.wait_for("rdma/hca allocatable and the node Ready", lambda: cluster.get("node", HOST_NODE)["status"]
                     ["allocatable"].get("rdma/hca") == "1k" and cluster.node_ready(HOST_NODE), timeout=180)
    REPORT.append(f"kubelet restarted: the plugin registered again, rdma/hca 1k, "
                  f"{time.monotonic() - began:.1f} s after the restart")
    cluster.wait_for("exec through the restarted kubelet", lambda: cluster.kubectl(
        "exec", "-n", NAMESPACE, "keeps-rails", "--", "true", check=False).returncode == 0, timeout=120)
    assert cluster.get("pod", "keeps-rails", "-n", NAMESPACE)["status"]["phase"] == "Running"
    after = cluster.kubectl("exec", "-n", NAMESPACE, "keeps-rails", "--", "cat", "/proc/net/if_inet6").stdout
    assert sorted(after.splitlines()) == sorted(rails.splitlines())
    assert "rdma0" in after and "rdma1" in after
    # A pod granted after the restart still gets its rails (the new registration allocates).
    job = manifests.training_job(installed.pinned, "after-restart", REPORT_SCRIPT, pods=1)
    apply(cluster, json.dumps(job), "-n", NAMESPACE)
    cluster.wait_for("the Job after the restart complete", lambda: cluster.get("job", "after-restart", "-n", NAMESPACE)
                     ["status"].get("succeeded", 0) == 1, timeout=300)
    (done,) = cluster.get("pods", "-n", NAMESPACE, "-l", "job-name=after-restart")["items"]
    assert {f"rdma{r}" for r in range(RAILS)} <= set(pod_report(cluster, done["metadata"]["name"], NAMESPACE)["if"])


def test_a_config_change_rolls_out_and_pods_started_meanwhile_get_rails(cluster, installed):
    """docs/install.md, "Change the configuration": edit the ConfigMap, apply, `kubectl rollout
    restart`; the node's chained entry is the new one once the rollout is done. Granted pods created
    while the DaemonSet's pod is replaced either run with their rails or are refused by kubelet
    (never run without them); the Job replaces refused ones and completes."""
    manifest = manifests.daemonset(installed.pinned, entry_changes={"podResourcesTimeoutMs": 3000})
    apply(cluster, manifest)
    before = {p["metadata"]["name"] for p in dp_pods(cluster)}
    name, pods = "during-rollout", 4
    job = manifests.training_job(installed.pinned, name, REPORT_SCRIPT, pods=pods)
    job["spec"]["backoffLimit"] = pods  # a pod kubelet refuses while the plugin is away is replaced
    began = time.monotonic()
    cluster.kubectl("rollout", "restart", f"ds/{DS}", "-n", "kube-system")
    apply(cluster, json.dumps(job), "-n", NAMESPACE)
    cluster.kubectl("rollout", "status", f"ds/{DS}", "-n", "kube-system", "--timeout=300s", timeout=330)
    rolled = time.monotonic() - began
    assert not before & {p["metadata"]["name"] for p in dp_pods(cluster)}, "the DaemonSet's pod was not replaced"
    (entry,) = [p for p in rails_primary_conflist(cluster)["plugins"] if p["type"] == "rdma-netns"]
    assert entry["podResourcesTimeoutMs"] == 3000, entry
    cluster.wait_for("the Job started during the rollout complete", lambda: cluster.get(
        "job", name, "-n", NAMESPACE)["status"].get("succeeded", 0) == pods, timeout=300)
    all_pods = cluster.get("pods", "-n", NAMESPACE, "-l", f"job-name={name}")["items"]
    done = [p for p in all_pods if p["status"]["phase"] == "Succeeded"]
    refused = [p["status"].get("reason") for p in all_pods if p["status"]["phase"] == "Failed"]
    assert set(refused) <= {"UnexpectedAdmissionError"}, refused
    for pod in done:
        interfaces = set(pod_report(cluster, pod["metadata"]["name"], NAMESPACE).get("if", []))
        assert {f"rdma{r}" for r in range(RAILS)} <= interfaces, (pod["metadata"]["name"], interfaces)
    REPORT.append(f"ConfigMap changed and `kubectl rollout restart`: the DaemonSet rolled in {rolled:.1f} s, the "
                  f"node's entry updated; {pods} granted pods created meanwhile all ran with rails "
                  f"({len(refused)} refused by kubelet while the plugin was away, replaced by the Job)")


def test_uninstall_as_the_docs_say_leaves_the_node_clean(cluster, installed, primary_bytes):
    cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=true", timeout=300)
    cluster.kubectl("delete", "-f", "-", "--wait=true", stdin=manifests.daemonset(installed.pinned), timeout=300)
    cluster.kubectl("apply", "-f", "-", stdin=manifests.uninstall(installed.pinned))
    cluster.wait_for("the uninstall DaemonSet Ready", lambda: _ready(cluster, "rdma-netns-uninstall"), timeout=300)
    cluster.kubectl("delete", "-f", "-", "--wait=true", stdin=manifests.uninstall(installed.pinned), timeout=300)
    assert cluster.node_path(PRIMARY).read_bytes() == primary_bytes
    left = [p for p in ("/opt/rdma-netns-ds", "/var/lib/cni/rdma-netns", "/var/lib/rdma-netns/cni-conf",
                        "/run/rdma-netns", "/opt/cni/bin/rdma-netns") if cluster.node_path(p).exists()]
    for folder, pattern in (("/run/cdi", "rdma-netns*"), ("/var/lib/kubelet/device-plugins", "rdma-netns*"),
                            ("/var/lib/kubelet/plugins_registry", "rdma-netns*"), ("/etc/cni/net.d", "*rdma*")):
        left += [str(p) for p in cluster.node_path(folder).glob(pattern)]
    assert not left, left


def dp_pods(cluster) -> list[dict]:
    return cluster.get("pods", "-n", "kube-system", "-l", "app.kubernetes.io/name=rdma-netns-dp")["items"]


def dp_registrations(cluster) -> int:
    """How often the device plugin registered with kubelet (its log)."""
    ds_pod = cluster.get("pods", "-n", "kube-system", "-l", "app.kubernetes.io/name=rdma-netns-dp")["items"][0]
    log = cluster.kubectl("logs", "-n", "kube-system", ds_pod["metadata"]["name"], "-c", "rdma-netns-dp").stdout
    return log.count('"registered with kubelet"')


def _ready(cluster, name: str) -> bool:
    desired, ready = (cluster.get("ds", name, "-n", "kube-system")["status"].get(k, 0)
                      for k in ("desiredNumberScheduled", "numberReady"))
    return desired == ready == 1
