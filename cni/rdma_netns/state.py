"""Per-attachment state and locking under the state folder.

Layout: <stateDir>/<network>/<containerID>:<ifname>.json (0600 in 0700 folders) and
<stateDir>/locks/<containerID>:<ifname> while a call on that attachment runs. ':' cannot occur
in a container ID or an ifname, so a file name maps back to its attachment. The folder names
beside the network folders (RESERVED_NAMES) are refused as network names (config/loader.py).

<stateDir>/<network>/released/<containerID>:<ifname> (empty files) say "this attachment holds
nothing": written by DEL after a complete teardown and by an ADD that attached nothing (a pod not
granted the paired resource). Runtimes repeat DEL two or three times per pod (containerd: on
StopPodSandbox, then on RemovePodSandbox without netns or prevResult); with the marker a repeat
returns at once instead of running every rail's IPAM DEL again. Markers expire after
RELEASED_TTL seconds, and beyond RELEASED_KEEP the oldest go too (runtimes that never send GC,
containerd 1.6, would otherwise grow the folder for ever; a node churning pods faster than
RELEASED_KEEP an hour still holds a bounded number); a DEL that comes later still succeeds, by
releasing what the config says ADD would have taken.

The record itself is AttachmentState (one class: ADD writes it, DEL, CHECK, GC and the device
plugin read it through load/read_state).
"""

from __future__ import annotations

import posix
import sys
import time

from rdma_netns.spec.errors import INVALID_CONFIG, IO_FAILURE, TRY_AGAIN_LATER, CniError
from rdma_netns.util import fsutil, paths, trusted_paths

LOCKS = "locks"
CACHE_FOLDER = "verified-configs"  # config/loader.py's verdicts
# Folders beside the network folders: a network of that name would share them.
RESERVED_NAMES = (LOCKS, CACHE_FOLDER)
RELEASED = "released"
RELEASED_TTL = 3600.0
RELEASED_KEEP = 2048
SWEEP_INTERVAL = 60.0

# 2: "teardown" records the settings DEL needs (routing bases, link mode, IPAM timeout), so that
# a DEL whose config changed or is refused undoes what ADD really did.
# Compatibility rule (issue 16: version skew in both directions): `format` counts additive
# revisions; readers fill what an older format lacks from the config or the defaults, and ignore
# what a newer one adds. A change older readers must not act on bumps `formatMajor` (absent: 1);
# a reader refuses to CHECK a major it does not know, and DEL still undoes what it can from the
# fields it knows (a stuck DEL wedges the pod).
STATE_FORMAT = 2
STATE_MAJOR = 1


