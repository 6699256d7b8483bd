"""This node's ResourceSlices, kept equal to the devices of the last discovery pass.

One pool per node (named after it), split into slices of at most 128 devices (the API's limit),
all of one pool generation: the scheduler uses only the newest generation, so a change replaces
every slice under a new one. Slices are owned by the Node object, so deleting a node deletes them.
A watch on the node's slices notices when someone else changes or deletes one, and the next pass
writes it back (desired state, not polling: an unchanged pass costs no API call).
"""

from __future__ import annotations

import logging
import threading

from rdma_netns_dp.dra import kube_api
from rdma_netns_dp.dra.kube_api import ApiError, KubeApi

MAX_DEVICES_PER_SLICE = 128
WATCH_SECONDS = 300
log = logging.getLogger("rdma_netns_dp.dra.slices")


def slice_names(node: str, driver: str, count: int) -> list[str]:
    slug = driver.replace(".", "-")
    return [f"{node}-{slug}-{i}" for i in range(count)]


def build_slices(node: str, driver: str, devices: list[dict], generation: int,
                 owner: dict | None) -> list[dict]:
    """The pool's ResourceSlice objects (at least one, so an empty node says it has nothing)."""
    chunks = [devices[i:i + MAX_DEVICES_PER_SLICE] for i in range(0, len(devices), MAX_DEVICES_PER_SLICE)] or [[]]
    out = []
    for name, chunk in zip(slice_names(node, driver, len(chunks)), chunks):
        metadata: dict = {"name": name, "labels": {"app.kubernetes.io/managed-by": "rdma-netns-dp"}}
        if owner:
            metadata["ownerReferences"] = [owner]
        out.append({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": metadata,
                    "spec": {"driver": driver, "nodeName": node, "devices": chunk,
                             "pool": {"name": node, "generation": generation, "resourceSliceCount": len(chunks)}}})
    return out


def node_owner(api: KubeApi, node: str) -> dict | None:
    """The Node as an owner reference (None when it cannot be read: the slices are then
    unowned, and outlive a deleted node until the driver there is gone)."""
    try:
        found = api.get(f"/api/v1/nodes/{node}")
    except ApiError as exc:
        log.warning("cannot read this node's object; ResourceSlices get no owner", extra={"error": str(exc)})
        return None
    return {"apiVersion": "v1", "kind": "Node", "name": node, "uid": found["metadata"]["uid"], "controller": True}


class SlicePublisher:
    """publish(devices) after every discovery pass; writes only when something changed or a
    slice was changed behind its back."""

    def __init__(self, api: KubeApi, driver: str, node: str) -> None:
        self.api = api
        self.driver = driver
        self.node = node
        self.generation = 0
        self.published: list[dict] | None = None  # the devices last written
        self.names: list[str] = []
        self.owner: dict | None = None
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self._watch: threading.Thread | None = None
        self.writes = 0  # slices written (tests, status)
        self._written: set[int] = set()  # generations this process wrote

    def selector(self) -> str:
        return f"spec.nodeName={self.node},spec.driver={self.driver}"

    def start(self) -> SlicePublisher:
        """Adopt what a previous run published (its generation) and start watching."""
        self.owner = node_owner(self.api, self.node)
        existing = self.api.list(kube_api.resource_slices_path(), field_selector=self.selector())
        for item in existing.get("items", []):
            self.generation = max(self.generation, int(item["spec"]["pool"].get("generation", 0)))
            if item["metadata"]["name"] not in self.names:
                self.names.append(item["metadata"]["name"])
        if self._watch is not None:
            return self
        self._watch = threading.Thread(target=self._watch_loop, args=(existing.get("metadata", {})
                                                                      .get("resourceVersion", ""),),
                                       name="dra-slices-watch", daemon=True)
        self._watch.start()
        return self

    def publish(self, devices: list[dict]) -> bool:
        """Make the node's slices list `devices`; True when anything was written."""
        if devices == self.published and not self._dirty.is_set():
            return False
        self._dirty.clear()
        self.generation += 1
        self._written.add(self.generation)
        wanted = build_slices(self.node, self.driver, devices, self.generation, self.owner)
        for body in wanted:
            self._write(body)
        for stale in set(self.names) - {b["metadata"]["name"] for b in wanted}:
            self.api.delete(kube_api.resource_slices_path(stale))
        self.names = [b["metadata"]["name"] for b in wanted]
        self.published = devices
        log.info("ResourceSlices published", extra={"node": self.node, "devices": len(devices),
                                                    "slices": len(wanted), "generation": self.generation})
        return True

    def _write(self, body: dict) -> None:
        path = kube_api.resource_slices_path(body["metadata"]["name"])
        try:
            current = self.api.get(path)
        except ApiError as exc:
            if exc.status != 404:
                raise
            self.api.create(kube_api.resource_slices_path(), body)
        else:
            body = {**body, "metadata": {**body["metadata"],
                                         "resourceVersion": current["metadata"]["resourceVersion"]}}
            self.api.replace(path, body)
        self.writes += 1

    def _watch_loop(self, resource_version: str) -> None:
        """Mark the slices dirty when one is deleted or rewritten by someone else."""
        while not self._stop.is_set():
            try:
                for event in self.api.watch(kube_api.resource_slices_path(), resource_version,
                                            field_selector=self.selector(), timeout_seconds=WATCH_SECONDS):
                    obj = event.get("object") or {}
                    resource_version = obj.get("metadata", {}).get("resourceVersion", resource_version)
                    if event.get("type") in ("DELETED", "MODIFIED") and self._not_ours(event["type"], obj):
                        log.warning("a ResourceSlice of this node was changed by someone else; writing it back",
                                    extra={"slice": obj.get("metadata", {}).get("name"), "event": event["type"]})
                        self._dirty.set()
                    if self._stop.is_set():
                        return
            except ApiError as exc:
                if exc.status == 410:  # too old: watch from now (""), and write the slices once more
                    resource_version = ""
                    self._dirty.set()
                    continue
                log.warning("watching ResourceSlices failed; retrying", extra={"error": str(exc)})
                self._stop.wait(5)
            except Exception as exc:  # a bug must not end the watch for good
                log.exception("watching ResourceSlices failed", extra={"error": str(exc)})
                self._stop.wait(5)

    def _not_ours(self, kind: str, obj: dict) -> bool:
        """Deleted, or rewritten under another generation (the server's defaulting makes a
        field-by-field comparison of devices unreliable; every write of ours is a new generation)."""
        if obj.get("metadata", {}).get("name") not in self.names:
            return False
        generation = obj.get("spec", {}).get("pool", {}).get("generation")
        return kind == "DELETED" and generation == self.generation or generation not in self._written

    def stop(self, remove: bool = False) -> None:
        """Stop watching; with `remove`, delete the slices (the driver is leaving this node: its
        devices must not be allocated any more)."""
        self._stop.set()
        if remove:
            for name in self.names:
                try:
                    self.api.delete(kube_api.resource_slices_path(name))
                except ApiError as exc:
                    log.warning("cannot delete a ResourceSlice", extra={"slice": name, "error": str(exc)})
