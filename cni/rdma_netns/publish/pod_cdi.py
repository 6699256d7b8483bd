"""Publish what a pod's containers need to use their rails, where a runtime reads it.

After ADD: `<podInfoDir>/<containerID>/<ifname>.json` (pod_info.record; folder 0755, file 0644 so
a container user can read it) and, with pairing, one CDI spec per granted unit,
`<cdiSpecDir>/rdma-netns-pod-<unit>.json`: kubelet hands the runtime the name `<cdiKind>=<unit>`
(the device plugin's Allocate) and the runtime reads the spec when it creates each container,
which is after the pod's network exists. The spec sets the env, bind-mounts the JSON file
read-only at pod_info.RAILS_FILE and the NCCL settings (`<ifname>.nccl.conf` beside it) at
pod_info.NCCL_CONF, and adds the rails' RDMA char devices.

CDI version 0.5.0 and no annotations: Podman 4.3 (and every runtime on the CDI library before
v0.6) refuses a 0.6.0 spec, and a 0.5.0 spec with `annotations`, as unresolvable. A spec's
owner is therefore the attachment whose JSON file it mounts (the path names the container ID
and ifname): DEL removes a spec only while it still mounts its own file, so a unit kubelet has
meanwhile given to a newer pod keeps the newer pod's spec. The device plugin's placeholder
(devices only, no mount) belongs to no attachment.

Where the files went is recorded in the attachment's state before they are written, so DEL,
rollback and GC remove them from the state alone.
"""

from __future__ import annotations

import posix

from rdma_netns import testhooks
from rdma_netns.publish import pod_info
from rdma_netns.util import fsutil, jsonio, paths, trusted_paths

CDI_VERSION = "0.5.0"
SPEC_PREFIX = "rdma-netns-pod-"
RDMA_CM = "rdma_cm"
# Tests point this at a fake /dev (like RDMA_NETNS_SYSFS_ROOT for sysfs); only a test build
# honours the variable (testhooks.py).
DEV_ROOT = testhooks.get(testhooks.DEV_ROOT) or "/dev"
_UNIT_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:-")


def info_path(pod_info_dir: str, container_id: str, ifname: str) -> str:
    return f"{pod_info_dir}/{container_id}/{ifname}.json"


def spec_path(spec_dir: str, unit: str) -> str:
    return f"{spec_dir}/{SPEC_PREFIX}{unit}.json"


def valid_unit(unit: object) -> bool:
    """A unit ID usable as a CDI device name and in a file name (kubelet's, but never trusted)."""
    return isinstance(unit, str) and 0 < len(unit) <= 128 and unit[0].isalnum() and set(unit) <= _UNIT_CHARS


def plan(pod_info_dir: str, spec_dir: str, kind: str, container_id: str, ifname: str,
         units: list[str]) -> dict | None:
    """What ADD will publish (recorded in the state first); None when publishing is off."""
    if not pod_info_dir:
        return None
    return {"podInfoFile": info_path(pod_info_dir, container_id, ifname), "cdiKind": kind,
            "cdiSpecs": [{"unit": u, "path": spec_path(spec_dir, u)} for u in dict.fromkeys(units) if valid_unit(u)]}


def device_nodes(devices: list[str], uverbs: dict[str, list], dev_root: str = "") -> list[dict]:
    """CDI device nodes for the rails' RDMA devices: each one's uverbs char device, and rdma_cm
    where the node has it (rdma_ucm loaded: a node without it still runs verbs, and a node the
    runtime cannot find fails the container).
    `uverbs`: RdmaSysfs.char_devices("infiniband_verbs") (device -> [(uverbsN, port)])."""
    root = dev_root or DEV_ROOT
    names = [entry[0] for device in dict.fromkeys(devices) for entry in uverbs.get(device) or []]
    if not devices:
        return []
    if paths.exists(f"{root}/infiniband/{RDMA_CM}"):
        names.append(RDMA_CM)
    return [{"path": f"/dev/infiniband/{n}", "hostPath": f"{root}/infiniband/{n}", "permissions": "rw"}
            for n in names]


def nccl_conf_path(info_file: str) -> str:
    """The attachment's NCCL settings file, beside its JSON file (so DEL and GC find it from that)."""
    return info_file.removesuffix(".json") + ".nccl.conf"


def build_spec(kind: str, unit: str, info_file: str, env: dict[str, str], nodes: list[dict]) -> dict:
    """The unit's container edits: env (but NCCL's settings, mounted as NCCL's own file so the pod
    spec's values win: pod_info.NCCL_CONF), the char devices, the JSON file."""
    nccl, rest = pod_info.split_env(env)
    edits: dict[str, object] = {"env": [f"{k}={v}" for k, v in sorted(rest.items())]}
    if nodes:
        edits["deviceNodes"] = nodes
    edits["mounts"] = [{"hostPath": info_file, "containerPath": pod_info.RAILS_FILE, "options": ["ro", "bind"]}]
    if nccl:
        edits["mounts"].append({"hostPath": nccl_conf_path(info_file), "containerPath": pod_info.NCCL_CONF,
                                "options": ["ro", "bind"]})
    return {"cdiVersion": CDI_VERSION, "kind": kind, "devices": [{"name": unit, "containerEdits": edits}]}


