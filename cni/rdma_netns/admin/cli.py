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

    rows = devices.collect()
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
    ours = [dict(e, cniVersion=doc.get("cniVersion", e.get("cniVersion")), name=doc.get("name", e.get("name")))
            for e in entries if isinstance(e, dict) and e.get("type") == "rdma-netns"]
    if not ours:
        print(f"{args.file}: no plugin of type rdma-netns in it", file=sys.stderr)
        return 2
    status = 0
    for entry in ours:
        try:
            model.validate(entry)
            print(f"{args.file}: ok ({entry['name']})")
        except ValidationError as exc:
            print(f"{args.file}: {model.describe_errors(exc)}", file=sys.stderr)
            status = 1
    return status


def _install_launcher(args: argparse.Namespace) -> int:
    from rdma_netns.admin import launcher

    try:
        launcher.install(args.dest)
    except (OSError, ValueError) as exc:
        print(f"install-launcher: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.dest}")
    return 0


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
    p = sub.add_parser("devices", help="list the RDMA devices visible here, their ports and netdevs")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_devices)
    p = sub.add_parser("check-config", help="validate a conflist (or one plugin entry) against the config contract")
    p.add_argument("file")
    p.set_defaults(func=_check_config)
    p = sub.add_parser("install-launcher", help="write the CNI executable for a CNI bin folder, e.g. "
                       "/opt/cni/bin/rdma-netns (isolated, fast-starting Python)")
    p.add_argument("dest")
    p.set_defaults(func=_install_launcher)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "mode" and (args.action == "set") != (args.value is not None):
        parser.error("use `mode` to show it, or `mode set shared|exclusive`")
    return args.func(args)
