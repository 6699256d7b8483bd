"""What `rdma-netns status`'s checks share: findings (Check, its states), the paths (Options), the
node's rdma-netns config and attachment states read once (Context).

A module of its own so that status.py (which runs the checks) and the check modules
(status_hw, status_conf, status_services, status_attach) both import it, and neither imports the
other: no import circle.
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
GROUPS = ("Kernel", "Devices", "Rails", "Chained entry", "Runtime", "Launcher", "Device plugin", "Pairing", "Attachments")
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
    containerd_config: str = "/etc/containerd/config.toml"
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
