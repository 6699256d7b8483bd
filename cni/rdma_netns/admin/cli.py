"""`rdma-netns <command>`: what a node admin runs by hand.

The same executable is the CNI plugin; it acts as the CLI when it is given arguments or when
CNI_COMMAND is not set.
"""

from __future__ import annotations

import argparse
import json
import sys

from rdma_netns import __version__


def _mode(args: argparse.Namespace) -> int:
    from rdma_netns.admin import mode

    if args.action == "set":
        if args.value is None:
            print("mode set: say shared or exclusive", file=sys.stderr)
            return 2
        status, text = mode.set_mode(args.value, args.persist or args.persist_only, args.modprobe_file,
                                     live=not args.persist_only)
    else:
        status, text = mode.show()
    print(text, file=sys.stdout if status == 0 else sys.stderr)
    return status


def _devices(args: argparse.Namespace) -> int:
    from rdma_netns.admin import devices

    rows = devices.collect(args.max_gids)
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        print()
    else:
        print(devices.table(rows))
    return 0


def _check_config(args: argparse.Namespace) -> int:
    """Validate a conflist or a single plugin config the way the CNI plugin will."""
    from pydantic import ValidationError

    from rdma_netns.config import model

    try:
        with open(args.file) as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        print(f"{args.file}: cannot read JSON: {exc}", file=sys.stderr)
        return 2
    entries = doc.get("plugins", [doc]) if isinstance(doc, dict) else []
    # A lone entry (a chained entry takes cniVersion and name from the conflist it is chained into).
    single = isinstance(doc, dict) and "plugins" not in doc
    ours = [dict(e, cniVersion=doc.get("cniVersion", e.get("cniVersion")), name=doc.get("name", e.get("name")))
            for e in entries if isinstance(e, dict) and e.get("type") == "rdma-netns"]
    if single:
        ours = [dict(e, cniVersion=e["cniVersion"] or "1.0.0", name=e["name"] or "chained-entry") for e in ours]
    if not ours:
        print(f"{args.file}: no plugin of type rdma-netns in it", file=sys.stderr)
        return 2
    status = 0
    for entry in ours:
        try:
            normalised = model.validate(entry)
            print(f"{args.file}: ok ({entry['name']})")
        except ValidationError as exc:
            print(f"{args.file}: {model.describe_errors(exc)}", file=sys.stderr)
            status = 1
            continue
        if args.node:
            from rdma_netns.admin import node_check

            fits, lines = node_check.describe(normalised)
            print(f"on this node ({'ok' if fits else 'ADD would fail'}):")
            print("\n".join(lines))
            status = status or (0 if fits else 1)
    return status


