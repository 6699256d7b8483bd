"""`rdma-netns devices [--json]`: RDMA devices, ports, state, netdevs, GIDs and namespaces.

In exclusive mode a device is visible only in the namespace that holds it, so the listing
visits every named namespace (/var/run/netns) as well as the host's.
"""

from __future__ import annotations

import os

from rdma_netns.kernel import netns, netns_sysfs, rdma_sysfs
from rdma_netns.kernel.netns import NETNS_RUN_DIR


def _gid_rows(ports: list[tuple[str, int]]) -> list[list[dict]]:
    return [[{"index": g.index, "gid": g.gid, "type": g.gid_type, "ndev": g.ndev}
             for g in rdma_sysfs.gids(rdma_sysfs.RdmaPort(dev, port))] for dev, port in ports]


def _rows_here(namespace: str, view_fd: int | None) -> list[dict]:
    """Devices and ports visible in the current namespace; GIDs through that namespace's sysfs."""
    from rdma_netns.kernel.rdma_nldev import RdmaNetlink

    with RdmaNetlink() as rdma:
        ports = rdma.ports()
    keys = [(p.device_name, p.port_index) for p in ports]
    gid_lists = _gid_rows(keys) if view_fd is None else netns_sysfs.call_in_pod_view(view_fd, lambda: _gid_rows(keys))
    return [{"device": p.device_name, "port": p.port_index, "state": p.state_name, "netdev": p.netdev_name,
             "pci": rdma_sysfs.pci_address_of_device(p.device_name), "namespace": namespace, "gids": gids}
            for p, gids in zip(ports, gid_lists)]


def collect() -> list[dict]:
    mode = rdma_sysfs.netns_mode()
    if mode is None:
        return []
    rows = _rows_here("host" if mode == "exclusive" else "all (shared mode)", None)
    if mode != "exclusive":
        return rows
    try:
        names = sorted(os.listdir(NETNS_RUN_DIR))
    except OSError:
        names = []
    for name in names:
        try:
            fd = netns.open_netns(f"{NETNS_RUN_DIR}/{name}")
        except (OSError, netns.NotANetns):
            continue
        try:
            with netns.inside(fd):
                rows += _rows_here(name, fd)
        finally:
            os.close(fd)
    return rows


def table(rows: list[dict]) -> str:
    if not rows:
        return "no RDMA devices (or no RDMA subsystem) on this node"
    out = [f"{'DEVICE':<12} {'PORT':>4} {'STATE':<8} {'NETDEV':<12} {'NAMESPACE':<20} GIDS (index type ndev)"]
    for r in rows:
        gids = "; ".join(f"{g['index']} {g['gid']} {g['type']} {g['ndev']}" for g in r["gids"]) or "-"
        out.append(f"{r['device']:<12} {r['port']:>4} {r['state']:<8} {r['netdev'] or '-':<12} "
                   f"{r['namespace']:<20} {gids}")
    return "\n".join(out)
