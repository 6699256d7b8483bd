"""What a /metrics scrape costs the device-plugin daemon, and what it asks kubelet (run as root):

    .venv/bin/python -m integration.bench.metrics_scrape_cost [--records 1000] [--scrapes 200]

The installed rdma-netns-dp (a fake sysfs of the standard host) registered with the stand-in
kubelet (PodResources with kubelet's rate limit), /metrics on the loopback of a namespace of its
own, `--records` CNI state files in its cniStateDir. `--scrapes` scrapes one after another from
inside that namespace; printed: the daemon's CPU per scrape (utime+stime from /proc), the kubelet
calls and refusals during the scrapes, and the scrapes' wall time. `--old-config` leaves out the
config keys an older daemon does not know (metrics.refreshSeconds), to measure it the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.dp.conftest import dp_binary, soft_roce_gid_tables
from tests.fake_rdma_sysfs import standard_host
from tests.kubelet_standin import KubeletStandIn, PodResourcesStandIn

PORT = 9478
SCRAPES = """
import sys, time, urllib.request
url, n = sys.argv[1], int(sys.argv[2])
started = time.monotonic()
for _ in range(n):
    urllib.request.urlopen(url, timeout=10).read()
print(time.monotonic() - started)
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_records(state_dir: Path, count: int) -> None:
    folder = state_dir / "bench-net"
    folder.mkdir(parents=True)
    for i in range(count):
        record = {"format": 2, "phase": "ready", "mode": "shared", "link": "macvlan", "containerID": f"c{i:05d}",
                  "ifname": "eth0", "netns": f"/var/run/netns/p{i}", "network": "bench-net",
                  "rails": [{"netdev": f"rail{i % 8}", "ifname": f"rdma{i % 8}"}]}
        (folder / f"c{i:05d}:eth0.json").write_text(json.dumps(record))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--scrapes", type=int, default=200)
    parser.add_argument("--old-config", action="store_true")
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="rmsc-", dir="/tmp"))
    netns = f"rmsc-{os.urandom(3).hex()}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    subprocess.run(["ip", "-n", netns, "link", "set", "lo", "up"], check=True)
    pod_resources = PodResourcesStandIn(base / "k" / "pod-resources" / "kubelet.sock")
    kubelet = KubeletStandIn(base / "k" / "device-plugins", pod_resources=pod_resources).start()
    daemon = None
    try:
        fake = soft_roce_gid_tables(standard_host(base / "host", "Y", soft=True))
        write_records(base / "state", args.records)
        metrics: dict = {"address": "127.0.0.1", "port": PORT, "cniEventsFifo": str(base / "ev")}
        if not args.old_config:
            metrics["refreshSeconds"] = 10
        config = base / "dp.json"
        config.write_text(json.dumps({
            "mode": "shared", "kubeletDir": str(base / "k"), "sysfsRoot": str(fake.sys), "devRoot": str(fake.dev),
            "healthIntervalSeconds": 1, "healthFile": str(base / "health"), "podGrantsSocket": str(base / "pg.sock"),
            "cniStateDir": str(base / "state"), "metrics": metrics,
            "resources": [{"name": "rdma/hca", "sharedUnits": 1000}]}))
        daemon = subprocess.Popen(["ip", "netns", "exec", netns, dp_binary(), "--config", str(config)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        kubelet.wait_registrations(1, 20)
        kubelet.plugin("rdma/hca", 20).wait_first(20)
        for i in range(20):
            kubelet.admit_pod("bench", f"p{i}", {"main": {"rdma/hca": 1}})
        time.sleep(3)
        cpu, calls, refused = cpu_seconds(daemon.pid), len(pod_resources.calls), len(pod_resources.rejected)
        out = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", SCRAPES,
                              f"http://127.0.0.1:{PORT}/metrics", str(args.scrapes)],
                             capture_output=True, text=True, check=True)
        wall = float(out.stdout.strip())
        cpu = cpu_seconds(daemon.pid) - cpu
        print(json.dumps({"records": args.records, "scrapes": args.scrapes,
                          "daemon_cpu_ms_per_scrape": round(cpu / args.scrapes * 1000, 2),
                          "kubelet_calls": len(pod_resources.calls) - calls,
                          "kubelet_refusals": len(pod_resources.rejected) - refused,
                          "wall_ms_per_scrape": round(wall / args.scrapes * 1000, 2)}))
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(15)
        kubelet.close()
        pod_resources.close()
        subprocess.run(["ip", "netns", "delete", netns], check=False)
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
