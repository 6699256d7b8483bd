"""The device plugin's /metrics as a real Prometheus server sees them, after real CNI calls.

All of it runs inside the test's node namespace (its own loopback): the rdma-netns-dp daemon
(fake sysfs of the standard host, registered with the stand-in kubelet, whose PodResources API
admits the pods), Debian's Prometheus scraping it every second, and the CNI plugin attaching
veth-backed rails to pods in real namespaces. Prometheus' query API must then return the series
the calls made; promtool must accept the exposition; every query of the shipped Grafana dashboard
must parse in Prometheus and name only metrics the daemon exports.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.dp.conftest import HOST_GID_TABLE, dp_binary, soft_roce_gid_tables
from tests.fake_rdma_sysfs import standard_host
from tests.kubelet_standin import KubeletStandIn, PodResourcesStandIn
from tests.netns.conftest import ip
from tests.netns.test_pairing import k8s_args, primary_result

pytestmark = pytest.mark.netns

REPO = Path(__file__).resolve().parent.parent.parent
DASHBOARD = REPO / "conf" / "grafana" / "rdma-netns-dashboard.json"
RESOURCE = "rdma/hca"
METRICS_PORT = 9478
PROMETHEUS_PORT = 9090
# Fetches a URL from inside a namespace (the daemon and Prometheus listen on its loopback only).
FETCH = "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"


def fetch(netns: str, url: str) -> str:
    proc = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", FETCH, url],
                          capture_output=True, text=True, timeout=30)
    if proc.returncode:
        raise OSError(f"GET {url} in {netns}: {proc.stderr.strip()[-400:]}")
    return proc.stdout


def wait_for(what: str, check, timeout: float = 30.0, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except OSError as exc:
            last = exc
        time.sleep(interval)
    raise AssertionError(f"{what}: not after {timeout:.0f} s (last: {last!r})")


class Monitored:
    """The daemon, kubelet stand-ins and Prometheus of one node namespace."""

    def __init__(self, node) -> None:
        self.node = node
        self.base = Path(tempfile.mkdtemp(prefix="rnm-", dir="/tmp"))  # short: unix socket paths
        self.fake = soft_roce_gid_tables(standard_host(self.base / "host", "Y", soft=True), HOST_GID_TABLE)
        self.kubelet_dir = self.base / "k"
        self.pod_resources = PodResourcesStandIn(self.kubelet_dir / "pod-resources" / "kubelet.sock")
        self.kubelet = KubeletStandIn(self.kubelet_dir / "device-plugins", pod_resources=self.pod_resources)
        self.kubelet.start()
        self.grants = self.base / "pg.sock"
        self.events = self.base / "ev"
        self.daemon: subprocess.Popen | None = None
        self.prometheus: subprocess.Popen | None = None

    def start_daemon(self, refresh_seconds: float = 0.2) -> None:
        config = self.base / "dp.json"
        config.write_text(json.dumps({
            "mode": "shared", "kubeletDir": str(self.kubelet_dir), "sysfsRoot": str(self.fake.sys),
            "devRoot": str(self.fake.dev), "healthIntervalSeconds": 0.2, "healthFile": str(self.base / "health"),
            "podGrantsSocket": str(self.grants), "cniStateDir": self.node.state_dir,
            "metrics": {"address": "127.0.0.1", "port": METRICS_PORT, "cniEventsFifo": str(self.events),
                        "refreshSeconds": refresh_seconds},
            "resources": [{"name": RESOURCE, "sharedUnits": 1000}]}))
        self.daemon_log = open(self.base / "dp.log", "wb")
        self.daemon = subprocess.Popen(["ip", "netns", "exec", self.node.name, dp_binary(), "--config", str(config)],
                                       stdout=self.daemon_log, stderr=subprocess.STDOUT)
        self.kubelet.wait_registrations(1, 15)
        self.kubelet.plugin(RESOURCE, 15).wait_first(15)
        wait_for("the events FIFO", self.events.exists, 10, 0.1)

    def stop_daemon(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(signal.SIGTERM)
            self.daemon.wait(15)

    def start_prometheus(self) -> None:
        config = self.base / "prometheus.yml"
        config.write_text(f"global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                          f"scrape_configs:\n  - job_name: rdma-netns-dp\n    static_configs:\n"
                          f"      - targets: ['127.0.0.1:{METRICS_PORT}']\n")
        self.prometheus_log = open(self.base / "prometheus.log", "wb")
        self.prometheus = subprocess.Popen(
            ["ip", "netns", "exec", self.node.name, "prometheus", f"--config.file={config}",
             f"--storage.tsdb.path={self.base / 'tsdb'}", f"--web.listen-address=127.0.0.1:{PROMETHEUS_PORT}"],
            stdout=self.prometheus_log, stderr=subprocess.STDOUT)
        wait_for("Prometheus ready", lambda: "Ready" in fetch(self.node.name, self.url("/-/ready")), 60)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{PROMETHEUS_PORT}{path}"

    def query(self, expr: str) -> dict:
        from urllib.parse import quote

        answer = json.loads(fetch(self.node.name, self.url(f"/api/v1/query?query={quote(expr)}")))
        assert answer["status"] == "success", answer
        return answer["data"]

    def value(self, expr: str) -> float | None:
        """The single sample of an instant query (None when it has none)."""
        result = self.query(expr)["result"]
        assert len(result) <= 1, f"{expr}: {result}"
        return float(result[0]["value"][1]) if result else None

    def wait_value(self, expr: str, expected: float, timeout: float = 30.0) -> None:
        wait_for(f"{expr} == {expected}", lambda: self.value(expr) == expected, timeout)

    def scrape(self) -> str:
        return fetch(self.node.name, f"http://127.0.0.1:{METRICS_PORT}/metrics")

    def logs(self) -> str:
        out = []
        for name in ("dp.log", "prometheus.log"):
            path = self.base / name
            if path.exists():
                out.append(f"--- {name}\n{path.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)

    def close(self) -> None:
        for proc in (self.prometheus, self.daemon):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
        self.kubelet.close()
        self.pod_resources.close()
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture
def monitored(node):
    if not shutil.which("prometheus") or not shutil.which("promtool"):
        if os.environ.get("CI"):
            pytest.fail("Debian's prometheus package is missing; scripts/setup.sh installs it")
        pytest.skip("needs Debian's prometheus (scripts/setup.sh)")
    m = Monitored(node)
    try:
        m.start_daemon()
        m.start_prometheus()
        yield m
    except BaseException:
        print(m.logs())
        raise
    finally:
        m.close()


def paired_conf(m: Monitored, pod: str, grants_socket: str) -> dict:
    return m.node.conf(rails=2, version="1.0.0", resourceName=RESOURCE,
                       podResourcesSocket=str(m.pod_resources.socket), podGrantsSocket=grants_socket,
                       podResourcesTimeoutMs=5000, eventsFifo=str(m.events),
                       prevResult=primary_result(m.node, pod))


def add(m: Monitored, pod: str, name: str, cid: str, grants_socket: str | None = None):
    conf = paired_conf(m, pod, str(m.grants) if grants_socket is None else grants_socket)
    return m.node.cni("ADD", conf, pod, ifname="eth0", container_id=cid, extra_env=k8s_args(name))


def dashboard_queries() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in doc["templating"]["list"] if isinstance(v.get("query"), dict)]
    return exprs


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\b(rdma_netns_[a-z_]+)\b", expr))


def exported_names(exposition: str) -> set[str]:
    names = set(re.findall(r"^# TYPE (\S+) ", exposition, re.M))
    series = set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", exposition, re.M))
    return names | series


def test_prometheus_sees_what_the_node_and_its_cni_calls_did(node, monitored):
    m = monitored
    trainer, web, stranger, fallback = node.pod(), node.pod(), node.pod(), node.pod()
    m.kubelet.admit_pod("team-a", "trainer", {"main": {RESOURCE: 1}})
    m.kubelet.admit_pod("team-a", "web", {"main": {}})
    m.kubelet.admit_pod("team-a", "fallback", {"main": {RESOURCE: 1}})

    result = add(m, trainer, "trainer", "sbx1").ok()
    assert [i["name"] for i in result["interfaces"]] == ["eth0", "rdma0", "rdma1"]
    assert add(m, web, "web", "sbx2").ok()["interfaces"][0]["name"] == "eth0"   # passes through, no rails
    add(m, stranger, "nobody", "sbx3").error(107)                               # kubelet does not know it
    # The broker's socket absent: the CNI asks kubelet itself, and says so in its event.
    add(m, fallback, "fallback", "sbx4", grants_socket=str(m.base / "no-broker.sock")).ok()

    m.wait_value('rdma_netns_cni_calls_total{command="ADD",code="0"}', 3)
    m.wait_value('rdma_netns_cni_calls_total{command="ADD",code="107"}', 1)
    assert m.value('rdma_netns_cni_call_duration_seconds_count{command="ADD"}') == 4
    p99 = m.value('histogram_quantile(0.99, rdma_netns_cni_call_duration_seconds_bucket{command="ADD"})')
    assert p99 is not None and 0 < p99 <= 30
    pairing = {(r["metric"]["via"], r["metric"]["outcome"]): float(r["value"][1])
               for r in m.query("rdma_netns_cni_pairing_total")["result"]}
    assert pairing == {("broker", "granted"): 1, ("broker", "not_granted"): 1,
                       ("broker", "unavailable"): 1, ("kubelet", "granted"): 1}, pairing
    broker = {r["metric"]["result"]: float(r["value"][1])
              for r in m.query("rdma_netns_grants_broker_requests_total")["result"]}
    assert broker == {"found": 2, "not_found": 1}, broker

    # Node state: units, kubelet's allocations, registration, ports, GID tables, pods per rail.
    m.wait_value('rdma_netns_units{resource="rdma/hca"}', 1000)
    m.wait_value('rdma_netns_units_allocated{resource="rdma/hca"}', 2)
    assert m.value('rdma_netns_units_healthy{resource="rdma/hca"}') == 1000
    assert m.value('rdma_netns_registered{resource="rdma/hca"}') == 1
    assert m.value('rdma_netns_kubelet_registrations_total{result="ok"}') == 1
    assert m.value("rdma_netns_kernel_mode_mismatch") == 0
    ports = {r["metric"]["device"] for r in m.query("rdma_netns_port_up == 1")["result"]}
    assert {"mlx5_0", "rxe0"} <= ports, ports
    assert m.value('rdma_netns_gid_entries{device="rxe0",port="1"}') == HOST_GID_TABLE
    assert m.value('rdma_netns_gid_entries_per_address{device="rxe0",port="1"}') == 1
    m.wait_value('rdma_netns_rail_pods{netdev="rail0"}', 2)
    assert m.value('rdma_netns_rail_pods{netdev="rail1"}') == 2

    # DEL: the rails' pods go down, the DEL is counted.
    node.cni("DEL", paired_conf(m, trainer, str(m.grants)), trainer, ifname="eth0", container_id="sbx1").ok()
    m.wait_value('rdma_netns_rail_pods{netdev="rail0"}', 1)
    m.wait_value('rdma_netns_cni_calls_total{command="DEL",code="0"}', 1)

    # The exposition passes promtool; the dashboard's queries parse and name exported metrics only.
    exposition = m.scrape()
    check = subprocess.run(["promtool", "check", "metrics"], input=exposition, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    exported = exported_names(exposition)
    for expr in dashboard_queries():
        unknown = {n for n in metric_names(expr) if n not in exported}
        assert not unknown, f"dashboard query {expr!r} names {unknown}, which the daemon does not export"
        variable = re.fullmatch(r"label_values\((\w+), (\w+)\)", expr)  # Grafana's, not PromQL
        if variable:
            series = m.query(variable[1])["result"]
            assert series and all(variable[2] in s["metric"] for s in series), (expr, series)
            continue
        m.query(expr.replace("$__rate_interval", "1m").replace("$instance", ".*"))
    assert len(dashboard_queries()) >= 10


def test_the_cni_never_waits_for_or_fails_because_of_the_metrics(node, monitored):
    """The daemon gone, or hung with its FIFO full: calls succeed as before, without waiting."""
    m = monitored
    pod = node.pod()
    m.kubelet.admit_pod("team-a", "trainer", {"main": {RESOURCE: 1}})
    m.stop_daemon()
    assert not m.events.exists(), "the daemon removes its FIFO on exit"
    add(m, pod, "trainer", "sbx1").ok()  # no broker, no FIFO: kubelet asked, no event sent
    # A FIFO held open but never read (a hung daemon): the pipe fills, writes fail at once.
    os.mkfifo(m.events, 0o600)
    reader = os.open(m.events, os.O_RDONLY | os.O_NONBLOCK)
    try:
        sys.path.insert(0, str(REPO / "cni"))
        from rdma_netns import events

        started = time.perf_counter()
        for _ in range(2000):
            events.send(str(m.events), "ADD", 0, 0.01, "rdmanet")
        per_call = (time.perf_counter() - started) / 2000
        assert per_call < 0.001, f"{per_call * 1e6:.0f} us per event with a full pipe"
        started = time.monotonic()
        node.cni("DEL", paired_conf(m, pod, str(m.grants)), pod, ifname="eth0", container_id="sbx1").ok()
        assert time.monotonic() - started < 5
    finally:
        os.close(reader)
    assert "rdma0" not in node.links(pod)


def test_a_kubelet_restart_a_port_going_down_and_a_filling_gid_table_show(node, monitored):
    """What an admin alerts on: kubelet restarts (counted, registration again), a port DOWN, and a
    GID table whose free addresses run out (the units Healthy shrink with it)."""
    m = monitored
    m.kubelet.restart()
    m.wait_value('rdma_netns_kubelet_restarts_total{resource="rdma/hca"}', 1)
    m.wait_value('rdma_netns_kubelet_registrations_total{resource="rdma/hca",result="ok"}', 2)
    m.wait_value('rdma_netns_registered{resource="rdma/hca"}', 1)

    m.fake.set_port_state("mlx5_3", "DOWN")
    m.wait_value('rdma_netns_port_up{device="mlx5_3",port="1"}', 0)
    m.wait_value('rdma_netns_port_state{device="mlx5_3",port="1",state="DOWN"}', 1)

    # rxe0's table: fill all but 6 entries with the host's own addresses (a netdev of this node, so
    # not pods'): the node then takes 3 more RDMA pods (two addresses each: their own and their
    # rail's link-local one), and only 3 units stay Healthy.
    host_netdev = sorted(p.name for p in (m.fake.sys / "class" / "net").iterdir())[0]
    used = m.value('rdma_netns_gid_entries_used{device="rxe0",port="1"}')
    for i in range(int(HOST_GID_TABLE - used - 6)):
        m.fake.add_gid("rxe0", f"fd00:0099:0000:0000:0000:0000:{i >> 16:04x}:{i & 0xffff:04x}", host_netdev)
    m.wait_value('rdma_netns_gid_free_addresses{device="rxe0",port="1"}', 6, timeout=60)
    assert m.value('rdma_netns_gid_entries_in_pods{device="rxe0",port="1"}') == 0
    m.wait_value('rdma_netns_units_healthy{resource="rdma/hca"}', 3, timeout=60)
    assert m.value('rdma_netns_units{resource="rdma/hca"}') == 1000

    # A tenant with NET_ADMIN adds addresses of its own on its rail (issue 36): entries of a pod's
    # interface (a netdev not in this namespace) that no attachment record explains.
    assert m.value('rdma_netns_gid_entries_unexplained{device="rxe0",port="1"}') == 0
    for i in range(2):
        m.fake.add_gid("rxe0", f"fd00:0bad:0000:0000:0000:0000:0000:{i:04x}", "rdma0")
    m.wait_value('rdma_netns_gid_entries_unexplained{device="rxe0",port="1"}', 2, timeout=60)

# A scrape flood from inside the node's namespace: first connections that send nothing (held
# until told on stdin), then threads fetching /metrics as fast as they can. Prints the scrapes
# that got an answer.
FLOOD = """
import socket, sys, threading, time, urllib.request
url, seconds, idle = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
port = int(url.split(":")[2].split("/")[0])
held = [socket.create_connection(("127.0.0.1", port)) for _ in range(idle)]
print("holding", flush=True)
sys.stdin.readline()
for s in held:
    s.close()
