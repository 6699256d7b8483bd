"""`rdma-netns status`: one read-only look at the whole node, every problem with its fix.

Why one command: an RDMA pod needs seven parts to agree (the kernel's mode, the NICs and their GID
tables, the chained entry, the launcher, the device plugin, kubelet, the grants broker), and each
has its own place to look. This module gathers what the checks share (Context: the paths, the
rdma-netns config found on the node, the attachment states) and runs the checks, which live in
status_hw (Kernel, Devices, Rails), status_conf (Chained entry, Launcher), status_services
(Device plugin, Pairing) and status_attach (Attachments); status_render prints them.

States. "fail": an RDMA pod started now would not get working rails, or kubelet would not give it
`rdma/hca` (the exit code is 1). "warn": the node works but something needs a look (leftovers,
a GID table nearly full, a primary changed since the insert, a broker missing while the CNI can
still ask kubelet itself). "ok": fine, or not used.

Not used, the rules:
- Chained entry: required when --entry is given (it must be in the runtime's primary and equal
  the file: what the DaemonSet writes) or when the cni-conf record says it was inserted (then a
  missing entry means the watch is not keeping it). With neither and no entry in the primary the
  node does not chain rdma-netns (Multus, the standalone conflist, or the DaemonSet's switch set
  to "false"): ok, "not used". An entry present without a record is ok (written by an older
  install or by hand). A primary whose bytes differ from the recorded ones: warn.
- Launcher: required when any rdma-netns config is on the node (else its absence is a warn).
- Device plugin: required when the config names a resourceName, when --resource is given, or
  when a socket of ours is in kubelet's device-plugins folder; else "not deployed" is ok.
- Broker: used when the config names a resourceName and a podGrantsSocket; absent is a warn (the
  CNI then asks kubelet directly: slower, never wrong), a broker that cannot reach kubelet fails.
- Leftovers (a state whose netns is gone, a host-local lease without state) are warnings: they
  hold an address or files, not a working pod's rails.

Read-only: files are read, sockets connected to (each call bounded by Options.timeout), the
launcher run with CNI_COMMAND=VERSION and with --version (neither writes). No lock is taken and
no namespace entered.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rdma_netns.admin import cni_conf
from rdma_netns.config.defaults import DEFAULT_POD_GRANTS_SOCKET, DEFAULT_STATE_DIR
from rdma_netns.kernel.rdma_devices import DeviceSysfs, RdmaDevice
from rdma_netns.state import AttachmentState, all_records, read_state

OK, WARN, FAIL = "ok", "warn", "fail"
GROUPS = ("Kernel", "Devices", "Rails", "Chained entry", "Launcher", "Device plugin", "Pairing", "Attachments")
DEFAULT_CNI_STATE_DIR = DEFAULT_STATE_DIR
DEFAULT_IPAM_DIR = "/var/lib/cni/networks"
DEFAULT_RESOURCE = "rdma/hca"


@dataclass
class Check:
    """One finding: where it belongs, ok/warn/fail, what was seen, and how to fix it."""

    group: str
    name: str
    state: str
    detail: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"group": self.group, "name": self.name, "state": self.state, "detail": self.detail,
                "fix": self.fix, "data": self.data}


@dataclass
class Options:
    """Where each part lives (the real host paths by default); None: from the config, else the default."""

    sysfs_root: str = "/sys"
    cni_conf_dir: str = "/etc/cni/net.d"
    cni_conf_state_dir: str = cni_conf.DEFAULT_STATE_DIR
    cni_bin_dir: str = "/opt/cni/bin"
    state_dir: str | None = None
    ipam_dir: str | None = None
    kubelet_dir: str = "/var/lib/kubelet"
    pod_grants_socket: str | None = None
    resources: list[str] = field(default_factory=list)
    entry: dict | None = None          # --entry's content (what the DaemonSet would write)
    entry_path: str | None = None
    modprobe_file: str = "/etc/modprobe.d/rdma-netns.conf"
    timeout: float = 1.5               # each socket call


@dataclass
class Attachment:
    """One CNI state file (its record None when unreadable)."""

    network: str
    container_id: str
    ifname: str
    path: str
    state: AttachmentState | None


class Context:
    """What several checks need, read once: the primary CNI config, our config, the states."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.sysfs = DeviceSysfs(opts.sysfs_root)
        self.conf_dir = Path(opts.cni_conf_dir)
        self.record_state = cni_conf.State(Path(opts.cni_conf_state_dir))
        self.primary: str | None = cni_conf.find_primary(self.conf_dir)
        self.primary_bytes: bytes | None = None
        self.primary_doc: dict | None = None
        self.primary_error: str | None = None
        self._read_primary()
        self.chained: list[dict] = [p for p in (self.primary_doc or {}).get("plugins", [])
                                    if isinstance(p, dict) and p.get("type") == cni_conf.PLUGIN_TYPE] \
            if self.primary_doc and isinstance(self.primary_doc.get("plugins"), list) else []
        self.standalone: list[tuple[str, dict]] = self._standalone()
        self.config, self.config_source, self.config_chained = self._config()
        self.attachments: list[Attachment] = self._attachments()
        self._devices: list[RdmaDevice] | None = None

    def devices(self) -> list[RdmaDevice]:
        """The RDMA devices visible here, read once."""
        if self._devices is None:
            self._devices = self.sysfs.devices()
        return self._devices

    # --- the rdma-netns config in effect ---------------------------------------------------------
    def _read_primary(self) -> None:
        if self.primary is None:
            return
        try:
            self.primary_bytes = (self.conf_dir / self.primary).read_bytes()
            self.primary_doc = cni_conf.parse(self.primary_bytes, self.primary)
        except OSError as exc:
            self.primary_error = f"cannot read {self.primary}: {exc.strerror or exc}"
        except cni_conf.CniConfError as exc:
            self.primary_error = str(exc)

    def _standalone(self) -> list[tuple[str, dict]]:
        """Conflists holding only rdma-netns (the DaemonSet's INSTALL_CONFLIST, or for Multus)."""
        out = []
        for name in cni_conf.conf_files(self.conf_dir):
            if cni_conf.is_ours(self.conf_dir / name):
                try:
                    out.append((name, json.loads((self.conf_dir / name).read_bytes())))
                except (OSError, ValueError):
                    pass
        return out

    def _config(self) -> tuple[dict | None, str, bool]:
        """(plugin config with cniVersion and name, where it came from, chained?)."""
        top = self.primary_doc or {}
        if self.chained:
            return (dict(self.chained[-1], cniVersion=top.get("cniVersion"), name=top.get("name")),
                    f"the entry in {self.primary}", True)
        if self.opts.entry is not None:
            return (dict(self.opts.entry, cniVersion=top.get("cniVersion", "1.0.0"),
                         name=top.get("name", "rdma-netns")), f"--entry {self.opts.entry_path}", True)
        for name, doc in self.standalone:
            plugins = doc.get("plugins") if isinstance(doc.get("plugins"), list) else [doc]
            if plugins and isinstance(plugins[0], dict):
                return (dict(plugins[0], cniVersion=doc.get("cniVersion"), name=doc.get("name")),
                        f"the conflist {name}", False)
        return None, "no rdma-netns config on this node", False

    def setting(self, key: str, default: Any = None) -> Any:
        return (self.config or {}).get(key, default)

    @property
    def network(self) -> str | None:
        name = self.setting("name")
        return name if isinstance(name, str) and name else None

    @property
    def state_dir(self) -> str:
        return self.opts.state_dir or self.setting("stateDir") or DEFAULT_CNI_STATE_DIR

    @property
    def resources(self) -> list[str]:
        """The device plugin's resources asked for (--resource, else the config's); [] when neither says."""
        if self.opts.resources:
            return list(dict.fromkeys(self.opts.resources))
        return [self.setting("resourceName")] if self.setting("resourceName") else []

    @property
    def pod_grants_socket(self) -> str:
        if self.opts.pod_grants_socket is not None:
            return self.opts.pod_grants_socket
        return self.setting("podGrantsSocket", DEFAULT_POD_GRANTS_SOCKET)

    @property
    def pod_resources_socket(self) -> str:
        return os.path.join(self.opts.kubelet_dir, "pod-resources", "kubelet.sock")

    def rail_entries(self) -> list[dict]:
        rails = self.setting("rails")
        return [r for r in rails if isinstance(r, dict)] if isinstance(rails, list) else []

    # --- attachments -----------------------------------------------------------------------------
    def _attachments(self) -> list[Attachment]:
        return [Attachment(network, cid, ifname, path, read_state(path))
                for network, cid, ifname, path in all_records(self.state_dir)]


def collect(opts: Options) -> list[Check]:
    """Every check, in GROUPS order."""
    from rdma_netns.admin import status_attach, status_conf, status_hw, status_services

    ctx = Context(opts)
    checks: list[Check] = []
    for part in (status_hw.kernel, status_hw.devices, status_hw.rails, status_conf.chained_entry,
                 status_conf.launcher, status_services.device_plugin, status_services.pairing,
                 status_attach.attachments):
        checks += part(ctx)
    return checks


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.state == FAIL for c in checks) else 0
