"""Figures for rdma-netns under containerd's CRI (run as root):

    .venv/bin/python -m integration.cri.measure [--runs 10] [--bursts 3]

- RunPodSandbox wall time, sequential, bridge only vs bridge + rdma-netns chained (pods started
  one after another, each stopped and removed before the next);
- rdma-netns ADD and DEL as containerd ran it (cni-record.sh's clock around the plugin; DEL
  split into the first, with the netns, and the repeat with CNI_NETNS=''), and their CPU time;
- 16 sandboxes started at once (threads), --bursts times on one network, bridge only and then
  chained; the first burst follows the conflist's appearance.
Medians (min-max). The machine's other load shows up in every figure: note `uptime`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from integration.cri.rig import ContainerdRig
from tests.conftest import installed_executable


def summary(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values) * 1000:.0f} ms ({min(values) * 1000:.0f}-{max(values) * 1000:.0f}, n={len(values)})"


def plugin_times(rig: ContainerdRig, ids: set[str]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for call in rig.calls():
        if call.env.get("CNI_CONTAINERID") not in ids or call.seconds is None:
            continue
        what = call.command if call.command != "DEL" else ("DEL" if call.env.get("CNI_NETNS") else "DEL repeat")
        out.setdefault(f"rdma-netns {what}", []).append(call.seconds)
        if call.cpu_seconds is not None:
            out.setdefault(f"rdma-netns {what} CPU", []).append(call.cpu_seconds)
    return out


def sequential(rig: ContainerdRig, kind: str, runs: int) -> dict[str, list[float]]:
    rig.use_network(kind)
    runs_s, ids = [], set()
    for _ in range(runs):
        sid, seconds = rig.run_pod(rig.new_pod("m"))
        runs_s.append(seconds)
        ids.add(sid)
        rig.stop_remove(sid)
    return {f"RunPodSandbox, {kind}": runs_s, **plugin_times(rig, ids)}


def bursts(rig: ContainerdRig, kind: str, count: int) -> dict[str, list[float]]:
    rig.use_network(kind)
    walls, ids = [], set()
    for _ in range(count):
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=16) as pool:
            results = list(pool.map(rig.run_pod, [rig.new_pod(f"b{i}") for i in range(16)]))
        walls.append(time.perf_counter() - start)
        burst = [sid for sid, _ in results]
        ids.update(burst)
        with ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(rig.stop_remove, burst))
    return {f"16 concurrent RunPodSandbox (wall), {kind}": walls,
            **{f"{k}, in bursts": v for k, v in plugin_times(rig, ids).items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--json", help="also write the raw numbers here")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("measure: run as root", file=sys.stderr)
        return 2
    rig = ContainerdRig(installed_executable())
    try:
        rig.start()
        figures: dict[str, list[float]] = {}
        figures.update(sequential(rig, "primary", args.runs))
        figures.update(sequential(rig, "chained", args.runs))
        figures.update(bursts(rig, "primary", args.bursts))
        figures.update(bursts(rig, "chained", args.bursts))
    finally:
        rig.close()
    print(f"containerd CRI figures, load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs")
    for name, values in figures.items():
        print(f"  {name}: {summary(values)}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(figures, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
