"""Helpers shared by the burst and churn benchmarks (integration/bench/burst.py, churn.py).

Same approach as cni_add_del.py: the plugins run inside a private "node" network namespace whose
rails are veth pairs, every call is a fresh process started the way a runtime starts it (env +
stdin), every pod gets a fresh namespace, IPAM is Debian's Go host-local, and rdma-netns runs
through the launcher a CNI bin folder gets (`rdma-netns install-launcher`).

Calls are started with os.posix_spawn and reaped with os.wait4, so each call's wall time, CPU
time (user + system) and peak RSS come from the kernel's rusage of that very process (for maxrss:
the larger of the plugin's own and its reaped children's, i.e. host-local's).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

GO_PLUGINS = "/usr/lib/cni"
NETNS_DIR = "/var/run/netns"


# ---------------------------------------------------------------- processes


class Call:
    """One finished plugin call."""

    __slots__ = ("rc", "stdout", "stderr", "wall", "cpu", "maxrss_kb", "start")

    def __init__(self, rc: int, stdout: bytes, stderr: bytes, wall: float, cpu: float, maxrss_kb: int,
                 start: float) -> None:
        self.rc, self.stdout, self.stderr = rc, stdout, stderr
        self.wall, self.cpu, self.maxrss_kb, self.start = wall, cpu, maxrss_kb, start

    def error_text(self) -> str:
        return (self.stdout.decode(errors="replace") + " " + self.stderr.decode(errors="replace")).strip()[:600]


def spawn(argv: list[str], stdin: bytes, env: dict[str, str], timeout: float = 120.0) -> Call:
    """Run argv with stdin, collect stdout/stderr, and reap it with wait4 for its rusage."""
    in_r, in_w = os.pipe2(os.O_CLOEXEC)
    out_r, out_w = os.pipe2(os.O_CLOEXEC)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    start = time.perf_counter()
    try:
        pid = os.posix_spawn(argv[0], argv, env, file_actions=[
            (os.POSIX_SPAWN_DUP2, in_r, 0), (os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)])
    except BaseException:
        for fd in (in_r, in_w, out_r, out_w, err_r, err_w):
            os.close(fd)
        raise
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}
    pending = memoryview(stdin)
    deadline = start + timeout
    poller = select.poll()
    open_fds = {out_r, err_r}
    poller.register(out_r, select.POLLIN)
    poller.register(err_r, select.POLLIN)
    if pending:
        poller.register(in_w, select.POLLOUT)
        open_fds.add(in_w)
    else:
        os.close(in_w)
    try:
        while out_r in open_fds or err_r in open_fds:
            left = deadline - time.perf_counter()
            if left <= 0:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise TimeoutError(f"{argv[0]} did not finish within {timeout} s")
            for fd, _events in poller.poll(left * 1000):
                if fd == in_w:
                    try:
                        pending = pending[os.write(in_w, pending[:65536]):]
                    except BrokenPipeError:
                        pending = pending[:0]
                    if not pending:
                        poller.unregister(in_w)
                        os.close(in_w)
                        open_fds.discard(in_w)
                    continue
                data = os.read(fd, 65536)
                if data:
                    chunks[fd].append(data)
                else:
                    poller.unregister(fd)
                    os.close(fd)
                    open_fds.discard(fd)
        _, status, usage = os.wait4(pid, 0)
        wall = time.perf_counter() - start
    finally:
        for fd in open_fds:
            os.close(fd)
    return Call(os.waitstatus_to_exitcode(status), b"".join(chunks[out_r]), b"".join(chunks[err_r]), wall,
                usage.ru_utime + usage.ru_stime, usage.ru_maxrss, start)


def cni_env(command: str, container: str, netns: str, ifname: str, cni_path: str = GO_PLUGINS) -> dict[str, str]:
    return dict(os.environ, CNI_COMMAND=command, CNI_CONTAINERID=container, CNI_NETNS=netns, CNI_IFNAME=ifname,
                CNI_PATH=cni_path)


def sh(*args: str, quiet: bool = False) -> None:
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL if quiet else None)


def ip_batch(lines: list[str], namespace: str | None = None, check: bool = True) -> None:
    """Several iproute2 commands in one `ip -batch` process (netns add/del of many pods)."""
    if not lines:
        return
    cmd = ["ip"] + (["-n", namespace] if namespace else []) + ["-force", "-batch", "-"]
    subprocess.run(cmd, input="\n".join(lines) + "\n", text=True, check=check, stderr=subprocess.DEVNULL)


# ---------------------------------------------------------------- the node


def setup_node(node: str, rails: int) -> None:
    subprocess.run(["ip", "netns", "del", node], stderr=subprocess.DEVNULL)
    sh("ip", "netns", "add", node)
    lines = []
    for i in range(rails):
        lines += [f"link add rail{i} type veth peer name rail{i}p", f"link set rail{i} up", f"link set rail{i}p up"]
    ip_batch(lines, namespace=node)
    sh("ip", "-n", node, "link", "set", "lo", "up")


def remove_pods(prefix: str) -> int:
    """Delete every pod namespace whose name starts with prefix (our own, from this or a crashed run)."""
    names = [n for n in os.listdir(NETNS_DIR) if n.startswith(prefix)] if os.path.isdir(NETNS_DIR) else []
    ip_batch([f"netns del {n}" for n in names], check=False)
    return len(names)


def install_launcher(rdma_netns: str, dest_dir: str) -> str:
    launcher = os.path.join(dest_dir, "rdma-netns")
    subprocess.run([rdma_netns, "install-launcher", launcher], check=True, stdout=subprocess.DEVNULL)
    return launcher


def outer_main(args: argparse.Namespace, script: str, node: str, rails: int, pod_prefix: str) -> int:
    """The outer run: install the launcher, build the node, rerun this script inside it."""
    if os.geteuid() != 0:
        print("run as root: the benchmark creates network namespaces", file=sys.stderr)
        return 2
    bin_dir = tempfile.mkdtemp(prefix="rnbench-cni-bin-")
    launcher = install_launcher(args.rdma_netns, bin_dir)
    remove_pods(pod_prefix)
    setup_node(node, rails)
    try:
        cmd = ["ip", "netns", "exec", node, sys.executable, os.path.abspath(script), "--inner",
               "--plugin", launcher] + [a for a in sys.argv[1:]]
        return subprocess.run(cmd).returncode
    finally:
        remove_pods(pod_prefix)
        subprocess.run(["ip", "netns", "del", node])
        shutil.rmtree(bin_dir, ignore_errors=True)


def common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rdma-netns", default=shutil.which("rdma-netns") or "rdma-netns",
                        help="the installed rdma-netns executable (its package is what gets measured)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--plugin", help=argparse.SUPPRESS)  # the launcher, set by the outer run
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)


# ---------------------------------------------------------------- configs


def host_local(data_dir: str, subnet: str) -> dict:
    return {"type": "host-local", "dataDir": data_dir, "ranges": [[{"subnet": subnet}]]}


def ours_conf(name: str, rails: int, data_dir: str, state_dir: str, dir_per_rail: bool = False) -> dict:
    """An rdma-netns shared-mode network with `rails` rails, an IPv6 host-local subnet per rail.

    dir_per_rail: each rail's host-local gets its own dataDir, hence its own lock file (host-local
    locks dataDir/<network>/lock for a whole allocation, so by default all rails of all pods of
    the network queue on one lock)."""
    return {"cniVersion": "1.1.0", "name": name, "type": "rdma-netns", "mode": "shared", "requireRdma": False,
            "stateDir": state_dir, "pairing": False,
            "rails": [{"netdev": f"rail{i}", "ifname": f"rdma{i}",
                       "ipam": host_local(f"{data_dir}/rail{i}" if dir_per_rail else data_dir, f"fd00:{i + 1}::/64")}
                      for i in range(rails)]}


def go_macvlan_conf(name: str, rail: int, family: int, data_dir: str) -> dict:
    """Debian's Go macvlan on one rail (one interface per call), host-local IPv4 or IPv6."""
    subnet = f"10.{100 + rail}.0.0/16" if family == 4 else f"fd77:{rail + 1}::/64"
    return {"cniVersion": "1.0.0", "name": name, "type": "macvlan", "master": f"rail{rail}", "mode": "bridge",
            "ipam": host_local(data_dir, subnet)}


# ---------------------------------------------------------------- statistics


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summary_ms(values: list[float]) -> dict:
    """median/p90/p99/max/mean in milliseconds of a list of seconds."""
    if not values:
        return {"n": 0}
    return {"n": len(values), "median_ms": statistics.median(values) * 1000,
            "p90_ms": percentile(values, 0.90) * 1000, "p99_ms": percentile(values, 0.99) * 1000,
            "max_ms": max(values) * 1000, "min_ms": min(values) * 1000,
            "mean_ms": statistics.fmean(values) * 1000}


def fmt_summary(label: str, s: dict, width: int = 34) -> str:
    if not s.get("n"):
        return f"{label:<{width}} (no samples)"
    return (f"{label:<{width}} n={s['n']:<5} p50 {s['median_ms']:8.1f}  p90 {s['p90_ms']:8.1f}  "
            f"p99 {s['p99_ms']:8.1f}  max {s['max_ms']:8.1f} ms")


def write_json(path: str | None, value: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(value, f, indent=2, sort_keys=False)