class StateStore:
    def __init__(self, state_dir: str, network: str) -> None:
        self.root = state_dir
        self.folder = f"{state_dir}/{network}"

    def prepare(self) -> None:
        """The state folder (the config's stateDir: refused with 7, as the loader does) and the
        plugin's own folders in it (one in the way there: 5, the state folder is not usable)."""
        try:
            fsutil.ensure_private_dir(self.root)
        except trusted_paths.Untrusted as exc:
            raise CniError(INVALID_CONFIG, f"invalid network config: stateDir {self.root!r} is refused: {exc}") from None
        except OSError as exc:
            raise CniError(IO_FAILURE, f"state folder {self.root} is not usable: {exc}") from None
        try:
            fsutil.ensure_private_dir(self.folder)
            fsutil.ensure_private_dir(f"{self.root}/locks")
        except OSError as exc:
            raise CniError(IO_FAILURE, f"state folder {self.folder} is not usable: {exc}") from None

    def path(self, container_id: str, ifname: str) -> str:
        """Where the attachment's record is (whether or not it exists)."""
        return f"{self.folder}/{container_id}:{ifname}.json"

    def load(self, container_id: str, ifname: str) -> AttachmentState | None:
        return read_state(self.path(container_id, ifname))

    def save(self, container_id: str, ifname: str, value: AttachmentState) -> None:
        try:
            fsutil.write_json_atomic(self.path(container_id, ifname), value.to_json())
        except OSError as exc:
            raise CniError(IO_FAILURE, f"cannot write state in {self.folder}: {exc}") from None

    def delete(self, container_id: str, ifname: str) -> None:
        try:
            fsutil.remove(self.path(container_id, ifname))
        except OSError as exc:
            raise CniError(IO_FAILURE, f"cannot remove state in {self.folder}: {exc}") from None

    # ---- "holds nothing" markers

    def _released_path(self, container_id: str, ifname: str) -> str:
        return f"{self.folder}/{RELEASED}/{container_id}:{ifname}"

    def is_released(self, container_id: str, ifname: str) -> bool:
        try:
            return time.time() - posix.lstat(self._released_path(container_id, ifname)).st_mtime < RELEASED_TTL
        except OSError:
            return False

    def mark_released(self, container_id: str, ifname: str) -> None:
        """Best effort: without the marker a repeated DEL is slower, never wrong."""
        folder = f"{self.folder}/{RELEASED}"
        try:
            fsutil.ensure_private_dir(folder)
            fd = posix.open(self._released_path(container_id, ifname),
                            posix.O_WRONLY | posix.O_CREAT | posix.O_NOFOLLOW | posix.O_CLOEXEC, 0o600)
            posix.utime(fd)
            posix.close(fd)
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
            posix.unlink(self._released_path(container_id, ifname))
        except OSError:
            pass

    def released(self) -> list[tuple[str, str]]:
        """Every (containerID, ifname) with a marker."""
        try:
            names = posix.listdir(f"{self.folder}/{RELEASED}")
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
            if now - posix.lstat(stamp).st_mtime < SWEEP_INTERVAL:
                return
        except FileNotFoundError:
            pass
        posix.close(posix.open(stamp, posix.O_WRONLY | posix.O_CREAT | posix.O_NOFOLLOW | posix.O_CLOEXEC, 0o600))
        posix.utime(stamp)
        kept: list[tuple[float, str]] = []
        for entry in posix.scandir(folder):
            try:
                if ":" not in entry.name:
                    continue
                mtime = entry.stat(follow_symlinks=False).st_mtime
                if now - mtime >= RELEASED_TTL:
                    posix.unlink(entry.path)
                else:
                    kept.append((mtime, entry.path))
            except OSError:
                pass
        if len(kept) > RELEASED_KEEP:
            kept.sort(reverse=True)
            for _mtime, path in kept[RELEASED_KEEP:]:
                try:
                    posix.unlink(path)
                except OSError:
                    pass

    def attachments(self) -> list[tuple[str, str]]:
        """Every (containerID, ifname) with a state file."""
        try:
            names = posix.listdir(self.folder)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            if name.endswith(".json") and ":" in name:
                cid, _, ifname = name[: -len(".json")].partition(":")
                out.append((cid, ifname))
        return sorted(out)


    def locked(self, container_id: str, ifname: str, timeout: float) -> AttachmentLock:
        return AttachmentLock(f"{self.root}/{LOCKS}", f"{container_id}:{ifname}", timeout)

    def sweep_locks(self) -> int:
        """GC: remove lock files a killed process left (nobody holds them); returns how many.
        Each is taken (without waiting) and unlinked under the lock, like any release."""
        folder = f"{self.root}/{LOCKS}"
        try:
            names = [n for n in posix.listdir(folder) if ":" in n]
        except OSError:
            return 0
        swept = 0
        for name in names:
            lock = AttachmentLock(folder, name, 0.0, create=False)
            try:
                with lock:
                    swept += 1
            except (CniError, OSError):
                pass  # held (in use), or gone meanwhile
        return swept


