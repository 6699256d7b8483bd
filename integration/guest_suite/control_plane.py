"""A real Kubernetes control plane inside the real-kernel guest: etcd, kube-apiserver and
kube-scheduler of the cluster suite's build (integration/kube/build.sh; test_real_kernel.py links
them into $GUEST_RESULTS/kube-bin), with the cluster suite's command lines and certificates
(integration/cluster/components.py, pki.py).

What it is for: the scheduler allocating this guest's devices from the ResourceSlices the DRA
driver publishes, on a kernel booted in a mode the cluster's guest node does not run (exclusive).
There is no kubelet: the test plays kubelet's part of DRA (registration, NodePrepareResources,
NodeUnprepareResources, the CNI call with the pod's UID), which is the same in both kernel modes
and runs against the real kubelet in integration/cluster/test_dra.py. The API server listens on
the cluster's control address, added to the guest's loopback interface (never this machine's).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from integration.cluster import components
from integration.cluster.layout import CONTROL_IP, Layout
from integration.cluster.pki import ADMIN, Pki
from integration.guest_suite.conftest import RESULTS, sh
from rdma_netns_dp.dra.kube_api import ApiError, Credentials, KubeApi

START_TIMEOUT = 600  # kube-apiserver's first start under TCG


def kube_bin() -> Path:
    folder = RESULTS / "kube-bin"
    assert (folder / "kube-apiserver").exists(), f"no kube-apiserver in {folder}: test_real_kernel.py links it there"
    return folder


class ControlPlane:
    """etcd, kube-apiserver and kube-scheduler as child processes, logs kept in the results."""

    def __init__(self, root: Path) -> None:
        self.layout = Layout(root)
        self.bin_dir = kube_bin()
        self.procs: dict[str, subprocess.Popen] = {}
        self.pki = Pki(self.layout.pki)
        self.admin_kubeconfig = components.kubeconfig(self.layout.admin_kubeconfig, self.pki, ADMIN)
        self.api = KubeApi(Credentials.from_kubeconfig(self.admin_kubeconfig), timeout=60)

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(RESULTS / f"exclusive-dra-{name}.log", "ab")
        self.procs[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)

    def start(self) -> ControlPlane:
        sh("ip", "address", "add", f"{CONTROL_IP}/32", "dev", "lo")
        self._spawn("etcd", components.etcd(self.bin_dir, self.layout))
        self._spawn("kube-apiserver", components.apiserver(self.bin_dir, self.layout, self.pki))
        self.wait_for("the API server's /readyz", self._ready, START_TIMEOUT)
        self._spawn("kube-scheduler", components.scheduler(self.bin_dir, self.layout, self.pki))
        return self

    def _ready(self) -> bool:
        for name, proc in self.procs.items():
            assert proc.poll() is None, f"{name} exited ({proc.returncode}): see {RESULTS}/exclusive-dra-{name}.log"
        try:
            self.api.get("/api/v1/namespaces/default")
            return True
        except ApiError:
            return False

    def add_node(self, name: str) -> None:
        """What kubelet and the controller manager would have made: the Node, with room for pods
        (as a kubelet reports it) and without the not-ready taint the API server's
        TaintNodesByCondition admission gives a new node (the node lifecycle controller lifts it
        once kubelet reports Ready); the default namespace's ServiceAccount."""
        self.api.create("/api/v1/nodes", {"apiVersion": "v1", "kind": "Node",
                                          "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}})
        room = {"cpu": "2", "memory": "2Gi", "pods": "110"}
        self.api.patch(f"/api/v1/nodes/{name}/status", {"status": {"capacity": room, "allocatable": room}})
        self.api.patch(f"/api/v1/nodes/{name}", {"spec": {"taints": None}})
        self.api.create("/api/v1/namespaces/default/serviceaccounts",
                        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}})

    def wait_for(self, what: str, predicate, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
            time.sleep(0.5)

    def stop(self) -> None:
        self.api.close()
        for proc in reversed(list(self.procs.values())):
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        sh("ip", "address", "delete", f"{CONTROL_IP}/32", "dev", "lo", check=False)
