"""The device plugin's configuration: a YAML or JSON file, then CLI flags on top.

Validated once at start with pydantic, so a typo stops the daemon with a clear message instead
of advertising the wrong devices to kubelet.
"""

from __future__ import annotations

import json
import os
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

# Kubernetes extended resource names: a DNS-subdomain prefix, "/", a name (validation.IsQualifiedName).
_RESOURCE_NAME = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with its NUL; gRPC refuses longer paths
_PCI_ID = re.compile(r"^(0x)?[0-9a-fA-F]{4}$")
_CDI_KIND = re.compile(r"^[A-Za-z]([A-Za-z0-9_.\-]*[A-Za-z0-9])?/[A-Za-z]([A-Za-z0-9_\-]*[A-Za-z0-9])?$")


class ConfigError(ValueError):
    """The configuration cannot be used; the message says what and where."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Selectors(_Strict):
    """Which RDMA devices a resource takes. Every non-empty list must match (globs allowed)."""

    rdmaDevices: list[str] = Field(default_factory=list)
    netdevs: list[str] = Field(default_factory=list)  # a device's netdev, its bond or a bond member
    vendors: list[str] = Field(default_factory=list)
    deviceIDs: list[str] = Field(default_factory=list)
    drivers: list[str] = Field(default_factory=list)
    linkTypes: list[Literal["ethernet", "infiniband"]] = Field(default_factory=list)

    @field_validator("vendors", "deviceIDs")
    @classmethod
    def _pci_ids(cls, values: list[str]) -> list[str]:
        for value in values:
            if not _PCI_ID.match(value):
                raise ValueError(f"{value!r} is not a 4-digit hex PCI id (like 15b3 or 0x15b3)")
        return [v.lower().removeprefix("0x") for v in values]


class ResourceConfig(_Strict):
    name: str = "rdma/hca"
    sharedUnits: int = Field(1000, ge=1, le=100000)
    includeUmad: bool = False
    selectors: Selectors = Field(default_factory=Selectors)
    # Shared mode: when the units are Healthy. "any": at least one selected device has an ACTIVE
    # port (a pod may then get devices whose ports are DOWN); "all": every selected device has one.
    sharedHealth: Literal["any", "all"] = "any"
    # Shared mode: Allocate also names "<podCdiKind>=<unit>" per unit, the CDI device whose spec the
    # CNI writes at ADD with the pod's rails (env, JSON file, devices; issue 17); until then (and for
    # a hostNetwork pod, which gets no ADD) a devices-only placeholder written here resolves it.
    podCdi: bool = False
    podCdiKind: str = "rdma-netns.io/pod"  # the CNI config's cdiKind (the same default)
    # Shared mode: IP addresses a pod puts on each rail: 2 by default (its own and the rail's
    # link-local one, which RoCE needs to resolve peers); 1 with the CNI's linkLocal: false, more when
    # IPAM hands out several. Each takes 1 (rxe) or 2 (mlx5: RoCE v1 and v2) GID entries, and no
    # more units are Healthy than the rails' GID tables can still wire.
    addressesPerPod: int = Field(2, ge=1, le=16)

    @field_validator("name")
    @classmethod
    def _resource_name(cls, value: str) -> str:
        if len(value) > 253 or not _RESOURCE_NAME.match(value) or value.startswith("kubernetes.io/"):
            raise ValueError(f"{value!r} is not an extended resource name like rdma/hca")
        return value

    @field_validator("podCdiKind")
    @classmethod
    def _cdi_kind(cls, value: str) -> str:
        if len(value) > 253 or not _CDI_KIND.match(value):
            raise ValueError(f"{value!r} is not a CDI kind like rdma-netns.io/pod (vendor/class)")
        return value

    @property
    def slug(self) -> str:
        """The resource name as a file-name part: rdma/hca -> rdma_hca."""
        return self.name.replace("/", "_")


class CdiConfig(_Strict):
    enabled: bool = False
    specDir: str = "/var/run/cdi"

    @field_validator("specDir")
    @classmethod
    def _absolute(cls, value: str) -> str:
        return os.path.abspath(value)


class MetricsConfig(_Strict):
    """Prometheus /metrics (metrics.py) and the FIFO the CNI's per-call events reach it through
    (cni_events.py). port 0: no metrics, no FIFO. address: the node's loopback by default, where
    only the node itself (and a proxy in front, docs/metrics.md) reaches it; "0.0.0.0" opens it on
    every node address (hostNetwork). refreshSeconds: how often the units allocated (one kubelet
    List) and the pods per rail (the CNI's state files) are read, in the background."""

    address: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    refreshSeconds: float = Field(10.0, ge=0.1, le=300)
    cniEventsFifo: str = "/run/rdma-netns/cni-events"  # the CNI config's eventsFifo (same default)

    @field_validator("cniEventsFifo")
    @classmethod
    def _events_fifo(cls, value: str) -> str:
        if not os.path.isabs(value) or len(value.encode()) > MAX_SOCKET_PATH:
            raise ValueError(f"{value!r} must be an absolute path of at most {MAX_SOCKET_PATH} bytes")
        return os.path.normpath(value)


_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class DraConfig(_Strict):
    """The DRA driver mode (dra/): the node's rails published as ResourceSlice devices and
    prepared for ResourceClaims through kubelet's DRAPlugin API, instead of `rdma/hca` units
    through the device plugin API. A node pool runs one or the other (docs/dra.md).

    nodeName: this node's name ("" = the NODE_NAME environment variable, the downward API's).
    kubeconfig: "" = the pod's service account. gidEntriesLimit: publish at most this many GID
    entries per rail as its capacity (0 = what the table has): a reserve for the node's own
    addresses, or a small table in tests."""

    enabled: bool = False
    driverName: str = "rdma-netns.io"
    nodeName: str = ""
    kubeconfig: str = ""
    gidEntriesLimit: int = Field(0, ge=0, le=1 << 20)

    @field_validator("driverName")
    @classmethod
    def _driver_name(cls, value: str) -> str:
        if len(value) > 63 or not _DNS_SUBDOMAIN.match(value):
            raise ValueError(f"{value!r} is not a DRA driver name (a DNS subdomain of at most 63 characters)")
        return value

    @property
    def node(self) -> str:
        return self.nodeName or os.environ.get("NODE_NAME", "")


class DevicePluginConfig(_Strict):
    mode: Literal["shared", "exclusive", "auto"] = "auto"
    kubeletDir: str = "/var/lib/kubelet"
    sysfsRoot: str = "/sys"
    devRoot: str = "/dev"
    cniStateDir: str = "/var/lib/cni/rdma-netns"
    healthIntervalSeconds: float = Field(1.0, gt=0, le=60)
    registration: Literal["kubelet", "watcher"] = "kubelet"
    healthFile: str | None = "/run/rdma-netns-dp/health.json"
    # The grants broker's socket (pod_grants.py), which the CNI asks instead of kubelet; "" = off.
    podGrantsSocket: str = "/run/rdma-netns/pod-grants.sock"
    ensureKernelMode: bool = False
    cdi: CdiConfig = Field(default_factory=CdiConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    dra: DraConfig = Field(default_factory=DraConfig)
    resources: list[ResourceConfig] = Field(default_factory=lambda: [ResourceConfig()])

    @field_validator("kubeletDir", "sysfsRoot", "devRoot", "cniStateDir", "healthFile")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        """Relative paths would mean something else to gRPC ("unix:rel") and to kubelet."""
        return os.path.abspath(value) if value else value

    @field_validator("podGrantsSocket")
    @classmethod
    def _socket_path(cls, value: str) -> str:
        """The CNI finds the broker by this exact path: a relative one would be nobody's."""
        if value and not os.path.isabs(value):
            raise ValueError(f"{value!r} must be an absolute path (or \"\" to turn the broker off)")
        if len(value.encode()) > MAX_SOCKET_PATH:
            raise ValueError(f"socket path {value} is {len(value.encode())} bytes; unix sockets allow "
                             f"{MAX_SOCKET_PATH}")
        return os.path.normpath(value) if value else value

    @model_validator(mode="after")
    def _distinct_resources(self) -> DevicePluginConfig:
        names = [r.name for r in self.resources]
        if not names:
            raise ValueError("resources: at least one resource is needed")
        if len(set(names)) != len(names):
            raise ValueError(f"resources: names must be distinct, got {names}")
        if self.dra.enabled:
            path = os.path.join(self.kubeletDir, "plugins", self.dra.driverName, "dra.sock")
            if len(path) > MAX_SOCKET_PATH:
                raise ValueError(f"socket path {path} is {len(path)} characters; unix sockets allow {MAX_SOCKET_PATH}")
        for resource in self.resources:
            for folder in ("device-plugins", "plugins_registry"):
                path = os.path.join(self.kubeletDir, folder, f"rdma-netns-{resource.slug}.sock")
                if len(path) > MAX_SOCKET_PATH:
                    raise ValueError(f"socket path {path} is {len(path)} characters; unix sockets allow "
                                     f"{MAX_SOCKET_PATH}: shorten the resource name or kubeletDir")
        return self


def parse(text: str, source: str) -> DevicePluginConfig:
    """Parse YAML or JSON text (JSON is YAML, but JSON errors read better from json)."""
    stripped = text.lstrip()
    try:
        if stripped.startswith("{"):
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as exc:  # json.JSONDecodeError, yaml.YAMLError
        raise ConfigError(f"{source}: not valid YAML/JSON: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    return validate(data, source)


def validate(data: dict, source: str) -> DevicePluginConfig:
    try:
        return DevicePluginConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(top)'}: {err['msg']}" for err in exc.errors())
        raise ConfigError(f"{source}: {problems}") from None


def load(path: str | None, overrides: dict) -> DevicePluginConfig:
    """The config file (if any) with CLI overrides applied, validated as a whole."""
    data: dict = {}
    source = "command line"
    if path:
        try:
            with open(path) as f:
                text = f.read()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        data = parse(text, path).model_dump()
        source = f"{path} with command-line flags"
    resource_overrides = {k: overrides.pop(k) for k in ("resourceName", "sharedUnits") if k in overrides}
    cdi_overrides = {k: overrides.pop(k) for k in ("cdiEnabled", "cdiSpecDir") if k in overrides}
    metrics_overrides = {k: overrides.pop(k) for k in ("metricsAddress", "metricsPort") if k in overrides}
    data.update(overrides)
    if resource_overrides:
        resources = data.get("resources") or [{}]
        if len(resources) != 1:
            raise ConfigError("--resource-name/--shared-units apply only to a config with one resource")
        first = dict(resources[0])
        if "resourceName" in resource_overrides:
            first["name"] = resource_overrides["resourceName"]
        if "sharedUnits" in resource_overrides:
            first["sharedUnits"] = resource_overrides["sharedUnits"]
        data["resources"] = [first]
    if cdi_overrides:
        cdi = dict(data.get("cdi") or {})
        if "cdiEnabled" in cdi_overrides:
            cdi["enabled"] = cdi_overrides["cdiEnabled"]
        if "cdiSpecDir" in cdi_overrides:
            cdi["specDir"] = cdi_overrides["cdiSpecDir"]
        data["cdi"] = cdi
    if metrics_overrides:
        metrics = dict(data.get("metrics") or {})
        if "metricsAddress" in metrics_overrides:
            metrics["address"] = metrics_overrides["metricsAddress"]
        if "metricsPort" in metrics_overrides:
            metrics["port"] = metrics_overrides["metricsPort"]
        data["metrics"] = metrics
    return validate(data, source)
