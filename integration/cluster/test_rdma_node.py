"""The seed's procedure with real RDMA, installed with the Helm chart: a real-kernel guest (Soft-RoCE
on two rails) joins the cluster as a kubelet node beside the host node. Each is its own node pool,
as a cluster with RoCE LAG nodes has them: the host node runs the release without a pool (macvlan
rails), the guest the `lag` pool's release (deploy/helm/rdma-netns/examples/roce-lag-pool.yaml:
ipvlan rails, as on LAG bonds; its rails named as this cluster's). The seed's Job, two pods on the
guest, moves RDMA traffic between its pods over every rail using only what was published to them
(the device and GID index from /etc/nccl.conf, the peer's eth0 address for the out-of-band
exchange, no ping or other rail traffic first); `helm upgrade` with a changed rail rolls the
guest's pod while the Job's pods keep their rails, `helm rollback` puts it back; then the lag
pool is upgraded to DRA mode and the Job, asking `rdma/hca: 2` through the DeviceClass, moves RDMA
traffic over its claims' rails; `helm uninstall` with the chart's clean-up release leaves both
nodes clean."""

from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from integration.cluster import tools_image
from integration.cluster.conftest import REPORT
from integration.cluster.guest_node import GuestNode
from integration.cluster.host_rdma import RAILS, rail_netdev
from integration.cluster.layout import API_PORT, CONTROL_IP, HOST_NODE, REPO
from integration.cluster.manifests import documents as manifest_documents, training_job
from integration.cluster.pki import Pki

pytestmark = [
    pytest.mark.cluster,
    # In the test command; RDMA_NETNS_CLUSTER_RDMA_NODE=0 leaves it out (about 12 minutes) when
    # working on something else.
    pytest.mark.skipif(os.environ.get("RDMA_NETNS_CLUSTER_RDMA_NODE") == "0",
                       reason="RDMA_NETNS_CLUSTER_RDMA_NODE=0 leaves the guest RDMA node suite out"),
]

GUEST = "rk8s-rdma1"
NAMESPACE = "training"
CHART = REPO / "deploy" / "helm" / "rdma-netns"
LAG_VALUES = CHART / "examples" / "roce-lag-pool.yaml"
PRIMARY = "/etc/cni/net.d/10-local-pods.conflist"
# Where the DaemonSet's files land on a node (the uninstall must leave none of them).
NODE_FILES = ("/opt/rdma-netns-ds", "/var/lib/cni/rdma-netns", "/var/lib/rdma-netns/cni-conf", "/run/rdma-netns",
              "/opt/cni/bin/rdma-netns")
# The Job's pods wait for the test to drive traffic through `kubectl exec`, then exit 0.
WAIT_SCRIPT = "trap 'exit 0' TERM; while [ ! -e /tmp/done ]; do sleep 1; done"
RAIL_LIST = [{"netdev": rail_netdev(r), "ifname": f"rdma{r}"} for r in range(RAILS)]


def image_values(image) -> list[str]:
    repository, digest = image.pinned.split("@")
    return ["--set", f"image.repository={repository}", "--set", f"image.digest={digest}"]


def lag_values(image, rails: list[dict]) -> list[str]:
    """The LAG pool's values file, this cluster's rail names, and probe limits for a node under
    software emulation (the daemon's 1 s loop can take longer than 10 s there: docs/testing.md)."""
    return ["--set", "pool=lag", "-f", str(LAG_VALUES), "--set-json", f"rails={json.dumps(rails)}",
            "--set", "devicePlugin.probeTimeoutSeconds=90", "--set", "devicePlugin.healthMaxAgeSeconds=120",
            *image_values(image)]


def ds_counts(cluster, name: str) -> tuple[int, int, int]:
    status = cluster.get("ds", name, "-n", "kube-system")["status"]
    return (status.get("desiredNumberScheduled", 0), status.get("numberReady", 0),
            status.get("updatedNumberScheduled", 0))


