"""Receive the CNI's per-call events (rdma_netns.events, contract C) for the metrics.

A FIFO, 0600 in a 0700 folder (only root on the node may write; the CNI runs as root), made by
the daemon at start (under a temporary name, then renamed over the path: a stale one from an
earlier daemon is replaced whole) and removed at stop. The daemon also holds a write end itself,
so the last CNI closing its end is not an end of file. Each line is one call; anything malformed
is counted as rejected and otherwise ignored: labels come only from fixed sets (the command) or
bounded integers (the error code), so a bad writer cannot blow up the metrics' cardinality.
"""

from __future__ import annotations

import json
import logging
import os
import select
import stat
import threading
from collections.abc import Callable

from rdma_netns.util import fsutil

log = logging.getLogger("rdma_netns_dp.cni_events")

MAX_EVENT = 4096  # PIPE_BUF: the CNI writes no longer line
COMMANDS = frozenset(("ADD", "DEL", "CHECK", "STATUS", "GC"))
PAIRING = frozenset(("", "broker", "kubelet"))
MAX_SECONDS = 3600.0

Record = Callable[[str, int, float, str, "bool | None"], None]


def parse(data: bytes) -> tuple[str, int, float, str, bool | None] | None:
    """(command, code, seconds, pairing, granted), or None when the line is not an event."""
    if len(data) > MAX_EVENT:
        return None
    try:
        event = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(event, dict) or event.get("v") != 1:
        return None
    command, code, seconds = event.get("cmd"), event.get("code"), event.get("s")
    pairing, granted = event.get("pairing", ""), event.get("granted")
    if command not in COMMANDS or pairing not in PAIRING or granted not in (True, False, None):
        return None
    if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code <= 999:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds <= MAX_SECONDS:
        return None
    return command, code, float(seconds), pairing, granted


class CniEventsReceiver:
    """Make the FIFO, count every event in a thread; stop() removes the FIFO (if still ours)."""

    def __init__(self, path: str, record: Record, rejected: Callable[[], None]) -> None:
        self.path = path
        self.record = record
        self.rejected = rejected
        self._read_fd: int | None = None
        self._write_fd: int | None = None
        self._thread: threading.Thread | None = None
        self._identity: tuple[int, int] | None = None
        self._stop = threading.Event()

    def start(self) -> CniEventsReceiver:
        fsutil.make_daemon_folder(os.path.dirname(self.path))  # 0700 whoever made it
        tmp = f"{self.path}.{os.getpid()}.tmp"
        try:
            fsutil.remove(tmp)
            os.mkfifo(tmp, 0o600)
            os.chmod(tmp, 0o600)  # mkfifo's mode is filtered by the umask
            self._read_fd = os.open(tmp, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            self._write_fd = os.open(tmp, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            os.rename(tmp, self.path)
        except BaseException:
            self._close_fds()
            fsutil.remove(tmp)
            raise
        st = os.stat(self.path)
        self._identity = (st.st_dev, st.st_ino)
        self._thread = threading.Thread(target=self._loop, name="cni-events", daemon=True)
        self._thread.start()
        log.info("receiving CNI events", extra={"fifo": self.path})
        return self

    def _loop(self) -> None:
        pending = b""
        fd = self._read_fd
        while fd is not None and not self._stop.is_set():
            ready, _, _ = select.select([fd], [], [], 0.5)  # stop() is seen within half a second
            if not ready:
                continue
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            except OSError:
                return
            *lines, pending = (pending + chunk).split(b"\n")
            if len(pending) > MAX_EVENT:  # no newline in sight: not a CNI writing
                self.rejected()
                pending = b""
            for line in lines:
                event = parse(line)
                if event is None:
                    self.rejected()
                else:
                    self.record(*event)

    def _close_fds(self) -> None:
        for fd in (self._read_fd, self._write_fd):
            if fd is not None:
                os.close(fd)
        self._read_fd = self._write_fd = None

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        self._close_fds()
        try:
            st = os.lstat(self.path)
            if stat.S_ISFIFO(st.st_mode) and (st.st_dev, st.st_ino) == self._identity:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
