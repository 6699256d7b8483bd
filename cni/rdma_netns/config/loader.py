"""Load the config a runtime sends on stdin, fast.

Building the pydantic models costs ~0.15 s of start-up, more than a whole Go plugin ADD. A node
sees the same network config for every pod, so the loader validates a config with the model
once, stores the normalised result under the state folder keyed by the SHA-256 of the config
(runtime-supplied keys excluded), and later calls only read that file. The per-invocation keys
(runtimeConfig, args, prevResult) are small and checked here on every call.
"""

from __future__ import annotations

import posix

from rdma_netns import __version__
from rdma_netns.config.defaults import (  # noqa: F401 (re-exported: loader.DEFAULT_* as before)
    DEFAULT_CDI_KIND,
    DEFAULT_CDI_SPEC_DIR,
    DEFAULT_POD_GRANTS_SOCKET,
    DEFAULT_POD_INFO_DIR,
    DEFAULT_POD_RESOURCES_SOCKET,
    DEFAULT_STATE_DIR,
    RUNTIME_KEYS,
    TEARDOWN_DEFAULTS,
)
from rdma_netns.config.netconf import NetConfig
from rdma_netns.spec import versions
from rdma_netns.spec.errors import INVALID_CONFIG, INVALID_ENV, CniError
from rdma_netns.util import fsutil, jsonio, trusted_paths

CACHE_FOLDER = "verified-configs"  # state.CACHE_FOLDER (not imported: a VERSION call loads no state code)
# Folder names beside the network folders under stateDir (state.RESERVED_NAMES): a network of
# that name would share its folder with the lock files or this cache.
RESERVED_NETWORK_NAMES = ("locks", CACHE_FOLDER)
# The verified-config cache holds one file per (config digest, plugin version); containerd 1.6
# never sends GC, so a node whose configs change (rollouts, hand edits) would grow it for ever.
# A cache miss (rare: a new config) keeps only the CACHE_KEEP most recent files by mtime.
CACHE_KEEP = 32
NETWORK_NAME_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-"
HEX = "0123456789abcdefABCDEF"

try:  # the C sha256 without hashlib's OpenSSL loading (about 3 ms at start-up)
    from _sha256 import sha256
except ImportError:  # pragma: no cover - other Pythons
    from hashlib import sha256


def _valid_mac(mac: str) -> bool:
    parts = mac.split(":")
    return len(parts) == 6 and all(len(p) == 2 and p[0] in HEX and p[1] in HEX for p in parts)


def _valid_device_id(device_id: str) -> bool:
    """A PCI address (0000:3b:00.2) or an auxiliary/RDMA device name (mlx5_core.sf.4, mlx5_0)."""
    return (0 < len(device_id) <= 64 and device_id.isascii() and device_id not in (".", "..")
            and all(c.isalnum() or c in "_.:-" for c in device_id))


class RuntimeConfig:
    """The capability values a runtime injects (CNI conventions: deviceID, ips, mac)."""

    __slots__ = ("device_id", "ips", "mac")

    def __init__(self) -> None:
        self.device_id: str | None = None
        self.ips: list[str] = []
        self.mac: str | None = None


class Config:
    """One invocation's config: the validated network plus the runtime's per-call keys."""

    __slots__ = ("net", "cni_version", "runtime", "prev_result", "args", "valid_attachments", "refused")

    def __init__(self, net: NetConfig, cni_version: str, runtime: RuntimeConfig, prev_result: dict | None,
                 args: dict | None, valid_attachments: set[tuple[str, str]] | None,
                 refused: str | None = None) -> None:
        self.net, self.cni_version, self.runtime = net, cni_version, runtime
        self.prev_result, self.args = prev_result, args
        # GC: the (containerID, ifname) pairs still in use; None when the runtime sent no list.
        self.valid_attachments = valid_attachments
        # DEL only: why the config would be refused on ADD; net then holds teardown settings only.
        self.refused = refused