def ds_pod(cluster, pool: str) -> dict:
    (pod,) = [p for p in cluster.get("pods", "-n", "kube-system", "-l", f"rdma-netns.io/pool={pool}")["items"]
              if p["metadata"]["labels"].get("app.kubernetes.io/name") == "rdma-netns-dp"]
    return pod


def guest_entry(cluster) -> dict:
    """The chained entry in the guest's primary conflist, read by the lag pool's watcher container."""
    text = cluster.kubectl("exec", "-n", "kube-system", ds_pod(cluster, "lag")["metadata"]["name"], "-c",
                           "cni-conf-watch", "--", "cat", f"/host{PRIMARY}").stdout
    (entry,) = [p for p in json.loads(text)["plugins"] if p["type"] == "rdma-netns"]
    return entry


def rolled(cluster, name: str, before: str) -> bool:
    """The DaemonSet's one pod replaced (a new name) and Ready."""
    pods = cluster.get("pods", "-n", "kube-system", "-l", "app.kubernetes.io/name=rdma-netns-dp")["items"]
    return ds_counts(cluster, name)[:2] == (1, 1) and before not in {p["metadata"]["name"] for p in pods}


@pytest.fixture(scope="module")
def rdma_node(cluster, release_image):
    tools = tools_image.build()
    node = GuestNode(cluster, GUEST, 1)
    try:
        node.boot()
        node.join(Pki(cluster.layout.pki), cluster.bin_dir, [release_image.archive, tools.archive],
                  {release_image.name: release_image.pinned})
        REPORT.append(f"guest node {GUEST}: booted in {node.booted_s:.0f} s, Ready {node.setup_s:.0f} s later "
                      f"(images imported, kubelet registered)")
        yield node, tools
    finally:
        node.stop()


@pytest.fixture(scope="module")
def primaries(cluster, rdma_node) -> dict[str, str]:
    """Each node's primary conflist before rdma-netns (the uninstall must give it back byte for byte)."""
    node, _tools = rdma_node
    return {HOST_NODE: cluster.node_path(PRIMARY).read_text(), GUEST: node.agent.run("cat", PRIMARY).stdout}


def test_helm_installs_a_release_per_node_pool(cluster, rdma_node, release_image, primaries):
    cluster.helm("install", "rdma-netns", str(CHART), "-n", "kube-system", "--set-json",
                 f"rails={json.dumps(RAIL_LIST)}", *image_values(release_image))
    cluster.helm("install", "rdma-netns-lag", str(CHART), "-n", "kube-system", *lag_values(release_image, RAIL_LIST))
    cluster.kubectl("label", "node", HOST_NODE, "rdma-netns.io/rdma=true")
    cluster.kubectl("label", "node", GUEST, "rdma-netns.io/rdma=true", "rdma-netns.io/pool=lag")
    began = time.monotonic()
    cluster.wait_for("each pool's DaemonSet Ready on its node", lambda: ds_counts(cluster, "rdma-netns-dp")[:2] == (1, 1)
                     and ds_counts(cluster, "rdma-netns-dp-lag")[:2] == (1, 1), timeout=600)
    REPORT.append(f"helm install, a release per pool: both DaemonSets Ready {time.monotonic() - began:.0f} s after "
                  "labelling:\n" + cluster.kubectl("get", "ds", "-n", "kube-system").stdout.rstrip())
    assert ds_pod(cluster, "lag")["spec"]["nodeName"] == GUEST
    # Units follow the free GID entries: a real Soft-RoCE table (1024 entries) gives fewer than the
    # 1000 of the fake 2048-entry tables; the Job needs two.
    cluster.wait_for("rdma/hca on the guest", lambda: int(cluster.get("node", GUEST)["status"]["allocatable"]
                     .get("rdma/hca", "0").replace("k", "000")) >= 2, timeout=300)
    REPORT.append(f"rdma/hca allocatable on {GUEST}: {cluster.get('node', GUEST)['status']['allocatable']['rdma/hca']}")
    entry = guest_entry(cluster)
    assert (entry["link"], entry["linkMode"], entry["rails"]) == ("ipvlan", "l2", RAIL_LIST), entry


