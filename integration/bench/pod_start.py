#!/usr/bin/env python3
"""Pod start as users feel it, on the local real cluster (scripts/cluster.sh's host node: real
kubelet, containerd 1.7, the DaemonSet as written; veth rails with fake RDMA devices).

    .venv/bin/python -m integration.bench.pod_start [--samples 7] [--burst 16] [--json out.json]

Brings up its own cluster (a folder of its own), builds the release image, installs the DaemonSet,
then measures, side by side in one run:
  * create -> Running and create -> first log line, one pod at a time (medians of --samples):
    a pod without rdma/hca, and a granted pod (rdma/hca: 1: every rail of the node);
  * a burst of --burst pods created at once on the node: time until all are Running, granted
    against the same burst without rdma/hca, and the failed sandboxes (kubelet's events
    FailedCreatePodSandBox: must be 0);
  * then the same node in DRA mode (the chart with dra.enabled, docs/dra.md): the same pods, the
    granted ones served through the DeviceClass's extendedResourceName (the scheduler makes a
    claim, kubelet prepares it), against plain pods again, one at a time and in a burst.
"Create" is the moment before the API POST; "Running" the moment the API server's watch event
arrives; "first log line" the container's own first line (the kernel's uptime it read, as wall time).
The cluster is taken down at the end.
"""

from __future__ import annotations

import argparse
import ctypes
import http.client
import json
import os
import ssl
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from integration.cluster import manifests, tools_image
from integration.cluster.cluster import Cluster
from integration.cluster.host_rdma import RAILS, rail_netdev
from integration.cluster.layout import API_PORT, CONTROL_IP, HOST_NODE, REPO, Layout
from integration.cluster.pki import ADMIN

NAMESPACE = "bench"
CLONE_NEWNET = 0x40000000
# The container's first line: the kernel's uptime (the host node shares this machine's kernel, and
# busybox's date has no sub-second format), turned into wall time with this machine's boot time.
SCRIPT = "cat /proc/uptime; trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"


def boot_epoch() -> float:
    return time.time() - float(Path("/proc/uptime").read_text().split()[0])


def enter_netns(path: Path) -> None:
    """This thread (the process's only one so far) joins the cluster's network namespace, so its
    sockets reach the API server; subprocesses started later inherit it."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns")
    os.close(fd)


class Api:
    def __init__(self, layout: Layout) -> None:
        self.context = ssl.create_default_context(cafile=str(layout.pki / "ca.crt"))
        self.context.load_cert_chain(str(layout.pki / f"{ADMIN.file_stem}.crt"),
                                     str(layout.pki / f"{ADMIN.file_stem}.key"))

    def request(self, method: str, path: str, body: dict | None = None) -> dict:
        conn = http.client.HTTPSConnection(CONTROL_IP, API_PORT, context=self.context, timeout=60)
        conn.request(method, path, body=json.dumps(body) if body is not None else None,
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
        conn.close()
        if response.status >= 300:
            raise RuntimeError(f"{method} {path}: {response.status} {data[:300]!r}")
        return json.loads(data) if data else {}

    def log(self, pod: str) -> str:
        conn = http.client.HTTPSConnection(CONTROL_IP, API_PORT, context=self.context, timeout=60)
        conn.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}/log")
        data = conn.getresponse().read().decode()
        conn.close()
        return data


class RunningWatch:
    """When each pod of the namespace was first seen Running (the watch event's arrival)."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.running: dict[str, float] = {}
        self.lock = threading.Lock()
        version = api.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods")["metadata"]["resourceVersion"]
        self.thread = threading.Thread(target=self._watch, args=(version,), daemon=True)
        self.thread.start()

    def _watch(self, version: str) -> None:
        conn = http.client.HTTPSConnection(CONTROL_IP, API_PORT, context=self.api.context, timeout=3600)
        conn.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods?watch=true&resourceVersion={version}")
        response = conn.getresponse()
        while True:
            line = response.readline()
            if not line:
                return
            event = json.loads(line)
            pod = event["object"]
            if pod.get("status", {}).get("phase") == "Running":
                with self.lock:
                    self.running.setdefault(pod["metadata"]["name"], time.time())

    def wait(self, names: list[str], timeout: float = 600) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if all(n in self.running for n in names):
                    return {n: self.running[n] for n in names}
            time.sleep(0.01)
        raise TimeoutError(f"not Running within {timeout} s: {[n for n in names if n not in self.running]}")


def pod(name: str, image: str, granted: bool) -> dict:
    container = {"name": "app", "image": image, "command": ["/bin/sh", "-c", SCRIPT]}
    if granted:
        container["resources"] = {"limits": {"rdma/hca": "1"}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"terminationGracePeriodSeconds": 1, "containers": [container],
                     "nodeSelector": {"kubernetes.io/hostname": HOST_NODE}}}


def create(api: Api, names: list[str], image: str, granted: bool) -> dict[str, float]:
    created = {}
    for name in names:
        body = pod(name, image, granted)
        created[name] = time.time()
        api.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", body)
    return created


def first_line(api: Api, name: str, timeout: float = 60) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = api.log(name).strip()
        if text and not text.startswith("{"):  # a Status: the container's log is not there yet
            return boot_epoch() + float(text.splitlines()[0].split()[0])
        time.sleep(0.05)
    raise TimeoutError(f"{name}: no log line")


def delete_all(api: Api, cluster: Cluster) -> None:
    api.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods")
    cluster.wait_for("the pods gone", lambda: not api.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods")["items"],
                     timeout=600)


