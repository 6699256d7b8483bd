#!/usr/bin/env python3
"""ADD and DEL wall time of rdma-netns against Debian's Go macvlan plugin, side by side.

Every invocation is a fresh process started the way a runtime starts it (env + stdin), with a
fresh pod namespace per iteration, so process start-up is included, as it is on a node. The
plugins run inside a private "node" namespace with veth-backed rails, so the host is untouched.

    sudo python3 integration/bench/cni_add_del.py --rdma-netns .venv/bin/rdma-netns [--iterations 30]
        [--baseline /tmp/old-venv/bin/rdma-netns] [--node-range] [--extra-interfaces 200]

--baseline adds another build's cases to the same run (e.g. the previous commit installed into a
temp venv), so that a change's effect is measured side by side, not against figures from another
day on a noisy VM. The configs say "requireRdma": false (no RDMA hardware here), so a real node's
wait for each address's RoCE v2 GID is not in these figures.

--node-range adds the 1- and 8-rail cases with the pod range derived from the node's address on
each rail (rangeFromNodeAddress; the rails then carry node addresses fd00:<rail>::1:1/64), side by
side with the static ranges. --extra-interfaces adds that many dummy links (each with its IPv6
link-local address) to the node namespace: a node's pod veths, which the derivation's address
dump reads past.

Prints medians, p90 and the ratios the project tracks. Needs root, iproute2 and Debian's
containernetworking-plugins (/usr/lib/cni). rdma-netns runs through the launcher a node's CNI
bin folder gets (`rdma-netns install-launcher`), written from the installed package given by
--rdma-netns (default: the one on PATH).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

NODE = "rnbench-node"
GO_PLUGINS = "/usr/lib/cni"


def sh(*args: str) -> None:
    subprocess.run(args, check=True)


def setup_node(rails: int, extra_interfaces: int = 0) -> None:
    subprocess.run(["ip", "netns", "del", NODE], stderr=subprocess.DEVNULL)
    sh("ip", "netns", "add", NODE)
    for i in range(rails):
        sh("ip", "-n", NODE, "link", "add", f"rail{i}", "type", "veth", "peer", "name", f"rail{i}p")
        sh("ip", "-n", NODE, "link", "set", f"rail{i}", "up")
        sh("ip", "-n", NODE, "link", "set", f"rail{i}p", "up")
        sh("ip", "-n", NODE, "address", "add", f"fd00:{i + 1}::1:1/64", "dev", f"rail{i}", "nodad")
    if extra_interfaces:
        # veth pairs (this kernel has no dummy driver), both ends up: extra_interfaces links in all
        batch = "".join(f"link add pv{i} type veth peer name pw{i}\nlink set pv{i} up\nlink set pw{i} up\n"
                        for i in range(extra_interfaces // 2))
        subprocess.run(["ip", "-n", NODE, "-batch", "-"], input=batch.encode(), check=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class Case:
    def __init__(self, name: str, plugin: str, conf: dict, ifname: str) -> None:
        self.name, self.plugin, self.conf, self.ifname = name, plugin, conf, ifname
        self.add: list[float] = []
        self.dele: list[float] = []

    def invoke(self, command: str, container: str, netns: str) -> float:
        env = dict(os.environ, CNI_COMMAND=command, CNI_CONTAINERID=container, CNI_NETNS=netns,
                   CNI_IFNAME=self.ifname, CNI_PATH=GO_PLUGINS)
        start = time.perf_counter()
        proc = subprocess.run([self.plugin], input=json.dumps(self.conf).encode(), env=env, capture_output=True)
        elapsed = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"{self.name} {command} failed: {proc.stdout.decode()} {proc.stderr.decode()}")
        return elapsed


def ipam(data_dir: str, subnet: str) -> dict:
    return {"type": "host-local", "dataDir": data_dir, "ranges": [[{"subnet": subnet}]]}


def build_cases(plugin: str, data_dir: str, state_dir: str, baseline: str | None = None,
                node_range: bool = False) -> list[Case]:
    def ours(name: str, rails: int, executable: str = plugin) -> Case:
        conf = {"cniVersion": "1.1.0", "name": name, "type": "rdma-netns", "mode": "shared", "requireRdma": False,
                "stateDir": state_dir, "pairing": False,
                "rails": [{"netdev": f"rail{i}", "ifname": f"rdma{i}", "ipam": ipam(data_dir, f"fd00:{i + 1}::/64")}
                          for i in range(rails)]}
        return Case(name, executable, conf, "net1")

    def from_node(name: str, rails: int) -> Case:
        case = ours(name, rails)
        case.conf["rangeFromNodeAddress"] = {"prefixLength": 112, "within": "fd00::/16"}
        for rail in case.conf["rails"]:
            rail["ipam"] = {"type": "host-local", "dataDir": data_dir}
        return case

    def go(name: str, subnet: str) -> Case:
        conf = {"cniVersion": "1.0.0", "name": name, "type": "macvlan", "master": "rail0", "mode": "bridge",
                "ipam": ipam(data_dir, subnet)}
        return Case(name, f"{GO_PLUGINS}/macvlan", conf, "net1")

    return [
        go("go-macvlan-ipv4", "10.77.0.0/16"),
        ours("rdma-netns-ipv6-1rail", 1),
        *([from_node("node-range-ipv6-1rail", 1)] if node_range else []),
        *([ours("baseline-ipv6-1rail", 1, baseline)] if baseline else []),
        ours("rdma-netns-ipv6-8rails", 8),
        *([from_node("node-range-ipv6-8rails", 8)] if node_range else []),
        *([ours("baseline-ipv6-8rails", 8, baseline)] if baseline else []),
        go("go-macvlan-ipv6", "fd00:77::/64"),
    ]


def run_inside_node(args: argparse.Namespace) -> dict:
    data_dir = tempfile.mkdtemp(prefix="rnbench-ipam-")
    state_dir = tempfile.mkdtemp(prefix="rnbench-state-")
    cases = build_cases(args.plugin, data_dir, state_dir, args.baseline_plugin, args.node_range)
    cold = {}
    for case in cases:
        iterations = args.iterations if "go-macvlan-ipv6" != case.name else max(5, args.iterations // 3)
        for i in range(iterations + 1):  # iteration 0 warms caches (and rdma-netns's config check)
            pod = f"rnbench-pod-{i}"
            subprocess.run(["ip", "netns", "add", pod], check=True)
            try:
                netns = f"/var/run/netns/{pod}"
                t_add = case.invoke("ADD", f"{case.name}-{i}", netns)
                t_del = case.invoke("DEL", f"{case.name}-{i}", netns)
            finally:
                subprocess.run(["ip", "netns", "del", pod], check=True)
            if i == 0:
                cold[case.name] = t_add
                continue
            case.add.append(t_add)
            case.dele.append(t_del)
    shutil.rmtree(data_dir, ignore_errors=True)
    shutil.rmtree(state_dir, ignore_errors=True)
    out = {"iterations": args.iterations, "cases": {}}
    for case in cases:
        out["cases"][case.name] = {
            "add_median_ms": statistics.median(case.add) * 1000, "add_p90_ms": percentile(case.add, 0.9) * 1000,
            "del_median_ms": statistics.median(case.dele) * 1000, "del_p90_ms": percentile(case.dele, 0.9) * 1000,
            "first_add_ms": cold[case.name] * 1000, "runs": len(case.add),
        }
    c = out["cases"]
    out["ratios"] = {
        "ours_ipv6_add / go_ipv4_add": c["rdma-netns-ipv6-1rail"]["add_median_ms"] / c["go-macvlan-ipv4"]["add_median_ms"],
        "go_ipv6_add / ours_ipv6_add": c["go-macvlan-ipv6"]["add_median_ms"] / c["rdma-netns-ipv6-1rail"]["add_median_ms"],
        "ours_8rails_add / ours_1rail_add": c["rdma-netns-ipv6-8rails"]["add_median_ms"]
        / c["rdma-netns-ipv6-1rail"]["add_median_ms"],
        "ours_ipv6_del / go_ipv4_del": c["rdma-netns-ipv6-1rail"]["del_median_ms"] / c["go-macvlan-ipv4"]["del_median_ms"],
    }
    if "node-range-ipv6-1rail" in c:
        for rails in ("1rail", "8rails"):
            out["ratios"][f"node_range_{rails}_add / static_{rails}_add"] = \
                c[f"node-range-ipv6-{rails}"]["add_median_ms"] / c[f"rdma-netns-ipv6-{rails}"]["add_median_ms"]
    if "baseline-ipv6-1rail" in c:
        for rails in ("1rail", "8rails"):
            for what in ("add", "del"):
                out["ratios"][f"ours_{rails}_{what} / baseline_{rails}_{what}"] = \
                    c[f"rdma-netns-ipv6-{rails}"][f"{what}_median_ms"] / c[f"baseline-ipv6-{rails}"][f"{what}_median_ms"]
    return out


def report(out: dict) -> None:
    print(f"{'case':<26} {'ADD med':>8} {'ADD p90':>8} {'DEL med':>8} {'DEL p90':>8} {'1st ADD':>8}  (ms, {out['iterations']} runs)")
    for name, c in out["cases"].items():
        print(f"{name:<26} {c['add_median_ms']:8.1f} {c['add_p90_ms']:8.1f} {c['del_median_ms']:8.1f} "
              f"{c['del_p90_ms']:8.1f} {c['first_add_ms']:8.1f}")
    for name, value in out["ratios"].items():
        print(f"{name:<40} {value:6.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--rdma-netns", default=shutil.which("rdma-netns") or "rdma-netns",
                        help="the installed rdma-netns executable (its package is what gets measured)")
    parser.add_argument("--baseline", help="another installed rdma-netns executable, measured in the same run")
    parser.add_argument("--plugin", help=argparse.SUPPRESS)  # the launcher, set by the outer run
    parser.add_argument("--baseline-plugin", help=argparse.SUPPRESS)
    parser.add_argument("--node-range", action="store_true",
                        help="also the 1- and 8-rail cases with rangeFromNodeAddress (docs/configuration.md, one config for the whole cluster)")
    parser.add_argument("--extra-interfaces", type=int, default=0,
                        help="dummy links (with link-local addresses) in the node namespace, like a node's pod veths")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("run as root: the benchmark creates network namespaces", file=sys.stderr)
        return 2
    if not args.inner:
        bin_dir = tempfile.mkdtemp(prefix="rnbench-cni-bin-")
        launcher = os.path.join(bin_dir, "rdma-netns")
        subprocess.run([args.rdma_netns, "install-launcher", launcher], check=True, stdout=subprocess.DEVNULL)
        baseline = None
        if args.baseline:
            baseline = os.path.join(bin_dir, "rdma-netns-baseline")
            subprocess.run([args.baseline, "install-launcher", baseline], check=True, stdout=subprocess.DEVNULL)
        setup_node(rails=8, extra_interfaces=args.extra_interfaces)
        try:
            cmd = ["ip", "netns", "exec", NODE, sys.executable, os.path.abspath(__file__), "--inner",
                   "--iterations", str(args.iterations), "--plugin", launcher]
            if args.node_range:
                cmd.append("--node-range")
            if args.json:
                cmd += ["--json", os.path.abspath(args.json)]
            if baseline:
                cmd += ["--baseline-plugin", baseline]
            return subprocess.run(cmd).returncode
        finally:
            subprocess.run(["ip", "netns", "del", NODE])
            shutil.rmtree(bin_dir, ignore_errors=True)
    out = run_inside_node(args)
    report(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