def test_helm_test_checks_a_granted_pods_rails_on_each_pool(cluster, rdma_node):
    """`helm test <release>` as an admin runs it after the install: a pod granted one rdma/hca on a
    node of the release has both rails with a global and a link-local IPv6 address, the RDMA char
    devices and the NCCL settings from CDI."""
    for release, node in (("rdma-netns", HOST_NODE), ("rdma-netns-lag", GUEST)):
        began = time.monotonic()
        out = cluster.helm("test", release, "-n", "kube-system", "--logs", "--timeout", "10m", timeout=700).stdout
        assert "Phase:          Succeeded" in out, out
        for rail in RAIL_LIST:
            assert f"ok   {rail['ifname']}: global " in out, out
        assert "ok   /dev/infiniband: uverbs" in out and "ok   /etc/nccl.conf: NCCL_IB_HCA=" in out, out
        REPORT.append(f"helm test {release} (on {node}): passed in {time.monotonic() - began:.0f} s:\n"
                      + "\n".join(line for line in out.splitlines() if line.startswith(("ok", "FAIL"))))


def test_the_seed_job_moves_rdma_traffic_and_keeps_its_rails_through_upgrade_and_rollback(cluster, rdma_node,
                                                                                         release_image):
    _node, tools = rdma_node
    cluster.kubectl("create", "namespace", NAMESPACE)
    job = training_job(tools.name, "wdl-train", WAIT_SCRIPT, pods=2)
    # The host node's RDMA devices are fake: this Job runs where the real ones are.
    job["spec"]["template"]["spec"]["nodeSelector"]["kubernetes.io/hostname"] = GUEST
    began = time.monotonic()
    cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", stdin=json.dumps(job))

    def running() -> list[dict]:
        return running_pods(cluster, "wdl-train")

    cluster.wait_for("both pods Running", lambda: len(running()) == 2, timeout=600)
    REPORT.append(f"the seed's Job on {GUEST}: both pods Running {time.monotonic() - began:.0f} s after apply")
    server, client = sorted(running(), key=lambda p: p["metadata"]["name"])
    server_name, client_name = server["metadata"]["name"], client["metadata"]["name"]
    for line in rdma_traffic(cluster, server, client, range(RAILS)):
        REPORT.append(line)

    # helm upgrade with a changed rail rolls the pool's pod; the Job's pods keep their rails.
    def rails_of(pod: str) -> str:
        return cluster.kubectl("exec", "-n", NAMESPACE, pod, "--", "cat", "/proc/net/if_inet6").stdout

    kept = {pod: sorted(rails_of(pod).splitlines()) for pod in (server_name, client_name)}
    changed = [dict(RAIL_LIST[0]), dict(RAIL_LIST[1], ifname="rdma5")]
    for action, args, rails in (("upgrade", ["upgrade", "rdma-netns-lag", str(CHART), *lag_values(release_image, changed)],
                                 changed),
                                ("rollback", ["rollback", "rdma-netns-lag", "1"], RAIL_LIST)):
        before = ds_pod(cluster, "lag")["metadata"]["name"]
        began = time.monotonic()
        cluster.helm(*args, "-n", "kube-system")
        cluster.wait_for(f"helm {action}: the pool's pod replaced and Ready", lambda: rolled(cluster, "rdma-netns-dp-lag",
                                                                                            before), timeout=600)
        assert guest_entry(cluster)["rails"] == rails
        for pod, addresses in kept.items():
            assert sorted(rails_of(pod).splitlines()) == addresses, f"{pod} lost a rail in helm {action}"
        REPORT.append(f"helm {action}: the lag pool's pod rolled in {time.monotonic() - began:.0f} s, the guest's "
                      f"entry names {[r['ifname'] for r in rails]}, the Job's pods kept both rails")
    history = cluster.helm("history", "rdma-netns-lag", "-n", "kube-system", "-o", "json").stdout
    assert [h["revision"] for h in json.loads(history)] == [1, 2, 3]
    for pod in (server_name, client_name):
        cluster.kubectl("exec", "-n", NAMESPACE, pod, "--", "touch", "/tmp/done")
    cluster.wait_for("the Job complete", lambda: cluster.get("job", "wdl-train", "-n", NAMESPACE)["status"]
                     .get("succeeded", 0) == 2, timeout=300)


