"""The seed's procedure with real RDMA: a real-kernel guest (Soft-RoCE on two rails) joins the
cluster as a kubelet node beside the host node; the DaemonSet runs on both labelled nodes
(DESIRED 2); the seed's Job, two pods on the guest, moves RDMA traffic between its pods over every
rail, using only what was published to them (the GID index from /etc/nccl.conf, the device names,
the peer's eth0 address for the out-of-band exchange, no ping or other rail traffic first)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from integration.cluster import manifests, tools_image
from integration.cluster.conftest import REPORT
from integration.cluster.guest_node import GuestNode
from integration.cluster.host_rdma import RAILS
from integration.cluster.layout import HOST_NODE
from integration.cluster.pki import Pki

pytestmark = pytest.mark.cluster

GUEST = "rk8s-rdma1"
NAMESPACE = "training"
# The Job's pods wait for the test to drive traffic through `kubectl exec`, then exit 0.
WAIT_SCRIPT = "trap 'exit 0' TERM; while [ ! -e /tmp/done ]; do sleep 1; done"
# Run in a pod: perftest on rail r with what the pod was given, as NCCL reads it: the rail's
# device from NCCL_IB_HCA ("=rxe0,rxe1" in rail order) and the GID index.
PERFTEST = ('hca=$(sed -n "s/^NCCL_IB_HCA==//p" /etc/nccl.conf | cut -d, -f{field} | cut -d: -f1); '
            'idx=$(sed -n "s/^NCCL_IB_GID_INDEX=//p" /etc/nccl.conf); '
            'exec ib_write_bw -d "$hca" -x "$idx" -s 65536 -n 200 -p {port} --report_gbits {peer}')


def ds_counts(cluster) -> tuple[int, int]:
    status = cluster.get("ds", "rdma-netns-dp", "-n", "kube-system")["status"]
    return status.get("desiredNumberScheduled", 0), status.get("numberReady", 0)


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


def test_daemonset_on_both_rdma_nodes(cluster, rdma_node, release_image):
    # Under software emulation one Python probe takes longer than the manifest's 5 s. The rails are
    # ipvlan, as on RoCE LAG nodes: Soft-RoCE receives nothing that arrives on a macvlan upper, but
    # ipvlans share the rail's MAC, so rxe hands the peer pod's packets to its own QP (the same
    # device's, both pods' GIDs are in its table) after the kernel resolved the peer's address.
    cluster.kubectl("apply", "-f", "-", stdin=manifests.daemonset(release_image.pinned, emulated=True, lag_link=True))
    for node in (HOST_NODE, GUEST):
        cluster.kubectl("label", "node", node, "rdma-netns.io/rdma=true")
    began = time.monotonic()
    cluster.wait_for("DaemonSet Ready on both nodes", lambda: ds_counts(cluster) == (2, 2), timeout=600)
    REPORT.append(f"DaemonSet 2/2 Ready {time.monotonic() - began:.0f} s after labelling:\n"
                  + cluster.kubectl("get", "ds", "-n", "kube-system").stdout.rstrip())
    # Units follow the free GID entries: a real Soft-RoCE table (1024 entries) gives fewer than the
    # 1000 of the fake 2048-entry tables; the Job needs two.
    cluster.wait_for("rdma/hca on the guest", lambda: int(cluster.get("node", GUEST)["status"]["allocatable"]
                     .get("rdma/hca", "0").replace("k", "000")) >= 2, timeout=300)
    REPORT.append(f"rdma/hca allocatable on {GUEST}: {cluster.get('node', GUEST)['status']['allocatable']['rdma/hca']}")


def test_the_seed_job_moves_rdma_traffic_over_every_rail(cluster, rdma_node, release_image):
    _node, tools = rdma_node
    cluster.kubectl("create", "namespace", NAMESPACE)
    job = manifests.training_job(tools.name, "wdl-train", WAIT_SCRIPT, pods=2)
    # The host node's RDMA devices are fake: this Job runs where the real ones are.
    job["spec"]["template"]["spec"]["nodeSelector"]["kubernetes.io/hostname"] = GUEST
    began = time.monotonic()
    cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", stdin=json.dumps(job))

    def running() -> list[dict]:
        pods = cluster.get("pods", "-n", NAMESPACE, "-l", "job-name=wdl-train")["items"]
        return [p for p in pods if p["status"].get("phase") == "Running"]

    cluster.wait_for("both pods Running", lambda: len(running()) == 2, timeout=600)
    REPORT.append(f"the seed's Job on {GUEST}: both pods Running {time.monotonic() - began:.0f} s after apply")
    server, client = sorted(running(), key=lambda p: p["metadata"]["name"])
    server_name, client_name = server["metadata"]["name"], client["metadata"]["name"]
    for rail in range(RAILS):
        port = 18515 + rail
        listening = subprocess_background(cluster, server_name, PERFTEST.format(field=rail + 1, port=port, peer=""))
        time.sleep(5)  # the server listens on eth0's address before the client connects
        out = cluster.kubectl("exec", "-n", NAMESPACE, client_name, "--", "sh", "-c",
                              PERFTEST.format(field=rail + 1, port=port, peer=server["status"]["podIP"]), timeout=300)
        server_out = listening.communicate(timeout=120)[0]
        assert listening.returncode == 0, server_out
        figures = [line for line in out.stdout.splitlines() if line.strip().startswith("65536")]
        assert figures, out.stdout + out.stderr
        REPORT.append(f"rail {rail}: ib_write_bw {client_name} -> {server_name}: {figures[0].split()}")
    for pod in (server_name, client_name):
        cluster.kubectl("exec", "-n", NAMESPACE, pod, "--", "touch", "/tmp/done")
    cluster.wait_for("the Job complete", lambda: cluster.get("job", "wdl-train", "-n", NAMESPACE)["status"]
                     .get("succeeded", 0) == 2, timeout=300)


def subprocess_background(cluster, pod: str, script: str) -> subprocess.Popen:
    """`kubectl exec` left running (a perftest server while its client runs)."""
    argv = ["nsenter", f"--net={cluster.layout.netns_path}", "--", str(cluster.bin_dir / "kubectl"),
            "--kubeconfig", str(cluster.layout.admin_kubeconfig), "exec", "-n", NAMESPACE, pod, "--",
            "sh", "-c", script]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
