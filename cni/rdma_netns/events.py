"""Tell the device-plugin daemon what one CNI call did, for its Prometheus metrics.

The CNI is a short-lived process: it cannot be scraped, and it must never wait for, or fail
because of, a metrics consumer. So each call writes one JSON line to the daemon's FIFO (default
/run/rdma-netns/cni-events, the folder of the grants broker) and forgets it. A FIFO, not a
socket: opening and writing one needs only `os`, which every call has loaded, while the socket
module costs 0.1-0.3 ms to import, more than this whole step may take. Opened non-blocking, it
fails at once when no daemon reads it (ENXIO), when it is absent (ENOENT), or when its buffer
is full (EAGAIN): the event is dropped and the call goes on. A line of at most PIPE_BUF (4096)
bytes is written whole or not at all, so concurrent calls never interleave. Only the FIFO the daemon
makes is opened (root's, 0600, in folders only root can change: trusted_paths.check_fifo), and
only after lstat showed it: a device, a symlink or a regular file at the path is never opened. Cost: integration/bench/cni_events_cost.py.

The event (contract C, read by rdma_netns_dp.cni_events), one line:
  {"v": 1, "cmd": "ADD", "code": 0, "s": 0.0214, "net": "rdma-8rails",
   "pairing": "broker"|"kubelet"|"", "granted": true|false|null}
`code` is 0 for success, else the CNI error code written on stdout. `s` is the time from the start
of the call's own code to its answer (the interpreter's start-up, a few ms, is not in it).
"""

from __future__ import annotations

import posix

from rdma_netns.config.defaults import DEFAULT_EVENTS_FIFO as DEFAULT_PATH
from rdma_netns.util import jsonio, trusted_paths

PIPE_BUF = 4096
_FIFO = 0o010000
_FILE_TYPE = 0o170000

# What the call learned on the way, filled by the code that learns it (one call per process;
# run_cni resets it for in-process callers such as the tests).
call: dict[str, object] = {}


def reset() -> None:
    call.clear()


def note(key: str, value: object) -> None:
    call[key] = value


def send(path: str, command: str, code: int, seconds: float, network: str) -> None:
    """One line to the FIFO at `path`, never blocking, never raising. "" turns events off."""
    if not path:
        return
    event = {"v": 1, "cmd": command, "code": code, "s": round(seconds, 6), "net": network,
             "pairing": call.get("pairing", ""), "granted": call.get("granted")}
    try:
        line = (jsonio.dumps(event) + "\n").encode()
        if len(line) > PIPE_BUF:
            return
        # Looked at before it is opened: opening a device (a watchdog) can act by itself.
        seen = trusted_paths.check_fifo(path)
        if seen is None:
            return
        fd = posix.open(path, posix.O_WRONLY | posix.O_NONBLOCK | posix.O_CLOEXEC | posix.O_NOFOLLOW)
    except (OSError, ValueError, TypeError):
        return  # no daemon reading, no FIFO, not the daemon's, a path too long: the call is what matters
    try:
        st = posix.fstat(fd)
        if st.st_mode & _FILE_TYPE == _FIFO and (st.st_dev, st.st_ino) == (seen.st_dev, seen.st_ino):
            posix.write(fd, line)
    except OSError:
        pass  # EAGAIN: the daemon is behind; this event is dropped
    finally:
        posix.close(fd)