def test_the_lag_pool_in_dra_mode_moves_rdma_traffic_between_claimed_rails(cluster, rdma_node, release_image):
    """The lag pool's release upgraded to DRA (docs/dra.md): the guest's daemon publishes its two
    rails as a ResourceSlice; the seed's Job asking `rdma/hca: 2` (its only edit) gets a claim
    from the scheduler for both rails through the DeviceClass, and RDMA moves over each between
    its two pods with the settings CDI gave them."""
    _node, tools = rdma_node
    before = ds_pod(cluster, "lag")["metadata"]["name"]
    began = time.monotonic()
    cluster.helm("upgrade", "rdma-netns-lag", str(CHART), *lag_values(release_image, RAIL_LIST), "--set",
                 "dra.enabled=true", "--set", f"dra.apiServer={CONTROL_IP}:{API_PORT}", "-n", "kube-system")
    cluster.wait_for("the lag pool's pod replaced and Ready in DRA mode",
                     lambda: rolled(cluster, "rdma-netns-dp-lag", before), timeout=600)
    cluster.wait_for("the guest's ResourceSlice", lambda: any(
        s["spec"]["nodeName"] == GUEST and s["spec"]["driver"] == "rdma-netns.io"
        for s in cluster.get("resourceslices")["items"]), timeout=180)
    REPORT.append(f"helm upgrade --set dra.enabled=true: the lag pool's pod rolled and {GUEST}'s ResourceSlice "
                  f"published {time.monotonic() - began:.0f} s later")
    job = training_job(tools.name, "wdl-dra", WAIT_SCRIPT, pods=2)
    spec = job["spec"]["template"]["spec"]
    spec["nodeSelector"]["kubernetes.io/hostname"] = GUEST
    spec["containers"][0]["resources"]["limits"]["rdma/hca"] = str(RAILS)  # requests follow limits
    spec["containers"][0]["resources"].get("requests", {}).pop("rdma/hca", None)
    began = time.monotonic()
    cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", stdin=json.dumps(job))

    def running() -> list[dict]:
        return running_pods(cluster, "wdl-dra")

    cluster.wait_for("both DRA pods Running", lambda: len(running()) == 2, timeout=600)
    server, client = sorted(running(), key=lambda p: p["metadata"]["name"])
    for pod in (server, client):
        claim = pod["status"].get("extendedResourceClaimStatus", {}).get("resourceClaimName")
        assert claim, pod["status"]
        results = cluster.get("resourceclaim", claim, "-n", NAMESPACE)["status"]["allocation"]["devices"]["results"]
        assert sorted(r["device"] for r in results) == [f"rxe{r}" for r in range(RAILS)], results
    REPORT.append(f"the seed's Job with rdma/hca: {RAILS} on {GUEST} through DRA: both pods Running "
                  f"{time.monotonic() - began:.0f} s after apply, each with a claim for both rails")
    for line in rdma_traffic(cluster, server, client, range(RAILS)):
        REPORT.append("DRA " + line)
    for pod in (server, client):
        cluster.kubectl("exec", "-n", NAMESPACE, pod["metadata"]["name"], "--", "touch", "/tmp/done")
    cluster.wait_for("the DRA Job complete", lambda: cluster.get("job", "wdl-dra", "-n", NAMESPACE)["status"]
                     .get("succeeded", 0) == 2, timeout=300)


