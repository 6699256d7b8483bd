"""The daemon's loop: discover, update every resource, keep kubelet registrations alive, write
the health file; once per health interval, until SIGTERM."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from rdma_netns import mode_policy
from rdma_netns.kernel.rdma_devices import DeviceSysfs, RdmaDevice
from rdma_netns.kernel.rdma_sysfs import GidUsage, RdmaPort
from rdma_netns.kubelet import podresources, ratelimit
from rdma_netns.util import fsutil, probe_file
from rdma_netns_dp import away, cdi, kernel_mode
from rdma_netns_dp.cni_state import device_netns
from rdma_netns_dp.config import DevicePluginConfig
from rdma_netns_dp.inventory import Pool
from rdma_netns_dp.pod_grants import PodGrantsServer
from rdma_netns_dp.resource_plugin import ResourcePlugin

if TYPE_CHECKING:
    from rdma_netns_dp.cni_events import CniEventsReceiver
    from rdma_netns_dp.dra.driver import DraDriver
    from rdma_netns_dp.metrics import DaemonMetrics

log = logging.getLogger("rdma_netns_dp.daemon")


class Daemon:
    def __init__(self, config: DevicePluginConfig) -> None:
        self.config = config
        self.sysfs = DeviceSysfs(config.sysfsRoot)
        self.mode = kernel_mode.resolve(config.mode, self.sysfs)
        self.stop_event = threading.Event()
        self.pools = [Pool(resource, self.mode) for resource in config.resources]
        # DRA mode: the rails go to kubelet as ResourceSlice devices through the DRA driver, not as
        # rdma/hca units; discovery, GID capacity, CDI and the broker stay the same.
        self.dra: DraDriver | None = None
        if config.dra.enabled:
            from rdma_netns_dp.dra.driver import DraDriver

            self.dra = DraDriver(config, self.sysfs)
        self.plugins = [] if self.dra else [ResourcePlugin(pool, self.sysfs, config.kubeletDir, config.devRoot,
                                       config.cdi.enabled, config.registration, cdi_spec_dir=config.cdi.specDir)
                        for pool in self.pools]
        self._last_blocked: str | None = None
        self._last_gid_units: dict[str, int | None] = {}  # resource -> GID capacity last logged
        self.pod_grants: PodGrantsServer | None = None
        # exclusive + CDI: each device as last seen on the host, and, while it is away in a pod,
        # with the char devices the kernel gives it there (the CDI entry stays and follows them)
        self._last_seen: dict[str, RdmaDevice] = {}
        # The last discovery pass, for the metrics' port series (read at scrape time)
        self.last_discovery: tuple[list[RdmaDevice], dict[RdmaPort, GidUsage]] = ([], {})
        self.pod_resources_socket = os.path.join(config.kubeletDir, "pod-resources", "kubelet.sock")
        # One kubelet client for the broker and the metrics: one channel, one share of kubelet's
        # PodResources rate limit (ratelimit.CLIENT_QPS of its 100 QPS), one count of the calls.
        self.kubelet = podresources.Client(ratelimit.TokenBucket(), observe=self._kubelet_call)
        self.metrics: DaemonMetrics | None = None
        self.cni_events: CniEventsReceiver | None = None

    def _kubelet_call(self, method: str, result: str) -> None:
        if self.metrics is not None:
            self.metrics.kubelet_call(method, result)

    @property
    def last_blocked(self) -> str | None:
        """Why the kernel's RDMA netns mode blocks the resources, as of the last pass (None: it does not)."""
        return self._last_blocked

    def poll(self) -> None:
        """One discovery pass: a few sysfs reads per device, plus in shared mode one per GID
        table entry of the selected RoCE ports."""
        devices = self.sysfs.devices()
        gids = self.read_gids(devices)
        self.last_discovery = (devices, gids)
        blocked = kernel_mode.mismatch(self.mode, self.sysfs)
        if blocked != self._last_blocked:
            (log.error if blocked else log.info)(blocked or "kernel RDMA netns mode now matches",
                                                 extra={"mode": self.mode})
            self._last_blocked = blocked
        in_pods: dict[str, str] = {}
        if self.mode == "exclusive":
            present = {d.name for d in devices}
            if any(name not in present for pool in self.pools for name in pool.known_names()):
                in_pods = device_netns(self.config.cniStateDir)
            if self.config.cdi.enabled or self.dra is not None:
                for d in devices:
                    self._last_seen[d.name] = d
        for pool in self.pools:
            changed = pool.update(devices, set(in_pods), blocked, gids)
            self.log_gid_capacity(pool)
            if changed:
                _, units = pool.snapshot()
                unopenable = [d.name for d in pool.devices if d.uverbs is None]
                if unopenable:
                    log.warning("RDMA devices without a uverbs char device: their units are Unhealthy until "
                                "ib_uverbs is loaded (modprobe ib_uverbs; rdma-core loads it at boot)",
                                extra={"resource": pool.resource.name, "rdma_devices": unopenable})
                log.info("devices", extra={"resource": pool.resource.name, "devices": len(units),
                                           "healthy": sum(u.healthy for u in units),
                                           "rdma_devices": [d.name for d in pool.devices],
                                           "in_pods": sorted(pool.in_pods), "blocked": blocked})
            if self.config.cdi.enabled and self.dra is None:
                spec = cdi.build_spec(pool.resource.slug, list(pool.devices) + self.away_devices(pool, in_pods),
                                      self.config.devRoot, pool.resource.includeUmad, self.sysfs.rdma_cm_present())
                if cdi.write_spec(self.config.cdi.specDir, pool.resource.slug, spec):
                    log.info("CDI spec written", extra={"path": cdi.spec_path(self.config.cdi.specDir,
                                                                              pool.resource.slug)})

        if self.dra is not None:
            away = {pool.resource.name: [self._last_seen[n] for n in sorted(pool.in_pods) if n in self._last_seen]
                    for pool in self.pools}
            self.dra.update(self.pools, devices, gids, blocked, away)

    def read_gids(self, devices: list[RdmaDevice]) -> dict[RdmaPort, GidUsage]:
        """GID table usage of every port a pool is bounded by, read before any pool's lock."""
        ports = dict.fromkeys(p for pool in self.pools for p in pool.gid_ports(devices))
        return {p: usage for p in ports if (usage := self.sysfs.gid_usage(p)) is not None}

    def log_gid_capacity(self, pool: Pool) -> None:
        """Once per change of how many units the GID tables allow; a warning while that caps
        the resource below sharedUnits."""
        capacity = pool.gid_capacity
        units = capacity.units if capacity else None
        name = pool.resource.name
        if not pool.shared or (name in self._last_gid_units and self._last_gid_units[name] == units):
            return
        self._last_gid_units[name] = units
        if capacity is None:
            log.info("no GID table to bound the units by", extra={"resource": name})
            return
        capped = capacity.units < pool.resource.sharedUnits
        (log.warning if capped else log.info)(capacity.describe(), extra={
            "resource": name, "gid_capacity": capacity.units, "shared_units": pool.resource.sharedUnits})

    def away_devices(self, pool: Pool, in_pods: dict[str, str]) -> list[RdmaDevice]:
        """Devices of `pool` away in pods, as the CDI spec must describe them now: a container of
        the pod is created after the move, and its runtime resolves the CDI name then. The uverbs
        node is the one the kernel gave the device in the pod (asked there); when it cannot be
        asked (namespace going away), the host's sysfs if it still lists it, else the last known."""
        out = []
        fresh = None
        for name in sorted(pool.in_pods):
            last = self._last_seen.get(name)
            if last is None:
                continue  # never seen on the host by this daemon: nothing to describe
            found = away.uverbs_in_netns(name, in_pods.get(name, "")) if in_pods.get(name) else None
            if found is not None:
                uverbs = found[0]
            else:
                if fresh is None:
                    fresh = self.sysfs.fresh_char_devices(sorted(pool.in_pods))
                uverbs = fresh.get(name, (None, ()))[0] or last.uverbs
            if uverbs is not None and uverbs != last.uverbs:
                log.info("device away in a pod has a new uverbs node", extra={
                    "rdma_device": name, "was": last.uverbs.name if last.uverbs else None, "now": uverbs.name})
                last = replace(last, uverbs=uverbs)
                self._last_seen[name] = last
            out.append(last)
        return out

    def write_health(self) -> None:
        path = self.config.healthFile
        if not path:
            return
        status = {"time": time.time(), "pid": os.getpid(), "mode": self.mode,
                  "blocked": self._last_blocked,
                  "podGrantsSocket": self.pod_grants.socket_path if self.pod_grants else None,
                  "resources": {p.pool.resource.name: self.resource_health(p) for p in self.plugins}}
        if self.dra is not None:
            status["dra"] = self.dra.status()
        folder = os.path.dirname(path) or "."
        os.makedirs(folder, exist_ok=True)
        fsutil.write_atomic(path, json.dumps(status).encode(), 0o644)  # a probe may read it as any user
        # Next to it, what the readiness probe reads with the shell: every resource registered, and
        # the kernel's RDMA netns mode the one the config needs (else every unit is Unhealthy).
        problems = []
        pending = sorted(name for name, r in status["resources"].items() if not r["registered"])
        if pending:
            problems.append(f"not registered with kubelet: {', '.join(pending)}")
        if self.dra is not None:
            if not self.dra.registered:
                problems.append(f"DRA driver {self.dra.driver} not registered with kubelet")
            if self.dra.last_error:
                problems.append(f"ResourceSlices not published: {self.dra.last_error}")
        if self._last_blocked:
            problems.append(f"{self._last_blocked}: {mode_policy.fix_hint(self.mode)}")
        probe_file.write(ready_file(path), problems)

    @staticmethod
    def resource_health(plugin: ResourcePlugin) -> dict:
        """A resource's line in the health file; a shared one's gidCapacity says what the GID
        tables allow (None when no table was read), so an admin sees why units are Unhealthy."""
        pool = plugin.pool
        status = {"registered": plugin.registered, "devices": len(pool.units), "healthy": pool.healthy_count()}
        if pool.shared:
            status["gidCapacity"] = pool.gid_capacity.as_json() if pool.gid_capacity else None
        return status

    def run(self) -> int:
        log.info("starting", extra={"mode": self.mode, "resources": [r.name for r in self.config.resources],
                                    "kubelet_dir": self.config.kubeletDir,
                                    "registration": self.config.registration})
        if self.config.ensureKernelMode:
            kernel_mode.ensure(self.mode, self.sysfs)
        interval = self.config.healthIntervalSeconds
        try:
            self.start_metrics()
            if self.dra is not None:
                self.poll()  # the rails known before kubelet can ask to prepare a claim
                self.dra.start()
            self.start_pod_grants()
            while not self.stop_event.is_set():
                started = time.monotonic()
                self.poll()
                for plugin in self.plugins:
                    try:
                        plugin.tick()
                    except Exception:  # one bad pass must not end the node's RDMA advertising
                        log.exception("serving or registering failed; trying again next interval",
                                      extra={"resource": plugin.pool.resource.name})
                self.write_health()
                self.stop_event.wait(max(0.0, interval - (time.monotonic() - started)))
        finally:
            self.shutdown()
        return 0

    def start_pod_grants(self) -> None:
        """Serve the grants broker. Without it the CNI asks kubelet itself (slower), so a failure
        here is logged and the device plugin keeps serving."""
        if not self.config.podGrantsSocket:
            return
        observe = self.metrics.broker_answer if self.metrics else None
        try:
            self.pod_grants = PodGrantsServer(self.config.podGrantsSocket, observe=observe, client=self.kubelet,
                                              dra=self.dra.pod_grant if self.dra else None).start()
        except OSError as exc:
            log.error("cannot serve the pod grants broker; the CNI will ask kubelet directly",
                      extra={"socket": self.config.podGrantsSocket, "error": str(exc)})

    def start_metrics(self) -> None:
        """Serve /metrics and receive the CNI's events, when a port is set. Failing to is logged,
        never fatal: the node's RDMA does not depend on being watched."""
        settings = self.config.metrics
        if not settings.port:
            return
        from rdma_netns_dp.cni_events import CniEventsReceiver
        from rdma_netns_dp.gid_audit_metrics import INTERVAL as GID_AUDIT_INTERVAL
        from rdma_netns_dp.metrics import DaemonMetrics

        self.metrics = DaemonMetrics(self, self.config.cniStateDir, self.kubelet, settings.refreshSeconds,
                                     min(GID_AUDIT_INTERVAL, 10 * self.config.healthIntervalSeconds))
        self.metrics.start_sampling()
        try:
            port = self.metrics.serve(settings.address, settings.port)
            log.info("serving /metrics", extra={"address": settings.address, "port": port})
        except OSError as exc:
            log.error("cannot serve /metrics", extra={"address": settings.address, "port": settings.port,
                                                      "error": str(exc)})
        try:
            self.cni_events = CniEventsReceiver(settings.cniEventsFifo, self.metrics.cni_event,
                                                self.metrics.events_rejected.inc).start()
        except OSError as exc:
            log.error("cannot receive CNI events; CNI call metrics stay empty",
                      extra={"socket": settings.cniEventsFifo, "error": str(exc)})

    def shutdown(self) -> None:
        log.info("stopping: removing sockets")
        if self.cni_events is not None:
            self.cni_events.stop()
            self.cni_events = None
        if self.metrics is not None:
            self.metrics.stop()
        if self.pod_grants is not None:
            self.pod_grants.stop()
            self.pod_grants = None
        for plugin in self.plugins:
            plugin.stop()
        if self.dra is not None:
            self.dra.stop()
        self.kubelet.close()
        if self.config.healthFile:
            fsutil.remove(self.config.healthFile)
            fsutil.remove(ready_file(self.config.healthFile))


def ready_file(health_file: str) -> str:
    """The readiness file lives next to the health file: `ready` once every resource is registered
    and the kernel's RDMA netns mode is the one the config needs."""
    return os.path.join(os.path.dirname(health_file) or ".", "ready")
