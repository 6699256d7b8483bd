#!/usr/bin/env python3
"""Churn: many ADD/DEL cycles of R-rail pods, then a search for anything left behind.

    sudo python3 integration/bench/churn.py --rdma-netns .venv/bin/rdma-netns \\
        [--cycles 2000 | --quick] [--workers 1] [--rails 8] [--json churn.json]

Each cycle (inside a private node namespace with R veth rails, see common.py): make a fresh pod
namespace, ADD an R-rail rdma-netns attachment (one IPv6 host-local subnet per rail), DEL it,
delete the namespace. --workers W runs W such loops in parallel (cycles split between them).

Figures: ADD, DEL and cycle (ADD+DEL) time, median/p99, and the first 100 cycles' medians
against the last 100's (does it slow down as it goes?); CPU time per call (rusage).

Memory of the plugin per call: every --mem-every'th cycle runs its ADD and DEL under
`/usr/bin/time -f %M` and takes the maximum resident set size of the call's process tree (the
Python plugin and the host-local processes it starts; GNU time forks from a ~2 MB process, so the
figure is not inflated by this harness's own memory). Those cycles are left out of the timings.

Leaks looked for afterwards, against a snapshot taken after one warm-up cycle:
  * node namespace: links, addresses, IPv4/IPv6 rules, IPv4/IPv6 routes in ALL tables;
  * inside pods (every --pod-check-every'th cycle, after DEL and before the namespace goes):
    links other than lo, rules beyond the two defaults, routes in any table;
  * the plugin's stateDir: attachment state files and temporary files (lock files of calls in
    flight, the verified-config cache and the released/ markers are bounded by design and reported, not
    counted as leaks);

Bounded on-disk growth without GC (containerd 1.6 never sends it): the run never sends GC, counts
the stateDir's files every half second and reports the largest count against the bound the
plugin keeps by itself: one lock file per call in flight (the holder unlinks it) + 1 fill lock, at most loader.CACHE_KEEP verified
configs, released/ markers at most state.RELEASED_KEEP (older than state.RELEASED_TTL go sooner)
plus one SWEEP_INTERVAL of DELs, no attachment state after DEL. --config-variants K cycles through
K distinct network configs (a rollout or hand edits: one cache file each), and --plant-markers N
plants N old markers (ages spread over two TTLs) so that a short run shows the expiry a long one
would reach.
  * host-local: allocation files (one per address) left in its dataDir;
  * pod namespaces of this benchmark still present; plugin or host-local processes still alive;
  * file descriptors: the plugin is a new process per call, so nothing it opens can outlive the
    call, and the node gains no fds from it. What can be measured is the fds a call holds when it
    finishes and the fds it leaks into its children: every --probe-every'th cycle runs through
    a probe launcher (same interpreter flags and package as the real launcher) that calls the
    plugin's run_cni() and then lists /proc/self/fd just before the process exits, and through
    a host-local wrapper that lists the fds host-local inherits before exec'ing the real one.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
from common import GO_PLUGINS, cni_env, spawn, summary_ms  # noqa: E402

NODE = "rnchurn-node"
POD_PREFIX = "rnchurn-pod-"
POD_IFNAME = "net1"
LAUNCHER_TAIL = "from rdma_netns.entry import main\nsys.exit(main())\n"

PROBE_TAIL = """import json, os
from rdma_netns.entry import run_cni
def _fds():
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            out[fd] = "?"  # the listing's own descriptor, closed by now
    return out
_before = _fds()
_code = run_cni()
sys.stderr.write("BENCH-FDS " + json.dumps({"before": _before, "after": _fds()}) + "\\n")
sys.stderr.flush()
os._exit(_code)
"""

HOST_LOCAL_PROBE = """#!{python} -IS
import json, os
fds = {{}}
for fd in os.listdir("/proc/self/fd"):
    try:
        fds[fd] = os.readlink(f"/proc/self/fd/{{fd}}")
    except OSError:
        fds[fd] = "?"
with open({log!r}, "a") as f:
    f.write(json.dumps(fds) + "\\n")
