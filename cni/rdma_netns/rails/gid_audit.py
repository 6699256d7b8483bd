"""GID entries of pods' interfaces that no attachment record explains (a tenant's own addresses).

Why: a RoCE port's GID table is shared by every pod on the NIC in shared mode (255 entries on
mlx5, two per address). A tenant with CAP_NET_ADMIN in its pod can add addresses to its rail
interface, each one taking entries, until the table is full: every later ADD on that rail then
fails (its pod's address gets no GID). The attachment records say which addresses rdma-netns gave
each pod on each port; an entry whose netdev is not in the host's namespace (a pod's interface)
and whose GID is none of them is unexplained. Each recorded rail may also hold its interface's
one IPv6 link-local address (linkLocal, the kernel's own), so that many link-local entries per
recorded rail are allowed. Read-only: `rdma-netns status` (Rails) and the device plugin's
`rdma_netns_gid_entries_unexplained` report it; docs/security.md says how to forbid the cause.
"""

from __future__ import annotations

from collections.abc import Iterable

from rdma_netns.kernel.inet import Prefix
from rdma_netns.kernel.rdma_sysfs import RdmaPort, RdmaSysfs, gid_text
from rdma_netns.state import AttachmentState, all_records, read_state

SAMPLES = 5  # unexplained GIDs named per port (enough to find the pod, short enough for a log line)


class PortAudit:
    """One port: entries of pods' interfaces, how many no record explains, a few of their GIDs."""

    __slots__ = ("port", "in_pods", "unexplained", "samples")

    def __init__(self, port: RdmaPort, in_pods: int, unexplained: int, samples: list[tuple[str, str]]) -> None:
        self.port, self.in_pods, self.unexplained = port, in_pods, unexplained
        self.samples = samples  # (GID, the netdev name the kernel gives for it)

    def __repr__(self) -> str:
        return f"PortAudit({self.port}, in_pods={self.in_pods}, unexplained={self.unexplained})"


def records(state_dir: str) -> list[AttachmentState]:
    """Every readable attachment record under the CNI's state folder."""
    return [state for _n, _c, _i, path in all_records(state_dir) if (state := read_state(path)) is not None]


def recorded(states: Iterable[AttachmentState]) -> dict[RdmaPort, tuple[set[str], int]]:
    """Port -> (the GIDs of the addresses the records gave pods on it, how many rails they hold there)."""
    out: dict[RdmaPort, tuple[set[str], int]] = {}
    for state in states:
        for rail in state.rails:
            device, port = rail.get("rdmaDevice"), rail.get("port")
            if not isinstance(device, str) or not isinstance(port, int):
                continue
            gids, rails = out.get(RdmaPort(device, port), (set(), 0))
            for address in rail.get("addresses") or ():
                try:
                    gids.add(gid_text(Prefix.parse(address)))
                except (ValueError, TypeError):
                    continue
            out[RdmaPort(device, port)] = (gids, rails + 1)
    return out


def audit(sysfs: RdmaSysfs, ports: Iterable[RdmaPort], states: Iterable[AttachmentState]) -> dict[RdmaPort, PortAudit]:
    """Each port's audit (ports without a readable GID table are left out)."""
    known = recorded(states)
    here = set(sysfs.netdevs_here())
    out: dict[RdmaPort, PortAudit] = {}
    for port in ports:
        entries = sysfs.used_gids(port)
        if not entries:
            continue
        gids, rails = known.get(port, (set(), 0))
        types = {e.gid_type for e in entries}
        per_address = 2 if "IB/RoCE v1" in types else 1
        link_local_left = rails * per_address
        in_pods = unexplained = 0
        samples: list[tuple[str, str]] = []
        for entry in entries:
            if entry.ndev in here:
                continue  # the host's own addresses (and the default GID)
            in_pods += 1
            if entry.gid in gids:
                continue
            if _link_local(entry.gid) and link_local_left > 0:
                link_local_left -= 1
                continue
            unexplained += 1
            if len(samples) < SAMPLES and (entry.gid, entry.ndev) not in samples:
                samples.append((entry.gid, entry.ndev))
        out[port] = PortAudit(port, in_pods, unexplained, samples)
    return out


def _link_local(gid: str) -> bool:
    return gid[:4].lower() == "fe80"


def address_of(gid: str) -> str:
    """A GID as the address `ip addr` shows (IPv4-mapped ones as IPv4)."""
    try:
        prefix = Prefix.parse(gid)
    except ValueError:
        return gid
    packed = prefix.packed
    if packed[:12] == b"\0" * 10 + b"\xff\xff":
        return ".".join(str(b) for b in packed[12:])
    return prefix.address_text()