def load(raw: dict) -> Config:
    version = versions.require_supported(raw.get("cniVersion", ""))
    net = NetConfig(_validated_network(raw))
    if net.name in RESERVED_NETWORK_NAMES:
        raise CniError(INVALID_CONFIG, f"invalid network config: name {net.name!r} is reserved (the state folder "
                       f"keeps its {' and '.join(RESERVED_NETWORK_NAMES)} folders beside the networks' folders)",
                       "give the network another name")
    check_named_paths(net)
    return Config(
        net=net,
        cni_version=version,
        runtime=_runtime_config(raw.get("runtimeConfig")),
        prev_result=_optional_object(raw, "prevResult"),
        args=_optional_object(raw, "args"),
        valid_attachments=_attachments(raw),
    )


def load_for_teardown(raw: dict) -> Config:
    """DEL's config: the validated one when it passes, else just enough to find the state.

    A failed DEL wedges the pod (containerd 1.6 keeps the sandbox UNKNOWN and never runs the
    primary plugin's DEL), so a config this version would refuse on ADD (a newer version's key
    after a rollback, a hand edit, a value out of range) must not stop teardown: the attachment's
    own state says what to undo. Only the two values that locate the state are checked, and
    only for what would be unsafe (a network name or stateDir that leaves the state folder).
    """
    try:
        return load(raw)
    except CniError as exc:
        if exc.code != INVALID_CONFIG:
            raise
        refused = exc.msg
    version = versions.require_supported(raw.get("cniVersion", ""))
    try:
        runtime = _runtime_config(raw.get("runtimeConfig"))
    except CniError:
        runtime = RuntimeConfig()  # teardown never uses the runtime's per-call values
    net = teardown_network(raw)
    return Config(net=net, cni_version=version, runtime=runtime, prev_result=None, args=None,
                  valid_attachments=None, refused=refused)


def teardown_network(raw: dict) -> NetConfig:
    """The network name and stateDir from an unvalidated config, checked as the model would,
    plus the teardown defaults (the state's own recorded settings take precedence in commands/teardown.py).
    A reserved name passes here: an older version may have attached pods under it, and DEL must
    still find their state."""
    name = raw.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= 128 or name[0] in "_.-" \
            or not all(c in NETWORK_NAME_CHARS for c in name):
        raise CniError(INVALID_CONFIG, f"invalid network config: name {str(name)[:80]!r} is not a network name; "
                       "DEL cannot find this network's state")
    state_dir = raw.get("stateDir", DEFAULT_STATE_DIR)
    if not plain_absolute(state_dir):
        raise CniError(INVALID_CONFIG, f"invalid network config: stateDir {str(state_dir)[:80]!r} is not an "
                       "absolute path without '..'; DEL cannot find this network's state")
    trusted_state_dir(state_dir)  # state others could have written is never acted on
    net = dict(TEARDOWN_DEFAULTS, name=name, stateDir=state_dir, mode="auto", rails=None, ipam=None,
               resourceName=None)
    net["lockTimeoutSeconds"] = _lock_timeout(raw)
    return NetConfig(net)


def _validated_network(raw: dict) -> dict:
    """The model's verdict on the network config, from the cache when it has it.

    Nothing is made on the disk before the config passes: the cache is read only from a stateDir
    that passes trusted_paths (a missing one is simply a miss), and its folders and the fill lock
    are made only for a config the model accepted."""
    identity = {k: v for k, v in raw.items() if k not in RUNTIME_KEYS}
    # The version is part of the key: an upgrade that adds keys or changes defaults must not be
    # served a config normalised by the previous version.
    digest = sha256(f"{__version__}\n{_canonical(identity)}".encode()).hexdigest()
    state_dir = raw.get("stateDir", DEFAULT_STATE_DIR)
    if not plain_absolute(state_dir):
        return validate_with_model(identity)  # refuses it, naming stateDir
    cache_dir = f"{state_dir}/{CACHE_FOLDER}"
    path = f"{cache_dir}/{digest}.json"
    if trusted_state_dir(state_dir):
        cached = fsutil.read_json(path)
        if isinstance(cached, dict):
            return cached
    # A new config meets a burst of pods: one process validates (~0.15 s of CPU) while the others
    # wait for its verdict, instead of every one of them importing pydantic on a busy node.
    with _CacheFillLock(state_dir, _lock_timeout(raw)) as held:
        if held:
            cached = fsutil.read_json(path)
            if isinstance(cached, dict):
                return cached
        net = validate_with_model(identity)
        _store_verdict(state_dir, cache_dir, path, net)
    return net


