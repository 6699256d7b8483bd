"""The daemon's Prometheus metrics: what the node advertises, holds and does, on /metrics.

Two kinds of series:
- state (NodeCollector), read from memory when Prometheus scrapes: units per resource (advertised,
  healthy), RDMA ports (state, GID table fill, from the daemon's last discovery pass, at most one
  health interval old), registration and kubelet restarts (counted by each ResourcePlugin); and
  what costs more to learn, sampled in the background every `refreshSeconds` by the Sampler, never
  by a scrape: units allocated (kubelet's PodResources List, inside the daemon's share of kubelet's
  rate limit) and pods per rail (the CNI's state files);
- events, counted as they happen: every CNI call (cni_events.py receives what each call sends),
  every grants broker answer, every kubelet call the daemon makes.
A scrape therefore never calls kubelet and its work does not grow with the pods on the node; the
HTTP side (metrics_http.py) caps connections and renders at most once a second.
Names follow Prometheus' conventions: rdma_netns_ prefix, base units (seconds), _total counters,
no unbounded labels (a CNI error code is one of the spec's few, a command one of six).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter as Tally
from collections.abc import Iterator, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.process_collector import ProcessCollector

from rdma_netns.kernel.rdma_devices import RdmaDevice
from rdma_netns.kernel.rdma_sysfs import GidUsage, RdmaPort, RdmaSysfs
from rdma_netns.kubelet import podresources
from rdma_netns.state import all_records, read_state
from rdma_netns_dp.gid_audit_metrics import INTERVAL as GID_AUDIT_INTERVAL
from rdma_netns_dp.gid_audit_metrics import GidAuditCollector
from rdma_netns_dp.metrics_http import Exposition, MetricsServer
from rdma_netns_dp.resource_plugin import ResourcePlugin

log = logging.getLogger("rdma_netns_dp.metrics")

CNI_COMMANDS = ("ADD", "DEL", "CHECK", "STATUS", "GC")
# The runtime's whole ADD budget is seconds (IPv6 DAD alone is 1.5 s in Go plugins): buckets from
# a fast chained pass-through (~10 ms) to a stuck IPAM delegate.
CNI_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
BROKER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
PORT_STATES = ("DOWN", "INIT", "ARMED", "ACTIVE", "ACTIVE_DEFER")
POD_RESOURCES_TIMEOUT = 1.0  # a sample must not hang on a stuck kubelet


class NodeView(Protocol):
    """What the metrics read of the daemon (rdma_netns_dp.daemon.Daemon is one): declared here so
    that this module never imports the daemon, which imports it."""

    plugins: Sequence[ResourcePlugin]
    sysfs: RdmaSysfs
    pod_resources_socket: str
    last_discovery: tuple[list[RdmaDevice], dict[RdmaPort, GidUsage]]

    @property
    def last_blocked(self) -> str | None: ...


class DaemonMetrics:
    """The registry and the event counters; serve() exposes them over HTTP. With a `node`, its
    state too (NodeCollector), the costly part sampled by a Sampler that start_sampling() runs."""

    def __init__(self, node: NodeView | None = None, cni_state_dir: str = "",
                 client: podresources.Client | None = None, refresh_seconds: float = 10.0,
                 gid_audit_interval: float = GID_AUDIT_INTERVAL) -> None:
        disable_created_metrics()  # the _created series double every counter for no use here
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        self.cni_calls = Counter("rdma_netns_cni_calls", "CNI calls by command and result code (0 = success)",
                                 ["command", "code"], registry=self.registry)
        self.cni_seconds = Histogram("rdma_netns_cni_call_duration_seconds",
                                     "Time a CNI call took, from its own code's start to its answer",
                                     ["command"], buckets=CNI_BUCKETS, registry=self.registry)
        self.pairing = Counter("rdma_netns_cni_pairing", "How ADDs learned the pod's grant: through the "
                               "grants broker or kubelet itself (the fallback), and the outcome",
                               ["via", "outcome"], registry=self.registry)
        self.events_rejected = Counter("rdma_netns_cni_events_rejected", "CNI events not understood",
                                       registry=self.registry)
        self.broker_requests = Counter("rdma_netns_grants_broker_requests",
                                       "Grants broker answers by result (found, not_found, or the error kind)",
                                       ["result"], registry=self.registry)
        self.broker_seconds = Histogram("rdma_netns_grants_broker_request_duration_seconds",
                                        "Time the grants broker took to answer (kubelet's part included)",
                                        buckets=BROKER_BUCKETS, registry=self.registry)
        self.kubelet_calls = Counter("rdma_netns_kubelet_pod_resources_calls",
                                     "The daemon's calls to kubelet's PodResources API (grants broker and "
                                     "allocated units) by method and result; rate_limited: refused by "
                                     "kubelet's rate limit, then retried", ["method", "result"],
                                     registry=self.registry)
        for command in CNI_COMMANDS:  # every command's series exist from the start (rate() needs a 0)
            self.cni_seconds.labels(command)
        self.server: MetricsServer | None = None
        self.sampler: Sampler | None = None
        self.gid_audit: GidAuditCollector | None = None
        if node is not None:
            self.sampler = Sampler(node, cni_state_dir, client or podresources.Client(), refresh_seconds)
            self.registry.register(NodeCollector(node, self.sampler))
            # audited in its own thread (at most every GID_AUDIT_INTERVAL s); scrapes read the result
            self.gid_audit = GidAuditCollector(node.sysfs, lambda: node.last_discovery[1], cni_state_dir,
                                               gid_audit_interval)
            self.registry.register(self.gid_audit)

    def cni_event(self, command: str, code: int, seconds: float, pairing: str, granted: bool | None) -> None:
        self.cni_calls.labels(command, str(code)).inc()
        self.cni_seconds.labels(command).observe(seconds)
        if pairing:
            outcome = ("granted" if granted else "not_granted" if granted is False
                       else "unavailable" if code == 107 else "error")
            self.pairing.labels(pairing, outcome).inc()

    def broker_answer(self, result: str, seconds: float) -> None:
        self.broker_requests.labels(result).inc()
        self.broker_seconds.observe(seconds)

    def kubelet_call(self, method: str, result: str) -> None:
        self.kubelet_calls.labels(method, result).inc()

    def serve(self, address: str, port: int) -> int:
        """Serve /metrics; returns the port (the one the kernel chose when `port` is 0)."""
        exposition = Exposition(lambda: generate_latest(self.registry))
        self.server = MetricsServer(address, port, exposition, CONTENT_TYPE_LATEST).start()
        if self.gid_audit is not None:
            self.gid_audit.start()
        return self.server.server_port

    def start_sampling(self) -> None:
        if self.sampler is not None:
            self.sampler.start()

    def stop(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()
        if self.gid_audit is not None:
            self.gid_audit.stop()
        if self.server is not None:
            self.server.stop()
            self.server = None


class Sample:
    """One background reading: allocated units per resource (None when kubelet did not answer)
    and attachments per rail netdev."""

    def __init__(self, allocated: dict[str, int] | None, rail_pods: dict[str, int]) -> None:
        self.allocated = allocated
        self.rail_pods = rail_pods


class Sampler:
    """Reads, every `interval` seconds in a thread of its own, what a scrape must not pay for:
    kubelet's allocations (one List through the daemon's kubelet client, inside its share of
    kubelet's rate limit) and the CNI's state files (as many as the node has attachments)."""

    def __init__(self, node: NodeView, cni_state_dir: str, client: podresources.Client, interval: float) -> None:
        self.node = node
        self.cni_state_dir = cni_state_dir
        self.client = client
        self.interval = interval
        self.latest = Sample(None, {})
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> Sample:
        names = [p.pool.resource.name for p in self.node.plugins]
        try:
            allocated: dict[str, int] | None = podresources.allocated_counts(
                self.node.pod_resources_socket, names, POD_RESOURCES_TIMEOUT, client=self.client)
        except podresources.PodResourcesUnavailable as exc:
            log.debug("PodResources List failed", extra={"error": str(exc)})
            allocated = None
        self.latest = Sample(allocated, rail_attachments(self.cni_state_dir) if self.cni_state_dir else {})
        return self.latest

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.refresh()
            except Exception:  # never end the sampling: the series would freeze unnoticed
                log.exception("metrics sample failed")
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="metrics-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class NodeCollector:
    """The node's state, read at scrape time from the daemon's memory and the Sampler's latest."""

    def __init__(self, node: NodeView, sampler: Sampler) -> None:
        self.node = node
        self.sampler = sampler

    def describe(self) -> list[Metric]:
        return []  # the series depend on what is on the node; no registration-time check

    def collect(self) -> Iterator[Metric]:
        yield from self.resources()
        yield from self.ports()
        yield self.rail_pods()

    def resources(self) -> Iterator[Metric]:
        d = self.node
        units = GaugeMetricFamily("rdma_netns_units", "Units advertised to kubelet", labels=["resource"])
        healthy = GaugeMetricFamily("rdma_netns_units_healthy", "Units advertised Healthy", labels=["resource"])
        registered = GaugeMetricFamily("rdma_netns_registered", "1 while kubelet has the resource registered",
                                       labels=["resource"])
        registrations = CounterMetricFamily("rdma_netns_kubelet_registrations",
                                            "Registration attempts with kubelet by result",
                                            labels=["resource", "result"])
        restarts = CounterMetricFamily("rdma_netns_kubelet_restarts", "kubelet restarts seen (a new "
                                       "kubelet.sock)", labels=["resource"])
        for plugin in d.plugins:
            name = plugin.pool.resource.name
            _, snapshot = plugin.pool.snapshot()
            units.add_metric([name], len(snapshot))
            healthy.add_metric([name], sum(1 for u in snapshot if u.healthy))
            registered.add_metric([name], 1 if plugin.registered else 0)
            registrations.add_metric([name, "ok"], plugin.registrations_ok)
            registrations.add_metric([name, "failed"], plugin.registrations_failed)
            restarts.add_metric([name], plugin.kubelet_restarts)
        yield from (units, healthy, registered, registrations, restarts)
        blocked = GaugeMetricFamily("rdma_netns_kernel_mode_mismatch", "1 while the kernel's RDMA netns mode "
                                    "is not the one the resources need (every unit Unhealthy)")
        blocked.add_metric([], 1 if d.last_blocked else 0)
        yield blocked
        yield from self.allocated()

    def allocated(self) -> Iterator[Metric]:
        """Units kubelet has given to pods: its own PodResources List (the plugin is told of an
        allocation but never of its end), as the Sampler last read it."""
        up = GaugeMetricFamily("rdma_netns_kubelet_pod_resources_up",
                               "1 when kubelet's PodResources API answered the last sample")
        counts = self.sampler.latest.allocated
        names = [p.pool.resource.name for p in self.node.plugins]
        if counts is None:
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        allocated = GaugeMetricFamily("rdma_netns_units_allocated", "Units kubelet has allocated to pods",
                                      labels=["resource"])
        for name in names:
            allocated.add_metric([name], counts.get(name, 0))
        yield allocated

    def ports(self) -> Iterator[Metric]:
        devices, gids = self.node.last_discovery
        up = GaugeMetricFamily("rdma_netns_port_up", "1 while the RDMA port is ACTIVE", labels=["device", "port"])
        state = GaugeMetricFamily("rdma_netns_port_state", "The RDMA port's state (1 for the current one)",
                                  labels=["device", "port", "state"])
        used = GaugeMetricFamily("rdma_netns_gid_entries_used", "GID table entries in use",
                                 labels=["device", "port"])
        size = GaugeMetricFamily("rdma_netns_gid_entries", "GID table size", labels=["device", "port"])
        per_address = GaugeMetricFamily("rdma_netns_gid_entries_per_address",
                                        "GID entries each IP address takes (mlx5: 2, Soft-RoCE: 1)",
                                        labels=["device", "port"])
        free = GaugeMetricFamily("rdma_netns_gid_free_addresses",
                                 "IP addresses the GID table can still take (0: pods get no GID)",
                                 labels=["device", "port"])
        in_pods = GaugeMetricFamily("rdma_netns_gid_entries_in_pods", "GID entries of pods' interfaces",
                                    labels=["device", "port"])
        for device in devices:
            for port in device.ports:
                labels = [device.name, str(port.number)]
                up.add_metric(labels, 1 if port.active else 0)
                states = PORT_STATES if port.state in PORT_STATES else (*PORT_STATES, port.state)
                for s in states:
                    state.add_metric([*labels, s], 1 if s == port.state else 0)
        for rdma_port, usage in sorted(gids.items(), key=lambda item: (item[0].device, item[0].port)):
            labels = [rdma_port.device, str(rdma_port.port)]
            used.add_metric(labels, usage.used)
            size.add_metric(labels, usage.total)
            per_address.add_metric(labels, usage.per_address)
            free.add_metric(labels, usage.free_addresses)
            in_pods.add_metric(labels, usage.in_pods)
        yield from (up, state, used, size, per_address, free, in_pods)

    def rail_pods(self) -> Metric:
        """Attachments per host netdev, from the CNI's state records (the daemon's own view of what
        pods hold: the same files DEL and GC read), as the Sampler last read them."""
        pods = GaugeMetricFamily("rdma_netns_rail_pods", "Pod attachments on each host netdev (rail)",
                                 labels=["netdev"])
        for netdev, count in sorted(self.sampler.latest.rail_pods.items()):
            pods.add_metric([netdev], count)
        return pods


def rail_attachments(state_dir: str) -> dict[str, int]:
    """Host netdev -> attachments recorded on it, from the CNI's state files."""
    tally: Tally[str] = Tally()
    for _network, _cid, _ifname, path in all_records(state_dir):
        state = read_state(path)
        for rail in state.rails if state is not None else ():
            netdev = rail.get("netdev")
            if isinstance(netdev, str) and netdev:
                tally[netdev] += 1
    return dict(tally)