def test_helm_uninstall_and_the_clean_up_release_leave_every_node_clean(cluster, rdma_node, release_image,
                                                                       primaries):
    node, _tools = rdma_node
    cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=true", timeout=300)
    for release in ("rdma-netns-lag", "rdma-netns"):
        cluster.helm("uninstall", release, "-n", "kube-system", "--wait", timeout=600)
    cluster.helm("install", "rdma-netns-clean", str(CHART), "-n", "kube-system", "--set", "component=uninstall",
                 *image_values(release_image))
    cluster.helm("install", "rdma-netns-clean-lag", str(CHART), "-n", "kube-system", "--set", "component=uninstall",
                 *lag_values(release_image, RAIL_LIST))
    began = time.monotonic()
    cluster.wait_for("both clean-up DaemonSets Ready", lambda: ds_counts(cluster, "rdma-netns-uninstall")[:2] == (1, 1)
                     and ds_counts(cluster, "rdma-netns-uninstall-lag")[:2] == (1, 1), timeout=600)
    REPORT.append(f"helm uninstall, then the clean-up releases Ready {time.monotonic() - began:.0f} s later")
    for release in ("rdma-netns-clean", "rdma-netns-clean-lag"):
        cluster.helm("uninstall", release, "-n", "kube-system", "--wait", timeout=600)
    assert cluster.node_path(PRIMARY).read_text() == primaries[HOST_NODE]
    assert node.agent.run("cat", PRIMARY).stdout == primaries[GUEST]
    left = [p for p in NODE_FILES if cluster.node_path(p).exists()]
    left += [f"{GUEST}:{p}" for p in NODE_FILES if node.agent.run("test", "-e", p, check=False).rc == 0]
    assert not left, left


def running_pods(cluster, job: str) -> list[dict]:
    pods = cluster.get("pods", "-n", NAMESPACE, "-l", f"job-name={job}")["items"]
    return [p for p in pods if p["status"].get("phase") == "Running"]


def rdma_traffic(cluster, server: dict, client: dict, rails) -> list[str]:
    """conf/k8s/rdma-check.yaml's script, as its Job's pods 0 and 1 run it, with the server's eth0
    address for its DNS name (this cluster has no DNS): per rail, ib_write_bw with the device and
    GID index from /etc/nccl.conf, no rail traffic before. One report line per rail."""
    server_name, client_name = server["metadata"]["name"], client["metadata"]["name"]
    check = rdma_check_script()
    serving = subprocess_background(cluster, server_name, check, {"JOB_COMPLETION_INDEX": "0", "PEER": "-"})
    out = cluster.kubectl("exec", "-n", NAMESPACE, client_name, "--", "env", "JOB_COMPLETION_INDEX=1",
                          f"PEER={server['status']['podIP']}", "FIRST_PORT=18515", "sh", "-c", check,
                          timeout=900, check=False)
    server_out = serving.communicate(timeout=120)[0]
    assert out.returncode == 0 and serving.returncode == 0, out.stdout + out.stderr + server_out
    lines = []
    for rail in rails:
        section = out.stdout.split(f"rail {rail} (", 1)[1]
        figures = [line for line in section.splitlines() if line.strip().startswith("65536")]
        assert figures, out.stdout
        lines.append(f"rail {rail}: ib_write_bw {client_name} -> {server_name} (conf/k8s/rdma-check.yaml's "
                     f"script): {figures[0].split()}")
    return lines


def rdma_check_script() -> str:
    (job,) = [d for d in manifest_documents("rdma-check.yaml") if d["kind"] == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["/bin/sh", "-c"]
    return container["command"][2]


def subprocess_background(cluster, pod: str, script: str, env: dict[str, str]) -> subprocess.Popen:
    """`kubectl exec` left running (a perftest server while its client runs)."""
    argv = ["nsenter", f"--net={cluster.layout.netns_path}", "--", str(cluster.bin_dir / "kubectl"),
            "--kubeconfig", str(cluster.layout.admin_kubeconfig), "exec", "-n", NAMESPACE, pod, "--",
            "env", "FIRST_PORT=18515", *(f"{k}={v}" for k, v in env.items()), "sh", "-c", script]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
