#!/usr/bin/env python3
"""A pod burst: N pods ADDed at once on one node (kubelet runs CNI plugins in parallel), R rails
each, then all DELeted at once; rdma-netns against Debian's Go macvlan in the same run.

    sudo python3 integration/bench/burst.py --rdma-netns .venv/bin/rdma-netns \\
        [--pods 64] [--rails 8] [--concurrency 64] [--json burst.json]

What runs (inside a private node namespace with R veth rails, see common.py):
  * lone:   L sequential ADD/DEL of one R-rail pod (after a warm-up call), the uncontended time.
  * burst:  N pod namespaces are made first; then N R-rail ADDs start together (at most C at a
            time), each a fresh `rdma-netns` process (one call brings up all R rails, each rail
            with its own IPv6 host-local subnet); then the N DELs likewise.
  * go:     the same burst with Go macvlan. Go macvlan makes ONE interface per call, so a pod
            needs R calls (rail0..rail{R-1}, one host-local subnet each), run one after the
            other inside the pod's thread as a runtime or Multus runs a pod's attachments;
            pods still run concurrently. "per-pod ADD" is then the sum of its R calls. Run with
            IPv4 (the project's baseline) and IPv6 (which waits for DAD in Go) by default.
  * ours-ipam-dir-per-rail: the rdma-netns burst again with a host-local dataDir per rail, so
            that host-local's lock (one flock per dataDir/<network>) is per rail instead of one for
            the whole network: the measured effect of host-local's lock on the burst.
  * traced: the rdma-netns burst (and Go IPv4) once more under `strace -f --seccomp-bpf -T
            -e trace=flock,clock_nanosleep`, to measure lock waiting: the plugin's per-
            attachment lock files are polled (flock LOCK_NB + sleep), so its wait is the sum
            of its sleeps; host-local takes one blocking flock per network, so its wait is the
            time spent inside flock(LOCK_EX). strace slows every call, so the traced run only
            gives the lock figures, never the latency figures.

Per phase: total wall time (first start to last exit), per-ADD p50/p90/p99/max, errors (non-zero
exits; must be 0), CPU time of all calls (rusage: user+sys, children included) and the
"CPU floor" = CPU / cores, the wall time the burst could not beat on this machine even with no
locks at all. Results are verified: every pod has its R global IPv6 addresses after ADD, and after
DEL no pod interface, no state file and no host-local allocation is left.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from common import GO_PLUGINS, Call, cni_env, ip_batch, spawn, summary_ms  # noqa: E402

NODE = "rnburst-node"
POD_PREFIX = "rnburst-pod-"
POD_IFNAME = "net1"


class Variant:
    """How one pod is ADDed/DELeted: one rdma-netns call, or R Go macvlan calls in a row."""

    def __init__(self, name: str, calls_per_pod: list[tuple[list[str], bytes, str]]) -> None:
        # (argv, stdin, CNI_IFNAME) for each call a pod needs, in order
        self.name = name
        self.calls = calls_per_pod


def pod_names(n: int, tag: str) -> list[str]:
    return [f"{POD_PREFIX}{tag}-{i}" for i in range(n)]


# Container IDs as containerd makes them (64 random hex digits), one per pod for the whole run:
# sequential names would hide how a lock keyed by the ID spreads unrelated pods.
CONTAINER_IDS: dict[str, str] = {}


def container_id(pod: str) -> str:
    return CONTAINER_IDS.setdefault(pod, secrets.token_hex(32))


def run_pod(variant: Variant, command: str, pod: str, trace_dir: str | None) -> tuple[float, float, list[Call]]:
    """One pod's ADD or DEL (all of its calls, in order; DEL in reverse). Returns start, wall, calls."""
    netns = f"{common.NETNS_DIR}/{pod}"
    calls = variant.calls if command == "ADD" else list(reversed(variant.calls))
    out: list[Call] = []
    start = time.perf_counter()
    for argv, stdin, ifname in calls:
        if trace_dir:
            argv = ["/usr/bin/strace", "-f", "--seccomp-bpf", "-qq", "-Y", "-T", "-e",
                    "trace=flock,clock_nanosleep", "-o", f"{trace_dir}/{pod}.{command}.{ifname}"] + argv
        call = spawn(argv, stdin, cni_env(command, container_id(pod), netns, ifname))
        out.append(call)
        if call.rc != 0:
            break
    return start, time.perf_counter() - start, out


