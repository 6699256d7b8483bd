"""NodePrepareResources / NodeUnprepareResources: from a claim's allocation to what the pod's
network and containers get.

Prepare reads the claim from the API server (kubelet sends only namespace, name and UID), takes
the results allocated from this driver's pool on this node, checks that each device is one of
this node's rails now, and records the claim with the pods it is reserved for (the grants broker
answers the CNI's ADD from that record: the pod gets exactly these rails). Its answer names one
CDI device per claim, `<cdiKind>=claim-<uid>`: a devices-only placeholder spec is written here
so a container always resolves it, and the CNI's ADD replaces it with the pod's rails (addresses,
GID index, NCCL/UCX settings), as it does for the device plugin's pod CDI units.

Both calls are idempotent (kubelet retries them, and calls Prepare again for running pods after
it restarts): a claim already in the checkpoint is answered from there, unchanged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from rdma_netns.util import fsutil
from rdma_netns.kernel.rdma_devices import DeviceSysfs, RdmaDevice
from rdma_netns.publish.pod_cdi import mounted_file, spec_path
from rdma_netns_dp import allocation, pod_cdi
from rdma_netns_dp.config import ResourceConfig
from rdma_netns_dp.dra import kube_api
from rdma_netns_dp.dra.checkpoint import Checkpoint, PreparedClaim, PreparedDevice
from rdma_netns_dp.dra.kube_api import ApiError, KubeApi

log = logging.getLogger("rdma_netns_dp.dra.prepare")
CONFIG_API_VERSION = "rdma-netns.io/v1alpha1"
CONFIG_KIND = "RailConfig"


class PrepareError(RuntimeError):
    """The claim cannot be prepared on this node; the message reaches the pod's events."""


@dataclass(frozen=True)
class CdiSettings:
    spec_dir: str
    kind: str          # the CNI config's cdiKind: the CNI writes the same spec files
    dev_root: str
    include_umad: bool


def unit_of(claim_uid: str) -> str:
    return f"claim-{claim_uid}"


def reserved_pods(claim: dict) -> list[dict]:
    """The pods the claim is reserved for (status.reservedFor), as {"name", "uid"}."""
    return [{"name": r.get("name", ""), "uid": r.get("uid", "")}
            for r in claim.get("status", {}).get("reservedFor") or [] if r.get("resource") == "pods"]


def check_config(claim: dict, driver: str) -> None:
    """The claim's and its class's opaque config for this driver: only what this driver knows,
    so a typo fails the pod with a clear event instead of being ignored."""
    for entry in claim.get("status", {}).get("allocation", {}).get("devices", {}).get("config") or []:
        opaque = entry.get("opaque") or {}
        if opaque.get("driver") != driver:
            continue
        params = opaque.get("parameters")
        where = f"{entry.get('source', 'FromClaim')} config for {driver}"
        if not isinstance(params, dict):
            raise PrepareError(f"{where}: parameters must be an object")
        if params.get("apiVersion") != CONFIG_API_VERSION or params.get("kind") != CONFIG_KIND:
            raise PrepareError(f"{where}: apiVersion/kind must be {CONFIG_API_VERSION}/{CONFIG_KIND}, got "
                               f"{params.get('apiVersion')!r}/{params.get('kind')!r}")
        unknown = sorted(set(params) - {"apiVersion", "kind"})
        if unknown:
            raise PrepareError(f"{where}: unknown fields {unknown}; {CONFIG_KIND} has none yet (the rails' "
                               "interface kind and addresses come from the node's CNI config)")


