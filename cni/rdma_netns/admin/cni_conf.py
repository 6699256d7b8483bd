"""Chain rdma-netns into the node's primary CNI config, the istio-cni / linkerd-cni way.

A container runtime (containerd's CRI via go-cni, CRI-O via ocicni) runs only the *first* network
config of its conf dir: the files named *.conf, *.conflist, *.json, in byte-wise lexical order
(libcni ConfFiles + sort.Strings). The cluster CNI (Calico, Flannel, Cilium, ...) owns that file and
may rewrite it at any time. So rdma-netns does what istio-cni and linkerd-cni do: it appends its
entry to the end of that file's "plugins" list, watches the file and appends again after the
primary CNI rewrites it, and on removal leaves the file byte-for-byte as the primary CNI wrote it.

A `.conf` / `.json` primary holds one plugin, and go-cni (containerd 1.6, 1.7) loads such a file
with ConfFromFile: a "plugins" list in it is ignored (our entry would never run), and a file without
"type" is refused outright ("network type not found"). So to chain into one, the plugin object is
written as `<stem>.conflist` ({"cniVersion", "name", "plugins": [<the original object>, <ours>]},
what libcni's ConfListFromConf builds in memory) and the `.conf` is removed, in that order, so the
runtime always finds a valid primary; removal writes the `.conf` back and deletes the `.conflist`.
If the primary CNI writes its `.conf` again, that file sorts first again and is converted again.

A primary that is a symlink (a CNI or an admin keeping the file elsewhere) stays one: its target is
written in place (a temp file beside the target, then rename), so the CNI's later edits still reach
the runtime; a linked `.conf` is converted as any `.conf` is, and removal puts the same link back.
A dangling link, or a target that cannot be written (a read-only ConfigMap mount), is refused
with a message and left as it is.

State (--state-dir, 0700; files 0600): state.json names the file we wrote, the sha256 of the
bytes we wrote, the original file name and, for a converted link, what it pointed to; `original`
holds the primary's bytes before our insert.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rdma_netns.util import fsutil

PLUGIN_TYPE = "rdma-netns"
CONF_EXTENSIONS = (".conf", ".conflist", ".json")
DEFAULT_STATE_DIR = "/var/lib/rdma-netns/cni-conf"
TEMP_SUFFIX = ".rdma-netns-tmp"  # the runtime loads only CONF_EXTENSIONS: a temp file is never read


class CniConfError(Exception):
    """A refusal with a message for the admin (the file is left as it was)."""


def log(message: str) -> None:
    print(f"rdma-netns cni-conf: {message}", file=sys.stderr, flush=True)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- which file is the primary ---------------------------------------------------------------------

def conf_files(conf_dir: Path) -> list[str]:
    """Names the runtime considers, in its order (Go's sort.Strings: byte-wise)."""
    try:
        entries = list(os.scandir(conf_dir))
    except FileNotFoundError:
        return []
    names = [e.name for e in entries if not e.is_dir() and os.path.splitext(e.name)[1] in CONF_EXTENSIONS]
    return sorted(names, key=lambda n: n.encode())


def plugin_types(doc: Any) -> list[str]:
    if not isinstance(doc, dict):
        return []
    plugins = doc.get("plugins")
    if isinstance(plugins, list):
        return [p.get("type") for p in plugins if isinstance(p, dict)]
    return [doc.get("type")]


def is_ours(path: Path) -> bool:
    """A standalone rdma-netns config (e.g. 99-rdma-netns.conflist): never treated as the primary."""
    try:
        types = plugin_types(json.loads(path.read_bytes()))
    except (OSError, ValueError):
        return False
    return bool(types) and all(t == PLUGIN_TYPE for t in types)


def find_primary(conf_dir: Path) -> str | None:
    for name in conf_files(conf_dir):
        if not is_ours(conf_dir / name):
            return name
    return None


# --- JSON that looks like the primary CNI's ---------------------------------------------------------

@dataclass
class Style:
    indent: str | None
    separators: tuple[str, str]
    trailing_newline: bool
    ensure_ascii: bool

    @classmethod
    def of(cls, text: str) -> Style:
        body = text.strip()
        indent = None
        if "\n" in body:
            for line in body.splitlines()[1:]:
                stripped = line.lstrip(" \t")
                if stripped and stripped != line:
                    indent = line[: len(line) - len(stripped)]
                    break
            indent = indent if indent is not None else "  "
        item = "," if indent is not None else (", " if ", " in body or ",\n" in body else ",")
        key = ": " if '": ' in body else ":"
        return cls(indent, (item, key), text.endswith("\n"), text.isascii())

    def dump(self, doc: Any) -> bytes:
        out = json.dumps(doc, indent=self.indent, separators=self.separators, ensure_ascii=self.ensure_ascii)
        return (out + ("\n" if self.trailing_newline else "")).encode()


def parse(data: bytes, name: str) -> dict:
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise CniConfError(f"{name} is not valid JSON ({exc}): leaving it alone") from None
    if not isinstance(doc, dict):
        raise CniConfError(f"{name} is not a JSON object: leaving it alone")
    return doc


def with_entry(doc: dict, entry: dict, name: str) -> dict:
    """The conflist with our entry the last of its plugins (other rdma-netns entries dropped)."""
    plugins = doc.get("plugins")
    if not isinstance(plugins, list) or not plugins:
        raise CniConfError(f"{name} has no \"plugins\" list: leaving it alone")
    out = dict(doc)
    out["plugins"] = [p for p in plugins if not (isinstance(p, dict) and p.get("type") == PLUGIN_TYPE)] + [entry]
    return out


def without_entry(doc: dict) -> dict:
    out = dict(doc)
    out["plugins"] = [p for p in doc.get("plugins", []) if not (isinstance(p, dict) and p.get("type") == PLUGIN_TYPE)]
    return out


def has_entry(doc: Any) -> bool:
    return PLUGIN_TYPE in plugin_types(doc) and isinstance(doc, dict) and isinstance(doc.get("plugins"), list)


def as_conflist(single: dict) -> dict:
    """A one-plugin config as the conflist libcni's ConfListFromConf makes of it."""
    out: dict = {}
    if "cniVersion" in single:
        out["cniVersion"] = single["cniVersion"]
    if "name" in single:
        out["name"] = single["name"]
    out["plugins"] = [single]
    return out


# --- files ------------------------------------------------------------------------------------------

def fsync_dir(folder: Path) -> None:
    fsutil.fsync_dir(str(folder))


def atomic_write(path: Path, data: bytes, like: os.stat_result | None, mode: int = 0o644,
                 guard: Callable[[], None] | None = None) -> None:
    """The one writer of this module (conf files, the backup of the primary's file, the record):
    fsutil.write_atomic, durable, through a temp name the runtime never loads.

    These files are another program's or restore it, so they must survive power loss (fsync
    before the rename and of the folder after), keep a foreign owner (`like`), and lose to a
    concurrent writer (`guard` raises just before the rename when the file changed under us).
    """
    try:
        json.loads(data)
    except ValueError as exc:  # never happens with our own dumps; a last line of defence
        raise CniConfError(f"refusing to write {path.name}: not valid JSON ({exc})") from None
    fsutil.write_atomic(str(path), data, mode, durable=True, like=like,
                        tmp_path=str(path.with_name(f".{path.name}{TEMP_SUFFIX}")), before_rename=guard)


def write_conf(path: Path, data: bytes, like: os.stat_result | None,
               guard: Callable[[], None] | None = None) -> None:
    """Write a conf file of the runtime's folder; through a symlink to its target, so the link
    stays a link (and keeps reaching whatever its owner writes there later)."""
    if not path.is_symlink():
        atomic_write(path, data, like, guard=guard)
        return
    target = Path(os.path.realpath(path))
    if not target.is_file():
        raise CniConfError(f"{path.name} is a symlink that points to {os.readlink(path)}, which is not a file: "
                           "leaving it alone")
    try:
        atomic_write(target, data, like, guard=guard)
    except OSError as exc:
        raise CniConfError(f"{path.name} is a symlink to {target}, which cannot be written "
                           f"({exc.strerror or exc}): leaving it alone; chain into the file it points to, or "
                           "make it a file") from None
    log(f"{path.name} is a symlink: wrote through the symlink to {target}")


def unchanged_guard(path: Path, seen: os.stat_result | None) -> Callable[[], None]:
    def check() -> None:
        try:
            now = os.stat(path)
        except FileNotFoundError:
            now = None
        same = (now is None and seen is None) or (
            now is not None and seen is not None
            and (now.st_ino, now.st_size, now.st_mtime_ns) == (seen.st_ino, seen.st_size, seen.st_mtime_ns))
        if not same:
            raise CniConfError(f"{path.name} changed while it was being updated: will look again")
    return check


# --- state -----------------------------------------------------------------------------------------

class State:
    """What we wrote, where, and the bytes it replaced; kept in a 0700 folder, files 0600."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir
        self.file = state_dir / "state.json"
        self.original = state_dir / "original"

    def ensure_dir(self) -> None:
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)

    @contextlib.contextmanager
    def locked(self):
        """One writer at a time (a watch and an admin's insert/remove)."""
        self.ensure_dir()
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)  # no lock file: a cleaned state is an empty folder
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def load(self) -> dict | None:
        try:
            record = json.loads(self.file.read_bytes())
        except FileNotFoundError:
            return None
        except ValueError:
            log(f"{self.file} is damaged: ignoring it")
            return None
        if record.get("hasOriginal"):
            try:
                record["originalBytes"] = self.original.read_bytes()
            except FileNotFoundError:
                record["hasOriginal"] = False
        return record

    def save(self, conf_dir: Path, path: str, original_name: str, original: bytes | None, written: bytes,
             original_link: str | None = None) -> None:
        self.ensure_dir()
        if original is not None:
            atomic_write(self.original, original, None, 0o600)
        record = {"v": 1, "confDir": str(conf_dir), "file": path, "originalFile": original_name,
                  "hasOriginal": original is not None, "writtenSha256": sha256(written)}
        if original_link is not None:  # a linked .conf we converted: removal puts the link back
            record["originalLink"] = original_link
        atomic_write(self.file, json.dumps(record, indent=2).encode() + b"\n", None, 0o600)

    def clear(self) -> None:
        for f in (self.file, self.original):
            with contextlib.suppress(FileNotFoundError):
                f.unlink()


# --- the operations ---------------------------------------------------------------------------------

def load_entry(path: Path) -> dict:
    try:
        entry = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise CniConfError(f"--entry {path}: cannot read JSON: {exc}") from None
    if not isinstance(entry, dict) or entry.get("type") != PLUGIN_TYPE:
        raise CniConfError(f"--entry {path}: must be a JSON object with \"type\": \"{PLUGIN_TYPE}\"")
    return entry


def check_entry(entry: dict, cni_version: Any = "1.0.0", name: Any = "rdma-netns-check") -> None:
    """Refuse an entry the plugin itself would refuse: chained into the primary, a refused config
    would fail the ADD of every pod on the node."""
    from pydantic import ValidationError

    from rdma_netns.config import model

    try:
        model.validate(dict(entry, cniVersion=cni_version or "1.0.0", name=name or "rdma-netns-check"))
    except ValidationError as exc:
        raise CniConfError(f"the entry is not a valid rdma-netns config: {model.describe_errors(exc)}") from None


def insert(conf_dir: Path, entry: dict, state: State) -> str:
    """Make the primary end with `entry`. Returns what was done, one of:
    "inserted", "updated", "unchanged", "no-primary" (raises CniConfError on a refusal)."""
    with state.locked():
        return _insert(conf_dir, entry, state)


def _insert(conf_dir: Path, entry: dict, state: State) -> str:
    primary = find_primary(conf_dir)
    if primary is None:
        return "no-primary"
    record = state.load()
    if record is not None and record.get("file") != primary:
        # The primary changed (a new file sorts first, or the CNI wrote its .conf again): put the
        # old one back as it was, then chain into the new one.
        _remove(conf_dir, state, record)
        record = None
    path = conf_dir / primary
    if path.is_symlink() and not path.exists():
        raise CniConfError(f"{primary} is a symlink that points to {os.readlink(path)}, which does not exist: "
                           "leaving it alone")
    seen = os.stat(path)
    current = path.read_bytes()
    doc = parse(current, primary)
    check_entry(entry, doc.get("cniVersion"), doc.get("name"))
    guard = unchanged_guard(path, seen)

    if os.path.splitext(primary)[1] != ".conflist":
        if "plugins" in doc or not doc.get("type"):
            raise CniConfError(f"{primary} is not a single-plugin config (no \"type\"): leaving it alone")
        target_name = os.path.splitext(primary)[0] + ".conflist"
        target = conf_dir / target_name
        rest = [n for n in conf_files(conf_dir) if n != primary and not is_ours(conf_dir / n)]
        if target.exists():
            raise CniConfError(f"cannot chain into {primary}: converting it needs {target_name}, which exists")
        if rest and rest[0].encode() < target_name.encode():
            raise CniConfError(f"cannot chain into {primary}: as {target_name} it would sort after {rest[0]}")
        new = Style.of(current.decode()).dump(with_entry(as_conflist(doc), entry, primary))
        state.save(conf_dir, target_name, primary, current, new,
                   original_link=os.readlink(path) if path.is_symlink() else None)
        atomic_write(target, new, seen, guard=guard)
        os.unlink(path)
        fsync_dir(conf_dir)
        log(f"converted {primary} to {target_name} with the {PLUGIN_TYPE} entry last")
        return "inserted"

    style = Style.of(current.decode(errors="replace"))
    if record is not None and record.get("writtenSha256") == sha256(current):
        # Still what we wrote: rebuild from the primary's own bytes, so they stay restorable.
        if record.get("hasOriginal"):
            base_bytes = record["originalBytes"]
            base, original = parse(base_bytes, primary), base_bytes
            if record.get("originalFile", primary) != primary:  # we made this conflist of a .conf
                base = as_conflist(base)
            style = Style.of(base_bytes.decode(errors="replace"))
        else:
            base, original = doc, None
        new = style.dump(with_entry(base, entry, primary))
        if new == current:
            return "unchanged"
        state.save(conf_dir, primary, record.get("originalFile", primary), original, new,
                   original_link=record.get("originalLink"))
        write_conf(path, new, seen, guard=guard)
        log(f"updated the {PLUGIN_TYPE} entry in {primary}")
        return "updated"

    # Not what we last wrote (first insert, or the primary CNI rewrote it).
    plugins = doc.get("plugins")
    if isinstance(plugins, list) and plugins and plugins[-1] == entry \
            and sum(1 for t in plugin_types(doc) if t == PLUGIN_TYPE) == 1:
        # Already there as we want it (written by a CNI that keeps chained entries, or by an earlier
        # install whose state is gone): nothing to write; its bytes without us are unknown.
        state.save(conf_dir, primary, primary, None, current)
        return "unchanged"
    new = style.dump(with_entry(doc, entry, primary))
    original = None if has_entry(doc) else current
    state.save(conf_dir, primary, primary, original, new)
    write_conf(path, new, seen, guard=guard)
    log(f"inserted the {PLUGIN_TYPE} entry at the end of {primary}'s plugins")
    return "inserted"


def remove(conf_dir: Path, state: State) -> str:
    """Take our entry out. Returns "restored", "removed-entry", "absent" or "no-primary"."""
    with state.locked():
        return _remove(conf_dir, state, state.load())


def _remove(conf_dir: Path, state: State, record: dict | None) -> str:
    if record is None:
        name = find_primary(conf_dir)
        if name is None:
            return "no-primary"
        return _remove_entry(conf_dir / name)
    name = record["file"]
    original_name = record.get("originalFile", name)
    path = conf_dir / name
    try:
        seen = os.stat(path)
        current = path.read_bytes()
    except FileNotFoundError:
        state.clear()
        return "absent"
    result = "absent"
    if sha256(current) == record.get("writtenSha256") and record.get("hasOriginal"):
        original = record["originalBytes"]
        if original_name == name:
            write_conf(path, original, seen, guard=unchanged_guard(path, seen))
            log(f"restored {name} as its CNI wrote it")
        else:
            back = conf_dir / original_name
            if back.exists() or back.is_symlink():
                log(f"{original_name} was written again by its CNI: keeping it")
            elif isinstance(record.get("originalLink"), str):
                restore_link(back, record["originalLink"])
                log(f"restored {original_name} as the symlink to {record['originalLink']} it was")
            else:
                atomic_write(back, original, seen)
                log(f"restored {original_name} as its CNI wrote it")
            os.unlink(path)
            fsync_dir(conf_dir)
            log(f"removed {name}")
        result = "restored"
    else:
        result = _remove_entry(path)
    state.clear()
    return result


def restore_link(path: Path, target: str) -> None:
    """Put a symlink back atomically (made under a temp name the runtime never loads, renamed)."""
    tmp = path.with_name(f".{path.name}{TEMP_SUFFIX}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    os.symlink(target, tmp)
    os.rename(tmp, path)
    fsync_dir(path.parent)


def _remove_entry(path: Path) -> str:
    """The primary CNI rewrote the file after us: take out only our entry, keep the rest."""
    seen = os.stat(path)
    current = path.read_bytes()
    try:
        doc = parse(current, path.name)
    except CniConfError as exc:
        log(str(exc))
        return "absent"
    if not has_entry(doc):
        return "absent"
    new = Style.of(current.decode(errors="replace")).dump(without_entry(doc))
    write_conf(path, new, seen, guard=unchanged_guard(path, seen))
    log(f"removed the {PLUGIN_TYPE} entry from {path.name}")
    return "removed-entry"


def show(conf_dir: Path, state: State) -> dict:
    primary = find_primary(conf_dir)
    out: dict = {"confDir": str(conf_dir), "primary": primary, "entry": False, "tracked": False, "valid": None}
    if primary is not None:
        try:
            doc = parse((conf_dir / primary).read_bytes(), primary)
            out["valid"], out["entry"] = True, has_entry(doc)
        except (CniConfError, OSError):
            out["valid"] = False
    record = state.load() if state.file.exists() else None
    out["tracked"] = record is not None and record.get("file") == primary
    first = conf_files(conf_dir)
    out["runtimeUses"] = first[0] if first else None
    return out


# --- watch ------------------------------------------------------------------------------------------

def fingerprint(conf_dir: Path) -> tuple | None:
    """The primary's name, inode, size, mtime and content hash (any change means: look again)."""
    name = find_primary(conf_dir)
    if name is None:
        return None
    try:
        st = os.stat(conf_dir / name)
        data = (conf_dir / name).read_bytes()
    except FileNotFoundError:
        return (name,)
    return (name, st.st_ino, st.st_size, st.st_mtime_ns, sha256(data))


def watch(conf_dir: Path, entry: dict, state: State, interval: float, keep_on_exit: bool,
          after_look: Callable[[bool], None] | None = None) -> int:
    """Keep the entry chained until SIGTERM/SIGINT; `after_look(acted)` runs after every look
    (cni_conf_ready keeps the readiness file with it)."""
    stop = {"signal": None}

    def on_signal(signum, _frame) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log(f"watching {conf_dir} every {interval:g}s")
    last: tuple | None | str = "start"
    waiting_logged = False
    while stop["signal"] is None:
        now = fingerprint(conf_dir)
        acted = now != last
        if acted:
            try:
                result = insert(conf_dir, entry, state)
                if result == "no-primary" and not waiting_logged:
                    log(f"no primary CNI config in {conf_dir} yet: waiting for one")
                waiting_logged = result == "no-primary"
                # `last` stays what was seen before acting: after our own write the next look runs
                # insert once more ("unchanged", silent), and a rewrite by the primary CNI that lands
                # right after ours is never mistaken for our own.
            except CniConfError as exc:
                log(str(exc))
            except OSError as exc:
                log(f"{type(exc).__name__}: {exc}: will look again")
                now = "retry"
            last = now
        if after_look is not None:
            after_look(acted)
        deadline = time.monotonic() + interval
        while stop["signal"] is None and time.monotonic() < deadline:
            time.sleep(min(0.1, interval))
    name = signal.Signals(stop["signal"]).name
    if keep_on_exit:
        log(f"{name}: leaving the entry in place (--keep-on-exit)")
        return 0
    try:
        result = remove(conf_dir, state)
        log(f"{name}: removal: {result}")
    except (CniConfError, OSError) as exc:
        log(f"{name}: removal failed: {exc}")
        return 1
    return 0