def _uninstall_node(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rdma_netns.admin import uninstall

    paths = uninstall.NodePaths(Path(args.host_root), conf_dir=args.conf_dir, cni_bin_dir=args.cni_bin_dir,
                                cdi_dir=args.cdi_dir)
    status, lines = uninstall.uninstall(paths, force=args.force)
    for line in lines:
        print(("removed " if status == 0 and not line.startswith("kept") else "") + line,
              file=sys.stdout if status == 0 else sys.stderr)
    if status == 0:
        print(f"uninstall-node: nothing of rdma-netns is left under {args.host_root}")
    return status


def _install_launcher(args: argparse.Namespace) -> int:
    from rdma_netns.admin import launcher

    try:
        problem = launcher.install(args.dest)
    except (OSError, ValueError) as exc:
        print(f"install-launcher: {exc}", file=sys.stderr)
        return 1
    if problem:
        print(f"install-launcher: {problem}", file=sys.stderr)
    print(f"wrote {args.dest}")
    return 0


def _cni_conf(args: argparse.Namespace) -> int:
    """Chain our entry into the node's primary CNI config (istio-cni / linkerd-cni convention)."""
    from pathlib import Path

    from rdma_netns.admin import cni_conf

    conf_dir, state = Path(args.conf_dir), cni_conf.State(Path(args.state_dir))
    try:
        entry = cni_conf.load_entry(Path(args.entry)) if args.entry else None
        if args.action in ("insert", "watch") and entry is None:
            print(f"cni-conf {args.action}: --entry FILE is required", file=sys.stderr)
            return 2
        if args.action == "insert":
            result = cni_conf.insert(conf_dir, entry, state)
            if result == "no-primary":
                cni_conf.check_entry(entry)
                cni_conf.log(f"no primary CNI config in {conf_dir} yet: nothing to do "
                             "(`rdma-netns cni-conf watch` waits for one)")
            elif result == "unchanged":
                cni_conf.log(f"the {cni_conf.PLUGIN_TYPE} entry is already in {cni_conf.find_primary(conf_dir)}")
            return 0
        if args.action == "remove":
            result = cni_conf.remove(conf_dir, state)
            if result in ("absent", "no-primary"):
                cni_conf.log(f"no {cni_conf.PLUGIN_TYPE} entry to remove in {conf_dir}")
            return 0
        if args.action == "watch":
            ready = None
            if args.ready_file:
                from rdma_netns.admin.cni_conf_ready import ReadyFile

                ready = ReadyFile(args.ready_file, conf_dir, state, args.ready_interval,
                                  args.containerd_config).update
            return cni_conf.watch(conf_dir, entry, state, args.interval, args.keep_on_exit, ready)
        info = cni_conf.show(conf_dir, state)
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            print(f"primary: {info['primary'] or '-'}")
            print(f"entry: {'present' if info['entry'] else 'absent'}"
                  + ("" if info["valid"] is not False else " (the primary is not valid JSON)"))
            print(f"tracked: {'yes' if info['tracked'] else 'no'}")
            if info["runtimeUses"] != info["primary"]:
                print(f"note: the runtime uses {info['runtimeUses']} (it sorts first)")
        if args.require_entry or args.require_node_fit or args.containerd_config:
            # A readiness probe (a DaemonSet's reads `watch --ready-file` instead): pods started now
            # would get no rails, or every RDMA pod's ADD would fail while the node looks healthy.
            from rdma_netns.admin import cni_conf_ready

            found = cni_conf_ready.problems(conf_dir, state, entry=args.require_entry,
                                            node_fit=args.require_node_fit,
                                            containerd_config=args.containerd_config)
            if found:
                cni_conf.log("not ready: " + "\n".join(found))
                return 1
        return 0
    except cni_conf.CniConfError as exc:
        cni_conf.log(str(exc))
        return 1
    except OSError as exc:
        cni_conf.log(f"{exc}")
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rdma-netns",
        description="RDMA networking for Kubernetes pods without hostNetwork. Run by a container runtime "
                    "(CNI_COMMAND set) it is a CNI plugin; with a command it is this admin tool.")
    parser.add_argument("--version", action="version", version=f"rdma-netns {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("mode", help="show the kernel's RDMA network-namespace mode (and what blocks a change), "
                       "or set it: `mode set shared|exclusive [--persist]`")
    p.add_argument("action", nargs="?", choices=["show", "set"], default="show")
    p.add_argument("value", nargs="?", choices=["shared", "exclusive"])
    p.add_argument("--persist", action="store_true",
                   help="also write `options ib_core netns_mode=` to modprobe.d so the mode survives reboots")
    p.add_argument("--modprobe-file", default="/etc/modprobe.d/rdma-netns.conf", help=argparse.SUPPRESS)
    p.add_argument("--persist-only", action="store_true", help=argparse.SUPPRESS)  # install.sh --root
    p.set_defaults(func=_mode)
    p = sub.add_parser("devices", help="list the RDMA devices visible here, their ports, netdevs and GIDs; "
                       "run inside a pod, each port lists the pod's own GIDs first and marks the host's and "
                       "other namespaces' entries (a per-pod show_gids)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--max-gids", type=int, default=64, metavar="N",
                   help="GID entries to read per port (default %(default)s; soft devices have 1024, slow to read)")
    p.set_defaults(func=_devices)
    p = sub.add_parser("check-config", help="validate a conflist (or one plugin entry) against the config contract")
    p.add_argument("file")
    p.add_argument("--node", action="store_true",
                   help="also resolve it on this node: each rail's netdev and RDMA port, and this node's pod "
                        "range (rangeFromNodeAddress), or the error ADD would give")
    p.set_defaults(func=_check_config)
    p = sub.add_parser("uninstall-node", help="take rdma-netns off this node: the chained entry out of the primary "
                       "CNI config (byte for byte), the launcher, the releases, state, sockets and CDI specs; "
                       "refuses while pods still have rails")
    p.add_argument("--host-root", default="/", help="the node's root as seen here (the uninstall pod: /host)")
    p.add_argument("--conf-dir", default="/etc/cni/net.d", help="CNI config folder, under the host root")
    p.add_argument("--cni-bin-dir", default="/opt/cni/bin", help="CNI bin folder, under the host root")
    p.add_argument("--cdi-dir", default="/var/run/cdi", help="CDI spec folder, under the host root")
    p.add_argument("--force", action="store_true", help="also while attachments exist (their DEL will fail)")
    p.set_defaults(func=_uninstall_node)
    p = sub.add_parser("install-launcher", help="write the CNI executable for a CNI bin folder, e.g. "
                       "/opt/cni/bin/rdma-netns (isolated, fast-starting Python)")
    p.add_argument("dest")
    p.set_defaults(func=_install_launcher)
    from rdma_netns.admin import status_render  # `status`: its flags and runner live there

    status_render.add_parser(sub)
    p = sub.add_parser("cni-conf", help="chain the rdma-netns entry into the node's primary CNI config "
                       "(the first file of the conf dir): insert, remove, watch (re-insert when the primary "
                       "CNI rewrites it; remove on SIGTERM), show")
    p.add_argument("action", choices=["insert", "remove", "watch", "show"])
    p.add_argument("--conf-dir", default="/etc/cni/net.d", help="CNI config folder (default %(default)s)")
    p.add_argument("--entry", help="JSON file with the plugin entry, {\"type\": \"rdma-netns\", ...}")
    p.add_argument("--state-dir", default="/var/lib/rdma-netns/cni-conf",
                   help="where the primary's original bytes are kept for a byte-for-byte removal "
                        "(default %(default)s)")
    p.add_argument("--interval", type=float, default=1.0, help="watch: seconds between looks (default 1)")
    p.add_argument("--keep-on-exit", action="store_true", help="watch: leave the entry in place on SIGTERM")
    p.add_argument("--ready-file", help="watch: keep this file saying `ready` or `not ready: why` (the checks of "
                   "--require-entry --require-node-fit), for a probe that reads it with the shell")
    p.add_argument("--containerd-config", help="watch --ready-file and show: not ready while this containerd "
                   "config has CDI off (pods would get no NCCL/UCX settings)")
    p.add_argument("--ready-interval", type=float, default=10.0,
                   help="watch: seconds between readiness checks when nothing changed (default 10)")
    p.add_argument("--json", action="store_true", help="show: print JSON")
    p.add_argument("--require-entry", action="store_true",
                   help="show: exit 1 unless the config the runtime uses carries the entry (a readiness probe)")
    p.add_argument("--require-node-fit", action="store_true",
                   help="show: exit 1 unless ADD can derive this node's pod range on each rail of the chained "
                        "entry (rangeFromNodeAddress; `check-config --node` resolves the whole entry; a readiness "
                        "probe)")
    p.set_defaults(func=_cni_conf)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "mode" and (args.action == "set") != (args.value is not None):
        parser.error("use `mode` to show it, or `mode set shared|exclusive`")
    if args.command == "devices" and not 1 <= args.max_gids <= 4096:
        parser.error("--max-gids must be 1 to 4096")
    if args.command == "cni-conf" and not 0 < args.interval <= 3600:
        parser.error("--interval must be more than 0 and at most 3600 seconds")
    return args.func(args)
