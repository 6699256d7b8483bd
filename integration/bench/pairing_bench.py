#!/usr/bin/env python3
"""What pairing costs a pod event: rdma-netns chained after a cluster CNI, with kubelet's grants,
side by side with Debian's Go macvlan (IPv4) in one run.

    sudo .venv/bin/python integration/bench/pairing_bench.py [--iterations 30] [--json out.json]

Kubelet is the stand-in (tests/kubelet_standin.py: the real v1.PodResourcesLister over gRPC on a
unix socket) and the broker is the real rdma-netns-dp daemon (on a fake sysfs), both in the host;
the plugins run in a private node namespace with veth rails, a fresh process and a fresh pod
namespace per call, the way a runtime calls them. Cases, interleaved per iteration (in an order
shuffled each iteration, so that no case always follows the same one):
- go-macvlan-ipv4: ADD, DEL, and a repeated DEL (no netns), Go's own;
- not-granted: chained ADD of a pod that asked for no rdma/hca (the pairing query included),
  then its DEL and a repeated DEL;
- granted-1rail: chained ADD of a pod granted one unit (one IPv6 rail), DEL, repeated DEL
  (CNI_NETNS '' and no prevResult, as containerd's RemovePodSandbox sends it);
- not-granted-direct: the same ADD with podGrantsSocket "" (the plugin imports grpc and asks
  kubelet itself: what the broker saves).
--baseline /other/venv/bin/rdma-netns adds "not-granted-baseline" and "granted-1rail-baseline":
the same two cases through another build's launcher in the same run (a change's effect, side by
side, not against figures from another day on a noisy VM).
requireRdma is false (no RDMA hardware here): the GID wait of a real node is not in these figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from common import (  # noqa: E402
    GO_PLUGINS, cni_env, common_args, go_macvlan_conf, host_local, install_launcher, outer_main, percentile, spawn,
)

NODE = "rnpair-node"
POD_PREFIX = "rnpair-pod-"
RESOURCE = "rdma/hca"
BASELINE_NOT_GRANTED = "not-granted-baseline"
BASELINE_GRANTED = "granted-1rail-baseline"


def primary(netns: str) -> dict:
    return {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "mac": "02:00:00:00:00:01", "sandbox": netns}],
            "ips": [{"address": "10.244.1.7/24", "gateway": "10.244.1.1", "interface": 0}]}


def ours(state_dir: str, data_dir: str, kubelet_sock: str, broker: str) -> dict:
    return {"cniVersion": "1.0.0", "name": "rdma", "type": "rdma-netns", "mode": "shared", "requireRdma": False,
            "stateDir": state_dir, "resourceName": RESOURCE, "podResourcesSocket": kubelet_sock,
            "podGrantsSocket": broker,
            "rails": [{"netdev": "rail0", "ipam": host_local(data_dir, "fd00:1::/64")}]}


def call(plugin: str, command: str, conf: dict, cid: str, netns: str, ifname: str, args: str = "") -> float:
    env = cni_env(command, cid, netns, ifname)
    if args:
        env["CNI_ARGS"] = args
    done = spawn([plugin], json.dumps(conf).encode(), env)
    if done.rc != 0:
        raise SystemExit(f"{command} {cid} failed: {done.error_text()}")
    return done.wall


def inner(args: argparse.Namespace) -> dict:
    data_dir = tempfile.mkdtemp(prefix="rnpair-ipam-")
    state_dir = tempfile.mkdtemp(prefix="rnpair-state-")
    go = go_macvlan_conf("go4", 0, 4, data_dir)
    times: dict[str, dict[str, list[float]]] = {}

    def record(case: str, what: str, value: float) -> None:
        times.setdefault(case, {}).setdefault(what, []).append(value)

    cases = ["go-macvlan-ipv4", "not-granted", "granted-1rail", "not-granted-direct"]
    if args.baseline_plugin:
        cases += [BASELINE_NOT_GRANTED, BASELINE_GRANTED]
    order = random.Random(25)
    for i in range(args.iterations + 1):  # iteration 0 warms caches (and the verified-config cache)
        # A new order each iteration (seeded: reruns are alike): what ran just before matters (in
        # a fixed order the case after Go's ran 6-12% slower than the same build after another
        # case; the previous pods' namespaces are still being torn down by the kernel).
        order.shuffle(cases)
        for case in cases:
            pod = f"{POD_PREFIX}{i}-{case}"
            netns = f"/var/run/netns/{pod}"
            os.system(f"ip netns add {pod}")
            cid = f"{case}-{i}"
            try:
                if case == "go-macvlan-ipv4":
                    t = [call(GO_PLUGINS + "/macvlan", "ADD", go, cid, netns, "eth0"),
                         call(GO_PLUGINS + "/macvlan", "DEL", go, cid, netns, "eth0"),
                         call(GO_PLUGINS + "/macvlan", "DEL", go, cid, "", "eth0")]
                else:
                    broker = "" if case == "not-granted-direct" else args.broker
                    conf = ours(state_dir, data_dir, args.kubelet_sock, broker)
                    name = "trainer" if case.startswith("granted-1rail") else "web"
                    plugin = args.baseline_plugin if case.endswith("-baseline") else args.plugin
                    k8s = f"IgnoreUnknown=1;K8S_POD_NAMESPACE=bench;K8S_POD_NAME={name};K8S_POD_UID=u-{i}"
                    chained = dict(conf, prevResult=primary(netns))
                    t = [call(plugin, "ADD", chained, cid, netns, "eth0", k8s),
                         call(plugin, "DEL", chained, cid, netns, "eth0", k8s),
                         call(plugin, "DEL", conf, cid, "", "eth0", k8s)]
            finally:
                os.system(f"ip netns del {pod}")
            if i:
                for what, value in zip(("add", "del", "repeated_del"), t):
                    record(case, what, value)
    shutil.rmtree(data_dir, ignore_errors=True)
    shutil.rmtree(state_dir, ignore_errors=True)
    out: dict = {"iterations": args.iterations, "cases": {}}
    for case, series in times.items():
        out["cases"][case] = {f"{what}_median_ms": statistics.median(v) * 1000 for what, v in series.items()}
        out["cases"][case].update({f"{what}_p90_ms": percentile(v, 0.9) * 1000 for what, v in series.items()})
    c = out["cases"]
    go_add, go_del = c["go-macvlan-ipv4"]["add_median_ms"], c["go-macvlan-ipv4"]["del_median_ms"]
    out["ratios"] = {
        "not-granted ADD / Go IPv4 ADD (goal <= 2)": c["not-granted"]["add_median_ms"] / go_add,
        "granted 1-rail ADD / Go IPv4 ADD (goal <= 3)": c["granted-1rail"]["add_median_ms"] / go_add,
        "repeated DEL / Go IPv4 DEL (goal <= 1)": c["granted-1rail"]["repeated_del_median_ms"] / go_del,
        "direct (grpc) ADD / broker ADD, not granted": c["not-granted-direct"]["add_median_ms"]
        / c["not-granted"]["add_median_ms"],
    }
    if args.baseline_plugin:
        out["ratios"].update({
            "not-granted ADD / baseline's": c["not-granted"]["add_median_ms"] / c[BASELINE_NOT_GRANTED]["add_median_ms"],
            "granted 1-rail ADD / baseline's": c["granted-1rail"]["add_median_ms"] / c[BASELINE_GRANTED]["add_median_ms"],
        })
    return out


def report(out: dict) -> None:
    print(f"{'case':<26} {'ADD med':>8} {'ADD p90':>8} {'DEL med':>8} {'reDEL med':>9}  (ms, {out['iterations']} runs)")
    for name, c in out["cases"].items():
        print(f"{name:<26} {c['add_median_ms']:8.1f} {c['add_p90_ms']:8.1f} {c['del_median_ms']:8.1f} "
              f"{c['repeated_del_median_ms']:9.1f}")
    for name, value in out["ratios"].items():
        print(f"{name:<46} {value:6.2f}x")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(parser)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--kubelet-sock", help=argparse.SUPPRESS)
    parser.add_argument("--broker", help=argparse.SUPPRESS)
    parser.add_argument("--baseline", help="another build's rdma-netns executable, measured in the same run")
    parser.add_argument("--baseline-plugin", help=argparse.SUPPRESS)  # its launcher, set by the outer run
    args = parser.parse_args()
    if args.inner:
        out = inner(args)
        report(out)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))
        return 0
    from tests.dp.conftest import Host
    from tests.kubelet_standin import PodResourcesStandIn

    host = Host("Y")
    try:
        pod_resources = PodResourcesStandIn(host.kubelet.pod_resources_socket).start()
        host.kubelet.pod_resources = pod_resources
        broker = host.base / "grants.sock"
        host.start_registered("--mode", "shared", "--resource-name", RESOURCE, "--pod-grants-socket", str(broker))
        deadline = time.monotonic() + 10
        while not broker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        host.kubelet.admit_pod("bench", "trainer", {"main": {RESOURCE: 1}})
        pod_resources.set_pod("bench", "web", {"main": {"nvidia.com/gpu": ["GPU-0"]}})
        sys.argv += ["--kubelet-sock", str(pod_resources.socket), "--broker", str(broker)]
        if args.baseline:
            sys.argv += ["--baseline-plugin", install_launcher(args.baseline, tempfile.mkdtemp(prefix="rnpair-base-"))]
        if args.json:
            sys.argv[sys.argv.index("--json") + 1] = os.path.abspath(args.json)
        return outer_main(args, __file__, NODE, 1, POD_PREFIX)
    finally:
        host.close()


if __name__ == "__main__":
    sys.exit(main())