done = [0]
def hammer():
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            urllib.request.urlopen(url, timeout=5).read()
            done[0] += 1
        except OSError:
            time.sleep(0.01)
threads = [threading.Thread(target=hammer) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
print(done[0], flush=True)
"""


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


@pytest.fixture
def sampled_slowly(node):
    """The daemon alone (no Prometheus), sampling kubelet every 5 s."""
    m = Monitored(node)
    try:
        m.start_daemon(refresh_seconds=5.0)
        yield m
    except BaseException:
        print(m.logs())
        raise
    finally:
        m.close()


def test_a_scrape_flood_never_reaches_kubelet_and_fails_no_add(node, sampled_slowly):
    """Anyone who reaches the metrics port can hold connections open and scrape as fast as they
    like: the daemon's threads stay bounded, kubelet sees no call from the scrapes (the allocated
    units are sampled in the background), and every ADD meanwhile succeeds, granted or not."""
    m = sampled_slowly
    granted = [f"g{i}" for i in range(6)]
    plain = [f"n{i}" for i in range(6)]
    for name in granted:
        m.kubelet.admit_pod("team-a", name, {"main": {RESOURCE: 1}})
    for name in plain:
        m.kubelet.admit_pod("team-a", name, {"main": {}})
    threads_before = _threads(m.daemon.pid)
    flood = subprocess.Popen(["ip", "netns", "exec", node.name, sys.executable, "-c", FLOOD,
                              f"http://127.0.0.1:{METRICS_PORT}/metrics", "5", "300"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pods = list(zip(granted, plain))
    try:
        assert flood.stdout.readline().strip() == "holding", flood.stderr.read()
        time.sleep(0.5)
        threads_idle = _threads(m.daemon.pid)
        for i, names in enumerate(pods[:3]):  # while 300 connections are held open
            for name in names:
                result = add(m, node.pod(), name, f"sbx{name}").ok()
                assert ("rdma0" in [x["name"] for x in result["interfaces"]]) == (name in granted), result
        lists_before = sum(1 for c in m.pod_resources.calls if c[0] == "List")
        flood.stdin.write("go\n")
        flood.stdin.flush()
        started = time.monotonic()
        for names in pods[3:]:  # while 8 threads scrape as fast as they can
            for name in names:
                result = add(m, node.pod(), name, f"sbx{name}").ok()
                assert ("rdma0" in [x["name"] for x in result["interfaces"]]) == (name in granted), result
        scrapes = int(flood.communicate(timeout=60)[0].strip().splitlines()[-1])
        window = time.monotonic() - started
    finally:
        if flood.poll() is None:
            flood.kill()
    lists = sum(1 for c in m.pod_resources.calls if c[0] == "List") - lists_before
    assert threads_idle - threads_before <= 20, f"threads {threads_before} -> {threads_idle} with 300 idle connections"
    assert scrapes >= 100, f"only {scrapes} scrapes answered in the flood"
    # The sampler's Lists alone: one per refreshSeconds (5 s) over the flood, plus one.
    assert lists <= window / 5 + 1, f"{lists} kubelet Lists during {scrapes} scrapes in {window:.1f} s"
    assert m.pod_resources.rejected == []
    assert m.daemon.poll() is None