class Preparer:
    """The driver's claims on this node."""

    def __init__(self, api: KubeApi, driver: str, node: str, checkpoint: Checkpoint,
                 rails: Callable[[], dict[str, RdmaDevice]], sysfs: DeviceSysfs, cdi: CdiSettings,
                 resource: ResourceConfig) -> None:
        """`rails()`: this node's publishable devices now, by DRA device name."""
        self.api = api
        self.driver = driver
        self.node = node
        self.checkpoint = checkpoint
        self.rails = rails
        self.sysfs = sysfs
        self.cdi = cdi
        self.resource = resource
        self._lock = threading.Lock()  # one prepare or unprepare at a time: they share spec files

    def prepare(self, namespace: str, name: str, uid: str) -> PreparedClaim:
        """The claim prepared (or as prepared before); PrepareError when it cannot be."""
        with self._lock:
            done = self.checkpoint.get(uid)
            if done is not None:
                return self._with_current_pods(done)
            claim = self._read_claim(namespace, name, uid)
            check_config(claim, self.driver)
            prepared = self._devices(claim)
            pods = reserved_pods(claim)
            record = PreparedClaim(uid=uid, namespace=namespace, name=name, pods=pods,
                                   devices=[d for d, _ in prepared], unit=unit_of(uid),
                                   cdi_ids=[f"{self.cdi.kind}={unit_of(uid)}"])
            self._write_placeholder(record, [rdma for _, rdma in prepared])
            self.checkpoint.put(record)
            log.info("claim prepared", extra={"claim": f"{namespace}/{name}", "uid": uid, "pods": pods,
                                              "rails": [d.rdma_device for d in record.devices]})
            return record

    def _with_current_pods(self, done: PreparedClaim) -> PreparedClaim:
        """A prepared claim asked for again: by another pod sharing it (kubelet prepares per pod),
        whose rails the broker must know, or after a restart. Its pods are read again; when the
        API server cannot be reached the checkpoint's answer stands (kubelet must get the same)."""
        try:
            claim = self.api.get(kube_api.resource_claims_path(done.namespace, done.name))
        except ApiError:
            return done
        pods = reserved_pods(claim)
        if claim.get("metadata", {}).get("uid") == done.uid and pods != done.pods:
            done = PreparedClaim(**{**done.__dict__, "pods": pods})
            self.checkpoint.put(done)
        return done

    def unprepare(self, uid: str) -> None:
        """Forget the claim and remove its placeholder spec; a spec the CNI wrote belongs to the
        pod's attachment, whose DEL removes it (DEL and unprepare come in either order)."""
        with self._lock:
            gone = self.checkpoint.remove(uid)
            path = spec_path(self.cdi.spec_dir, unit_of(uid))
            if mounted_file(fsutil.read_json(path)) is None:
                fsutil.remove(path)
            if gone is not None:
                log.info("claim unprepared", extra={"claim": f"{gone.namespace}/{gone.name}", "uid": uid})

    def _read_claim(self, namespace: str, name: str, uid: str) -> dict:
        try:
            claim = self.api.get(kube_api.resource_claims_path(namespace, name))
        except ApiError as exc:
            raise PrepareError(f"cannot read ResourceClaim {namespace}/{name}: {exc}") from None
        if claim.get("metadata", {}).get("uid") != uid:
            raise PrepareError(f"ResourceClaim {namespace}/{name} is not the one kubelet asked for "
                               f"(UID {claim.get('metadata', {}).get('uid')}, asked {uid}): deleted and made again?")
        if not claim.get("status", {}).get("allocation"):
            raise PrepareError(f"ResourceClaim {namespace}/{name} is not allocated")
        return claim

    def _devices(self, claim: dict) -> list[tuple[PreparedDevice, RdmaDevice]]:
        results = [r for r in claim["status"]["allocation"].get("devices", {}).get("results") or []
                   if r.get("driver") == self.driver]
        if not results:
            raise PrepareError(f"nothing in the claim is allocated from driver {self.driver}")
        rails = self.rails()
        out = []
        for r in results:
            if r.get("pool") != self.node:
                raise PrepareError(f"device {r.get('pool')}/{r.get('device')} is another node's (this is {self.node})")
            found = rails.get(r.get("device", ""))
            if found is None:
                raise PrepareError(f"device {r.get('device')} is not on node {self.node} now")
            out.append((PreparedDevice(request=r.get("request", ""), pool=r["pool"], device=r["device"],
                                       rdma_device=found.name, share_id=r.get("shareID")), found))
        return out

    def _write_placeholder(self, record: PreparedClaim, devices: list[RdmaDevice]) -> None:
        """The devices-only spec the CDI name resolves to until the pod's ADD writes its own
        (and for good when no ADD comes: a hostNetwork pod)."""
        try:
            grant = allocation.grant(devices, self.sysfs, self.cdi.dev_root, self.resource.name, self.resource.slug,
                                     self.cdi.include_umad, use_cdi=False)
        except allocation.AllocationError as exc:
            raise PrepareError(str(exc)) from None
        path = spec_path(self.cdi.spec_dir, record.unit)
        if mounted_file(fsutil.read_json(path)) is not None:
            return  # the pod's ADD already wrote its spec (kubelet prepared again after a restart)
        pod_cdi.ensure_placeholder(self.cdi.spec_dir, self.cdi.kind, record.unit, allocation.pod_cdi_nodes(grant))

    def pod_grant(self, namespace: str, pod_name: str, pod_uid: str) -> tuple[list[str], list[str]] | None:
        """The rails (RDMA device names) and CDI units prepared for a pod; None when it has no
        claim of this driver here."""
        claims = [c for c in self.checkpoint.all() if c.serves(namespace, pod_name, pod_uid)]
        if not claims:
            return None
        rails = list(dict.fromkeys(d.rdma_device for c in claims for d in c.devices))
        return rails, [c.unit for c in claims]
