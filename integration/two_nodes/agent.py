"""Guest side of the two-node rig: run the commands the host's tests leave in a shared folder.

Each guest of integration/two_nodes boots with this as its only command. The host's tests and
the guest share one read-write folder (run-in-guest.sh --results, the same path on both sides);
there is no network between host and guests, by design (the guests' NICs are wired only to each
other). Protocol, one JSON file per request, written atomically (temp file + rename):

    <channel>/in/<seq>.json    {"argv": [...], "timeout": s, "input": str, "env": {...}}
                               {"argv": [...], "background": true}   -> {"pid": ...}
                               {"wait": <seq of a background request>, "timeout": s}
                               {"stop": true}
    <channel>/out/<seq>.json   {"rc": int, "stdout": str, "stderr": str, "seconds": float}

Requests run one at a time, in order; background ones run alongside until waited for (a server
on one node while the other node's client runs). argv is run directly, never through a shell.
`<channel>/ready.json` tells the host that the node is up and what it has (NICs by MAC).
Stdlib only: it runs on Debian's /usr/bin/python3 or the project's venv alike.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

POLL_S = 0.05


def write_atomically(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def nics() -> list[dict]:
    """The guest's virtio NICs: name and MAC, so the host can tell its rails apart."""
    out = []
    for name in sorted(os.listdir("/sys/class/net")):
        try:
            driver = os.path.basename(os.readlink(f"/sys/class/net/{name}/device/driver"))
            mac = Path(f"/sys/class/net/{name}/address").read_text().strip()
        except OSError:
            continue
        if driver == "virtio_net":
            out.append({"name": name, "mac": mac})
    return out


def finish(proc: subprocess.Popen, timeout: float | None, started: float, data: str | None = None) -> dict:
    try:
        stdout, stderr = proc.communicate(input=data, timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        rc = 124
        stderr += f"\nagent: killed after {timeout} s"
    return {"rc": rc, "stdout": stdout, "stderr": stderr, "seconds": round(time.monotonic() - started, 3)}


def start(request: dict) -> tuple[subprocess.Popen, float]:
    env = dict(os.environ)
    env.update(request.get("env") or {})
    started = time.monotonic()
    proc = subprocess.Popen(request["argv"], stdin=subprocess.PIPE if "input" in request else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return proc, started


def serve(channel: Path) -> None:
    inbox, outbox = channel / "in", channel / "out"
    inbox.mkdir(parents=True, exist_ok=True)
    outbox.mkdir(parents=True, exist_ok=True)
    write_atomically(channel / "ready.json", {"hostname": os.uname().nodename, "kernel": os.uname().release,
                                              "nics": nics()})
    background: dict[str, tuple[subprocess.Popen, float]] = {}
    while True:
        names = sorted((n for n in os.listdir(inbox) if n.endswith(".json") and not n.startswith(".")),
                       key=lambda n: int(n.split(".")[0]))
        if not names:
            time.sleep(POLL_S)
            continue
        for name in names:
            path = inbox / name
            request = json.loads(path.read_text())
            path.unlink()
            seq = name.split(".")[0]
            try:
                if request.get("stop"):
                    for proc, _ in background.values():
                        proc.kill()
                    write_atomically(outbox / name, {"rc": 0, "stdout": "", "stderr": "", "seconds": 0})
                    return
                if "wait" in request:
                    proc, started = background.pop(str(request["wait"]))
                    reply = finish(proc, request.get("timeout"), started)
                elif request.get("background"):
                    proc, started = start(request)
                    background[seq] = (proc, started)
                    reply = {"rc": 0, "pid": proc.pid, "stdout": "", "stderr": "", "seconds": 0}
                else:
                    proc, started = start(request)
                    reply = finish(proc, request.get("timeout", 120), started, request.get("input"))
            except Exception as exc:  # noqa: BLE001 - the host gets every failure as a reply, never a hang
                reply = {"rc": 127, "stdout": "", "stderr": f"agent: {type(exc).__name__}: {exc}", "seconds": 0}
            write_atomically(outbox / name, reply)


def main() -> int:
    results = os.environ.get("GUEST_RESULTS")
    if not results:
        print("agent.py runs inside a guest of run-in-guest.sh (GUEST_RESULTS unset)", file=sys.stderr)
        return 2
    # Two guests of one kernel booted at once under emulation start with the same random state:
    # the host's entropy (the rig's virtio-rng device) makes their random MACs differ.
    subprocess.run(["modprobe", "virtio-rng"], check=False)
    subprocess.run(["modprobe", "rdma_rxe"], check=False)
    os.makedirs("/var/run/netns", exist_ok=True)
    serve(Path(results) / "channel")
    return 0


if __name__ == "__main__":
    sys.exit(main())
