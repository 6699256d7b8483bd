"""Per-attachment state and locking under the state folder.

Layout: <stateDir>/<network>/<containerID>:<ifname>.json (0600 in 0700 folders) and
<stateDir>/locks/<n> for a fixed set of lock stripes. ':' cannot occur in a container ID or an
ifname, so the file name maps back to its attachment. Striped locks never need deleting, so
there is no unlink-while-locked race and nothing leaks, and unrelated pods rarely share a stripe.

<stateDir>/<network>/released/<containerID>:<ifname> (empty files) say "this attachment holds
nothing": written by DEL after a complete teardown and by an ADD that attached nothing (a pod not
granted the paired resource). Runtimes repeat DEL two or three times per pod (containerd: on
StopPodSandbox, then on RemovePodSandbox without netns or prevResult); with the marker a repeat
returns at once instead of running every rail's IPAM DEL again. Markers expire after
RELEASED_TTL seconds, and beyond RELEASED_KEEP the oldest go too (runtimes that never send GC,
containerd 1.6, would otherwise grow the folder for ever; a node churning pods faster than
RELEASED_KEEP an hour still holds a bounded number); a DEL that comes later still succeeds, by
releasing what the config says ADD would have taken.
"""

from __future__ import annotations

import errno
import os
import time

from rdma_netns import fsutil
from rdma_netns.spec.errors import IO_FAILURE, TRY_AGAIN_LATER, CniError

LOCK_STRIPES = 256
RELEASED = "released"
RELEASED_TTL = 3600.0
RELEASED_KEEP = 2048
SWEEP_INTERVAL = 60.0


class StateStore:
    def __init__(self, state_dir: str, network: str) -> None:
        self.root = state_dir
        self.folder = f"{state_dir}/{network}"

    def prepare(self) -> None:
        try:
            fsutil.ensure_private_dir(self.root)
            fsutil.ensure_private_dir(self.folder)
            fsutil.ensure_private_dir(f"{self.root}/locks")
        except OSError as exc:
            raise CniError(IO_FAILURE, f"state folder {self.folder} is not usable: {exc}") from None

    def _path(self, container_id: str, ifname: str) -> str:
        return f"{self.folder}/{container_id}:{ifname}.json"

    def load(self, container_id: str, ifname: str) -> dict | None:
        value = fsutil.read_json(self._path(container_id, ifname))
        return value if isinstance(value, dict) else None

    def save(self, container_id: str, ifname: str, value: dict) -> None:
        try:
            fsutil.write_json_atomic(self._path(container_id, ifname), value)
        except OSError as exc:
            raise CniError(IO_FAILURE, f"cannot write state in {self.folder}: {exc}") from None

    def delete(self, container_id: str, ifname: str) -> None:
        try:
            fsutil.remove(self._path(container_id, ifname))
        except OSError as exc:
            raise CniError(IO_FAILURE, f"cannot remove state in {self.folder}: {exc}") from None

    # ---- "holds nothing" markers

    def _released_path(self, container_id: str, ifname: str) -> str:
        return f"{self.folder}/{RELEASED}/{container_id}:{ifname}"

    def is_released(self, container_id: str, ifname: str) -> bool:
        try:
            return time.time() - os.lstat(self._released_path(container_id, ifname)).st_mtime < RELEASED_TTL
        except OSError:
            return False

    def mark_released(self, container_id: str, ifname: str) -> None:
        """Best effort: without the marker a repeated DEL is slower, never wrong."""
        folder = f"{self.folder}/{RELEASED}"
        try:
            fsutil.ensure_private_dir(folder)
            fd = os.open(self._released_path(container_id, ifname),
                         os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            os.utime(fd)
            os.close(fd)
            self._expire_released(folder)
        except OSError:
            pass

    def already_released(self, container_id: str, ifname: str, lock_timeout: float) -> bool:
        """A repeated DEL's whole work: no record and a fresh marker (checked under the lock, so a
        concurrent ADD of the same attachment is not missed). One lstat when there is no marker."""
        if not self.is_released(container_id, ifname):
            return False
        with self.locked(container_id, ifname, lock_timeout):
            return self.load(container_id, ifname) is None and self.is_released(container_id, ifname)

    def clear_released(self, container_id: str, ifname: str) -> None:
        try:
            os.unlink(self._released_path(container_id, ifname))
        except OSError:
            pass

    def released(self) -> list[tuple[str, str]]:
        """Every (containerID, ifname) with a marker."""
        try:
            names = os.listdir(f"{self.folder}/{RELEASED}")
        except OSError:
            return []
        out = []
        for name in names:
            container_id, sep, ifname = name.partition(":")
            if sep:
                out.append((container_id, ifname))
        return sorted(out)

    def _expire_released(self, folder: str) -> None:
        """At most once a minute (one stat otherwise), drop markers older than RELEASED_TTL and
        all but the RELEASED_KEEP newest. A dropped marker makes a late repeated DEL slower, never
        wrong. Bound: RELEASED_KEEP plus the DELs of one SWEEP_INTERVAL."""
        stamp = f"{folder}/.swept"
        now = time.time()
        try:
            if now - os.lstat(stamp).st_mtime < SWEEP_INTERVAL:
                return
        except FileNotFoundError:
            pass
        os.close(os.open(stamp, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        os.utime(stamp)
        kept: list[tuple[float, str]] = []
        for entry in os.scandir(folder):
            try:
                if ":" not in entry.name:
                    continue
                mtime = entry.stat(follow_symlinks=False).st_mtime
                if now - mtime >= RELEASED_TTL:
                    os.unlink(entry.path)
                else:
                    kept.append((mtime, entry.path))
            except OSError:
                pass
        if len(kept) > RELEASED_KEEP:
            kept.sort(reverse=True)
            for _mtime, path in kept[RELEASED_KEEP:]:
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def attachments(self) -> list[tuple[str, str]]:
        """Every (containerID, ifname) with a state file."""
        try:
            names = os.listdir(self.folder)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            if name.endswith(".json") and ":" in name:
                cid, _, ifname = name[: -len(".json")].partition(":")
                out.append((cid, ifname))
        return sorted(out)

    def locked(self, container_id: str, ifname: str, timeout: float) -> AttachmentLock:
        from zlib import crc32  # here, not at the top: an ADD that attaches nothing never locks

        stripe = crc32(f"{container_id}:{ifname}".encode()) % LOCK_STRIPES
        return AttachmentLock(f"{self.root}/locks/{stripe}", f"{container_id}/{ifname}", timeout)


class AttachmentLock:
    """`with store.locked(...) as waited:` holds an attachment's lock stripe (flock, polled so
    that it can give up after `timeout` with "try again later" instead of hanging a runtime)."""

    def __init__(self, path: str, what: str, timeout: float) -> None:
        self.path, self.what, self.timeout = path, what, timeout
        self.fd = -1

    def __enter__(self) -> float:
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:  # read-only or full state folder, a planted symlink (ELOOP)
            raise CniError(IO_FAILURE, f"cannot open the lock file {self.path}: {exc.strerror}") from None
        import fcntl

        start = time.monotonic()
        delay = 0.001
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return time.monotonic() - start
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    self.__exit__()
                    raise
            if time.monotonic() - start > self.timeout:
                self.__exit__()
                raise CniError(TRY_AGAIN_LATER, f"another invocation holds the lock of {self.what}",
                               f"waited {self.timeout:.1f} s")
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the last fd releases the flock
            self.fd = -1
