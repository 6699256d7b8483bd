"""`rdma_netns_gid_entries_unexplained`: GID entries of pods' interfaces no attachment record
explains (rdma_netns.rails.gid_audit), per RDMA port, for an alert on a tenant filling the table.

The audit reads a whole GID table per port and every CNI state file, so it runs in a thread of
its own at most once per `interval` seconds; a scrape only reads its last result (a scrape's cost
does not grow with the tables or the number of pods, and never waits for sysfs).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from rdma_netns.kernel.rdma_sysfs import RdmaPort, RdmaSysfs
from rdma_netns.rails import gid_audit

log = logging.getLogger("rdma_netns_dp.gid_audit")

INTERVAL = 30.0  # seconds between audits: a tenant fills a table in seconds, an alert fires in minutes


class GidAuditCollector:
    """The registry's collector of the unexplained-entries series; start() begins the audits."""

    def __init__(self, sysfs: RdmaSysfs, ports: Callable[[], Iterable[RdmaPort]], state_dir: str,
                 interval: float = INTERVAL) -> None:
        self.sysfs, self.ports, self.state_dir, self.interval = sysfs, ports, state_dir, interval
        self.last: dict[RdmaPort, gid_audit.PortAudit] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> None:
        """One audit of every port the daemon watches (the GID-bounded ports of its pools)."""
        ports = list(dict.fromkeys(self.ports()))
        found = gid_audit.audit(self.sysfs, ports, gid_audit.records(self.state_dir)) if ports else {}
        for port, result in found.items():
            before = self.last.get(port)
            if result.unexplained and (before is None or before.unexplained != result.unexplained):
                log.warning("GID entries of pods' interfaces that no attachment record explains",
                            extra={"device": port.device, "port": port.port, "entries": result.unexplained,
                                   "samples": [f"{gid_audit.address_of(g)} on {n}" for g, n in result.samples]})
        self.last = found

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gid-audit", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception:  # an audit is advice: never let it take the daemon down
                log.exception("GID audit failed")
            self._stop.wait(self.interval)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        series = GaugeMetricFamily(
            "rdma_netns_gid_entries_unexplained",
            "GID entries of pods' interfaces that no attachment record explains (addresses a pod added "
            "itself: forbid NET_ADMIN in pods with rails)", labels=["device", "port"])
        for port, result in sorted(self.last.items(), key=lambda item: (item[0].device, item[0].port)):
            series.add_metric([port.device, str(port.port)], result.unexplained)
        yield series