os.execv("{real}", ["{real}"])
"""


# ---------------------------------------------------------------- node and leak snapshots


def run(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True).stdout


def wait_settled(limit: float = 10.0) -> None:
    """Let tentative IPv6 link-local addresses of the rails finish DAD, so that their local routes
    are in the snapshot either way (else they show up later as 'new' routes)."""
    deadline = time.monotonic() + limit
    while run("ip", "-6", "addr", "show", "tentative").strip() and time.monotonic() < deadline:
        time.sleep(0.1)


def node_snapshot() -> dict[str, set[str]]:
    """What the node namespace (the one we run in) holds, normalised to comparable lines."""
    wait_settled()
    links = set()
    for line in run("ip", "-d", "-o", "link").splitlines():
        m = re.match(r"\d+: ([^:@]+)[@:]", line)
        kind = next((k for k in ("veth", "macvlan", "ipvlan", "vlan", "dummy") if f" {k} " in line), "other")
        links.add(f"{m.group(1) if m else line} {kind}")
    addrs = {" ".join(line.split()[1:4]) for line in run("ip", "-o", "addr").splitlines()}
    out = {"links": links, "addresses": addrs}
    for fam in ("-4", "-6"):
        out[f"rules{fam}"] = set(run("ip", fam, "rule").splitlines())
        out[f"routes{fam}"] = {re.sub(r" expires \d+sec", "", line)
                                for line in run("ip", fam, "route", "show", "table", "all").splitlines()}
    return out


def pod_leftovers(pod: str) -> list[str]:
    """After DEL, the pod must hold nothing of ours: only lo, default rules, no routes."""
    problems = []
    links = [line.split(":")[1].strip() for line in run("ip", "-n", pod, "-o", "link").splitlines()]
    if links != ["lo"]:
        problems.append(f"{pod}: links {links}")
    for fam, default in (("-4", 3), ("-6", 2)):
        rules = run("ip", "-n", pod, fam, "rule").splitlines()
        if len(rules) != default:
            problems.append(f"{pod}: {fam} rules {rules}")
        routes = run("ip", "-n", pod, fam, "route", "show", "table", "all").splitlines()
        if routes:
            problems.append(f"{pod}: {fam} routes {routes[:4]}")
    return problems


def state_files(state_dir: str) -> dict:
    out = {"attachment_or_temp_files": [], "lock_files": 0, "verified_configs": 0, "released_markers": 0}
    for root, _dirs, files in os.walk(state_dir):
        rel = os.path.relpath(root, state_dir).split(os.sep)
        top = rel[0]
        if rel[-1] == "released":  # "holds nothing" markers: bounded by their TTL (state.py)
            out["released_markers"] += sum(1 for f in files if ":" in f)
        elif top == "locks":
            out["lock_files"] += len(files)
        elif top == "verified-configs":
            out["verified_configs"] += sum(1 for f in files if f.endswith(".json") and ".tmp." not in f)
            out["attachment_or_temp_files"] += [f"verified-configs/{f}" for f in files if ".tmp." in f]
        else:
            out["attachment_or_temp_files"] += [os.path.join(os.path.relpath(root, state_dir), f) for f in files]
    return out


def plant_markers(state_dir: str, network: str, count: int) -> None:
    """Markers of pods deleted long ago (ages spread over 0 to 2 TTLs): what a long run leaves."""
    from rdma_netns import state

    folder = f"{state_dir}/{network}/released"
    os.makedirs(folder, mode=0o700, exist_ok=True)
    now = time.time()
    for i in range(count):
        path = f"{folder}/planted{i:06d}:net1"
        open(path, "w").close()
        age = 2 * state.RELEASED_TTL * (i + 0.5) / count
        os.utime(path, (now - age, now - age))


def disk_bound(args: argparse.Namespace, elapsed: float) -> dict:
    """The most files the plugin's own expiry allows in the stateDir for this run's DEL rate."""
    from rdma_netns import state
    from rdma_netns.config import loader

    dels_per_sweep = int(args.cycles / max(elapsed, 1e-3) * state.SWEEP_INTERVAL) + 1
    markers = min(state.RELEASED_KEEP + dels_per_sweep, args.plant_markers + args.cycles + 1)
    return {"lock_files": 1 + args.workers, "verified_configs": loader.CACHE_KEEP,
            "released_markers": markers, "sweep_stamps": 1, "attachments_in_flight": args.workers * 2,
            "total": 1 + args.workers + loader.CACHE_KEEP + markers + 1 + args.workers * 2,
            "released_keep": state.RELEASED_KEEP, "released_ttl_s": state.RELEASED_TTL}


def count_files(state_dir: str) -> int:
    return sum(len(files) for _root, _dirs, files in os.walk(state_dir))


def ipam_files(data_dir: str) -> dict:
    allocations, other = [], []
    for root, _dirs, files in os.walk(data_dir):
        for f in files:
            rel = os.path.join(os.path.relpath(root, data_dir), f)
            try:
                ipaddress.ip_address(f)
                allocations.append(rel)
            except ValueError:
                other.append(rel)
    return {"allocations": allocations, "other_files": sorted(other)}


def stray_processes(markers: list[str]) -> list[str]:
    """Processes still alive whose command line mentions one of our plugin paths."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(pid) != os.getpid() and any(m in cmd for m in markers):
            out.append(f"{pid}: {cmd[:120]}")
    return out


