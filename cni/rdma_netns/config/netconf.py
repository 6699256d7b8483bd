"""The validated network config as a typed object, for the hot path.

model.py (pydantic) is the contract and runs only on a cache miss; the loader keeps its
normalised output as a plain dict (the cached verdict), and every call builds a NetConfig from
that dict: attribute access, slots, no imports. A new config key means a field in model.py and
an attribute here (one line in __slots__, one in __init__).
"""

from __future__ import annotations

# The defaults live in defaults.py (shared with model.py and loader.py); re-exported here.
from rdma_netns.config.defaults import (  # noqa: F401
    DEFAULT_GID_WAIT_MS,
    DEFAULT_POD_RESOURCES_TIMEOUT_MS,
    TEARDOWN_DEFAULTS,
)


def rail_range_rule(top: object, own: object, rail_ipam: object) -> dict | None:
    """The rangeFromNodeAddress rule a rail follows: its own, else the top-level one unless the
    rail's own ipam says where its addresses come from (ranges or subnet: a static rail). ADD,
    `status` and the DaemonSet's readiness check all decide with this."""
    if isinstance(own, dict):
        return own
    static = isinstance(rail_ipam, dict) and ("ranges" in rail_ipam or "subnet" in rail_ipam)
    return top if isinstance(top, dict) and not static else None


class RailConf:
    """One configured rail: a NIC named by exactly one of netdev, rdma_device, pci_address."""

    __slots__ = ("netdev", "rdma_device", "pci_address", "ifname", "ipam", "mtu", "node_range")

    def __init__(self, netdev: str | None = None, rdma_device: str | None = None, pci_address: str | None = None,
                 ifname: str | None = None, ipam: dict | None = None, mtu: int | None = None,
                 node_range: dict | None = None) -> None:
        self.netdev, self.rdma_device, self.pci_address = netdev, rdma_device, pci_address
        self.ifname, self.ipam, self.mtu = ifname, ipam, mtu
        self.node_range = node_range  # rangeFromNodeAddress of this rail ({"prefixLength", "within"})

    @classmethod
    def from_dict(cls, d: dict) -> RailConf:
        return cls(d.get("netdev"), d.get("rdmaDevice"), d.get("pciAddress"), d.get("ifname"), d.get("ipam"),
                   d.get("mtu"), d.get("rangeFromNodeAddress"))


class NetConfig:
    """One network's settings (names as in the JSON config, in snake case)."""

    __slots__ = ("name", "type", "mode", "link", "link_mode", "rails", "ipam", "node_range", "require_rdma",
                 "gid_wait_ms", "link_local", "route_table_base", "rule_priority_base", "ipam_timeout", "lock_timeout", "mtu", "state_dir",
                 "dns", "resource_name", "pod_resources_socket", "pod_resources_timeout_ms",
                 "pod_grants_socket", "pod_info_dir", "cdi_spec_dir", "cdi_kind", "source")

    def __init__(self, d: dict) -> None:
        """d: the model's normalised output (every key present), or teardown_network()'s subset."""
        self.source = d  # the normalised dict itself (cached verdict): for code that passes it on
        self.name: str = d["name"]
        self.type: str = d.get("type", "rdma-netns")
        self.mode: str = d.get("mode", "auto")
        self.link: str = d.get("link") or TEARDOWN_DEFAULTS["link"]
        self.link_mode: str | None = d.get("linkMode")
        rails = d.get("rails")
        self.rails: list[RailConf] | None = [RailConf.from_dict(r) for r in rails] if rails else None
        self.ipam: dict | None = d.get("ipam")
        self.node_range: dict | None = d.get("rangeFromNodeAddress")  # every rail's unless it has its own
        self.require_rdma: bool = d.get("requireRdma", True)
        self.gid_wait_ms: int = d.get("gidWaitMs", DEFAULT_GID_WAIT_MS)
        self.link_local: bool = d.get("linkLocal", True)
        self.route_table_base: int = d.get("routeTableBase", TEARDOWN_DEFAULTS["routeTableBase"])
        self.rule_priority_base: int = d.get("rulePriorityBase", TEARDOWN_DEFAULTS["rulePriorityBase"])
        self.ipam_timeout: float = d.get("ipamTimeoutSeconds", TEARDOWN_DEFAULTS["ipamTimeoutSeconds"])
        self.lock_timeout: float = d.get("lockTimeoutSeconds", TEARDOWN_DEFAULTS["lockTimeoutSeconds"])
        self.mtu: int | None = d.get("mtu")
        self.state_dir: str = d["stateDir"]
        self.dns: dict | None = d.get("dns")
        self.resource_name: str | None = d.get("resourceName")
        self.pod_resources_socket: str = d.get("podResourcesSocket", "")
        self.pod_resources_timeout_ms: int = d.get("podResourcesTimeoutMs", DEFAULT_POD_RESOURCES_TIMEOUT_MS)
        self.pod_grants_socket: str = d.get("podGrantsSocket", "")
        # "" (also DEL's fallback for a refused config): publish nothing; teardown uses the state.
        self.pod_info_dir: str = d.get("podInfoDir", "")
        self.cdi_spec_dir: str = d.get("cdiSpecDir", "")
        self.cdi_kind: str = d.get("cdiKind", "")

    def range_rule(self, entry: RailConf) -> dict | None:
        return rail_range_rule(self.node_range, entry.node_range, entry.ipam)

    def teardown_settings(self) -> dict:
        """What DEL needs of the config to undo an attachment, recorded at ADD (state format 2)."""
        return {"routeTableBase": self.route_table_base, "rulePriorityBase": self.rule_priority_base,
                "ipamTimeoutSeconds": self.ipam_timeout, "link": self.link, "linkMode": self.link_mode}

    def with_recorded(self, recorded: object) -> NetConfig:
        """The config as teardown sees it: the settings a state recorded at ADD win over today's
        config (which may have changed, or be DEL's fallback for a refused config); values of
        the wrong type (a hand-edited or foreign state) are ignored."""
        if not isinstance(recorded, dict):
            return self
        out = NetConfig.__new__(NetConfig)
        for slot in NetConfig.__slots__:
            setattr(out, slot, getattr(self, slot))
        for key, attr in (("link", "link"), ("linkMode", "link_mode")):
            if isinstance(recorded.get(key), str):
                setattr(out, attr, recorded[key])
        for key, attr in (("routeTableBase", "route_table_base"), ("rulePriorityBase", "rule_priority_base"),
                          ("ipamTimeoutSeconds", "ipam_timeout")):
            value = recorded.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                setattr(out, attr, type(TEARDOWN_DEFAULTS[key])(value))
        return out
