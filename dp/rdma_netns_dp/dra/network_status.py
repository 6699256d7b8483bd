"""After the pod's ADD, the claim's `status.devices[].networkData` (KEP-4817): each prepared rail's
interface name in the pod, its addresses and MAC, so `kubectl get resourceclaim -o yaml` (and any
controller) sees how the pod is wired without entering it.

The CNI records every attachment (its rails with their RDMA devices, the CNI result) in its state
folder, which the daemon already reads; the attachment that published a claim's CDI unit is that
claim's pod's. Each pass looks only while a prepared claim has no status written yet, and writes
it once (a read-modify-write of the claim's status keeping other drivers' entries, retried on a
conflict).
"""

from __future__ import annotations

import logging
import time

from rdma_netns.state import AttachmentState, all_records, read_state
from rdma_netns_dp.dra import kube_api
from rdma_netns_dp.dra.checkpoint import PreparedClaim
from rdma_netns_dp.dra.kube_api import ApiError, KubeApi

log = logging.getLogger("rdma_netns_dp.dra.network_status")
CONFLICT_RETRIES = 3
# How long a prepared claim is looked for in the CNI's state: a hostNetwork pod's never shows up,
# and the state folder is not read every pass for the claim's whole life.
LOOK_SECONDS = 600


def attachments_by_unit(state_dir: str) -> dict[str, AttachmentState]:
    """Ready attachments by the CDI units they published."""
    out: dict[str, AttachmentState] = {}
    for _network, _cid, _ifname, path in all_records(state_dir):
        state = read_state(path)
        if state is None or state.phase != "ready" or not state.published:
            continue
        for spec in state.published.get("cdiSpecs") or []:
            if isinstance(spec, dict) and isinstance(spec.get("unit"), str):
                out[spec["unit"]] = state
    return out


def network_data(state: AttachmentState, rdma_device: str) -> dict | None:
    """The pod-side interface of the rail made for `rdma_device`, from the CNI result."""
    rail = next((r for r in state.rails if r.get("rdmaDevice") == rdma_device), None)
    result = state.result or {}
    if rail is None or not rail.get("ifname"):
        return None
    interfaces = result.get("interfaces") or []
    index = next((i for i, iface in enumerate(interfaces)
                  if iface.get("name") == rail["ifname"] and iface.get("sandbox")), None)
    if index is None:
        return None
    data: dict = {"interfaceName": rail["ifname"],
                  "ips": [ip["address"] for ip in result.get("ips") or [] if ip.get("interface") == index]}
    if interfaces[index].get("mac"):
        data["hardwareAddress"] = interfaces[index]["mac"]
    return data


def device_statuses(claim: PreparedClaim, state: AttachmentState, driver: str) -> list[dict]:
    out = []
    for d in claim.devices:
        entry: dict = {"driver": driver, "pool": d.pool, "device": d.device}
        if d.share_id:
            entry["shareID"] = d.share_id
        data = network_data(state, d.rdma_device)
        if data is not None:
            entry["networkData"] = data
        out.append(entry)
    return out


class NetworkStatusWriter:
    def __init__(self, api: KubeApi, driver: str, state_dir: str) -> None:
        self.api = api
        self.driver = driver
        self.state_dir = state_dir
        self.written: set[str] = set()  # claim UIDs whose status this process wrote (or gave up on)
        self.first_seen: dict[str, float] = {}

    def sync(self, claims: list[PreparedClaim]) -> None:
        now = time.monotonic()
        live = {c.uid for c in claims}
        self.written &= live
        self.first_seen = {uid: t for uid, t in self.first_seen.items() if uid in live}
        for c in claims:
            if c.uid not in self.written and now - self.first_seen.setdefault(c.uid, now) > LOOK_SECONDS:
                self.written.add(c.uid)  # no ADD came (a hostNetwork pod): nothing to write
        pending = [c for c in claims if c.uid not in self.written]
        if not pending:
            return
        attachments = attachments_by_unit(self.state_dir)
        for claim in pending:
            state = attachments.get(claim.unit)
            if state is None:
                continue  # no ADD yet (or a hostNetwork pod: never)
            try:
                self._write(claim, device_statuses(claim, state, self.driver))
                self.written.add(claim.uid)
            except ApiError as exc:
                if exc.status == 404:
                    self.written.add(claim.uid)  # deleted meanwhile: nothing to write
                    continue
                log.warning("cannot write the claim's device status; retrying next pass",
                            extra={"claim": f"{claim.namespace}/{claim.name}", "error": str(exc)})

    def _write(self, claim: PreparedClaim, ours: list[dict]) -> None:
        path = kube_api.resource_claims_path(claim.namespace, claim.name)
        for attempt in range(CONFLICT_RETRIES):
            current = self.api.get(path)
            if current.get("metadata", {}).get("uid") != claim.uid:
                return
            status = current.setdefault("status", {})
            others = [d for d in status.get("devices") or [] if d.get("driver") != self.driver]
            status["devices"] = others + ours
            try:
                self.api.replace(kube_api.resource_claims_path(claim.namespace, claim.name, status=True), current)
                log.info("claim device status written", extra={"claim": f"{claim.namespace}/{claim.name}",
                                                               "devices": ours})
                return
            except ApiError as exc:
                if exc.status != 409 or attempt == CONFLICT_RETRIES - 1:
                    raise