# ---------------------------------------------------------------- the cycles


class Recorder:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.timed: list[tuple[int, float, float, float, float]] = []  # (cycle, add, del, add_cpu, del_cpu)
        self.mem: list[tuple[int, int, int]] = []  # (cycle, add maxrss kB, del maxrss kB)
        self.errors: list[str] = []
        self.pod_problems: list[str] = []
        self.probes: list[dict] = []
        self.stderr: dict[str, int] = {}
        self.done = 0


def timed_maxrss(argv: list[str], stdin: bytes, env: dict[str, str], tmp: str) -> tuple[common.Call, int]:
    out = f"{tmp}.time"
    call = spawn(["/usr/bin/time", "-f", "%M", "-o", out] + argv, stdin, env)
    try:
        with open(out) as f:
            kb = int(f.read().strip().splitlines()[-1])
    except (OSError, ValueError, IndexError):
        kb = -1
    return call, kb


def cycle(args: argparse.Namespace, rec: Recorder, n: int, worker: int, stdin: bytes | list[bytes],
          probe: dict) -> None:
    if isinstance(stdin, list):  # --config-variants: the configs take turns
        stdin = stdin[n % len(stdin)]
    pod = f"{POD_PREFIX}{worker}-{n}"
    netns = f"{common.NETNS_DIR}/{pod}"
    subprocess.run(["ip", "netns", "add", pod], check=True)
    try:
        kind = "timed"
        if args.probe_every and n % args.probe_every == args.probe_every // 2:
            kind = "probe"
        elif args.mem_every and n % args.mem_every == 0:
            kind = "mem"
        calls = []
        for command in ("ADD", "DEL"):
            if kind == "probe":
                env = cni_env(command, pod, netns, POD_IFNAME, cni_path=f"{probe['cni_dir']}:{GO_PLUGINS}")
                call = spawn([probe["launcher"]], stdin, env)
                lines = call.stderr.decode(errors="replace").splitlines()
                fds = [json.loads(line[len("BENCH-FDS "):]) for line in lines if line.startswith("BENCH-FDS ")]
                call.stderr = "\n".join(line for line in lines if not line.startswith("BENCH-FDS ")).encode()
                with rec.lock:
                    rec.probes.append({"cycle": n, "command": command, **(fds[0] if fds else {"missing": True})})
            elif kind == "mem":
                call, kb = timed_maxrss([args.plugin], stdin, cni_env(command, pod, netns, POD_IFNAME),
                                        f"{args.work}/w{worker}")
                call.maxrss_kb = kb
            else:
                call = spawn([args.plugin], stdin, cni_env(command, pod, netns, POD_IFNAME))
            calls.append(call)
            if call.rc != 0:
                with rec.lock:
                    rec.errors.append(f"cycle {n} worker {worker} {command}: {call.error_text()}")
                break
        with rec.lock:
            for call in calls:
                for line in call.stderr.decode(errors="replace").splitlines():
                    if line.strip():
                        rec.stderr[line[:200]] = rec.stderr.get(line[:200], 0) + 1
        if len(calls) == 2 and not any(c.rc for c in calls):
            with rec.lock:
                if kind == "timed":
                    rec.timed.append((n, calls[0].wall, calls[1].wall, calls[0].cpu, calls[1].cpu))
                elif kind == "mem":
                    rec.mem.append((n, calls[0].maxrss_kb, calls[1].maxrss_kb))
        if args.pod_check_every and (n % args.pod_check_every == 0 or kind != "timed"):
            problems = pod_leftovers(pod)
            with rec.lock:
                rec.pod_problems += problems
    finally:
        subprocess.run(["ip", "netns", "del", pod], check=True)
        with rec.lock:
            rec.done += 1


