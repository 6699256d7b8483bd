"""An in-memory stand-in for the parts of kube-apiserver the DRA driver uses, for tests that
inject what the real one cannot be made to do on cue (a deleted slice between two passes, a claim
gone while the driver was down). It copies the real server's answers: 404 NotFound for a missing
object, 409 AlreadyExists on create, 409 Conflict on a replace whose resourceVersion is stale, a
new resourceVersion on every write, a status subresource whose PUT changes only the status,
fieldSelector on spec.nodeName/spec.driver for slices
(k8s.io/apiserver v0.37.2; pkg/registry/resource/resourceslice/strategy.go's selectable fields).
The real API server is the cluster suite's (integration/cluster/test_dra.py)."""

from __future__ import annotations

import copy
import itertools
import queue

from rdma_netns_dp.dra.kube_api import ApiError


class ApiStandin:
    def __init__(self) -> None:
        self.objects: dict[str, dict] = {}
        self._rv = itertools.count(100)
        self.calls: list[tuple[str, str]] = []
        self.events: queue.Queue = queue.Queue()
        self.fail_next: ApiError | None = None

    def _check(self, verb: str, path: str) -> None:
        self.calls.append((verb, path))
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc

    def put_object(self, path: str, obj: dict) -> dict:
        obj = copy.deepcopy(obj)
        obj.setdefault("metadata", {})["resourceVersion"] = str(next(self._rv))
        self.objects[path] = obj
        return obj

    def get(self, path: str) -> dict:
        self._check("get", path)
        if path not in self.objects:
            raise ApiError(404, "NotFound", f"{path} not found")
        return copy.deepcopy(self.objects[path])

    def list(self, path: str, label_selector=None, field_selector=None, limit=None, continue_=None) -> dict:
        self._check("list", path)
        wanted = dict(part.split("=", 1) for part in field_selector.split(",")) if field_selector else {}
        items = []
        for key, obj in sorted(self.objects.items()):
            if not key.startswith(path + "/"):
                continue
            spec = obj.get("spec", {})
            if all(spec.get(k.removeprefix("spec.")) == v for k, v in wanted.items()):
                items.append(copy.deepcopy(obj))
        return {"items": items, "metadata": {"resourceVersion": str(next(self._rv))}}

    def create(self, path: str, body: dict) -> dict:
        self._check("create", path)
        full = f"{path}/{body['metadata']['name']}"
        if full in self.objects:
            raise ApiError(409, "AlreadyExists", f"{full} already exists")
        created = self.put_object(full, body)
        self.events.put({"type": "ADDED", "object": copy.deepcopy(created)})
        return created

    def replace(self, path: str, body: dict) -> dict:
        """PUT; on a `/status` subresource only the status changes, as the server's status strategy does."""
        self._check("replace", path)
        if path.endswith("/status"):
            path = path.removesuffix("/status")
            current = self.objects.get(path)
            if current is not None:
                body = {**copy.deepcopy(current), "status": body.get("status"),
                        "metadata": {**current["metadata"], "resourceVersion": body["metadata"].get("resourceVersion")}}
        current = self.objects.get(path)
        if current is None:
            raise ApiError(404, "NotFound", f"{path} not found")
        if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", "the object has been modified; please apply your changes to the "
                                            "latest version and try again")
        replaced = self.put_object(path, body)
        self.events.put({"type": "MODIFIED", "object": copy.deepcopy(replaced)})
        return replaced

    def delete(self, path: str, preconditions_uid=None) -> None:
        self._check("delete", path)
        gone = self.objects.pop(path, None)
        if gone is not None:
            self.events.put({"type": "DELETED", "object": gone})

    def watch(self, path, resource_version, field_selector=None, label_selector=None, timeout_seconds=300,
              allow_bookmarks=True):
        while True:
            event = self.events.get()
            if event is None:
                return
            yield event
