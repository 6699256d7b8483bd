"""One resource's life towards kubelet: serve its socket, register, and do both again whenever
kubelet restarts (it wipes the device-plugins folder and re-creates kubelet.sock) or our socket
vanishes. Devices live in the Pool, outside the server, so a restart loses nothing.

A socket file is told apart from its predecessor by (device, inode, ctime): on ext4 a re-created
kubelet.sock can get the old inode number back, but creating it sets a new ctime. Any change of
kubelet.sock (appearing, re-created, with or without the folder wipe) also ends the retry
back-off, so registration follows within one poll interval."""

from __future__ import annotations

import logging
import os
import time
from concurrent import futures

import grpc

from rdma_netns.kernel.rdma_devices import DeviceSysfs
from rdma_netns_dp.api.deviceplugin.v1beta1 import api_pb2_grpc
from rdma_netns_dp.inventory import Pool
from rdma_netns_dp.registration import RegistrationFailed, WatcherRegistration, register, serve_watcher
from rdma_netns_dp.servicer import DevicePluginServicer

log = logging.getLogger("rdma_netns_dp.resource_plugin")
BACKOFF_FIRST = 0.5
BACKOFF_MAX = 10.0


def _inode(path: str) -> tuple[int, int, int] | None:
    """The identity of the file at `path` now: (device, inode, ctime in ns), None when absent."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


class ResourcePlugin:
    def __init__(self, pool: Pool, sysfs: DeviceSysfs, kubelet_dir: str, dev_root: str, use_cdi: bool,
                 registration: str, workers: int = 32, cdi_spec_dir: str = "/var/run/cdi") -> None:
        self.pool = pool
        self.cdi_spec_dir = cdi_spec_dir
        self.sysfs = sysfs
        self.dev_root = dev_root
        self.use_cdi = use_cdi
        self.registration = registration
        self.workers = workers
        kubelet_dir = os.path.abspath(kubelet_dir)  # gRPC reads "unix:relative" differently
        self.plugin_dir = os.path.join(kubelet_dir, "device-plugins")
        self.kubelet_socket = os.path.join(self.plugin_dir, "kubelet.sock")
        self.socket_name = f"rdma-netns-{pool.resource.slug}.sock"
        self.socket_path = os.path.join(self.plugin_dir, self.socket_name)
        self.watcher_socket = os.path.join(kubelet_dir, "plugins_registry", self.socket_name)
        self.server: grpc.Server | None = None
        self.servicer: DevicePluginServicer | None = None
        self.watcher_server: grpc.Server | None = None
        self.watcher: WatcherRegistration | None = None
        self._serving_inode: tuple[int, int, int] | None = None
        self._registered_with: tuple[int, int, int] | None = None  # kubelet.sock identity we registered with
        self._kubelet_seen: tuple[int, int, int] | None = None     # kubelet.sock identity at the last tick
        self._kubelet_known: tuple[int, int, int] | None = None    # the last kubelet.sock that existed
        self._next_attempt = 0.0
        self._backoff = BACKOFF_FIRST
        self._last_failure: str | None = None
        # For the metrics (metrics.py reads them at scrape time)
        self.registrations_ok = 0
        self.registrations_failed = 0
        self.kubelet_restarts = 0

    @property
    def registered(self) -> bool:
        if self.registration == "watcher":
            return bool(self.watcher and self.watcher.registered)
        return self._registered_with is not None

    def _start_server(self) -> None:
        self._stop_server()
        os.makedirs(self.plugin_dir, exist_ok=True)
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
        self.servicer = DevicePluginServicer(self.pool, self.sysfs, self.dev_root, self.use_cdi, self.cdi_spec_dir)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.workers))
        api_pb2_grpc.add_DevicePluginServicer_to_server(self.servicer, server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.start()
        self.server = server
        self._serving_inode = _inode(self.socket_path)
        self._registered_with = None
        if self.registration == "watcher":
            os.makedirs(os.path.dirname(self.watcher_socket), exist_ok=True)
            self.watcher = WatcherRegistration(self.pool.resource.name, self.socket_path)
            self.watcher_server = serve_watcher(self.watcher, self.watcher_socket)
        log.info("serving", extra={"resource": self.pool.resource.name, "socket": self.socket_path,
                                   "registration": self.registration})

    def _stop_server(self) -> None:
        if self.servicer:
            self.servicer.stopping.set()
            self.pool.wake_all()
        for server in (self.server, self.watcher_server):
            if server is not None:
                server.stop(grace=0.2).wait(2)
        self.server = self.watcher_server = None
        self.watcher = None
        self.servicer = None

    def tick(self) -> None:
        """Called every health interval: restart and re-register when kubelet needs it."""
        if self.server is None or _inode(self.socket_path) != self._serving_inode:
            if self.server is not None:
                log.warning("our socket is gone (kubelet restarted?): serving again",
                            extra={"resource": self.pool.resource.name, "socket": self.socket_path})
            self._start_server()
            self._next_attempt = 0.0
            self._backoff = BACKOFF_FIRST
        if self.registration != "kubelet":
            return
        kubelet = _inode(self.kubelet_socket)
        if kubelet != self._kubelet_seen:
            # kubelet.sock appeared or was re-created: a kubelet is (re)starting, so the back-off
            # earned against the previous one no longer applies.
            self._kubelet_seen = kubelet
            if kubelet is not None:
                # A kubelet.sock other than the last one seen: one kubelet restart (however many
                # ticks its stop, socket wipe and start are spread over).
                if self._kubelet_known is not None and kubelet != self._kubelet_known:
                    self.kubelet_restarts += 1
                self._kubelet_known = kubelet
                self._next_attempt = 0.0
                self._backoff = BACKOFF_FIRST
        if kubelet is not None and kubelet == self._registered_with:
            return
        if self._registered_with is not None:
            log.warning("kubelet.sock was re-created (kubelet restarted): registering again",
                        extra={"resource": self.pool.resource.name})
            self._registered_with = None
            self._next_attempt = 0.0
            self._backoff = BACKOFF_FIRST
        if time.monotonic() < self._next_attempt:
            return
        try:
            register(self.kubelet_socket, self.socket_name, self.pool.resource.name, self.servicer.options())
        except RegistrationFailed as exc:
            self.registrations_failed += 1
            reason = str(exc)
            if reason != self._last_failure:
                log.warning("registration with kubelet failed; retrying with back-off: %s", reason,
                            extra={"resource": self.pool.resource.name, "retry_in_s": self._backoff})
            else:
                log.debug("registration retry failed: %s", reason, extra={"retry_in_s": self._backoff})
            self._last_failure = reason
            self._next_attempt = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, BACKOFF_MAX)
            return
        self._registered_with = kubelet or _inode(self.kubelet_socket)
        self.registrations_ok += 1
        self._last_failure = None
        self._backoff = BACKOFF_FIRST
        log.info("registered with kubelet", extra={"resource": self.pool.resource.name,
                                                   "endpoint": self.socket_name})

    def stop(self) -> None:
        self._stop_server()
        for path in (self.socket_path, self.watcher_socket):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