def make_probes(launcher: str, work: str) -> dict:
    """A probe launcher (the real one with a different tail) and a host-local wrapper."""
    with open(launcher) as f:
        text = f.read()
    if LAUNCHER_TAIL not in text:
        return {}
    probe_launcher = f"{work}/probe-bin/rdma-netns"
    cni_dir = f"{work}/probe-cni"
    os.makedirs(os.path.dirname(probe_launcher))
    os.makedirs(cni_dir)
    with open(probe_launcher, "w") as f:
        f.write(text.replace(LAUNCHER_TAIL, PROBE_TAIL))
    os.chmod(probe_launcher, 0o755)
    log = f"{work}/host-local-fds.log"
    with open(f"{cni_dir}/host-local", "w") as f:
        f.write(HOST_LOCAL_PROBE.format(python=sys.executable, log=log, real=f"{GO_PLUGINS}/host-local"))
    os.chmod(f"{cni_dir}/host-local", 0o755)
    return {"launcher": probe_launcher, "cni_dir": cni_dir, "log": log}


def fd_report(rec: Recorder, probe: dict) -> dict:
    """fds each probed call held at exit beyond stdio, and fds host-local inherited beyond stdio."""
    at_exit, at_start = set(), set()
    for p in rec.probes:
        if p.get("missing"):
            at_exit.add("(probe output missing)")
            continue
        at_start |= {f"{fd}->{t}" for fd, t in p["before"].items() if fd not in ("0", "1", "2") and t != "?"}
        at_exit |= {f"{fd}->{t}" for fd, t in p["after"].items() if fd not in ("0", "1", "2") and t != "?"}
    inherited, hl_calls = set(), 0
    if probe and os.path.exists(probe["log"]):
        with open(probe["log"]) as f:
            for line in f:
                hl_calls += 1
                fds = json.loads(line)
                inherited |= {f"{fd}->{t}" for fd, t in fds.items() if fd not in ("0", "1", "2") and t != "?"}
    return {"probed_calls": len(rec.probes), "fds_open_at_start_beyond_stdio": sorted(at_start),
            "fds_open_at_exit_beyond_stdio": sorted(at_exit - at_start),
            "host_local_calls_probed": hl_calls, "fds_inherited_by_host_local_beyond_stdio": sorted(inherited)}


def diff(before: dict[str, set[str]], after: dict[str, set[str]]) -> dict:
    return {k: {"added": sorted(after[k] - before[k]), "removed": sorted(before[k] - after[k])} for k in before}


def window_medians(timed: list[tuple], size: int) -> dict:
    ordered = sorted(timed)
    first, last = ordered[:size], ordered[-size:]

    def med(rows: list[tuple], i: int) -> float:
        return statistics.median(r[i] for r in rows) * 1000

    return {"window": size,
            "first": {"add_ms": med(first, 1), "del_ms": med(first, 2),
                      "cycle_ms": statistics.median(r[1] + r[2] for r in first) * 1000},
            "last": {"add_ms": med(last, 1), "del_ms": med(last, 2),
                     "cycle_ms": statistics.median(r[1] + r[2] for r in last) * 1000}}