class AttachmentLock:
    """`with store.locked(...) as waited:` holds one attachment's lock: flock on its own file
    <stateDir>/locks/<containerID>:<ifname>, polled so that it can give up after `timeout` with
    "try again later" instead of hanging a runtime. Unrelated attachments have unrelated files,
    so they never wait for each other.

    The file exists only while a call holds (or waits for) it: release unlinks it, then closes.
    Unlinking a lock file can race with a waiter, so the rule is:
    - only the holder unlinks, as the last step of its critical section (nothing it protects
      happens after the unlink);
    - after flock succeeds, the acquirer checks that its fd is still the file at the path
      (fstat and lstat agree on device and inode); if not, the holder it waited for unlinked it,
      so it closes and starts over on the path's current file (created afresh by O_CREAT).
    So at any moment only the holder of the inode linked at the path is inside the critical
    section: a waiter on an unlinked inode never proceeds, and a newcomer creating a new file
    after the unlink could only meet a holder that has already finished. A process killed while
    holding leaves its file unlocked (the kernel drops the flock): the next caller reuses it and
    unlinks it, and GC sweeps any that nobody comes back for (sweep_locks).
    """

    def __init__(self, folder: str, name: str, timeout: float, create: bool = True) -> None:
        self.folder, self.path, self.what, self.timeout = folder, f"{folder}/{name}", name.replace(":", "/"), timeout
        self.create = create
        self.fd = -1

    def _open(self) -> int:
        flags = posix.O_RDWR | posix.O_NOFOLLOW | posix.O_CLOEXEC | (posix.O_CREAT if self.create else 0)
        try:
            return posix.open(self.path, flags, 0o600)
        except FileNotFoundError:
            if not self.create:
                raise
            fsutil.ensure_private_dir(self.folder)  # a state folder older than this layout
            return posix.open(self.path, flags, 0o600)

    def __enter__(self) -> float:
        start = time.monotonic()
        contended = False
        while True:
            try:
                fd = self._open()
            except OSError as exc:  # read-only or full state folder, a planted symlink (ELOOP)
                if not self.create:
                    raise
                raise CniError(IO_FAILURE, f"cannot open the lock file {self.path}: "
                               f"{exc.strerror or exc}") from None
            failed = fsutil.flock_polled(fd, start + self.timeout, 0.05)
            if failed is None:  # fd closed
                raise CniError(TRY_AGAIN_LATER, f"another invocation holds the lock of {self.what}",
                               f"waited {self.timeout:.1f} s")
            contended = contended or failed > 0
            if _same_file(fd, self.path):
                self.fd = fd
                waited = time.monotonic() - start
                if contended and self.create:  # runtime logs keep stderr: say who waited, and how long
                    sys.stderr.write(f"rdma-netns: waited {waited:.3f} s for the lock of {self.what} "
                                     "(another call on the same attachment)\n")
                return waited
            posix.close(fd)  # the holder we waited for unlinked it on release: take the current file

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            try:
                # Under the lock, as the last step (see the class docstring); and only our own file:
                # if something else removed it meanwhile, the path may be a newer caller's.
                if _same_file(self.fd, self.path):
                    posix.unlink(self.path)
            except OSError:
                pass
            posix.close(self.fd)  # closing the last fd releases the flock
            self.fd = -1


def _same_file(fd: int, path: str) -> bool:
    try:
        st = posix.lstat(path)
    except FileNotFoundError:
        return False
    mine = posix.fstat(fd)
    return st.st_ino == mine.st_ino and st.st_dev == mine.st_dev


# ---------------------------------------------------------------- the state record