def burst(variant: Variant, command: str, pods: list[str], concurrency: int,
          trace_dir: str | None = None) -> dict:
    """All pods' ADD (or DEL) started together, at most `concurrency` at a time."""
    go = threading.Event()

    def task(pod: str) -> tuple[float, float, list[Call]]:
        go.wait()
        return run_pod(variant, command, pod, trace_dir)

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(task, pod) for pod in pods]
        time.sleep(0.05)  # let the workers reach the gate
        t0 = time.perf_counter()
        go.set()
        results = [f.result() for f in futures]
    total = max(s + w for s, w, _ in results) - t0
    per_pod = [w for _, w, _ in results]
    per_call = [c.wall for _, _, calls in results for c in calls]
    errors = [(pod, c.error_text()) for pod, (_, _, calls) in zip(pods, results) for c in calls if c.rc != 0]
    stderr_lines = Counter(line for _, _, calls in results for c in calls
                           for line in c.stderr.decode(errors="replace").splitlines() if line.strip())
    cpu = sum(c.cpu for _, _, calls in results for c in calls)
    out = {
        "variant": variant.name, "command": command, "pods": len(pods), "concurrency": concurrency,
        "calls_per_pod": len(variant.calls), "total_wall_s": total,
        "per_pod": summary_ms(per_pod), "per_call": summary_ms(per_call),
        "errors": len(errors), "error_samples": errors[:5],
        "stderr_lines": dict(stderr_lines.most_common(10)),
        "cpu_total_s": cpu, "cpu_floor_s": cpu / os.cpu_count(),
        "cpu_per_pod_ms": cpu / len(pods) * 1000,
        "p99_over_p50": summary_ms(per_pod)["p99_ms"] / summary_ms(per_pod)["median_ms"],
        "_stdouts": [[c.stdout for c in calls] for _, _, calls in results],
    }
    return out


def verify_added(pods: list[str], rails: int, result: dict, ours: bool) -> list[str]:
    """Every pod has its rails' global IPv6/IPv4 addresses; rdma-netns results list R interfaces."""
    problems = []
    for pod, stdouts in zip(pods, result["_stdouts"]):
        if ours:
            try:
                res = json.loads(stdouts[0])
                if len(res.get("interfaces", [])) != rails or len(res.get("ips", [])) != rails:
                    problems.append(f"{pod}: result has {len(res.get('interfaces', []))} interfaces")
            except (ValueError, IndexError):
                problems.append(f"{pod}: no JSON result")
        text = subprocess.run(["ip", "-n", pod, "-o", "addr", "show", "scope", "global"], capture_output=True,
                              text=True).stdout
        if len(text.splitlines()) != rails:
            problems.append(f"{pod}: {len(text.splitlines())} global addresses, expected {rails}")
    return problems


def verify_deleted(pods: list[str], state_dir: str, data_dir: str) -> list[str]:
    problems = []
    for pod in pods:
        links = subprocess.run(["ip", "-n", pod, "-o", "link"], capture_output=True, text=True).stdout.splitlines()
        if len(links) != 1:
            problems.append(f"{pod}: {len(links)} links left (expected only lo)")
        rules = subprocess.run(["ip", "-n", pod, "-6", "rule"], capture_output=True, text=True).stdout.splitlines()
        if len(rules) != 2:  # 0: from all lookup local; 32766: from all lookup main
            problems.append(f"{pod}: {len(rules)} IPv6 rules left")
    for root, _dirs, files in os.walk(state_dir):
        rel = os.path.relpath(root, state_dir)
        if rel.split(os.sep)[0] in ("locks", "verified-configs") or os.path.basename(root) == "released":
            continue  # released/: DEL's "holds nothing" markers, kept by design (state.py, bounded)
        problems += [f"state file left: {rel}/{f}" for f in files]
    problems += [f"host-local allocation left: {a}" for a in leftover_allocations(data_dir)]
    return problems


def leftover_allocations(data_dir: str) -> list[str]:
    """host-local keeps one file per allocated address (named by the IP) in dataDir/<network>/."""
    import ipaddress

    out = []
    for root, _dirs, files in os.walk(data_dir):
        for f in files:
            try:
                ipaddress.ip_address(f)
                out.append(os.path.join(os.path.relpath(root, data_dir), f))
            except ValueError:
                pass  # lock, last_reserved_ip.N
    return out


