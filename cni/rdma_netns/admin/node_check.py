"""`rdma-netns check-config --node`: what a validated config resolves to on this node.

The same code ADD runs (nics.plan, node_range), read-only: each rail's netdev, RDMA port and,
with rangeFromNodeAddress, this node's pod range, or the error ADD would give.
"""

from __future__ import annotations

from rdma_netns.config.netconf import NetConfig, rail_range_rule
from rdma_netns.kernel.netlink import NetlinkSocket
from rdma_netns.rails import nics, node_range
from rdma_netns.spec.errors import CniError


def describe(normalised: dict) -> tuple[bool, list[str]]:
    """(ok, lines) for one validated config (model.validate's output) on this node."""
    net = NetConfig(dict(normalised, stateDir=normalised.get("stateDir", "/")))
    try:
        plan = nics.plan(net, "eth0", None, chained=True)
        with NetlinkSocket() as sock:
            parents = [nics.host_parent(sock, rail, must_be_up=False) for rail in plan]
            lines = []
            ok = True
            for rail, parent in zip(plan, parents):
                port = f"{rail.rdma.device} port {rail.rdma.port}" if rail.rdma else "no RDMA device"
                line = f"  rail {rail.index} {rail.ifname}: {rail.netdev} ({port})"
                if rail.range_rule is not None:
                    try:
                        node_range.apply(sock, [rail], [parent])
                        line += f"; pod range {rail.node_range.describe()}"
                    except CniError as exc:
                        ok = False
                        line += f"; error {exc.code}: {exc.msg}" + (f" ({exc.details})" if exc.details else "")
                lines.append(line)
            return ok, lines
    except CniError as exc:
        return False, [f"  error {exc.code}: {exc.msg}" + (f" ({exc.details})" if exc.details else "")]



def chained(conf_dir: str) -> tuple[bool, list[str]]:
    """(ok, lines): this node's pod range on each rail of the entry chained into conf_dir's primary
    (rangeFromNodeAddress), as ADD derives it; ok when there is no entry or no rule.

    Cheap on purpose (a readiness probe, every 10 s, also on slow nodes): no config validation
    (the entry was validated when it was inserted), no RDMA sysfs walk, one address dump. A rail
    named by its RDMA device or PCI address is left to `check-config --node`; a bond member's rail
    is its bond (rdma_sysfs' rule), whose addresses count."""
    from _socket import AF_INET6
    from pathlib import Path

    from rdma_netns.admin import cni_conf
    from rdma_netns.kernel import rtnl

    primary = cni_conf.find_primary(Path(conf_dir))
    if primary is None:
        return True, []
    doc = cni_conf.parse((Path(conf_dir) / primary).read_bytes(), primary)
    plugins = doc.get("plugins") if isinstance(doc.get("plugins"), list) else []
    ours = [p for p in plugins if isinstance(p, dict) and p.get("type") == cni_conf.PLUGIN_TYPE]
    if not ours:
        return True, []
    top = ours[-1].get("rangeFromNodeAddress")
    entries = [r for r in ours[-1].get("rails") or [] if isinstance(r, dict)]
    rules = [rail_range_rule(top, rail.get("rangeFromNodeAddress"), rail.get("ipam")) for rail in entries]
    if not any(rules):
        return True, []
    ok, lines = True, []
    with NetlinkSocket() as sock:
        addresses = rtnl.list_addresses(sock, AF_INET6)
        for index, (rail, rule) in enumerate(zip(entries, rules)):
            netdev = rail.get("netdev")
            if rule is None:
                lines.append(f"  rail {index}: static (its own ipam ranges)")
                continue
            if not isinstance(netdev, str):
                continue
            master = Path("/sys/class/net", netdev, "master")
            netdev = master.resolve().name if master.exists() else netdev
            link = rtnl.get_link(sock, netdev)
            if link is None:
                ok = False
                lines.append(f"  rail {index}: no netdev {netdev} on this node")
                continue
            try:
                found = node_range.derive(netdev, [a for a in addresses if a.index == link.index], rule)
            except CniError as exc:
                ok = False
                lines.append(f"  rail {index}: error {exc.code}: {exc.msg}" + (f" ({exc.details})" if exc.details else ""))
                continue
            lines.append(f"  rail {index}: pod range {found.describe()}")
    return ok, lines