def failed_sandboxes(api: Api) -> int:
    events = api.request("GET", f"/api/v1/namespaces/{NAMESPACE}/events")["items"]
    return sum(e.get("count", 1) for e in events if e.get("reason") == "FailedCreatePodSandBox")


def measure(api: Api, cluster: Cluster, watch: RunningWatch, image: str, args: argparse.Namespace,
            granted_kind: str) -> dict:
    """Plain and granted pods alternating one at a time (medians), then a burst of each."""
    singles: dict[str, dict[str, list[float]]] = {}
    for i in range(args.samples):  # alternate, so that drift hits both alike
        for kind, granted in (("plain", False), (granted_kind, True)):
            name = f"{granted_kind}-{kind}-{i}"  # unique per phase: the watch keeps each name's first Running
            created = create(api, [name], image, granted)[name]
            running = watch.wait([name])[name]
            line = first_line(api, name)
            entry = singles.setdefault(kind, {"running": [], "first_line": []})
            entry["running"].append(running - created)
            entry["first_line"].append(line - created)
            delete_all(api, cluster)
    out: dict = {"single": {k: {m: round(statistics.median(v), 3) for m, v in d.items()} for k, d in singles.items()},
                 "single_raw": singles}
    bursts: dict = {}
    for kind, granted in (("plain", False), (granted_kind, True)):
        names = [f"burst-{granted_kind}-{kind}-{i}" for i in range(args.burst)]
        created = create(api, names, image, granted)
        running = watch.wait(names)
        first = min(created.values())
        bursts[kind] = {"all_running_s": round(max(running.values()) - first, 3),
                        "median_running_s": round(statistics.median(running[n] - created[n] for n in names), 3),
                        "failed_sandboxes": failed_sandboxes(api)}
        delete_all(api, cluster)
    bursts["ratio_all_running"] = round(bursts[granted_kind]["all_running_s"] / bursts["plain"]["all_running_s"], 2)
    out["burst_result"] = bursts
    return out


def switch_to_dra(cluster: Cluster, pinned: str) -> None:
    """The device plugin's DaemonSet out, the chart's DRA release in (this cluster has no
    kube-proxy: the driver reaches the API server directly)."""
    cluster.kubectl("delete", "-f", "-", "--wait=true", stdin=manifests.daemonset(pinned), timeout=300)
    repository, digest = pinned.split("@")
    rails = [{"netdev": rail_netdev(r), "ifname": f"rdma{r}"} for r in range(RAILS)]
    cluster.helm("install", "rdma-netns", str(REPO / "deploy" / "helm" / "rdma-netns"), "-n", "kube-system",
                 "--set-json", f"rails={json.dumps(rails)}", "--set", "dra.enabled=true",
                 "--set", f"dra.apiServer={CONTROL_IP}:{API_PORT}", "--set", f"image.repository={repository}",
                 "--set", f"image.digest={digest}")
    cluster.wait_for("the DRA DaemonSet Ready", lambda: cluster.get("ds", "rdma-netns-dp", "-n", "kube-system")
                     ["status"].get("numberReady") == 1, timeout=300)
    cluster.wait_for("the node's ResourceSlice", lambda: any(
        s["spec"]["driver"] == "rdma-netns.io" for s in cluster.get("resourceslices")["items"]), timeout=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=7)
    parser.add_argument("--burst", type=int, default=16)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    layout = Layout(Path(tempfile.mkdtemp(prefix="rk8s-bench-", dir="/tmp")))
    cluster = Cluster(layout)
    results: dict = {"date": time.strftime("%Y-%m-%d"), "samples": args.samples, "burst": args.burst}
    try:
        cluster.up()
        out = Path(tempfile.mkdtemp(prefix="rk8s-bench-image-", dir="/var/tmp"))
        proc = subprocess.run([str(REPO / "scripts" / "build-image.sh"), "--release", "bench", "--out",
                               str(out / "bench.oci.tar")], capture_output=True, text=True, check=True)
        facts = json.loads(proc.stdout.strip().splitlines()[-1])
        cluster.ctr("images", "import", "--snapshotter", "overlayfs", facts["archive"])
        cluster.ctr("images", "tag", facts["image"], facts["pinned"])
        tools = tools_image.build()
        cluster.ctr("images", "import", "--snapshotter", "overlayfs", str(tools.archive))
        cluster.kubectl("apply", "-f", "-", stdin=manifests.daemonset(facts["pinned"]))
        cluster.kubectl("label", "node", HOST_NODE, "rdma-netns.io/rdma=true")
        cluster.wait_for("the DaemonSet Ready", lambda: cluster.get("ds", "rdma-netns-dp", "-n", "kube-system")
                         ["status"].get("numberReady") == 1, timeout=300)
        cluster.wait_for("rdma/hca allocatable", lambda: cluster.get("node", HOST_NODE)["status"]["allocatable"]
                         .get("rdma/hca") == "1k", timeout=120)
        cluster.kubectl("create", "namespace", NAMESPACE)
        cluster.wait_for("the namespace's ServiceAccount", lambda: cluster.kubectl(
            "get", "serviceaccount", "default", "-n", NAMESPACE, check=False).returncode == 0, timeout=60)
        enter_netns(layout.netns_path)
        api = Api(layout)
        watch = RunningWatch(api)
        results["device_plugin"] = measure(api, cluster, watch, tools.name, args, "granted")
        switch_to_dra(cluster, facts["pinned"])
        results["dra"] = measure(api, cluster, watch, tools.name, args, "dra")
    finally:
        cluster.down()
    print(json.dumps(results, indent=1))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