class AttachmentState:
    """One attachment's record, as ADD writes it before its first change.

    rails: one dict per rail (Rail.to_state() plus the mode's prepare() facts and what ADD
    learns: ipamStarted, addresses, gidIndexes; rdmaOnly for an RDMA-device-only rail; ipamHolder
    for rails that share one IPAM call, ipam.hold_shared: an additive key, and an older reader's
    per-rail DEL under the holder's name still releases all of them, host-local keying leases by
    container and interface name).
    published: what ADD publishes for the pod's containers (publish/pod_cdi.py), so that DEL removes it from
    the state alone (an additive field: older readers keep it in `extra`).
    Unknown top-level fields of a newer writer are kept in `extra` and written back unchanged.
    """

    __slots__ = ("format", "major", "phase", "mode", "link", "container_id", "ifname", "netns", "network",
                 "teardown", "rails", "result", "published", "extra")

    _KEYS = ("format", "formatMajor", "phase", "mode", "link", "containerID", "ifname", "netns", "network",
             "teardown", "rails", "result", "published")

    def __init__(self, *, mode: str, link: str, container_id: str, ifname: str, netns: str, network: str,
                 rails: list[dict], teardown: dict | None = None, phase: str = "adding",
                 result: dict | None = None, format: object = STATE_FORMAT, major: object = STATE_MAJOR,
                 published: dict | None = None, extra: dict | None = None) -> None:
        self.format, self.major, self.phase = format, major, phase
        self.mode, self.link = mode, link
        self.container_id, self.ifname, self.netns, self.network = container_id, ifname, netns, network
        self.teardown, self.rails, self.result = teardown, rails, result
        # pod_cdi.plan(): the pod info file and CDI specs ADD publishes (written before the files are)
        self.published = published
        self.extra = extra or {}

    @classmethod
    def from_json(cls, value: dict) -> AttachmentState:
        """Tolerant: missing or mistyped fields read as empty (a format 1, hand-edited or foreign
        record); unknown ones are kept aside."""
        def text(key: str) -> str:
            v = value.get(key)
            return v if isinstance(v, str) else ""

        rails = value.get("rails")
        teardown = value.get("teardown")
        result = value.get("result")
        published = value.get("published")
        return cls(format=value.get("format", 1), major=value.get("formatMajor", 1), phase=text("phase"),
                   mode=text("mode"), link=text("link"), container_id=text("containerID"), ifname=text("ifname"),
                   netns=text("netns"), network=text("network"),
                   rails=[r for r in rails if isinstance(r, dict)] if isinstance(rails, list) else [],
                   teardown=teardown if isinstance(teardown, dict) else None,
                   result=result if isinstance(result, dict) else None,
                   published=published if isinstance(published, dict) else None,
                   extra={k: v for k, v in value.items() if k not in cls._KEYS})

    def to_json(self) -> dict:
        out: dict[str, object] = {
            "format": self.format, "phase": self.phase, "mode": self.mode, "link": self.link,
            "containerID": self.container_id, "ifname": self.ifname, "netns": self.netns, "network": self.network}
        if self.major != 1:
            out["formatMajor"] = self.major
        if self.teardown is not None:
            out["teardown"] = self.teardown
        out["rails"] = self.rails
        if self.result is not None:
            out["result"] = self.result
        if self.published is not None:
            out["published"] = self.published
        out.update(self.extra)
        return out

    def unreadable(self) -> str | None:
        """Why this version cannot trust the record as a whole (None: it can). Older and newer
        formats of the same major are readable; another major, or no sane format, is not."""
        if self.major != STATE_MAJOR:
            return f"state format major {self.major!r} (this version reads major {STATE_MAJOR})"
        if not isinstance(self.format, int) or isinstance(self.format, bool) or self.format < 1:
            return f"state format {self.format!r} is not a format number"
        return None


def read_state(path: str) -> AttachmentState | None:
    """The record at `path`; None when it is missing, a symlink, or not a JSON object."""
    value = fsutil.read_json(path)
    return AttachmentState.from_json(value) if isinstance(value, dict) else None


def all_records(state_dir: str) -> list[tuple[str, str, str, str]]:
    """(network, containerID, ifname, record path) of every attachment record under a state
    folder, sorted: the one walk the device plugin, its metrics and `rdma-netns status` share."""
    out = []
    for network in network_folders(state_dir):
        store = StateStore(state_dir, network)
        out += [(network, cid, ifname, store.path(cid, ifname)) for cid, ifname in store.attachments()]
    return out


def network_folders(state_dir: str) -> list[str]:
    """The network folders under a state folder (not the lock or cache folders beside them)."""
    try:
        names = posix.listdir(state_dir)
    except OSError:
        return []
    return sorted(n for n in names if n not in RESERVED_NAMES and paths.isdir(f"{state_dir}/{n}"))
