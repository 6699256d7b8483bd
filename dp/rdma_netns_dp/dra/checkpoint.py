"""The claims this node has prepared, on disk: a driver or kubelet restart loses nothing and
prepares nothing twice (kubelet calls NodePrepareResources again for running pods after it
restarts; the answer must be the same devices and CDI IDs).

One JSON file, 0600 in the driver's 0700 folder under kubelet's plugins folder (on the node's
disk, so it outlives the daemon's pod), replaced atomically after every change. No fsync: after
a node crash kubelet prepares its pods' claims again, and a prepare needs only the claim.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass, field

from rdma_netns.util import fsutil

FORMAT = 1


@dataclass
class PreparedDevice:
    request: str
    pool: str
    device: str          # the DRA device name
    rdma_device: str     # the kernel's name: what the CNI narrows the pod's rails to
    share_id: str | None = None


@dataclass
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    pods: list[dict] = field(default_factory=list)   # status.reservedFor pods: {"name", "uid"}
    devices: list[PreparedDevice] = field(default_factory=list)
    unit: str = ""                                     # its CDI device name (<cdiKind>=<unit>)
    cdi_ids: list[str] = field(default_factory=list)

    @staticmethod
    def from_json(data: dict) -> PreparedClaim:
        devices = [PreparedDevice(**d) for d in data.get("devices", [])]
        return PreparedClaim(**{**data, "devices": devices})

    def serves(self, namespace: str, pod_name: str, pod_uid: str) -> bool:
        """Whether the claim is reserved for this pod (by UID when the runtime sends one)."""
        if namespace != self.namespace:
            return False
        return any(p.get("uid") == pod_uid if pod_uid else p.get("name") == pod_name for p in self.pods)


class Checkpoint:
    """The prepared claims by UID; thread-safe, written through on every change."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.claims: dict[str, PreparedClaim] = {}

    def load(self) -> Checkpoint:
        data = fsutil.read_json(self.path)
        if isinstance(data, dict) and data.get("v") == FORMAT:
            self.claims = {uid: PreparedClaim.from_json(c) for uid, c in (data.get("claims") or {}).items()}
        return self

    def get(self, uid: str) -> PreparedClaim | None:
        with self._lock:
            return self.claims.get(uid)

    def put(self, claim: PreparedClaim) -> None:
        with self._lock:
            self.claims[claim.uid] = claim
            self._save()

    def remove(self, uid: str) -> PreparedClaim | None:
        with self._lock:
            gone = self.claims.pop(uid, None)
            if gone is not None:
                self._save()
            return gone

    def all(self) -> list[PreparedClaim]:
        with self._lock:
            return list(self.claims.values())

    def _save(self) -> None:
        fsutil.ensure_private_dir(os.path.dirname(self.path))
        data = {"v": FORMAT, "claims": {uid: asdict(c) for uid, c in sorted(self.claims.items())}}
        fsutil.write_atomic(self.path, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode())
