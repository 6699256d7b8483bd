"""Host side of the two-node rig: two guests of the real-kernel suite's kernel, wired rail by rail.

Each node is a QEMU guest (run-in-guest.sh, software emulation, one vCPU each so two fit on a
2-core machine) with one virtio NIC per rail. Rail r of node 1 and rail r of node 2 are the two
ends of one QEMU `dgram` netdev pair over unix sockets: a point-to-point wire, no host bridge,
no host address, nothing else on it. The guests run integration/two_nodes/agent.py, and the
tests drive them through the shared results folder (see agent.py for the protocol).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN_IN_GUEST = REPO / "integration" / "guest" / "run-in-guest.sh"
AGENT = REPO / "integration" / "two_nodes" / "agent.py"
RAILS = 2
BOOT_TIMEOUT_S = int(os.environ.get("RDMA_NETNS_TWO_NODES_BOOT_TIMEOUT", "420"))
SESSION_TIMEOUT_S = int(os.environ.get("RDMA_NETNS_TWO_NODES_TIMEOUT", "2400"))


def rail_mac(node: int, rail: int) -> str:
    return f"52:54:00:a{node}:0{rail}:01"


@dataclass
class Reply:
    rc: int
    stdout: str
    stderr: str
    seconds: float


class NodeError(AssertionError):
    pass


class Node:
    """One guest: run commands in it (in order, as root) through its agent."""

    def __init__(self, index: int, results: Path, wires: Path) -> None:
        self.index = index
        self.name = f"node{index}"
        self.results = results
        self.channel = results / "channel"
        self.seq = 0
        self.proc: subprocess.Popen | None = None
        self.nics: dict[int, str] = {}
        self.booted_s = 0.0
        peer = 2 if index == 1 else 1
        self.qemu_opts: list[str] = ["-device", "virtio-rng-pci"]  # entropy: see agent.py
        for rail in range(RAILS):
            local, remote = wires / f"n{index}r{rail}", wires / f"n{peer}r{rail}"
            self.qemu_opts += ["-netdev", f"dgram,id=rail{rail},local.type=unix,local.path={local},"
                                          f"remote.type=unix,remote.path={remote}",
                               "-device", f"virtio-net-pci,netdev=rail{rail},mac={rail_mac(index, rail)}"]

    def boot(self, *, cpus: int = 1, memory: str = "1536M", timeout_s: int = SESSION_TIMEOUT_S,
             name: str | None = None, wrap: tuple[str, ...] = ()) -> None:
        """Start the guest with its agent. wrap: a command prefix for run-in-guest.sh (the real
        cluster's guest node runs it in the cluster's network namespace, for its tap NIC)."""
        argv = [*wrap, str(RUN_IN_GUEST), "--timeout", str(timeout_s), "--cpus", str(cpus), "--memory", memory,
                "--name", name or self.name, "--results", str(self.results),
                # one boot: a second QEMU could not bind the wires' unix sockets the first one left
                "--boot-attempts", "1"]
        for opt in self.qemu_opts:
            argv += ["--qemu-opt", opt]
        argv += ["--", "/usr/bin/python3", str(AGENT)]
        self.console = open(self.results.parent / f"{self.name}-console.log", "w")
        self.proc = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=self.console,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.started = time.monotonic()

    def wait_ready(self, deadline: float) -> None:
        ready = self.channel / "ready.json"
        while not ready.exists():
            if self.proc.poll() is not None:
                raise NodeError(f"{self.name} did not boot (run-in-guest exit {self.proc.returncode}): "
                                f"{self.console_tail()}")
            if time.monotonic() > deadline:
                raise NodeError(f"{self.name} did not boot within {BOOT_TIMEOUT_S} s: {self.console_tail()}")
            time.sleep(0.2)
        self.booted_s = time.monotonic() - self.started
        facts = json.loads(ready.read_text())
        by_mac = {nic["mac"]: nic["name"] for nic in facts["nics"]}
        for rail in range(RAILS):
            if rail_mac(self.index, rail) not in by_mac:
                raise NodeError(f"{self.name}: no NIC with rail {rail}'s MAC {rail_mac(self.index, rail)}: {facts}")
            self.nics[rail] = by_mac[rail_mac(self.index, rail)]

    def console_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join((self.results.parent / f"{self.name}-console.log").read_text().splitlines()[-lines:])
        except OSError:
            return "(no console)"

    def request(self, request: dict, timeout: float) -> dict:
        self.seq += 1
        name = f"{self.seq}.json"
        inbox, out = self.channel / "in", self.channel / "out" / name
        tmp = inbox / f".{name}.tmp"
        tmp.write_text(json.dumps(request))
        os.replace(tmp, inbox / name)
        deadline = time.monotonic() + timeout + 60
        while not out.exists():
            if self.proc.poll() is not None:
                raise NodeError(f"{self.name} died (run-in-guest exit {self.proc.returncode}): {self.console_tail()}")
            if time.monotonic() > deadline:
                raise NodeError(f"{self.name}: no reply to {request} within {timeout + 60:.0f} s")
            time.sleep(0.02)
        reply = json.loads(out.read_text())  # the agent renames a complete file into place
        out.unlink()
        return reply

    def run(self, *argv: str, timeout: float = 120, check: bool = True, input: str | None = None,
            env: dict | None = None) -> Reply:
        request: dict = {"argv": list(argv), "timeout": timeout, "env": env or {}}
        if input is not None:
            request["input"] = input
        r = self.request(request, timeout)
        reply = Reply(r["rc"], r["stdout"], r["stderr"], r["seconds"])
        if check and reply.rc != 0:
            raise NodeError(f"{self.name}: {' '.join(argv)} failed ({reply.rc}): {reply.stdout} {reply.stderr}")
        return reply

    def in_pod(self, pod: str, *argv: str, **kw) -> Reply:
        return self.run("ip", "netns", "exec", pod, *argv, **kw)

    def spawn(self, *argv: str) -> "Background":
        self.request({"argv": list(argv), "background": True}, 30)
        return Background(self, self.seq)

    def counters(self, nic: str) -> dict[str, int]:
        out = self.run("cat", f"/sys/class/net/{nic}/statistics/tx_packets",
                       f"/sys/class/net/{nic}/statistics/rx_packets").stdout.split()
        return {"tx": int(out[0]), "rx": int(out[1])}

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self.request({"stop": True}, 10)
            except NodeError:
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self.console.close()


class Background:
    def __init__(self, node: Node, seq: int) -> None:
        self.node, self.seq = node, seq

    def wait(self, timeout: float = 300) -> Reply:
        r = self.node.request({"wait": self.seq, "timeout": timeout}, timeout)
        return Reply(r["rc"], r["stdout"], r["stderr"], r["seconds"])


class TwoNodes:
    """Both guests, booted at once; `close()` stops them."""

    def __init__(self, workdir: Path) -> None:
        # unix socket paths are limited to 107 bytes: the wires live in a short folder of their own
        self.wires = Path(tempfile.mkdtemp(prefix="rn2w-", dir="/tmp"))
        self.nodes = [Node(i, workdir / f"node{i}", self.wires) for i in (1, 2)]
        self.boot_s = 0.0

    def boot(self) -> None:
        start = time.monotonic()
        for node in self.nodes:
            node.results.mkdir(parents=True, exist_ok=True)
            node.boot()
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        for node in self.nodes:
            node.wait_ready(deadline)
        self.boot_s = time.monotonic() - start

    def close(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.wires, ignore_errors=True)
