"""`rdma-netns uninstall-node`: take everything of rdma-netns off a node, in the order that never
leaves a CNI config naming a missing executable.

1. Refuse while attachments exist (their DEL needs the executable and the state), unless --force.
2. The chained entry out of the primary CNI config, byte for byte as its CNI wrote it
   (cni_conf.remove), and a standalone conflist that holds only rdma-netns.
3. The launcher in the CNI bin folder (only if it is ours), then the release folders.
4. State and run-time files: the CNI state, the cni-conf record, the grants broker's folder, the
   CDI specs (the device plugin's and the pods'), the device plugin's sockets.

Every path is given relative to a host root, so the DaemonSet's uninstall pod (which sees the node
under /host) and a shell on the node run the same code.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from rdma_netns.admin import cni_conf
from rdma_netns.state import all_records

LAUNCHER_MARK = "rdma-netns launcher"


@dataclass
class NodePaths:
    """Where each part lives on the node (as the DaemonSet and install.sh put them), under `root`."""

    root: Path
    conf_dir: str = "/etc/cni/net.d"
    cni_bin_dir: str = "/opt/cni/bin"
    releases: str = "/opt/rdma-netns-ds"
    cni_state: str = "/var/lib/cni/rdma-netns"
    cni_conf_state: str = "/var/lib/rdma-netns"
    run_dir: str = "/run/rdma-netns"
    cdi_dir: str = "/var/run/cdi"
    kubelet_dir: str = "/var/lib/kubelet"

    def at(self, path: str) -> Path:
        return self.root / path.lstrip("/")


def attachments(paths: NodePaths) -> list[str]:
    """Attachment records still in the CNI state (network/containerID:ifname.json)."""
    records = all_records(str(paths.at(paths.cni_state)))
    return [f"{network}/{cid}:{ifname}.json" for network, cid, ifname, _path in records]


def _ours_only(path: Path) -> bool:
    """A standalone conflist whose every plugin is rdma-netns (INSTALL_CONFLIST wrote it)."""
    try:
        types = cni_conf.plugin_types(cni_conf.parse(path.read_bytes(), path.name))
    except (OSError, ValueError):
        return False
    return bool(types) and all(t == cni_conf.PLUGIN_TYPE for t in types)


def _remove(path: Path, done: list[str]) -> None:
    if path.is_symlink() or path.is_file() or path.is_socket():
        path.unlink()
        done.append(str(path))
    elif path.is_dir():
        shutil.rmtree(path)
        done.append(str(path) + "/")


def uninstall(paths: NodePaths, force: bool = False) -> tuple[int, list[str]]:
    """(exit status, what was removed or why not)."""
    left = attachments(paths)
    if left and not force:
        return 1, [f"{len(left)} attachment(s) still have rails: {', '.join(left[:5])}"
                   + (" ..." if len(left) > 5 else ""),
                   "delete the pods that use rdma/hca first (their DEL needs the plugin), or --force"]
    done: list[str] = []
    conf_dir = paths.at(paths.conf_dir)
    if conf_dir.is_dir():
        state = cni_conf.State(paths.at(paths.cni_conf_state) / "cni-conf")
        if cni_conf.remove(conf_dir, state) in ("restored", "removed-entry"):
            done.append(f"the {cni_conf.PLUGIN_TYPE} entry of {cni_conf.find_primary(conf_dir)}")
        for name in cni_conf.conf_files(conf_dir):
            if _ours_only(conf_dir / name):
                _remove(conf_dir / name, done)
    launcher = paths.at(paths.cni_bin_dir) / "rdma-netns"
    if launcher.is_file():
        head = launcher.read_bytes()[:512].decode(errors="replace")
        if LAUNCHER_MARK in head:
            _remove(launcher, done)
        else:
            done.append(f"kept {launcher}: not written by install-launcher")
    _remove(paths.at(paths.releases), done)
    for folder in (paths.cni_state, paths.cni_conf_state, paths.run_dir):
        _remove(paths.at(folder), done)
    cdi = paths.at(paths.cdi_dir)
    if cdi.is_dir():
        for spec in sorted(cdi.glob("rdma-netns-*.json")):
            _remove(spec, done)
    kubelet = paths.at(paths.kubelet_dir)
    for pattern in ("device-plugins/rdma-netns-*.sock", "plugins_registry/rdma-netns*"):
        for path in sorted(kubelet.glob(pattern)) if kubelet.is_dir() else []:
            _remove(path, done)
    return 0, done
