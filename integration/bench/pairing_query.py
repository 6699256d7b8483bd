#!/usr/bin/env python3
"""What the CNI pays to learn a pod's granted RDMA units: the grants broker vs asking kubelet directly.

The real rdma-netns-dp daemon runs on a fake sysfs/dev tree (tests/fake_rdma_sysfs.py) with its
grants broker on; the stand-in kubelet (tests/kubelet_standin.py) admits pods through the
daemon's Allocate and serves the real v1.PodResourcesLister gRPC service. Measured:

  1. Broker round trip: 200 sequential requests from a plain stdlib socket client (connect, one
     JSON line, read to EOF), Get-capable kubelet, and again with Get disabled (List fallback,
     --pods pods on the node).
  2. Direct gRPC, as the CNI's fallback does: in fresh processes, the import cost of
     rdma_netns.kubelet.podresources alone, of grpc + the generated stubs (python -X importtime and
     perf_counter), the first call (channel set-up included) and later calls.
  3. Whole fresh processes (what each CNI ADD adds): python start -> answer, broker vs direct.

    sudo .venv/bin/python integration/bench/pairing_query.py [--json out.json] [--requests 200]

The figures share the machine's CPUs with whatever else runs: the load average at start and end
is printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.fake_rdma_sysfs import standard_host  # noqa: E402
from tests.kubelet_standin import KubeletStandIn, PodResourcesStandIn, wait_for_path  # noqa: E402

PY = sys.executable
DP = str(Path(PY).parent / "rdma-netns-dp")
RESOURCE = "rdma/hca"


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def stats_ms(seconds: list[float]) -> dict:
    ms = [s * 1000 for s in seconds]
    return {"n": len(ms), "median_ms": round(statistics.median(ms), 3), "p90_ms": round(percentile(ms, 90), 3),
            "p99_ms": round(percentile(ms, 99), 3), "min_ms": round(min(ms), 3), "max_ms": round(max(ms), 3)}


def broker_query(path: str, request: bytes) -> dict:
    """The CNI's broker client: stdlib only."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(request)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return json.loads(b"".join(chunks))


# A fresh CNI-like process asking the broker (stdlib only) or kubelet (podresources + grpc).
BROKER_CHILD = r"""
import time; t0 = time.perf_counter()
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.connect(sys.argv[1]); s.sendall(sys.argv[2].encode())
data = b""
while chunk := s.recv(65536): data += chunk
answer = json.loads(data); t1 = time.perf_counter()
print(json.dumps({"answer": answer, "in_process_s": t1 - t0, "grpc_loaded": "grpc" in sys.modules}))
"""
DIRECT_CHILD = r"""
import time; t0 = time.perf_counter()
import sys
from rdma_netns.kubelet.podresources import pod_device_ids
t1 = time.perf_counter()
import grpc
from rdma_netns.kubelet.api.podresources.v1 import api_pb2, api_pb2_grpc
t2 = time.perf_counter()
grant = pod_device_ids(sys.argv[1], "bench", "pod-0", "rdma/hca", 2.0)
t3 = time.perf_counter()
later = []
for _ in range(20):
    t = time.perf_counter(); pod_device_ids(sys.argv[1], "bench", "pod-0", "rdma/hca", 2.0)
    later.append(time.perf_counter() - t)
print(__import__("json").dumps({"ids": grant.device_ids, "via": grant.via, "module_import_s": t1 - t0,
      "grpc_import_s": t2 - t1, "first_call_s": t3 - t2, "later_calls_s": later, "in_process_s": t3 - t0}))
"""
ONE_DIRECT_CHILD = r"""
import time; t0 = time.perf_counter()
import json, sys
from rdma_netns.kubelet.podresources import pod_device_ids
grant = pod_device_ids(sys.argv[1], "bench", "pod-0", "rdma/hca", 2.0)
print(json.dumps({"ids": grant.device_ids, "in_process_s": time.perf_counter() - t0}))
"""


