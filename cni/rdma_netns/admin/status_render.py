"""`rdma-netns status [--json]`: its flags, and the checks as one screen of text or as JSON.

Kept apart from the checks (status.py and friends) so cli.py needs two lines for the command and
the parser costs no import of the checks until `status` runs.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

LABEL = {"ok": "ok", "warn": "WARN", "fail": "FAIL"}
NAME_WIDTH = 22


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="one read-only look at the node: kernel mode, devices, rails and their GID "
                       "tables, the chained entry, the launcher, the device plugin, kubelet, the grants broker, "
                       "attachments and leftovers; each problem with its fix; exit 1 when something fails")
    p.add_argument("--json", action="store_true", help="print {\"ok\": ..., \"checks\": [...]}")
    p.add_argument("--entry", metavar="FILE", help="the entry the DaemonSet writes (its ConfigMap's "
                   "rdma-netns-chained-entry.json): the primary must hold exactly this")
    p.add_argument("--resource", action="append", default=[], metavar="NAME",
                   help="extended resource the device plugin serves (repeatable; default: the config's "
                        "resourceName, else rdma/hca)")
    where = p.add_argument_group("where things are (defaults: the node's own paths)")
    where.add_argument("--sysfs-root", default="/sys")
    where.add_argument("--cni-conf-dir", default="/etc/cni/net.d")
    where.add_argument("--cni-conf-state-dir", default="/var/lib/rdma-netns/cni-conf")
    where.add_argument("--cni-bin-dir", default="/opt/cni/bin")
    where.add_argument("--state-dir", help="the CNI's state (default: the config's stateDir, else "
                       "/var/lib/cni/rdma-netns)")
    where.add_argument("--ipam-dir", help="host-local's dataDir (default: the config's, else /var/lib/cni/networks)")
    where.add_argument("--kubelet-dir", default="/var/lib/kubelet")
    where.add_argument("--pod-grants-socket", help="the grants broker (default: the config's podGrantsSocket, "
                       "else /run/rdma-netns/pod-grants.sock)")
    where.add_argument("--modprobe-file", default="/etc/modprobe.d/rdma-netns.conf")
    where.add_argument("--containerd-config", default="/etc/containerd/config.toml",
                       help="containerd's config, for its CDI setting (default %(default)s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rdma_netns.admin import cni_conf, status
    from rdma_netns.admin.status_context import Options

    entry = None
    if args.entry:
        try:
            entry = cni_conf.load_entry(Path(args.entry))
        except cni_conf.CniConfError as exc:
            print(f"status: {exc}", file=sys.stderr)
            return 2
    opts = Options(sysfs_root=args.sysfs_root, cni_conf_dir=args.cni_conf_dir,
                   cni_conf_state_dir=args.cni_conf_state_dir, cni_bin_dir=args.cni_bin_dir,
                   state_dir=args.state_dir, ipam_dir=args.ipam_dir, kubelet_dir=args.kubelet_dir,
                   pod_grants_socket=args.pod_grants_socket, resources=args.resource, entry=entry,
                   entry_path=args.entry, modprobe_file=args.modprobe_file,
                   containerd_config=args.containerd_config)
    checks = status.collect(opts)
    code = status.exit_code(checks)
    if args.json:
        json.dump({"ok": code == 0, "checks": [c.to_json() for c in checks]}, sys.stdout, indent=2)
        print()
    else:
        print(text(checks, code))
    return code


def text(checks: list, code: int) -> str:
    """Grouped lines, `STATE  name  detail`, each problem followed by its `fix:` line."""
    from rdma_netns import __version__
    from rdma_netns.admin.status_context import GROUPS

    width = min(NAME_WIDTH, max((len(c.name) for c in checks), default=0))
    pad = " " * (4 + 2 + width + 2)
    lines = [f"rdma-netns {__version__} status of {socket.gethostname()}"]
    for group in GROUPS:
        items = [c for c in checks if c.group == group]
        if not items:
            continue
        lines.append(group)
        for c in items:
            lines.append(f"  {LABEL[c.state]:<4}  {c.name:<{width}}  {c.detail}")
            if c.fix and c.state != "ok":
                lines.append(f"  {pad}fix: {c.fix}")
    fails = sum(c.state == "fail" for c in checks)
    warns = sum(c.state == "warn" for c in checks)
    if fails or warns:
        lines.append(f"{fails} failing, {warns} warning(s): exit {code}")
    else:
        lines.append("all ok")
    return "\n".join(lines)
