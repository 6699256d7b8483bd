"""kubelet's side of the driver: the DRAPlugin and DRAResourceHealth gRPC services on the
driver's socket, and the plugin-watcher registration that tells kubelet where they are.

Registration: a socket in kubelet's plugins_registry answering GetInfo with type "DRAPlugin",
the driver name, the endpoint, and the services this driver speaks ("v1.DRAPlugin", and
"v1.DRAResourceHealth", which kubelet opens a stream on to show device health in pod status).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc

from rdma_netns.util import fsutil
from rdma_netns_dp.api.dra.v1 import api_pb2 as dra_pb2
from rdma_netns_dp.api.dra.v1 import api_pb2_grpc as dra_grpc
from rdma_netns_dp.api.drahealth.v1 import api_pb2 as health_pb2
from rdma_netns_dp.api.drahealth.v1 import api_pb2_grpc as health_grpc
from rdma_netns_dp.dra.prepare import PrepareError, Preparer
from rdma_netns_dp.registration import WatcherRegistration

log = logging.getLogger("rdma_netns_dp.dra.service")
SERVICES = ["v1.DRAPlugin", "v1.DRAResourceHealth"]
HEALTH_TIMEOUT_SECONDS = 30   # kubelet shows Unknown when no update came for this long
HEALTH_RESEND_SECONDS = 10


class DeviceHealth:
    """Each device's health as of the last discovery pass; streams wait on `changed`."""

    def __init__(self, pool: str) -> None:
        self.pool = pool
        self.changed = threading.Condition()
        self.version = 0
        self.devices: dict[str, str | None] = {}   # device name -> problem (None: healthy)

    def update(self, devices: dict[str, str | None]) -> None:
        with self.changed:
            if devices != self.devices:
                self.devices = dict(devices)
                self.version += 1
                self.changed.notify_all()

    def message(self) -> health_pb2.NodeWatchResourcesResponse:
        now = int(time.time())
        with self.changed:
            items = sorted(self.devices.items())
        return health_pb2.NodeWatchResourcesResponse(devices=[health_pb2.DeviceHealth(
            device=health_pb2.DeviceIdentifier(pool_name=self.pool, device_name=name),
            health=health_pb2.UNHEALTHY if problem else health_pb2.HEALTHY, last_updated_time=now,
            health_check_timeout_seconds=HEALTH_TIMEOUT_SECONDS, message=problem or "") for name, problem in items])


class DraPluginServicer(dra_grpc.DRAPluginServicer):
    def __init__(self, preparer: Preparer) -> None:
        self.preparer = preparer

    def NodePrepareResources(self, request, context):
        out = dra_pb2.NodePrepareResourcesResponse()
        for claim in request.claims:
            try:
                prepared = self.preparer.prepare(claim.namespace, claim.name, claim.uid)
            except PrepareError as exc:
                log.warning("claim not prepared", extra={"claim": f"{claim.namespace}/{claim.name}", "error": str(exc)})
                out.claims[claim.uid].error = str(exc)
                continue
            except Exception as exc:  # a bug must still answer kubelet, which retries
                log.exception("preparing a claim failed")
                out.claims[claim.uid].error = f"{type(exc).__name__}: {exc}"
                continue
            answer = out.claims[claim.uid]
            for d in prepared.devices:
                device = answer.devices.add(request_names=[d.request], pool_name=d.pool, device_name=d.device,
                                            cdi_device_ids=prepared.cdi_ids)
                if d.share_id:
                    device.share_id = d.share_id
        return out

    def NodeUnprepareResources(self, request, context):
        out = dra_pb2.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            try:
                self.preparer.unprepare(claim.uid)
                out.claims[claim.uid].SetInParent()
            except Exception as exc:
                log.exception("unpreparing a claim failed")
                out.claims[claim.uid].error = f"{type(exc).__name__}: {exc}"
        return out


class HealthServicer(health_grpc.DRAResourceHealthServicer):
    def __init__(self, health: DeviceHealth, stopping: threading.Event) -> None:
        self.health = health
        self.stopping = stopping

    def NodeWatchResources(self, request, context) -> Iterator[health_pb2.NodeWatchResourcesResponse]:
        seen = -1
        while context.is_active() and not self.stopping.is_set():
            with self.health.changed:
                self.health.changed.wait_for(lambda: self.health.version != seen or self.stopping.is_set(),
                                             HEALTH_RESEND_SECONDS)
                seen = self.health.version
            yield self.health.message()


class DraServer:
    """The driver's gRPC server and its plugin-watcher registration socket."""

    def __init__(self, kubelet_dir: str, driver: str, preparer: Preparer, health: DeviceHealth) -> None:
        self.endpoint = os.path.join(kubelet_dir, "plugins", driver, "dra.sock")
        self.registration_socket = os.path.join(kubelet_dir, "plugins_registry", f"{driver}-reg.sock")
        self.registration = WatcherRegistration(driver, self.endpoint, plugin_type="DRAPlugin",
                                                versions=SERVICES)
        self.stopping = threading.Event()
        self._servicers = (DraPluginServicer(preparer), HealthServicer(health, self.stopping))
        self._servers: list[grpc.Server] = []

    @property
    def registered(self) -> bool:
        return self.registration.registered

    def start(self) -> DraServer:
        fsutil.ensure_private_dir(os.path.dirname(self.endpoint))
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        dra_grpc.add_DRAPluginServicer_to_server(self._servicers[0], server)
        health_grpc.add_DRAResourceHealthServicer_to_server(self._servicers[1], server)
        fsutil.remove(self.endpoint)
        server.add_insecure_port(f"unix://{self.endpoint}")
        server.start()
        self._servers.append(server)
        os.makedirs(os.path.dirname(self.registration_socket), exist_ok=True)
        from rdma_netns_dp.registration import serve_watcher

        self._servers.append(serve_watcher(self.registration, self.registration_socket))
        log.info("DRA driver serving", extra={"endpoint": self.endpoint, "registration": self.registration_socket})
        return self

    def stop(self) -> None:
        """Remove the registration socket first, so kubelet stops calling, then the endpoint."""
        self.stopping.set()
        for server in reversed(self._servers):
            server.stop(grace=2).wait(3)
        self._servers.clear()
        fsutil.remove(self.registration_socket)
        fsutil.remove(self.endpoint)