TRACE_LINE = re.compile(r"^(\d+)<([^>]*)> +(?:<\.\.\. (\w+) resumed>|(\w+)\()(.*?)= (-?\d+)( \w+)?.*<([\d.]+)>\s*$")


def parse_traces(trace_dir: str) -> dict:
    """Lock waiting from the strace logs: the plugin's polled attachment lock, host-local's flock."""
    plugin_sleep = defaultdict(float)   # trace file -> seconds slept by rdma-netns waiting for its lock
    plugin_eagain = defaultdict(int)
    hl_wait = defaultdict(float)        # trace file -> seconds host-local spent blocked in flock(LOCK_EX)
    other = Counter()
    for name in os.listdir(trace_dir):
        with open(os.path.join(trace_dir, name)) as f:
            for line in f:
                m = TRACE_LINE.match(line)
                if not m:
                    continue
                comm, syscall = m.group(2), m.group(3) or m.group(4)
                args, err, dur = m.group(5), m.group(7), float(m.group(8))
                if comm == "rdma-netns" or comm.startswith("python"):
                    if syscall == "clock_nanosleep":
                        plugin_sleep[name] += dur
                    elif syscall == "flock" and err and "EAGAIN" in err:
                        plugin_eagain[name] += 1
                elif comm == "host-local":
                    if syscall == "flock" and ("LOCK_EX" in args or m.group(3)):
                        hl_wait[name] += dur
                else:
                    other[(comm, syscall)] += 1
    files = sorted(os.listdir(trace_dir))
    return {
        "calls_traced": len(files),
        "plugin_attachment_lock": {"calls_that_waited": sum(1 for v in plugin_sleep.values() if v > 0),
                               "total_wait_s": sum(plugin_sleep.values()),
                               "max_wait_ms": max(plugin_sleep.values(), default=0) * 1000,
                               "eagain_polls": sum(plugin_eagain.values())},
        "host_local_flock": {"calls_that_waited_1ms": sum(1 for v in hl_wait.values() if v > 0.001),
                             "total_wait_s": sum(hl_wait.values()),
                             "per_call": summary_ms(list(hl_wait.values()) + [0.0] * (len(files) - len(hl_wait)))},
        "other_syscalls_seen": {f"{c}:{s}": n for (c, s), n in other.most_common(5)},
    }


