"""`rdma-netns check-config --node`: what a validated config resolves to on this node.

The same code ADD runs (rails.plan, node_range), read-only: each rail's netdev, RDMA port and,
with rangeFromNodeAddress, this node's pod range, or the error ADD would give.
"""

from __future__ import annotations

from rdma_netns import node_range, rails
from rdma_netns.config.netconf import NetConfig
from rdma_netns.kernel.netlink import NetlinkSocket
from rdma_netns.spec.errors import CniError


def describe(normalised: dict) -> tuple[bool, list[str]]:
    """(ok, lines) for one validated config (model.validate's output) on this node."""
    net = NetConfig(dict(normalised, stateDir=normalised.get("stateDir", "/")))
    try:
        plan = rails.plan(net, "eth0", None, chained=True)
        with NetlinkSocket() as sock:
            parents = [rails.host_parent(sock, rail, must_be_up=False) for rail in plan]
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
    """(ok, lines) for the rdma-netns entry chained into the primary config of conf_dir, as the
    runtime will run it (with the primary's cniVersion and name); ok when there is no entry."""
    from pathlib import Path

    from pydantic import ValidationError

    from rdma_netns.admin import cni_conf
    from rdma_netns.config import model

    primary = cni_conf.find_primary(Path(conf_dir))
    if primary is None:
        return True, []
    doc = cni_conf.parse((Path(conf_dir) / primary).read_bytes(), primary)
    plugins = doc.get("plugins") if isinstance(doc.get("plugins"), list) else []
    ours = [p for p in plugins if isinstance(p, dict) and p.get("type") == cni_conf.PLUGIN_TYPE]
    if not ours:
        return True, []
    try:
        normalised = model.validate(dict(ours[-1], cniVersion=doc.get("cniVersion"), name=doc.get("name")))
    except ValidationError as exc:
        return False, [f"  {primary}: {model.describe_errors(exc)}"]
    return describe(normalised)
