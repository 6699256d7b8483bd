"""`rdma-netns-dp`: the device plugin daemon (serve), and its `kernel-mode`, `devices` and `probe`
helpers."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

from rdma_netns_dp import __version__


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rdma-netns-dp",
        description="Kubernetes device plugin for RDMA (rdma/hca): advertises RDMA devices to kubelet "
                    "and hands pods their /dev/infiniband char devices.")
    parser.add_argument("--version", action="version", version=f"rdma-netns-dp {__version__}")
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="run the device plugin (the default)")
    serve.add_argument("--config", help="YAML or JSON config file (flags below override it)")
    serve.add_argument("--kubelet-dir", dest="kubeletDir", help="kubelet's root (default /var/lib/kubelet)")
    serve.add_argument("--mode", choices=["shared", "exclusive", "auto"],
                       help="RDMA netns mode the resources follow (default auto: the kernel's)")
    serve.add_argument("--resource-name", dest="resourceName", help="extended resource name (default rdma/hca)")
    serve.add_argument("--shared-units", dest="sharedUnits", type=int,
                       help="units advertised in shared mode (default 1000)")
    serve.add_argument("--health-interval", dest="healthIntervalSeconds", type=float,
                       help="seconds between health polls (default 1)")
    serve.add_argument("--registration", choices=["kubelet", "watcher"],
                       help="register with kubelet.sock (default) or through the plugin watcher")
    serve.add_argument("--cdi", dest="cdiEnabled", action="store_const", const=True,
                       help="hand out CDI device names and write the CDI spec")
    serve.add_argument("--cdi-dir", dest="cdiSpecDir", help="CDI spec folder (default /var/run/cdi)")
    serve.add_argument("--health-file", dest="healthFile",
                       help="status file for liveness probes (default /run/rdma-netns-dp/health.json)")
    serve.add_argument("--ensure-kernel-mode", dest="ensureKernelMode", action="store_const", const=True,
                       help="RDMA for non-hostNetwork pods: set the kernel's RDMA netns mode if it can be")
    serve.add_argument("--no-ensure-kernel-mode", dest="ensureKernelMode", action="store_const", const=False,
                       help="leave the kernel's mode alone, only check it (`kernel-mode` set it before: the "
                            "DaemonSet's init container, so that the daemon needs no CAP_NET_ADMIN)")
    serve.add_argument("--pod-grants-socket", dest="podGrantsSocket",
                       help="the grants broker's socket the CNI asks which devices kubelet gave a pod "
                            "(default /run/rdma-netns/pod-grants.sock; \"\" turns it off)")
    serve.add_argument("--metrics-address", dest="metricsAddress",
                       help="address /metrics listens on (default 127.0.0.1: the node itself; docs/metrics.md)")
    serve.add_argument("--metrics-port", dest="metricsPort", type=int,
                       help="port of Prometheus /metrics (default 0: off)")
    serve.add_argument("--cni-state-dir", dest="cniStateDir", help="the CNI plugin's state folder")
    serve.add_argument("--sysfs-root", dest="sysfsRoot", help=argparse.SUPPRESS)
    serve.add_argument("--dev-root", dest="devRoot", help=argparse.SUPPRESS)
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    mode = sub.add_parser("kernel-mode", help="set the kernel's RDMA netns mode as the config needs (when "
                          "ensureKernelMode is true; otherwise only check it) and exit: the one step "
                          "that needs CAP_NET_ADMIN, run before the daemon")
    mode.add_argument("--config", help="the daemon's config file (its mode, ensureKernelMode, sysfsRoot)")
    mode.add_argument("--sysfs-root", dest="sysfsRoot", help=argparse.SUPPRESS)
    mode.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    devices = sub.add_parser("devices", help="print the RDMA devices found and exit")
    devices.add_argument("--json", action="store_true")
    devices.add_argument("--sysfs-root", default="/sys", help=argparse.SUPPRESS)
    probe = sub.add_parser("probe", help="liveness probe: exit 0 when the health file is fresh")
    probe.add_argument("--health-file", default="/run/rdma-netns-dp/health.json")
    probe.add_argument("--max-age", type=float, default=10.0, help="seconds (default 10)")
    probe.add_argument("--require-registered", action="store_true",
                       help="also fail while a resource is not registered with kubelet (readiness)")
    return parser


def _load(args: argparse.Namespace, overrides: dict):
    """The validated config with `overrides`, logging set up; None (said on stderr) when invalid."""
    from rdma_netns_dp import log
    from rdma_netns_dp.config import ConfigError, load

    try:
        config = load(args.config, overrides)
    except ConfigError as exc:
        print(f"rdma-netns-dp: invalid configuration: {exc}", file=sys.stderr)
        return None
    log.setup(args.log_level)
    return config


def _serve(args: argparse.Namespace) -> int:
    config = _load(args, {k: v for k, v in vars(args).items()
                          if v is not None and k not in ("command", "config", "log_level")})
    if config is None:
        return 2
    if config.dra.enabled and not config.dra.node:
        # Checked here, not in the config: the init containers read the same file without it.
        print("rdma-netns-dp: invalid configuration: dra.enabled needs the node's name: dra.nodeName, or "
              "NODE_NAME in the environment (the downward API's spec.nodeName)", file=sys.stderr)
        return 2
    from rdma_netns_dp.daemon import Daemon

    refused: tuple[type[Exception], ...] = ()
    if config.dra.enabled:
        from rdma_netns_dp.dra.kube_api import CredentialsError

        refused = (CredentialsError,)  # no service account token, an unusable kubeconfig
    try:
        daemon = Daemon(config)
    except refused as exc:
        print(f"rdma-netns-dp: cannot start the DRA driver: {exc}", file=sys.stderr)
        return 2

    def stop(signum: int, _frame: object) -> None:
        daemon.stop_event.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return daemon.run()


def _kernel_mode(args: argparse.Namespace) -> int:
    """Exit 0 when the kernel's mode is as needed, was set, cannot be checked (no RDMA core) or is
    blocked by other namespaces (a node with pods: the daemon marks the units Unhealthy and says
    why); 1 when the kernel refused for another reason (no CAP_NET_ADMIN, ...); 2 for a bad config."""
    import logging

    from rdma_netns_dp import kernel_mode

    config = _load(args, {"sysfsRoot": args.sysfsRoot} if args.sysfsRoot else {})
    if config is None:
        return 2
    from rdma_netns.kernel.rdma_devices import DeviceSysfs

    sysfs = DeviceSysfs(config.sysfsRoot)
    wanted = kernel_mode.resolve(config.mode, sysfs)
    if not config.ensureKernelMode:
        why = kernel_mode.mismatch(wanted, sysfs)
        logging.getLogger("rdma_netns_dp.kernel_mode").log(
            logging.WARNING if why else logging.INFO, why or "kernel RDMA netns mode is as needed",
            extra={"mode": wanted})
        return 0
    return 1 if kernel_mode.ensure(wanted, sysfs) == kernel_mode.FAILED else 0


def _devices(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from rdma_netns.kernel.rdma_devices import DeviceSysfs

    sysfs = DeviceSysfs(args.sysfs_root)
    found = sysfs.devices()
    if args.json:
        print(json.dumps({"netnsMode": sysfs.netns_mode(), "devices": [asdict(d) for d in found]}, indent=2))
        return 0
    print(f"RDMA netns mode: {sysfs.netns_mode() or 'unknown (no RDMA subsystem)'}")
    if not found:
        print("no RDMA devices")
    for d in found:
        ports = ", ".join(f"{p.number}:{p.state}/{p.link_layer}" for p in d.ports)
        print(f"{d.name}: id {d.stable_id}, ports {ports or '-'}, netdevs {','.join(d.netdevs) or '-'}, "
              f"numa {d.numa_node if d.numa_node is not None else '-'}, "
              f"uverbs {d.uverbs.name if d.uverbs else '-'}, driver {d.driver or '-'}")
    return 0


def _probe(args: argparse.Namespace) -> int:
    try:
        with open(args.health_file) as f:
            status = json.load(f)
        age = time.time() - float(status["time"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"unhealthy: cannot read {args.health_file}: {exc}", file=sys.stderr)
        return 1
    if age > args.max_age:
        print(f"unhealthy: {args.health_file} is {age:.1f} s old (the daemon's loop is stuck or dead)",
              file=sys.stderr)
        return 1
    if args.require_registered:
        pending = sorted(name for name, r in (status.get("resources") or {}).items() if not r.get("registered"))
        if pending:
            print(f"not ready: not registered with kubelet: {', '.join(pending)}", file=sys.stderr)
            return 1
    print(f"ok: updated {age:.1f} s ago")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv.insert(0, "serve")
    args = _parser().parse_args(argv)
    return {"serve": _serve, "kernel-mode": _kernel_mode, "devices": _devices, "probe": _probe}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