def plain_absolute(path: object) -> bool:
    """The model's rule for stateDir (and the publish folders): absolute, no NUL, no '..'."""
    return isinstance(path, str) and path.startswith("/") and "\0" not in path and ".." not in path.split("/")


def trusted_state_dir(state_dir: str) -> bool:
    """True when stateDir exists and nobody but root can change it, False when it is missing
    (the plugin makes it at the first ADD); CniError(INVALID_CONFIG) when it is refused."""
    return _checked_path("stateDir", state_dir, trusted_paths.check_folder)


def _checked_path(key: str, path: str, check: object) -> bool:
    try:
        return bool(check(path))  # type: ignore[operator]
    except trusted_paths.Untrusted as exc:
        raise CniError(INVALID_CONFIG, f"invalid network config: {key} {path[:200]!r} is refused: {exc}",
                       "name a path that only root can change (docs/security.md, \"Paths a config names\")") from None
    except OSError as exc:  # EACCES, ELOOP on the way: unusable either way
        raise CniError(INVALID_CONFIG, f"invalid network config: {key} {path[:200]!r} cannot be checked: "
                       f"{exc.strerror or exc}") from None


def check_named_paths(net: NetConfig) -> None:
    """The folders and the FIFO a validated config names, checked on every call (the disk changes;
    the verdict cache does not): podInfoDir and, when it publishes, cdiSpecDir; eventsFifo.
    Missing ones pass (the plugin makes the folders; no FIFO means no daemon reading)."""
    if net.pod_info_dir:
        _checked_path("podInfoDir", net.pod_info_dir, trusted_paths.check_folder)
        _checked_path("cdiSpecDir", net.cdi_spec_dir, trusted_paths.check_folder)
    fifo = net.source.get("eventsFifo")
    if fifo:
        _checked_path("eventsFifo", fifo, trusted_paths.check_fifo)


def _lock_timeout(raw: dict) -> float:
    """How long to wait for a concurrent call: the config's lockTimeoutSeconds, if sane."""
    timeout = raw.get("lockTimeoutSeconds")
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 < timeout <= 600:
        return float(timeout)
    return float(TEARDOWN_DEFAULTS["lockTimeoutSeconds"])


def _store_verdict(state_dir: str, cache_dir: str, path: str, net: dict) -> None:
    """Keep an accepted config's verdict, and make the fill lock the next new config waits on."""
    try:
        fsutil.ensure_private_dir(state_dir)
        fsutil.ensure_private_dir(cache_dir)
        fsutil.ensure_private_dir(f"{state_dir}/locks")
        posix.close(posix.open(f"{state_dir}/locks/{CACHE_FOLDER}.fill",
                               posix.O_RDWR | posix.O_CREAT | posix.O_NOFOLLOW | posix.O_CLOEXEC, 0o600))
        fsutil.write_json_atomic(path, net)
    except OSError:
        return  # the cache is an optimisation; an unusable state folder is reported by ADD itself
    expire_cache(cache_dir, CACHE_KEEP)


def expire_cache(cache_dir: str, keep: int) -> None:
    """Keep the `keep` most recently written verdicts (runs on a cache miss only, under the fill
    lock). A dropped verdict costs its config one more validation, never a wrong answer."""
    try:
        entries = [e for e in posix.scandir(cache_dir) if e.name.endswith(".json")]
        if len(entries) <= keep:
            return
        entries.sort(key=lambda e: e.stat(follow_symlinks=False).st_mtime, reverse=True)
        for entry in entries[keep:]:
            posix.unlink(entry.path)
    except OSError:
        pass


