"""The DRA driver: one object the daemon's loop feeds with every discovery pass.

It publishes the rails as ResourceSlice devices (devices.py, slices.py), serves kubelet's DRA
calls (service.py, prepare.py) with prepared claims kept in a checkpoint (checkpoint.py), reports
device health to kubelet, and answers the grants broker: which rails and CDI units a pod's
claims hold. Everything below the daemon's discovery (inventory, GID tables, CDI writer, broker)
is the device plugin's, so both modes see the same rails the same way.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping

from rdma_netns.kernel.rdma_devices import DeviceSysfs, RdmaDevice
from rdma_netns.kernel.rdma_sysfs import GidUsage, RdmaPort
from rdma_netns_dp.config import DevicePluginConfig
from rdma_netns_dp.dra import devices as dra_devices
from rdma_netns_dp.dra import kube_api
from rdma_netns_dp.dra.checkpoint import Checkpoint
from rdma_netns_dp.dra.kube_api import ApiError, Credentials, KubeApi
from rdma_netns_dp.dra.network_status import NetworkStatusWriter
from rdma_netns_dp.dra.prepare import CdiSettings, Preparer
from rdma_netns_dp.dra.service import DeviceHealth, DraServer
from rdma_netns_dp.dra.slices import SlicePublisher
from rdma_netns_dp.inventory import Pool

log = logging.getLogger("rdma_netns_dp.dra.driver")


def api_for(config: DevicePluginConfig) -> KubeApi:
    settings = config.dra
    credentials = Credentials.from_kubeconfig(settings.kubeconfig) if settings.kubeconfig else Credentials.in_cluster()
    return KubeApi(credentials)


class DraDriver:
    def __init__(self, config: DevicePluginConfig, sysfs: DeviceSysfs, api: KubeApi | None = None) -> None:
        settings = config.dra
        self.config = config
        self.driver = settings.driverName
        self.node = settings.node
        self.sysfs = sysfs
        self.api = api or api_for(config)
        folder = os.path.join(config.kubeletDir, "plugins", self.driver)
        self.checkpoint = Checkpoint(os.path.join(folder, "checkpoint.json")).load()
        resource = config.resources[0]
        self.health = DeviceHealth(self.node)
        self.preparer = Preparer(self.api, self.driver, self.node, self.checkpoint, self.rails_by_name, sysfs,
                                 CdiSettings(config.cdi.specDir, resource.podCdiKind, config.devRoot,
                                             resource.includeUmad), resource)
        self.publisher = SlicePublisher(self.api, self.driver, self.node)
        self.server = DraServer(config.kubeletDir, self.driver, self.preparer, self.health)
        self.network_status = NetworkStatusWriter(self.api, self.driver, config.cniStateDir)
        self._lock = threading.Lock()
        self._rails: dict[str, RdmaDevice] = {}
        self._pcie: dict[str, str | None] = {}
        self.started = False
        self.last_error: str | None = None

    @property
    def registered(self) -> bool:
        return self.server.registered

    def rails_by_name(self) -> dict[str, RdmaDevice]:
        with self._lock:
            return dict(self._rails)

    def start(self) -> DraDriver:
        """Serve kubelet; the daemon calls this after its first discovery pass, so a new claim
        finds this node's rails. The API server is reached from update(): prepared claims answer
        from the checkpoint even while it is away."""
        self.server.start()
        return self

    def reconcile(self) -> None:
        """Claims prepared before a restart whose ResourceClaim is gone (or was made again under
        another UID) are unprepared: kubelet will not ask for them any more."""
        for claim in self.checkpoint.all():
            try:
                found = self.api.get(kube_api.resource_claims_path(claim.namespace, claim.name))
            except ApiError as exc:
                if exc.status != 404:
                    raise
                found = None
            if found is None or found.get("metadata", {}).get("uid") != claim.uid:
                log.info("prepared claim is gone from the API server; unpreparing",
                         extra={"claim": f"{claim.namespace}/{claim.name}", "uid": claim.uid})
                self.preparer.unprepare(claim.uid)

    def update(self, pools: list[Pool], discovered: list[RdmaDevice], gids: Mapping[RdmaPort, GidUsage],
               blocked: str | None, away: Mapping[str, list[RdmaDevice]] | None = None) -> None:
        """Publish the pass's devices and their health; API errors are logged and retried next pass."""
        rails = []
        for pool in pools:
            selected = pool.select(discovered)
            for d in selected:
                if d.name not in self._pcie:
                    self._pcie[d.name] = self.sysfs.pcie_root(d)
            rails += dra_devices.rails_of(list(selected), pool.resource.name, pool.mode, self._pcie, gids,
                                          pool.resource.addressesPerPod, blocked,
                                          list((away or {}).get(pool.resource.name, [])))
        devices = [dra_devices.to_device(r, self.driver, self.config.dra.gidEntriesLimit) for r in rails]
        with self._lock:
            self._rails = {dra_devices.device_name(r.device.name): r.device for r in rails}
        self.health.update({dra_devices.device_name(r.device.name): dra_devices.health_problem(r) for r in rails})
        try:
            if not self.started:
                self.publisher.start()
                self.reconcile()
                self.started = True
            self.publisher.publish(devices)
            self.network_status.sync(self.checkpoint.all())
            self.last_error = None
        except ApiError as exc:
            if self.last_error != str(exc):
                log.error("cannot publish ResourceSlices; retrying each pass", extra={"error": str(exc)})
            self.last_error = str(exc)

    def pod_grant(self, namespace: str, name: str, uid: str) -> tuple[list[str], list[str]] | None:
        return self.preparer.pod_grant(namespace, name, uid)

    def status(self) -> dict:
        """The health file's DRA line: registered, slices written, claims prepared, the last API error."""
        return {"driver": self.driver, "node": self.node, "registered": self.registered,
                "slicesPublished": len(self.publisher.names) if self.publisher.published is not None else 0,
                "devices": len(self.publisher.published or []), "generation": self.publisher.generation,
                "claimsPrepared": len(self.checkpoint.all()), "apiError": self.last_error}

    def stop(self) -> None:
        self.server.stop()
        self.publisher.stop()
        self.api.close()  # ends the slices' watch too
