"""The network configuration contract, as pydantic models.

This is the single definition of what a valid config is. The CNI hot path does not import
it on every call: config/loader.py validates a config once and caches the verdict by digest.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

# pydantic loads every installed package's `pydantic` entry points (plugins) into the process when
# it builds the first model. This runs as root on every node: no third-party code that way, and no
# scan of every installed package's metadata on the first ADD of a new config.
os.environ["PYDANTIC_DISABLE_PLUGINS"] = "__all__"

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator  # noqa: E402

from rdma_netns.config.defaults import (
    DEFAULT_CDI_KIND,
    DEFAULT_CDI_SPEC_DIR,
    DEFAULT_EVENTS_FIFO,
    DEFAULT_GID_WAIT_MS,
    DEFAULT_POD_GRANTS_SOCKET,
    DEFAULT_POD_INFO_DIR,
    DEFAULT_POD_RESOURCES_SOCKET,
    DEFAULT_POD_RESOURCES_TIMEOUT_MS,
    DEFAULT_STATE_DIR,
    MAX_POD_RESOURCES_TIMEOUT_MS,
    RUNTIME_KEYS,
    TEARDOWN_DEFAULTS,
)
from rdma_netns.spec.env import valid_ifname

NETWORK_NAME = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.\-]*\Z")
PCI_ADDRESS = re.compile(r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]\Z")
DEVICE_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}\Z")
PLUGIN_TYPE = re.compile(r"[A-Za-z0-9_.\-]{1,64}\Z")
# A Kubernetes extended resource name: DNS-subdomain prefix, "/", name (IsQualifiedName).
RESOURCE_NAME = re.compile(
    r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?\Z")
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the NUL
# A CDI kind, vendor/class (the CDI spec's rules: vendor may have dots, class may not).
CDI_KIND = re.compile(r"[A-Za-z]([A-Za-z0-9_.\-]*[A-Za-z0-9])?/[A-Za-z]([A-Za-z0-9_\-]*[A-Za-z0-9])?\Z")



class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Ipam(BaseModel):
    """An IPAM delegate's config: its own schema, but it must name a plugin binary, and the keys
    the plugin itself reads (rails/ipam.py shares host-local calls by `ranges`; status reads `dataDir`;
    netconf.py tells static rails by `ranges`/`subnet`) must have host-local's types, so that a
    wrong one is a config error naming the key rather than a crash in ADD."""

    model_config = ConfigDict(extra="allow")
    type: str

    @field_validator("type")
    @classmethod
    def _plugin_name(cls, value: str) -> str:
        if not PLUGIN_TYPE.match(value) or value in (".", ".."):
            raise ValueError(f"IPAM type {value!r} is not a plugin name")
        return value

    @model_validator(mode="after")
    def _keys_the_plugin_reads(self) -> Ipam:
        problem = ipam_key_problem(self.model_extra or {})
        if problem:
            raise ValueError(problem)
        return self


# host-local's types for the IPAM keys rdma-netns reads itself (names as host-local spells them).
IPAM_STRING_KEYS = ("subnet", "rangeStart", "rangeEnd", "gateway")


def _non_string_key(entry: dict, where: str) -> str | None:
    """The first of IPAM_STRING_KEYS in `entry` that is not a string, as `<where><key> must be a string`."""
    key = next((k for k in IPAM_STRING_KEYS if k in entry and not isinstance(entry[k], str)), None)
    return None if key is None else f"{where}{key} must be a string"


def ipam_key_problem(ipam: dict) -> str | None:
    """The first IPAM key (its path, e.g. `ranges.0.1.subnet`) whose type is not host-local's, or
    None. ranges: a list of range sets, each a list of objects whose subnet/rangeStart/rangeEnd/
    gateway are strings; routes: a list of objects with a string dst (and gw); dataDir: an absolute
    path."""
    problem = _non_string_key(ipam, "")
    if problem:
        return problem
    if "ranges" in ipam:
        ranges = ipam["ranges"]
        if not isinstance(ranges, list):
            return "ranges must be a list of range sets (lists of {\"subnet\": ...} objects)"
        for i, range_set in enumerate(ranges):
            if not isinstance(range_set, list):
                return f"ranges.{i} must be a list of ranges ({{\"subnet\": ...}} objects)"
            for j, entry in enumerate(range_set):
                if not isinstance(entry, dict):
                    return f"ranges.{i}.{j} must be an object like {{\"subnet\": \"fd00:1::/64\"}}"
                problem = _non_string_key(entry, f"ranges.{i}.{j}.")
                if problem:
                    return problem
    if "routes" in ipam:
        routes = ipam["routes"]
        if not isinstance(routes, list):
            return "routes must be a list of {\"dst\": ...} objects"
        for i, route in enumerate(routes):
            if not isinstance(route, dict) or not isinstance(route.get("dst"), str):
                return f"routes.{i} must be an object with a string dst, like {{\"dst\": \"fd00::/16\"}}"
            if "gw" in route and not isinstance(route["gw"], str):
                return f"routes.{i}.gw must be a string"
    if "dataDir" in ipam:
        data_dir = ipam["dataDir"]
        if not isinstance(data_dir, str) or not data_dir.startswith("/") or "\0" in data_dir:
            return "dataDir must be an absolute folder path"
    return None


# host-local keys that say where addresses come from: rangeFromNodeAddress writes them itself.
RANGE_KEYS = ("ranges", "subnet", "rangeStart", "rangeEnd", "gateway")


class RangeFromNodeAddress(Strict):
    """This node's pod range on a rail, derived at ADD from the node's own global IPv6 address
    there (rails/node_range.py): the address's /prefixLength block, the node's addresses left out.
    One config for every node; no two nodes share a block as long as their addresses do not."""

    prefixLength: int | None = Field(default=None, ge=8, le=124)  # None: the address's own length
    within: str | None = None  # only node addresses inside this IPv6 prefix count

    @field_validator("within")
    @classmethod
    def _ipv6_prefix(cls, value: str | None) -> str | None:
        if value is None:
            return value
        from rdma_netns.kernel.inet import Prefix

        try:
            prefix = Prefix.parse(value)
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        if prefix.version != 6 or "/" not in value:
            raise ValueError(f"{value!r} is not an IPv6 prefix like fd00::/16")
        return str(prefix.network)


class Rail(Strict):
    """One RDMA NIC: named by exactly one of netdev, rdmaDevice or pciAddress."""

    netdev: str | None = None
    rdmaDevice: str | None = None
    pciAddress: str | None = None
    ifname: str | None = None
    ipam: Ipam | None = None
    rangeFromNodeAddress: RangeFromNodeAddress | None = None
    mtu: int | None = Field(default=None, ge=1280, le=65535)

    @model_validator(mode="after")
    def _one_selector(self) -> Rail:
        chosen = [k for k in ("netdev", "rdmaDevice", "pciAddress") if getattr(self, k)]
        if len(chosen) != 1:
            raise ValueError("a rail names its NIC by exactly one of netdev, rdmaDevice, pciAddress"
                             f" (got {', '.join(chosen) or 'none'})")
        if self.netdev is not None and not valid_ifname(self.netdev):
            raise ValueError(f"netdev {self.netdev!r} is not a valid interface name")
        if self.rdmaDevice is not None and not DEVICE_NAME.match(self.rdmaDevice):
            raise ValueError(f"rdmaDevice {self.rdmaDevice!r} is not a valid RDMA device name")
        if self.pciAddress is not None and not PCI_ADDRESS.match(self.pciAddress):
            raise ValueError(f"pciAddress {self.pciAddress!r} is not a PCI address like 0000:3b:00.0")
        if self.ifname is not None and not valid_ifname(self.ifname):
            raise ValueError(f"ifname {self.ifname!r} is not a valid interface name")
        return self


class NetConf(Strict):
    cniVersion: str
    name: str
    type: str
    mode: Literal["shared", "exclusive", "auto"] = "auto"
    link: Literal["macvlan", "ipvlan"] = "macvlan"
    linkMode: str | None = None
    rails: list[Rail] | None = Field(default=None, min_length=1, max_length=64)
    ipam: Ipam | None = None
    # Each node's own pod range on every rail, from its address there (per rail: the rail's key).
    rangeFromNodeAddress: RangeFromNodeAddress | None = None
    requireRdma: bool = True
    gidWaitMs: int = Field(default=DEFAULT_GID_WAIT_MS, ge=0, le=30000)
    # An IPv6 link-local address (a GID) on each rail interface. On by default: without one the
    # kernel sends no neighbour solicitation when a RoCE QP resolves its peer, so RC over IPv6 GIDs
    # fails at RTR to any peer no other rail traffic has resolved (addressing.prepare_sysctls).
    linkLocal: bool = True
    # Defaults shared with DEL's fallback for a config it cannot validate (defaults.TEARDOWN_DEFAULTS).
    routeTableBase: int = Field(default=TEARDOWN_DEFAULTS["routeTableBase"], ge=1, le=2**31 - 64)
    rulePriorityBase: int = Field(default=TEARDOWN_DEFAULTS["rulePriorityBase"], ge=1, le=32000)
    ipamTimeoutSeconds: float = Field(default=TEARDOWN_DEFAULTS["ipamTimeoutSeconds"], gt=0, le=600)
    lockTimeoutSeconds: float = Field(default=TEARDOWN_DEFAULTS["lockTimeoutSeconds"], gt=0, le=600)
    mtu: int | None = Field(default=None, ge=1280, le=65535)
    stateDir: str = DEFAULT_STATE_DIR
    dns: dict[str, Any] | None = None
    capabilities: dict[str, bool] | None = None
    # Pairing with the device plugin: attach only pods kubelet granted units of this resource.
    resourceName: str | None = None
    # false: attach every pod that reaches this network, on purpose (no kubelet: Podman, the demo;
    # or the rails are every pod's only network). Without it a config must name resourceName.
    pairing: bool | None = None
    podResourcesSocket: str = DEFAULT_POD_RESOURCES_SOCKET
    podResourcesTimeoutMs: int = Field(default=DEFAULT_POD_RESOURCES_TIMEOUT_MS, ge=1, le=MAX_POD_RESOURCES_TIMEOUT_MS)
    podGrantsSocket: str = DEFAULT_POD_GRANTS_SOCKET
    # Where each call's metrics event goes (events.py; the device plugin's metrics); "" = nowhere.
    eventsFifo: str = DEFAULT_EVENTS_FIFO
    # Issue 17: what a pod's containers learn of their rails (publish/pod_info.py, publish/pod_cdi.py).
    podInfoDir: str = DEFAULT_POD_INFO_DIR  # "" = publish nothing
    cdiSpecDir: str = DEFAULT_CDI_SPEC_DIR
    cdiKind: str = DEFAULT_CDI_KIND

    @field_validator("podInfoDir", "cdiSpecDir")
    @classmethod
    def _publish_dir(cls, value: str, info: Any) -> str:
        if value == "" and info.field_name == "podInfoDir":
            return value
        if not value.startswith("/") or "\0" in value or ".." in value.split("/") or value.rstrip("/") == "":
            raise ValueError("must be an absolute folder path without '..' (not /)")
        return value.rstrip("/")

    @field_validator("cdiKind")
    @classmethod
    def _cdi_kind(cls, value: str) -> str:
        if len(value) > 253 or not CDI_KIND.match(value):
            raise ValueError(f"{value!r} is not a CDI kind like rdma-netns.io/pod (vendor/class)")
        return value

    @field_validator("resourceName")
    @classmethod
    def _resource_name(cls, value: str | None) -> str | None:
        if value is not None and (len(value) > 253 or not RESOURCE_NAME.match(value)):
            raise ValueError(f"{value!r} is not an extended resource name like rdma/hca")
        return value

    @field_validator("podResourcesSocket", "podGrantsSocket", "eventsFifo")  # the FIFO: same limits
    @classmethod
    def _socket_path(cls, value: str, info: Any) -> str:
        if value == "" and info.field_name in ("podGrantsSocket", "eventsFifo"):
            return value  # "" = ask kubelet directly; send no events
        if not value.startswith("/") or "\0" in value or ".." in value.split("/") \
                or len(value.encode()) > MAX_SOCKET_PATH:
            raise ValueError(f"must be an absolute unix socket path of at most {MAX_SOCKET_PATH} bytes")
        return value

    @field_validator("name")
    @classmethod
    def _network_name(cls, value: str) -> str:
        if not NETWORK_NAME.match(value) or len(value) > 128:
            raise ValueError("network name must start with a letter or digit and use only [A-Za-z0-9_.-]")
        return value

    @field_validator("stateDir")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/") or "\0" in value or ".." in value.split("/"):
            raise ValueError("stateDir must be an absolute path without '..'")
        return value

    @model_validator(mode="after")
    def _coherent(self) -> NetConf:
        if self.linkMode is not None:
            allowed = {"macvlan": ("bridge", "private", "vepa", "passthru"), "ipvlan": ("l2", "l3", "l3s")}[self.link]
            if self.linkMode not in allowed:
                raise ValueError(f"linkMode {self.linkMode!r} is not one of {', '.join(allowed)} for {self.link}")
        if self.rails:
            names = [r.ifname for r in self.rails if r.ifname]
            if len(names) != len(set(names)):
                raise ValueError("rails have duplicate ifnames")
        # Only exclusive mode chained after a netdev plugin runs without IPAM (it moves just the
        # RDMA device); `auto` may turn out to be that, and is checked again at ADD.
        if self.mode == "shared":
            if self.rails and any(r.ipam is None for r in self.rails) and self.ipam is None:
                raise ValueError("every rail needs an ipam (its own, or the top-level default)")
            if not self.rails and self.ipam is None:
                raise ValueError("ipam is required (top-level, or per rail)")
        self._node_ranges_fit()
        self._pairing_said()
        return self

    def _pairing_said(self) -> None:
        """A config pairs attachments with kubelet's grants (resourceName) or says it does not
        (`pairing: false`): left out by mistake, any pod that names the network would get rails,
        fabric addresses and GID entries without being granted rdma/hca (issue 36)."""
        if self.resourceName is not None and self.pairing is False:
            raise ValueError("resourceName pairs pods with kubelet's grants and \"pairing\": false turns that off: "
                             "keep one of them")
        if self.resourceName is None and self.pairing is not False:
            raise ValueError("resourceName is missing: without it every pod that names this network gets rails, "
                             "not only pods granted the device plugin's resource. Add \"resourceName\": \"rdma/hca\" "
                             "(the device plugin's resource), or, where no kubelet pairs pods (Podman, a demo) or "
                             "the rails are every pod's network, say so with \"pairing\": false")

    def _node_ranges_fit(self) -> None:
        """rangeFromNodeAddress fills host-local's ranges: the IPAM must be host-local without its
        own, and the mode one that leaves the NIC (and its address) in the host."""
        rails = self.rails or [Rail(netdev="x")]  # rails omitted: the top-level settings serve every rail
        for i, rail in enumerate(rails):
            own = (rail.ipam.model_extra or {}) if rail.ipam else {}
            static = "ranges" in own or "subnet" in own  # a rail's own ranges win over the top-level rule
            rule = rail.rangeFromNodeAddress or (None if static else self.rangeFromNodeAddress)
            ipam = rail.ipam or self.ipam
            if rule is None or ipam is None:
                continue
            where = f"rails.{i}" if self.rails else "config"
            if self.mode == "exclusive":
                raise ValueError(f"{where}: rangeFromNodeAddress needs shared mode (exclusive mode moves the NIC, "
                                 "and the node's address with it, into the pod)")
            if ipam.type != "host-local":
                raise ValueError(f"{where}: rangeFromNodeAddress fills host-local's ranges; the rail's ipam is "
                                 f"{ipam.type!r}")
            given = [k for k in RANGE_KEYS if k in (ipam.model_extra or {})]
            if given:
                raise ValueError(f"{where}: the ipam sets {', '.join(given)} and rangeFromNodeAddress derives "
                                 "them: use one or the other")


def validate(raw: dict) -> dict:
    """Validate a config and return it normalised: every default filled in, plain JSON types.

    The runtime's per-invocation keys (RUNTIME_KEYS) are not part of the contract checked here.
    """
    conf = NetConf.model_validate({k: v for k, v in raw.items() if k not in RUNTIME_KEYS})
    out = conf.model_dump(mode="json")
    out["linkMode"] = out["linkMode"] or {"macvlan": "bridge", "ipvlan": "l2"}[out["link"]]
    return out


def describe_errors(exc: Exception) -> str:
    """pydantic's errors as one line a node admin can act on: field path and reason."""
    errors = getattr(exc, "errors", None)
    if errors is None:
        return str(exc)
    parts = []
    for err in errors():
        where = ".".join(str(p) for p in err.get("loc", ())) or "config"
        reason = "unknown field" if err.get("type") == "extra_forbidden" else err.get("msg", "invalid")
        reason = reason.removeprefix("Value error, ")  # pydantic's prefix for our own checks' messages
        parts.append(f"{where}: {reason}")
    return "; ".join(parts)