def run_child(code: str, *args: str, importtime: bool = False) -> tuple[dict, float, str]:
    cmd = [PY, *(["-X", "importtime"] if importtime else []), "-c", code, *args]
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd="/")
    wall = time.perf_counter() - t
    if out.returncode != 0:
        raise RuntimeError(f"child failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1]), wall, out.stderr


def importtime_cumulative_ms(stderr: str, module: str) -> float | None:
    """The cumulative µs kept by -X importtime for `module` (its first, outermost import)."""
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            _, cumulative, name = (p.strip() for p in line[len("import time:"):].split("|"))
            if name.strip() == module:
                return round(int(cumulative) / 1000, 2)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--fresh", type=int, default=10, help="fresh processes per kind (default 10)")
    parser.add_argument("--pods", type=int, default=110, help="pods on the node for the List case")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("run as root (sudo): the daemon's fake tree mirrors a node's", file=sys.stderr)

    root = Path(tempfile.mkdtemp(prefix="rnpq-", dir="/tmp"))
    fake = standard_host(root / "host", "Y")
    kubelet_dir = root / "k"
    pod_resources = PodResourcesStandIn(kubelet_dir / "pod-resources" / "kubelet.sock")
    kubelet = KubeletStandIn(kubelet_dir / "device-plugins", pod_resources=pod_resources).start()
    broker = str(root / "g" / "pod-grants.sock")
    log = open(root / "dp.log", "w")
    proc = subprocess.Popen([DP, "--kubelet-dir", str(kubelet_dir), "--mode", "shared", "--sysfs-root", str(fake.sys),
                             "--dev-root", str(fake.dev), "--health-file", str(root / "h.json"),
                             "--cni-state-dir", str(root / "cni"), "--pod-grants-socket", broker,
                             "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=log)
    results: dict = {"requests": args.requests, "python": sys.version.split()[0], "cpus": os.cpu_count(),
                     "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]}
    try:
        kubelet.wait_registrations(1, 30)
        kubelet.plugin(RESOURCE, 30).wait_first(30)
        if not wait_for_path(broker, 10):
            raise RuntimeError("the broker socket never appeared")
        for i in range(args.pods):
            kubelet.admit_pod("bench", f"pod-{i}", {"main": {RESOURCE: 1}})
        expected = kubelet.pod_grants("bench", "pod-0")["main"][RESOURCE]
        request = json.dumps({"v": 1, "podResourcesSocket": str(pod_resources.socket), "namespace": "bench",
                              "name": "pod-0", "uid": "", "resourceName": RESOURCE, "timeoutMs": 2000}).encode() + b"\n"

        for mode in ("enabled", "disabled"):
            pod_resources.get_mode = mode
            for _ in range(5):  # warm
                broker_query(broker, request)
            times = []
            for _ in range(args.requests):
                # One question every 40 ms: a round trip, not the broker's share of kubelet's rate
                # limit (40 calls a second, rdma_netns.kubelet.ratelimit), is what this measures.
                time.sleep(0.04)
                t = time.perf_counter()
                answer = broker_query(broker, request)
                times.append(time.perf_counter() - t)
                assert answer.get("deviceIDs") == expected, answer
            results[f"broker_round_trip_get_{mode}"] = {**stats_ms(times), "via": answer["via"]}
        pod_resources.get_mode = "enabled"

        # Direct gRPC in fresh processes: import costs, first and later calls.
        direct = [run_child(DIRECT_CHILD, str(pod_resources.socket), importtime=True) for _ in range(args.fresh)]
        for child, _, _ in direct:
            assert child["ids"] == expected, child
        later = [s for child, _, _ in direct for s in child["later_calls_s"]]
        results["direct_grpc"] = {
            "podresources_module_import_ms": stats_ms([c["module_import_s"] for c, _, _ in direct]),
            "grpc_and_stubs_import_ms": stats_ms([c["grpc_import_s"] for c, _, _ in direct]),
            "importtime_grpc_cumulative_ms": statistics.median(
                v for _, _, err in direct if (v := importtime_cumulative_ms(err, "grpc")) is not None),
            "importtime_podresources_cumulative_ms": statistics.median(
                v for _, _, err in direct if (v := importtime_cumulative_ms(err, "rdma_netns.kubelet.podresources"))
                is not None),
            "first_call_ms": stats_ms([c["first_call_s"] for c, _, _ in direct]),
            "later_calls_ms": stats_ms(later),
        }
        # The plain `python -X importtime -c 'import rdma_netns.kubelet.podresources'` of the brief.
        plain = subprocess.run([PY, "-X", "importtime", "-c", "import rdma_netns.kubelet.podresources, sys; "
                                "print('grpc' in sys.modules)"], capture_output=True, text=True, cwd="/")
        results["direct_grpc"]["plain_import_loads_grpc"] = plain.stdout.strip() == "True"
        results["direct_grpc"]["plain_import_cumulative_ms"] = importtime_cumulative_ms(
            plain.stderr, "rdma_netns.kubelet.podresources")

        # Whole fresh processes, what one CNI ADD would add.
        fresh_broker, fresh_direct = [], []
        for _ in range(args.fresh):
            child, wall, _ = run_child(BROKER_CHILD, broker, request.decode())
            assert child["answer"]["deviceIDs"] == expected and not child["grpc_loaded"], child
            fresh_broker.append((child["in_process_s"], wall))
            child, wall, _ = run_child(ONE_DIRECT_CHILD, str(pod_resources.socket))
            assert child["ids"] == expected, child
            fresh_direct.append((child["in_process_s"], wall))
        results["fresh_process"] = {
            "broker_in_process_ms": stats_ms([a for a, _ in fresh_broker]),
            "broker_process_wall_ms": stats_ms([b for _, b in fresh_broker]),
            "direct_in_process_ms": stats_ms([a for a, _ in fresh_direct]),
            "direct_process_wall_ms": stats_ms([b for _, b in fresh_direct]),
        }
        results["daemon_alive"] = proc.poll() is None
        results["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        kubelet.close()
        log.close()
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if results.get("daemon_alive") else 1


if __name__ == "__main__":
    sys.exit(main())