def run_inner(args: argparse.Namespace) -> dict:
    rails, npods, conc = args.rails, args.pods, args.concurrency or args.pods
    work = tempfile.mkdtemp(prefix="rnburst-")
    data_dir, state_dir, trace_root = f"{work}/ipam", f"{work}/state", f"{work}/traces"
    ours_stdin = json.dumps(common.ours_conf("rnburst", rails, data_dir, state_dir)).encode()
    ours = Variant("rdma-netns", [([args.plugin], ours_stdin, POD_IFNAME)])
    out: dict = {"pods": npods, "rails": rails, "concurrency": conc, "cpus": os.cpu_count(), "phases": {}}

    def pods_up(tag: str) -> list[str]:
        names = pod_names(npods, tag)
        ip_batch([f"netns add {n}" for n in names])
        return names

    def pods_down(names: list[str]) -> None:
        ip_batch([f"netns del {n}" for n in names], check=False)

    # --- lone (uncontended) ADD/DEL of one R-rail pod; iteration 0 warms the config cache
    lone_add, lone_del, lone_cpu = [], [], []
    for i in range(args.lone + 1):
        pod = f"{POD_PREFIX}lone-{i}"
        ip_batch([f"netns add {pod}"])
        _, wa, ca = run_pod(ours, "ADD", pod, None)
        _, wd, cd = run_pod(ours, "DEL", pod, None)
        pods_down([pod])
        if any(c.rc for c in ca + cd):
            raise SystemExit(f"lone call failed: {[c.error_text() for c in ca + cd if c.rc]}")
        if i:
            lone_add.append(wa)
            lone_del.append(wd)
            lone_cpu.append(ca[0].cpu)
    out["lone"] = {"add": summary_ms(lone_add), "del": summary_ms(lone_del),
                   "add_cpu_ms": statistics.median(lone_cpu) * 1000}


    def run_variant(variant: Variant, tag: str, is_ours: bool, trace: bool = False) -> None:
        warm = f"{POD_PREFIX}warm-{tag}"  # one untimed pod first: config cache, page cache, IPAM files
        ip_batch([f"netns add {warm}"])
        try:
            for command in ("ADD", "DEL"):
                calls = run_pod(variant, command, warm, None)[2]
                if any(c.rc for c in calls):
                    raise SystemExit(f"{tag} warm-up {command} failed: {[c.error_text() for c in calls if c.rc]}")
        finally:
            pods_down([warm])
        names = pods_up(tag)
        trace_dir = None
        if trace:
            trace_dir = f"{trace_root}/{tag}"
            os.makedirs(trace_dir)
        try:
            add = burst(variant, "ADD", names, conc, trace_dir)
            add["verify_problems"] = verify_added(names, rails, add, is_ours)[:10] if not add["errors"] else ["skipped"]
            dele = burst(variant, "DEL", names, conc, trace_dir)
            dele["verify_problems"] = verify_deleted(names, state_dir, data_dir)[:10]
        finally:
            pods_down(names)
        for r in (add, dele):
            r.pop("_stdouts")
        phase = {"ADD": add, "DEL": dele}
        if trace_dir:
            phase["locks"] = parse_traces(trace_dir)
        out["phases"][tag] = phase
        print(f"  {tag}: ADD {add['total_wall_s']:.2f} s, DEL {dele['total_wall_s']:.2f} s, "
              f"errors {add['errors']}+{dele['errors']}", file=sys.stderr, flush=True)

    print(f"burst: {npods} pods x {rails} rails, concurrency {conc}, {os.cpu_count()} CPUs", file=sys.stderr)
    run_variant(ours, "ours", True)
    if args.ipam_dir_per_rail:
        split = Variant("rdma-netns, host-local dataDir per rail", [([args.plugin], json.dumps(
            common.ours_conf("rnburst", rails, data_dir, state_dir, dir_per_rail=True)).encode(), POD_IFNAME)])
        run_variant(split, "ours-ipam-dir-per-rail", True)
    for fam in args.go_families:
        family = 4 if fam == "ipv4" else 6
        go = Variant(f"go-macvlan-{fam}", [
            ([f"{GO_PLUGINS}/macvlan"], json.dumps(common.go_macvlan_conf("goburst", r, family, data_dir)).encode(),
             f"rdma{r}") for r in range(rails)])
        run_variant(go, f"go-{fam}", False)
    if args.trace_locks and shutil.which("strace"):
        run_variant(ours, "ours-traced", True, trace=True)
        if "ipv4" in args.go_families:
            go4 = Variant("go-macvlan-ipv4", [
                ([f"{GO_PLUGINS}/macvlan"], json.dumps(common.go_macvlan_conf("goburst", r, 4, data_dir)).encode(),
                 f"rdma{r}") for r in range(rails)])
            run_variant(go4, "go-ipv4-traced", False, trace=True)
    shutil.rmtree(work, ignore_errors=True)

    p = out["phases"]
    ratios = {"burst_add_p50 / lone_add_median": p["ours"]["ADD"]["per_pod"]["median_ms"]
              / out["lone"]["add"]["median_ms"],
              "burst_add_total / cpu_floor": p["ours"]["ADD"]["total_wall_s"] / p["ours"]["ADD"]["cpu_floor_s"]}
    for fam in args.go_families:
        g = p[f"go-{fam}"]
        ratios[f"ours_add_total / go_{fam}_add_total"] = p["ours"]["ADD"]["total_wall_s"] / g["ADD"]["total_wall_s"]
        ratios[f"ours_add_p50 / go_{fam}_pod_add_p50"] = (p["ours"]["ADD"]["per_pod"]["median_ms"]
                                                          / g["ADD"]["per_pod"]["median_ms"])
        ratios[f"ours_del_total / go_{fam}_del_total"] = p["ours"]["DEL"]["total_wall_s"] / g["DEL"]["total_wall_s"]
    if "ours-ipam-dir-per-rail" in p:
        ratios["ours_add_total / ours_ipam_dir_per_rail_add_total"] = (
            p["ours"]["ADD"]["total_wall_s"] / p["ours-ipam-dir-per-rail"]["ADD"]["total_wall_s"])
    out["ratios"] = ratios
    a = p["ours"]["ADD"]
    out["goals"] = {"zero_errors": all(ph[c]["errors"] == 0 and not ph[c]["verify_problems"]
                                       for ph in p.values() for c in ("ADD", "DEL")),
                    "ours_add_p99_over_p50": a["p99_over_p50"], "p99_lt_5x_p50": a["p99_over_p50"] < 5}
    return out