def run_inner(args: argparse.Namespace) -> dict:
    args.work = work = tempfile.mkdtemp(prefix="rnchurn-")
    data_dir, state_dir = f"{work}/ipam", f"{work}/state"
    base_conf = common.ours_conf("rnchurn", args.rails, data_dir, state_dir)
    stdin: bytes | list[bytes] = json.dumps(base_conf).encode()
    if args.config_variants > 1:
        stdin = [json.dumps(dict(base_conf, gidWaitMs=500 + k)).encode() for k in range(args.config_variants)]
    if args.plant_markers:
        plant_markers(state_dir, "rnchurn", args.plant_markers)
    files_max = 0
    probe = make_probes(args.plugin, work) if args.probe_every else {}
    rec = Recorder()
    harness_fds_before = len(os.listdir("/proc/self/fd"))
    time_baseline = subprocess.run(["/usr/bin/time", "-f", "%M", "true"], capture_output=True, text=True).stderr
    cycle(args, Recorder(), -1, 0, stdin, probe)  # warm-up: config cache, lock folder, IPAM folder
    time.sleep(0.5)
    before = node_snapshot()
    state_before = state_files(state_dir)
    print(f"churn: {args.cycles} cycles of {args.rails}-rail pods, {args.workers} worker(s)", file=sys.stderr)
    t0 = time.perf_counter()
    per_worker = [range(w, args.cycles, args.workers) for w in range(args.workers)]

    def worker(w: int) -> None:
        for n in per_worker[w]:
            cycle(args, rec, n, w, stdin, probe)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(args.workers)]
    for t in threads:
        t.start()
    step = max(1, args.cycles // 10)
    next_report = step
    while any(t.is_alive() for t in threads):
        time.sleep(0.5)
        files_max = max(files_max, count_files(state_dir))
        if rec.done >= next_report:
            print(f"  {rec.done}/{args.cycles} cycles, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            next_report += step
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if args.inject_leaks:  # self-test of the detectors: each of these must be reported
        subprocess.run(["ip", "link", "add", "leaktest0", "type", "veth", "peer", "name", "leaktest1"], check=True)
        subprocess.run(["ip", "-6", "rule", "add", "from", "fd00:99::1", "table", "999", "priority", "999"], check=True)
        subprocess.run(["ip", "-6", "route", "add", "fd00:99::/64", "dev", "rail0", "table", "999"], check=True)
        os.makedirs(f"{state_dir}/rnchurn", exist_ok=True)
        open(f"{state_dir}/rnchurn/leaktest:net1.json", "w").close()
        os.makedirs(f"{data_dir}/rnchurn", exist_ok=True)
        open(f"{data_dir}/rnchurn/fd00:1::99", "w").close()
    time.sleep(0.5)
    after = node_snapshot()
    node_diff = diff(before, after)
    state_after = state_files(state_dir)
    ipam_after = ipam_files(data_dir)
    leftover_pods = [n for n in os.listdir(common.NETNS_DIR) if n.startswith(POD_PREFIX)]
    strays = stray_processes([args.plugin, f"{GO_PLUGINS}/host-local", work])
    fds = fd_report(rec, probe)
    harness_fds_after = len(os.listdir("/proc/self/fd"))

    leaks = {
        "node_links": node_diff["links"]["added"], "node_addresses": node_diff["addresses"]["added"],
        "node_rules": node_diff["rules-4"]["added"] + node_diff["rules-6"]["added"],
        "node_routes": node_diff["routes-4"]["added"] + node_diff["routes-6"]["added"],
        "node_removed_anything": [x for k in node_diff for x in node_diff[k]["removed"]],
        "pod_side": rec.pod_problems[:20],
        "state_files": state_after["attachment_or_temp_files"][:20],
        "ipam_allocations": ipam_after["allocations"][:20],
        "pod_netns": leftover_pods[:20], "processes": strays[:20],
        "fds_at_plugin_exit": fds["fds_open_at_exit_beyond_stdio"],
        "fds_inherited_by_host_local": fds["fds_inherited_by_host_local_beyond_stdio"],
        "harness_fds": [] if harness_fds_after == harness_fds_before
        else [f"{harness_fds_before} -> {harness_fds_after}"],
    }
    timed = rec.timed
    window = 100 if len(timed) >= 400 else max(1, len(timed) // 4)
    add_mem = [m[1] for m in rec.mem if m[1] > 0]
    del_mem = [m[2] for m in rec.mem if m[2] > 0]
    out = {
        "cycles": args.cycles, "workers": args.workers, "rails": args.rails, "elapsed_s": elapsed,
        "cycles_per_s": args.cycles / elapsed, "errors": len(rec.errors), "error_samples": rec.errors[:5],
        "stderr_lines": dict(sorted(rec.stderr.items(), key=lambda kv: -kv[1])[:10]),
        "timed_cycles": len(timed),
        "add": summary_ms([t[1] for t in timed]), "del": summary_ms([t[2] for t in timed]),
        "cycle": summary_ms([t[1] + t[2] for t in timed]),
        "add_cpu_ms_median": statistics.median(t[3] for t in timed) * 1000 if timed else None,
        "del_cpu_ms_median": statistics.median(t[4] for t in timed) * 1000 if timed else None,
        "trend": window_medians(timed, window) if timed else {},
        "trend_tenths_cycle_ms": [statistics.median(r[1] + r[2] for r in part) * 1000
                                  for part in (sorted(timed)[k * len(timed) // 10:(k + 1) * len(timed) // 10]
                                               for k in range(10)) if part],
        "memory": {"samples": len(rec.mem), "time_tool_baseline_kb": time_baseline.strip(),
                   "add_maxrss_kb_median": statistics.median(add_mem) if add_mem else None,
                   "add_maxrss_kb_max": max(add_mem, default=None),
                   "del_maxrss_kb_median": statistics.median(del_mem) if del_mem else None,
                   "del_maxrss_kb_max": max(del_mem, default=None),
                   "first_samples_kb": [m[1] for m in sorted(rec.mem)[:5]],
                   "last_samples_kb": [m[1] for m in sorted(rec.mem)[-5:]]},
        "state_dir": {"before": {k: v for k, v in state_before.items() if k != "attachment_or_temp_files"},
                      "after": {k: v for k, v in state_after.items() if k != "attachment_or_temp_files"},
                      "files_after": count_files(state_dir), "files_max_during_run": files_max,
                      "config_variants": args.config_variants, "planted_markers": args.plant_markers,
                      "bound": disk_bound(args, elapsed)},
        "ipam_other_files": ipam_after["other_files"],
        "fds": fds, "leaks": leaks,
        "leak_free": not any(v for v in leaks.values()) and not rec.errors,
        "disk_bounded": max(files_max, count_files(state_dir)) <= disk_bound(args, elapsed)["total"],
    }
    shutil.rmtree(work, ignore_errors=True)
    return out


def report(out: dict) -> None:
    print(f"\n== churn: {out['cycles']} cycles x {out['rails']} rails, {out['workers']} worker(s): "
          f"{out['elapsed_s']:.0f} s ({out['cycles_per_s']:.1f} cycles/s), errors {out['errors']} ==")
    print(common.fmt_summary("ADD", out["add"]))
    print(common.fmt_summary("DEL", out["del"]))
    print(common.fmt_summary("cycle (ADD+DEL)", out["cycle"]))
    print(f"CPU per call (median, user+sys incl. host-local): ADD {out['add_cpu_ms_median']:.1f} ms, "
          f"DEL {out['del_cpu_ms_median']:.1f} ms")
    tr = out["trend"]
    if tr:
        f, last = tr["first"], tr["last"]
        print(f"trend, medians of the first {tr['window']} vs last {tr['window']} timed cycles: "
              f"ADD {f['add_ms']:.1f} -> {last['add_ms']:.1f} ms, DEL {f['del_ms']:.1f} -> {last['del_ms']:.1f} ms, "
              f"cycle {f['cycle_ms']:.1f} -> {last['cycle_ms']:.1f} ms "
              f"({(last['cycle_ms'] / f['cycle_ms'] - 1) * 100:+.1f}%)")
    print("cycle median per tenth of the run (ms): " + " ".join(f"{v:.0f}" for v in out["trend_tenths_cycle_ms"]))
    m = out["memory"]
    print(f"max RSS per call ({m['samples']} sampled cycles, /usr/bin/time alone: {m['time_tool_baseline_kb']} kB): "
          f"ADD median {m['add_maxrss_kb_median']} kB max {m['add_maxrss_kb_max']} kB, "
          f"DEL median {m['del_maxrss_kb_median']} kB max {m['del_maxrss_kb_max']} kB; "
          f"first {m['first_samples_kb']} last {m['last_samples_kb']}")
    print(f"stateDir before/after: {out['state_dir']['before']} / {out['state_dir']['after']}; "
          f"host-local non-allocation files: {out['ipam_other_files']}")
    sd = out["state_dir"]
    print(f"stateDir files without GC ({sd['config_variants']} config variant(s), {sd['planted_markers']} planted "
          f"old markers): max during the run {sd['files_max_during_run']}, after {sd['files_after']}; "
          f"bound {sd['bound']['total']} ({sd['bound']}); bounded: {out['disk_bounded']}")
    fd = out["fds"]
    print(f"fds: {fd['probed_calls']} probed calls; open at start beyond stdio: {fd['fds_open_at_start_beyond_stdio']}; "
          f"still open at exit: {fd['fds_open_at_exit_beyond_stdio']}; {fd['host_local_calls_probed']} host-local "
          f"calls inherited beyond stdio: {fd['fds_inherited_by_host_local_beyond_stdio']}")
    for name, value in out["leaks"].items():
        print(f"  leak check {name:<28} {'none' if not value else value}")
    if out["stderr_lines"]:
        print(f"plugin stderr: {out['stderr_lines']}")
    if out["error_samples"]:
        print(f"errors: {out['error_samples']}")
    print(f"leak-free: {out['leak_free']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, help="ADD/DEL cycles (default 2000; 200 with --quick)")
    parser.add_argument("--quick", action="store_true", help="a CI-sized run: 200 cycles")
    parser.add_argument("--workers", type=int, default=1, help="parallel ADD/DEL loops (default 1: sequential)")
    parser.add_argument("--rails", type=int, default=8)
    parser.add_argument("--mem-every", type=int, default=10, help="every Nth cycle measures max RSS (0: never)")
    parser.add_argument("--probe-every", type=int, default=50, help="every Nth cycle runs the fd probes (0: never)")
    parser.add_argument("--pod-check-every", type=int, default=10,
                        help="every Nth cycle checks the pod is empty after DEL (0: never)")
    parser.add_argument("--inject-leaks", action="store_true",
                        help="self-test: plant a link, rule, route, state file and IPAM file after the "
                             "cycles; the leak checks must report each (exit status 1)")
    parser.add_argument("--config-variants", type=int, default=1,
                        help="cycle through K distinct network configs (one verified-config cache file each)")
    parser.add_argument("--plant-markers", type=int, default=0,
                        help="plant N old released/ markers first (ages over two TTLs) to show their expiry")
    common.common_args(parser)
    args = parser.parse_args()
    if args.cycles is None:
        args.cycles = 200 if args.quick else 2000
    if not args.inner:
        return common.outer_main(args, __file__, NODE, args.rails, POD_PREFIX)
    if args.json:
        args.json = os.path.abspath(args.json)
    out = run_inner(args)
    report(out)
    common.write_json(args.json, out)
    return 0 if out["leak_free"] and out["disk_bounded"] else 1


if __name__ == "__main__":
    sys.exit(main())