class _CacheFillLock:
    """flock on <stateDir>/locks/verified-configs.fill (beside the attachment locks, whose names
    have a ':'), waited for at most `timeout` seconds: a holder that hangs (stopped, or stuck on a
    dead disk) must not hang CHECK and DEL behind it, so at the deadline this call validates
    without the cache lock, which costs only CPU. The lock file is made with an accepted config's
    verdict (_store_verdict), never before validation: without it (the first config a state folder
    sees) every process validates for itself. `with` gives True when the lock is held."""

    def __init__(self, state_dir: str, timeout: float) -> None:
        self.path, self.timeout = f"{state_dir}/locks/{CACHE_FOLDER}.fill", timeout
        self.fd = -1

    def __enter__(self) -> bool:
        from time import monotonic

        start = monotonic()
        try:
            fd = posix.open(self.path, posix.O_RDWR | posix.O_NOFOLLOW | posix.O_CLOEXEC)
        except OSError:
            return False
        try:
            taken = fsutil.flock_polled(fd, start + self.timeout, 0.05)
        except OSError:
            return False  # fd closed by flock_polled
        if taken is None:  # fd closed
            import sys

            sys.stderr.write(f"rdma-netns: another call held {self.path} for {self.timeout:.1f} s; "
                             "validating this config without waiting for its verdict\n")
            return False
        self.fd = fd
        return True

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            posix.close(self.fd)
            self.fd = -1


def _canonical(value: object) -> str:
    """Deterministic JSON (keys sorted at every level) so equal configs hash equally."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{jsonio.dumps(str(k))}:{_canonical(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_canonical(v) for v in value) + "]"
    return jsonio.dumps(value)


def validate_with_model(identity: dict) -> dict:
    """Full validation through the pydantic model (imported only here, on a cache miss)."""
    from pydantic import ValidationError

    from rdma_netns.config import model

    try:
        return model.validate(identity)
    except ValidationError as exc:
        raise CniError(INVALID_CONFIG, f"invalid network config: {model.describe_errors(exc)}") from None


def _optional_object(raw: dict, key: str) -> dict | None:
    value = raw.get(key)
    if value is not None and not isinstance(value, dict):
        raise CniError(INVALID_CONFIG, f"{key} must be a JSON object")
    return value


def _attachments(raw: dict) -> set[tuple[str, str]] | None:
    key = "cni.dev/valid-attachments" if "cni.dev/valid-attachments" in raw else "cni.dev/attachments"
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, list):
        raise CniError(INVALID_CONFIG, f"{key} must be a list")
    out = set()
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("containerID"), str) \
                or not isinstance(item.get("ifname"), str):
            raise CniError(INVALID_CONFIG, f"{key}: every entry needs string containerID and ifname")
        out.add((item["containerID"], item["ifname"]))
    return out


def apply_cni_args(cfg: Config, cni_args: dict[str, str]) -> None:
    """Runtimes without capabilities send a static MAC as CNI_ARGS MAC= (Podman 4 does);
    runtimeConfig.mac wins when both are given."""
    mac = cni_args.get("MAC")
    if mac and cfg.runtime.mac is None:
        if not _valid_mac(mac):
            raise CniError(INVALID_ENV, f"CNI_ARGS MAC={mac[:80]!r} is not a MAC address")
        cfg.runtime.mac = mac.lower()


def _runtime_config(value: object) -> RuntimeConfig:
    if value is None:
        return RuntimeConfig()
    if not isinstance(value, dict):
        raise CniError(INVALID_CONFIG, "runtimeConfig must be a JSON object")
    rc = RuntimeConfig()
    device_id = value.get("deviceID")
    if device_id is not None:
        if not isinstance(device_id, str) or not _valid_device_id(device_id):
            raise CniError(INVALID_CONFIG, f"runtimeConfig.deviceID {str(device_id)[:80]!r} is not a PCI address "
                           "or device name")
        rc.device_id = device_id
    ips = value.get("ips")
    if ips is not None:
        if not isinstance(ips, list) or not all(isinstance(i, str) for i in ips):
            raise CniError(INVALID_CONFIG, "runtimeConfig.ips must be a list of strings")
        from rdma_netns.kernel.inet import Prefix  # only runtimes that pin IPs pay for it

        for ip in ips:
            try:
                Prefix.parse(ip)
            except ValueError:
                raise CniError(INVALID_CONFIG, f"runtimeConfig.ips: {ip[:80]!r} is not an IP address") from None
        rc.ips = ips
    mac = value.get("mac")
    if mac is not None:
        if not isinstance(mac, str) or not _valid_mac(mac):
            raise CniError(INVALID_CONFIG, f"runtimeConfig.mac {str(mac)[:80]!r} is not a MAC address")
        rc.mac = mac.lower()
    return rc