def report(out: dict) -> None:
    print(f"\n== burst: {out['pods']} pods x {out['rails']} rails, concurrency {out['concurrency']}, "
          f"{out['cpus']} CPUs ==")
    print(common.fmt_summary("lone rdma-netns ADD (uncontended)", out["lone"]["add"]))
    print(common.fmt_summary("lone rdma-netns DEL (uncontended)", out["lone"]["del"]))
    print(f"{'lone ADD CPU time (user+sys)':<34} {out['lone']['add_cpu_ms']:.1f} ms")
    for tag, ph in out["phases"].items():
        for cmd in ("ADD", "DEL"):
            r = ph[cmd]
            print(f"-- {tag} {cmd}: total {r['total_wall_s']:.2f} s, errors {r['errors']}, "
                  f"CPU {r['cpu_total_s']:.1f} s (floor {r['cpu_floor_s']:.2f} s on {out['cpus']} CPUs), "
                  f"p99/p50 {r['p99_over_p50']:.2f}, "
                  f"verify: {'ok' if not r['verify_problems'] else r['verify_problems'][:3]}")
            print("   " + common.fmt_summary(f"per pod ({r['calls_per_pod']} call(s))", r["per_pod"], 31))
            if r["calls_per_pod"] > 1:
                print("   " + common.fmt_summary("per call", r["per_call"], 31))
            if r["error_samples"]:
                print(f"   errors: {r['error_samples'][:3]}")
            if r["stderr_lines"]:
                print(f"   stderr: {r['stderr_lines']}")
        if "locks" in ph:
            lk = ph["locks"]
            s, h = lk["plugin_attachment_lock"], lk["host_local_flock"]
            print(f"   locks ({lk['calls_traced']} traced calls, ADD+DEL): rdma-netns attachment locks: "
                  f"{s['calls_that_waited']} calls waited, total {s['total_wait_s'] * 1000:.1f} ms, "
                  f"max {s['max_wait_ms']:.1f} ms; host-local flock: total {h['total_wait_s'] * 1000:.1f} ms, "
                  f"{h['calls_that_waited_1ms']} calls waited >1 ms, per call p50 {h['per_call'].get('median_ms', 0):.2f} "
                  f"p99 {h['per_call'].get('p99_ms', 0):.1f} max {h['per_call'].get('max_ms', 0):.1f} ms")
    for name, value in out["ratios"].items():
        print(f"{name:<44} {value:7.2f}x")
    print(f"goals: {out['goals']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=64)
    parser.add_argument("--rails", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=0, help="calls in flight at once (default: --pods)")
    parser.add_argument("--lone", type=int, default=10, help="uncontended ADD/DEL runs for the baseline")
    parser.add_argument("--go-families", default="ipv4,ipv6",
                        help="Go macvlan bursts to run: ipv4,ipv6 (default), ipv4, or none")
    parser.add_argument("--no-ipam-dir-per-rail", dest="ipam_dir_per_rail", action="store_false",
                        help="skip the extra rdma-netns burst whose rails each have their own host-local "
                             "dataDir (one host-local lock per rail instead of one per network)")
    parser.add_argument("--no-trace-locks", dest="trace_locks", action="store_false",
                        help="skip the extra strace'd burst that measures lock waiting")
    common.common_args(parser)
    args = parser.parse_args()
    args.go_families = [f for f in args.go_families.split(",") if f in ("ipv4", "ipv6")]
    if not args.inner:
        return common.outer_main(args, __file__, NODE, args.rails, POD_PREFIX)
    if args.json:
        args.json = os.path.abspath(args.json)
    out = run_inner(args)
    report(out)
    common.write_json(args.json, out)
    return 0 if out["goals"]["zero_errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
