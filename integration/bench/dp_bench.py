#!/usr/bin/env python3
"""Benchmark of the device plugin daemon (`rdma-netns-dp`) on this machine, without RDMA hardware.

The real daemon runs against a fake sysfs/dev tree (tests/fake_rdma_sysfs.py) and a stand-in
kubelet (tests/kubelet_standin.py: the real v1beta1 gRPC services over unix sockets):

  1. Allocate latency, shared mode, 1000 units backed by 8 devices: sequential single calls on
     one channel, then 100 concurrent callers (threads, one channel each), and the throughput.
  2. Health latency, exclusive mode, 64 devices, default --health-interval 1.0: from writing a
     port's state "1: DOWN" to the ListAndWatch update that shows the device Unhealthy (and back
     up), one device at a time at random moments, then all 64 flapping at once.
  3. The daemon's idle cost with 64 devices (CPU time per second, resident memory).

    sudo .venv/bin/python integration/bench/dp_bench.py [--json out.json] [--quick]

The 100 concurrent callers are threads with their own channels, spread over 4 spawned client
processes (--processes) so that one client GIL does not dominate; they share this machine's CPUs
with the daemon, whose own CPU use is shown (a Python gRPC server: about one core at most).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from tests.fake_rdma_sysfs import FakeRdmaSysfs, standard_host  # noqa: E402
from tests.kubelet_standin import KubeletStandIn, PluginConnection, unix_channel  # noqa: E402

from rdma_netns_dp.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc  # noqa: E402

DP = str(Path(sys.executable).parent / "rdma-netns-dp")
RESOURCE = "rdma/hca"
SOCKET = "rdma-netns-rdma_hca.sock"


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def stats_ms(seconds: list[float]) -> dict:
    ms = [s * 1000 for s in seconds]
    return {"n": len(ms), "median_ms": round(statistics.median(ms), 3), "p99_ms": round(percentile(ms, 99), 3),
            "min_ms": round(min(ms), 3), "max_ms": round(max(ms), 3), "mean_ms": round(statistics.fmean(ms), 3)}


class Daemon:
    """The installed daemon on a fake tree, registered with a stand-in kubelet."""

    def __init__(self, root: Path, fake: FakeRdmaSysfs, mode: str, interval: float) -> None:
        self.root = root
        self.kubelet = KubeletStandIn(root / "kubelet" / "device-plugins", connect=False).start()
        self.log = open(root / "dp.log", "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [DP, "--kubelet-dir", str(root / "kubelet"), "--mode", mode, "--health-interval", str(interval),
             "--sysfs-root", str(fake.sys), "--dev-root", str(fake.dev), "--health-file", str(root / "h.json"),
             "--cni-state-dir", str(root / "cni"), "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=self.log)
        self.kubelet.wait_registrations(1, 60)
        self.registered_s = time.monotonic() - self.started
        self.socket = root / "kubelet" / "device-plugins" / SOCKET
        self.conn = PluginConnection(self.socket, RESOURCE, timeout=30)
        self.conn.wait_first(30)
        self.first_list_s = time.monotonic() - self.started

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> int:
        self.conn.close()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.kubelet.close()
        self.log.close()
        return rc


def allocate_request(ids: list[str]) -> api_pb2.AllocateRequest:
    return api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)])


def _caller_process(socket: str, ids: list[str], first: int, threads: int, per_caller: int,
                    ready, go, results) -> None:
    """`threads` callers, each with its own channel; latencies go back through `results`."""
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    connected = threading.Barrier(threads + 1)

    def caller(index: int) -> None:
        mine: list[float] = []
        try:
            channel = unix_channel(socket, 30)
            stub = api_pb2_grpc.DevicePluginStub(channel)
            stub.Allocate(allocate_request([ids[index % len(ids)]]), timeout=30)  # connected and warm
            connected.wait()
            go.wait()
            for j in range(per_caller):
                t = time.perf_counter()
                stub.Allocate(allocate_request([ids[(index * per_caller + j) % len(ids)]]), timeout=120)
                mine.append(time.perf_counter() - t)
            channel.close()
        except BaseException as exc:  # reported to the parent
            with lock:
                errors.append(repr(exc))
            try:
                connected.abort()
            except threading.BrokenBarrierError:
                pass
        with lock:
            latencies.extend(mine)

    workers = [threading.Thread(target=caller, args=(first + i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    try:
        connected.wait()
    except threading.BrokenBarrierError:
        pass
    ready.put(1)
    for worker in workers:
        worker.join()
    results.put((latencies, errors))


def concurrent_allocate(dp: Daemon, ids: list[str], callers: int, processes: int, per_caller: int) -> dict:
    """`callers` concurrent callers (threads with their own channels) spread over `processes`
    client processes, so that the client side's GIL does not dominate what is measured."""
    ctx = multiprocessing.get_context("spawn")  # no fork: gRPC's threads and fork do not mix
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    share = [callers // processes + (1 if i < callers % processes else 0) for i in range(processes)]
    procs, first = [], 0
    for count in share:
        procs.append(ctx.Process(target=_caller_process, args=(str(dp.socket), ids, first, count, per_caller,
                                                               ready, go, results)))
        first += count
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.get(timeout=120)
    cpu0 = dp.cpu_seconds()
    start = time.perf_counter()
    go.set()
    collected = [results.get(timeout=600) for _ in procs]
    wall = time.perf_counter() - start
    daemon_cpu = dp.cpu_seconds() - cpu0
    for proc in procs:
        proc.join(timeout=30)
    errors = [e for _, errs in collected for e in errs]
    if errors:
        raise RuntimeError(f"{len(errors)} concurrent callers failed, first: {errors[0]}")
    flat = [x for lat, _ in collected for x in lat]
    return stats_ms(flat) | {"callers": callers, "client_processes": processes, "calls_per_caller": per_caller,
                             "calls_per_s": round(len(flat) / wall, 1), "wall_s": round(wall, 3),
                             "daemon_cpu_percent": round(100 * daemon_cpu / wall, 1)}


def bench_allocate(root: Path, sequential: int, callers: int, processes: int, per_caller: int) -> dict:
    fake = standard_host(root / "fake", "Y")  # 8 PCI devices + rxe0
    dp = Daemon(root, fake, "shared", 1.0)
    out: dict = {"devices_behind_units": len(fake.devices), "units": len(dp.conn.latest.ids()),
                 "daemon_registered_s": round(dp.registered_s, 3), "daemon_first_list_s": round(dp.first_list_s, 3)}
    try:
        ids = dp.conn.latest.ids()
        stub = dp.conn.stub
        for _ in range(20):  # warm-up
            stub.Allocate(allocate_request([ids[0]]), timeout=10)
        latencies = []
        cpu0 = dp.cpu_seconds()
        start = time.perf_counter()
        for i in range(sequential):
            t = time.perf_counter()
            response = stub.Allocate(allocate_request([ids[i % len(ids)]]), timeout=10)
            latencies.append(time.perf_counter() - t)
        wall = time.perf_counter() - start
        nodes = len(response.container_responses[0].devices)
        out["sequential"] = stats_ms(latencies) | {"calls_per_s": round(sequential / wall, 1),
                                                   "device_specs_per_response": nodes,
                                                   "daemon_cpu_percent": round(100 * (dp.cpu_seconds() - cpu0) / wall, 1)}

        out["concurrent"] = concurrent_allocate(dp, ids, callers, processes, per_caller)
        # The daemon kept running and still answers.
        stub.Allocate(allocate_request([ids[0]]), timeout=10)
    finally:
        out["exit_code"] = dp.stop()
    return out


def exclusive_host(root: Path, count: int) -> FakeRdmaSysfs:
    fake = FakeRdmaSysfs(root, "N")
    for i in range(count):
        fake.add_pci_device(f"mlx5_{i}", f"0000:{0x10 + i:02x}:00.0", f"ens{i}f0", numa_node=i % 2)
    return fake


def bench_health(root: Path, count: int, interval: float, repeats: int, flaps: int) -> dict:
    fake = exclusive_host(root / "fake", count)
    dp = Daemon(root, fake, "exclusive", interval)
    conn = dp.conn
    out: dict = {"devices": count, "health_interval_s": interval,
                 "daemon_first_list_s": round(dp.first_list_s, 3)}
    try:
        names = sorted(fake.devices)
        pci = {name: fake.devices[name].pci for name in names}
        assert len(conn.latest.ids()) == count, conn.latest.ids()
        assert set(conn.latest.health().values()) == {"Healthy"}
        timeout = 10 * interval + 10

        # Idle cost: nothing changes for a few intervals.
        cpu0, t0 = dp.cpu_seconds(), time.monotonic()
        time.sleep(max(5.0, 5 * interval))
        out["idle_cpu_percent"] = round(100 * (dp.cpu_seconds() - cpu0) / (time.monotonic() - t0), 2)
        out["rss_mib"] = round(dp.rss_mib(), 1)

        down, up = [], []
        rng = random.Random(7)
        for i in range(repeats):
            name = names[rng.randrange(count)]
            time.sleep(rng.uniform(0, interval))  # a random phase against the daemon's poll
            t = time.monotonic()
            fake.set_port_state(name, "DOWN")
            update = conn.wait_for(lambda u, d=pci[name]: u.health().get(d) == "Unhealthy", timeout,
                                   f"{name} Unhealthy")
            down.append(update.time - t)
            time.sleep(rng.uniform(0, interval))
            t = time.monotonic()
            fake.set_port_state(name, "ACTIVE")
            update = conn.wait_for(lambda u, d=pci[name]: u.health().get(d) == "Healthy", timeout,
                                   f"{name} Healthy")
            up.append(update.time - t)
        out["one_device_down_to_unhealthy"] = stats_ms(down)
        out["one_device_up_to_healthy"] = stats_ms(up)

        all_down, all_up, lists_down = [], [], []
        for _ in range(flaps):
            time.sleep(rng.uniform(0, interval))
            before = len(conn.history)
            t = time.monotonic()
            fake.set_all_ports("DOWN")
            write_s = time.monotonic() - t
            update = conn.wait_for(lambda u: set(u.health().values()) == {"Unhealthy"}, timeout,
                                   "all Unhealthy")
            all_down.append(update.time - t)
            lists_down.append(len(conn.history) - before)
            time.sleep(rng.uniform(0, interval))
            t = time.monotonic()
            fake.set_all_ports("ACTIVE")
            update = conn.wait_for(lambda u: set(u.health().values()) == {"Healthy"}, timeout, "all Healthy")
            all_up.append(update.time - t)
        out["all_down_to_unhealthy"] = stats_ms(all_down) | {
            "lists_per_flap": lists_down, "fake_tree_write_ms": round(write_s * 1000, 1)}
        out["all_up_to_healthy"] = stats_ms(all_up)
    finally:
        out["exit_code"] = dp.stop()
    return out


def table(results: dict) -> str:
    rows = []
    a = results["allocate"]
    rows.append(f"daemon start (shared, {a['devices_behind_units']} devices): registered "
                f"{a['daemon_registered_s']:.2f} s, first ListAndWatch list {a['daemon_first_list_s']:.2f} s")
    rows.append("")
    rows.append(f"{'Allocate, shared mode, ' + str(a['units']) + ' units':<46}{'n':>6}{'median':>10}{'p99':>10}"
                f"{'max':>10}{'calls/s':>10}{'dp CPU':>8}")
    for key, label in (("sequential", "  sequential, one channel"),
                       ("concurrent", f"  {a['concurrent']['callers']} concurrent callers "
                                      f"({a['concurrent']['client_processes']} client procs)")):
        s = a[key]
        rows.append(f"{label:<46}{s['n']:>6}{s['median_ms']:>8.2f}ms{s['p99_ms']:>8.2f}ms{s['max_ms']:>8.2f}ms"
                    f"{s['calls_per_s']:>10.0f}{s['daemon_cpu_percent']:>7.0f}%")
    rows.append(f"  ({a['sequential']['device_specs_per_response']} DeviceSpecs per response; "
                f"daemon exit code {a['exit_code']})")
    rows.append("")
    h = results["health"]
    rows.append(f"{'Health, exclusive, ' + str(h['devices']) + ' devices, interval ' + str(h['health_interval_s']) + ' s':<46}"
                f"{'n':>6}{'median':>10}{'p99':>10}{'max':>10}{'min':>10}")
    for key, label in (("one_device_down_to_unhealthy", "  one port DOWN -> Unhealthy"),
                       ("one_device_up_to_healthy", "  one port ACTIVE -> Healthy"),
                       ("all_down_to_unhealthy", f"  all {h['devices']} DOWN -> all Unhealthy"),
                       ("all_up_to_healthy", f"  all {h['devices']} ACTIVE -> all Healthy")):
        s = h[key]
        rows.append(f"{label:<46}{s['n']:>6}{s['median_ms'] / 1000:>9.3f}s{s['p99_ms'] / 1000:>9.3f}s"
                    f"{s['max_ms'] / 1000:>9.3f}s{s['min_ms'] / 1000:>9.3f}s")
    rows.append(f"  ListAndWatch lists per {h['devices']}-device flap down: {h['all_down_to_unhealthy']['lists_per_flap']} "
                f"(2 = the poll ran while the {h['devices']} state files were being written, "
                f"{h['all_down_to_unhealthy']['fake_tree_write_ms']} ms)")
    rows.append(f"  idle daemon, {h['devices']} devices: {h['idle_cpu_percent']:.2f} % of a CPU, "
                f"RSS {h['rss_mib']:.0f} MiB; daemon exit code {h['exit_code']}")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results as JSON to this file")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    parser.add_argument("--sequential", type=int, default=500)
    parser.add_argument("--callers", type=int, default=100)
    parser.add_argument("--processes", type=int, default=4, help="client processes the callers are spread over")
    parser.add_argument("--per-caller", type=int, default=20)
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--flaps", type=int, default=5)
    args = parser.parse_args()
    if args.quick:
        args.sequential, args.per_caller, args.repeats, args.flaps = 100, 5, 5, 2
    results = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                           "grpc": grpc.__version__}}
    with tempfile.TemporaryDirectory(prefix="dp-bench-") as tmp:
        root = Path(tmp)
        (root / "a").mkdir()
        (root / "h").mkdir()
        results["allocate"] = bench_allocate(root / "a", args.sequential, args.callers, args.processes, args.per_caller)
        results["health"] = bench_health(root / "h", args.devices, args.interval, args.repeats, args.flaps)
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nJSON: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