def placeholder_spec(kind: str, unit: str, nodes: list[dict]) -> dict:
    """The device plugin's spec for a unit no CNI ADD has published (a hostNetwork pod): the
    devices only, so the runtime can resolve the name; the CNI's ADD replaces it."""
    edits: dict[str, object] = {"deviceNodes": nodes} if nodes else {"env": ["RDMA_NETNS_POD_INFO=none"]}
    return {"cdiVersion": CDI_VERSION, "kind": kind, "devices": [{"name": unit, "containerEdits": edits}]}


def mounted_file(spec: object) -> str | None:
    """The JSON file a spec mounts (its owner), None for a placeholder or something else."""
    try:
        for device in spec["devices"]:  # type: ignore[index]
            for mount in device["containerEdits"].get("mounts") or []:
                if mount.get("containerPath") == pod_info.RAILS_FILE:
                    return mount.get("hostPath")
    except (TypeError, KeyError, AttributeError):
        return None
    return None


def _ensure_dir(path: str) -> None:
    """A world-readable folder (runtimes and container users read below it), made 0755 when
    missing; an existing one is used only when nobody but root can change it (util/trusted_paths.py)."""
    trusted_paths.make_folder(path, 0o755)


def publish(published: dict, record: dict, nodes: list[dict]) -> None:
    """Write the JSON file, then the specs that mount it (OSError on failure: ADD rolls back)."""
    info = published["podInfoFile"]
    _ensure_dir(paths.dirname(paths.dirname(info)))
    _ensure_dir(paths.dirname(info))
    fsutil.write_atomic(info, (jsonio.dumps(record) + "\n").encode(), 0o644)
    nccl, _rest = pod_info.split_env(record["env"])
    if published.get("cdiSpecs") and nccl:  # read only through the specs' mount
        fsutil.write_atomic(nccl_conf_path(info), pod_info.nccl_conf(nccl).encode(), 0o644)
    for spec in published.get("cdiSpecs") or []:
        _ensure_dir(paths.dirname(spec["path"]))
        content = build_spec(published.get("cdiKind") or "rdma-netns.io/pod", spec["unit"], info,
                             record["env"], nodes)
        fsutil.write_atomic(spec["path"], (jsonio.dumps(content) + "\n").encode(), 0o644)


def unpublish(published: object) -> list[str]:
    """Remove what `published` (the state's record) names: each spec only while it still mounts
    this attachment's file, then the file and its folder when empty. Returns the failures."""
    if not isinstance(published, dict):
        return []
    info = published.get("podInfoFile")
    errors: list[str] = []
    for spec in published.get("cdiSpecs") or []:
        path = spec.get("path") if isinstance(spec, dict) else None
        if not isinstance(path, str) or not path:
            continue
        if mounted_file(fsutil.read_json(path)) != info:
            continue  # gone, the device plugin's placeholder, or a newer pod's
        try:
            fsutil.remove(path)
        except OSError as exc:
            errors.append(f"cannot remove CDI spec {path}: {exc.strerror or exc}")
    if isinstance(info, str) and info:
        for path in (nccl_conf_path(info), info):
            try:
                fsutil.remove(path)
            except OSError as exc:
                errors.append(f"cannot remove {path}: {exc.strerror or exc}")
        _remove_empty(paths.dirname(info))
    return errors


def _remove_empty(folder: str) -> None:
    try:
        posix.rmdir(folder)
    except OSError:
        pass  # not empty (another attachment's file), or gone: either is fine


def sweep(pod_info_dir: str, spec_dir: str, network: str, keep: set[tuple[str, str]]) -> list[str]:
    """GC: remove this network's files of attachments not in `keep` (and specs mounting them),
    and specs whose mounted file under pod_info_dir is gone. Returns what it removed."""
    removed: list[str] = []
    if not pod_info_dir:
        return removed
    for container_id in _listdir(pod_info_dir):
        folder = f"{pod_info_dir}/{container_id}"
        for name in _listdir(folder):
            if not name.endswith(".json"):
                continue
            ifname = name[:-5]
            path = f"{folder}/{name}"
            value = fsutil.read_json(path)
            if not isinstance(value, dict) or value.get("network") != network or (container_id, ifname) in keep:
                continue
            for stale in (nccl_conf_path(path), path):
                if not paths.lexists(stale):
                    continue
                try:
                    fsutil.remove(stale)
                    removed.append(stale)
                except OSError:
                    pass
        _remove_empty(folder)
    prefix = f"{pod_info_dir}/"
    for name in _listdir(spec_dir):
        if not (name.startswith(SPEC_PREFIX) and name.endswith(".json")):
            continue
        path = f"{spec_dir}/{name}"
        info = mounted_file(fsutil.read_json(path))
        if isinstance(info, str) and info.startswith(prefix) and not paths.exists(info):
            try:
                fsutil.remove(path)
                removed.append(path)
            except OSError:
                pass
    return removed


def _listdir(path: str) -> list[str]:
    try:
        return sorted(posix.listdir(path))
    except OSError:
        return []
