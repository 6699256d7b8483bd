"""The CNI's per-call events (rdma_netns.events) and the daemon's side (rdma_netns_dp.cni_events,
metrics.DaemonMetrics): what a call sends, that nothing a call does depends on it, and that the
receiver takes only well-formed events. The whole path with a real Prometheus: tests/netns/test_metrics.py."""

from __future__ import annotations

import json
import os
import select
import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest

from rdma_netns import entry, events
from rdma_netns_dp import cni_events
from rdma_netns_dp.metrics import DaemonMetrics


class Fifo:
    """A FIFO read by the test, as the daemon's would be."""

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, "ev")
        os.mkfifo(self.path, 0o600)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)

    def lines(self, timeout: float = 2.0) -> list[dict]:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return []
        time.sleep(0.05)
        return [json.loads(line) for line in os.read(self.fd, 65536).splitlines()]


@pytest.fixture
def fifo() -> Iterator[Fifo]:
    folder = tempfile.mkdtemp(prefix="rnev-", dir="/tmp")
    f = Fifo(folder)
    yield f
    os.close(f.fd)
    shutil.rmtree(folder, ignore_errors=True)


def run(env: dict[str, str], conf: dict | bytes) -> int:
    data = conf if isinstance(conf, bytes) else json.dumps(conf).encode()
    return entry.run_cni({"CNI_CONTAINERID": "c1", "CNI_NETNS": "/var/run/netns/none", "CNI_IFNAME": "net1",
                          "CNI_PATH": "/opt/cni/bin", **env}, data)


def test_a_refused_call_sends_its_command_code_and_network(fifo, capsys):
    conf = {"cniVersion": "1.0.0", "name": "rdma-net", "type": "rdma-netns", "eventsFifo": fifo.path,
            "mode": "sideways", "stateDir": os.path.dirname(fifo.path)}
    assert run({"CNI_COMMAND": "ADD"}, conf) == 1
    [event] = fifo.lines()
    assert json.loads(capsys.readouterr().out)["code"] == event["code"] == 7  # INVALID_CONFIG
    assert event["cmd"] == "ADD" and event["net"] == "rdma-net" and event["v"] == 1
    assert 0 < event["s"] < 5 and event["pairing"] == "" and event["granted"] is None
    assert cni_events.parse(json.dumps(event).encode()) == ("ADD", 7, event["s"], "", None)


def test_malformed_json_is_counted_through_the_default_fifo_and_version_is_not(fifo, monkeypatch):
    monkeypatch.setattr(events, "DEFAULT_PATH", fifo.path)
    assert run({"CNI_COMMAND": "DEL"}, b"{not json") == 1
    assert [e["code"] for e in fifo.lines()] == [6]  # DECODE_FAILURE
    assert run({"CNI_COMMAND": "VERSION"}, b"{}") == 0
    assert fifo.lines(0.2) == []


def test_an_empty_events_fifo_sends_nothing(fifo, monkeypatch):
    monkeypatch.setattr(events, "DEFAULT_PATH", fifo.path)
    run({"CNI_COMMAND": "ADD"}, {"cniVersion": "1.0.0", "name": "n", "type": "rdma-netns", "eventsFifo": "",
                                  "mode": "sideways", "stateDir": os.path.dirname(fifo.path)})
    assert fifo.lines(0.2) == []


def test_sending_never_raises_blocks_or_writes_anything_but_a_fifo():
    folder = tempfile.mkdtemp(prefix="rnev-", dir="/tmp")
    try:
        os.mkfifo(f"{folder}/unread", 0o600)  # no reader: ENXIO
        with open(f"{folder}/file", "w") as f:
            f.write("keep")
        os.symlink(f"{folder}/file", f"{folder}/link")
        for path in (f"{folder}/absent", f"{folder}/unread", folder, f"{folder}/file", f"{folder}/link",
                     "/" + "x" * 5000, "relative"):
            events.send(path, "ADD", 0, 0.01, "n")
        with open(f"{folder}/file") as f:
            assert f.read() == "keep"
        # Read by nobody but held open (a hung daemon): the pipe fills, then writes fail at once.
        os.mkfifo(f"{folder}/hung", 0o600)
        reader = os.open(f"{folder}/hung", os.O_RDONLY | os.O_NONBLOCK)
        started = time.perf_counter()
        for _ in range(3000):
            events.send(f"{folder}/hung", "ADD", 0, 0.01, "n")
        assert (time.perf_counter() - started) / 3000 < 0.001
        os.close(reader)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("data", [
    b"", b"[]", b"{", b"\xff\xfe", json.dumps({"v": 2, "cmd": "ADD", "code": 0, "s": 0.1}).encode(),
    json.dumps({"v": 1, "cmd": "add", "code": 0, "s": 0.1}).encode(),
    json.dumps({"v": 1, "cmd": "ADD", "code": "0", "s": 0.1}).encode(),
    json.dumps({"v": 1, "cmd": "ADD", "code": True, "s": 0.1}).encode(),
    json.dumps({"v": 1, "cmd": "ADD", "code": 1000, "s": 0.1}).encode(),
    json.dumps({"v": 1, "cmd": "ADD", "code": 0, "s": -1}).encode(),
    json.dumps({"v": 1, "cmd": "ADD", "code": 0, "s": 1e9}).encode(),
    json.dumps({"v": 1, "cmd": "ADD", "code": 0, "s": 0.1, "pairing": "carrier-pigeon"}).encode(),
    json.dumps({"v": 1, "cmd": "ADD", "code": 0, "s": 0.1, "granted": "yes"}).encode(),
    b"{" + b" " * 5000 + b"}",
])
def test_the_receiver_rejects_what_is_not_an_event(data):
    assert cni_events.parse(data) is None


def test_receiver_counts_events_and_rejects():
    folder = tempfile.mkdtemp(prefix="rnev-", dir="/tmp")
    metrics = DaemonMetrics()
    path = f"{folder}/sub/ev"
    rx = cni_events.CniEventsReceiver(path, metrics.cni_event, metrics.events_rejected.inc).start()
    try:
        assert os.stat(path).st_mode & 0o777 == 0o600 and os.stat(os.path.dirname(path)).st_mode & 0o777 == 0o700
        events.reset()
        events.note("pairing", "kubelet")
        events.note("granted", False)
        events.send(path, "ADD", 0, 0.03, "n")
        events.reset()
        events.send(path, "DEL", 105, 0.2, "n")
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, b"junk\n")
        os.close(fd)
        deadline = time.monotonic() + 5
        sample = metrics.registry.get_sample_value
        while time.monotonic() < deadline and sample("rdma_netns_cni_events_rejected_total") != 1:
            time.sleep(0.02)
        assert sample("rdma_netns_cni_calls_total", {"command": "ADD", "code": "0"}) == 1
        assert sample("rdma_netns_cni_calls_total", {"command": "DEL", "code": "105"}) == 1
        assert sample("rdma_netns_cni_call_duration_seconds_count", {"command": "DEL"}) == 1
        assert sample("rdma_netns_cni_call_duration_seconds_bucket", {"command": "ADD", "le": "0.05"}) == 1
        assert sample("rdma_netns_cni_call_duration_seconds_bucket", {"command": "ADD", "le": "0.02"}) == 0
        assert sample("rdma_netns_cni_pairing_total", {"via": "kubelet", "outcome": "not_granted"}) == 1
        assert sample("rdma_netns_cni_events_rejected_total") == 1
    finally:
        rx.stop()
        shutil.rmtree(folder, ignore_errors=True)
    assert not os.path.exists(path)


def test_a_new_daemon_replaces_a_stale_fifo_and_an_old_one_leaves_the_new_ones():
    folder = tempfile.mkdtemp(prefix="rnev-", dir="/tmp")
    path = f"{folder}/ev"
    try:
        old = cni_events.CniEventsReceiver(path, lambda *a: None, lambda: None).start()
        new_metrics = DaemonMetrics()
        new = cni_events.CniEventsReceiver(path, new_metrics.cni_event, lambda: None).start()
        old.stop()  # the old daemon going away last must not take the new one's FIFO
        assert os.path.exists(path)
        events.send(path, "CHECK", 0, 0.01, "n")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not new_metrics.registry.get_sample_value(
                "rdma_netns_cni_calls_total", {"command": "CHECK", "code": "0"}):
            time.sleep(0.02)
        assert new_metrics.registry.get_sample_value("rdma_netns_cni_calls_total",
                                                     {"command": "CHECK", "code": "0"}) == 1
        new.stop()
        assert not os.path.exists(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("code, granted, outcome", [
    (0, True, "granted"), (0, False, "not_granted"), (107, None, "unavailable"), (104, True, "granted"),
    (4, None, "error")])
def test_pairing_outcomes(code, granted, outcome):
    metrics = DaemonMetrics()
    metrics.cni_event("ADD", code, 0.01, "broker", granted)
    assert metrics.registry.get_sample_value("rdma_netns_cni_pairing_total",
                                             {"via": "broker", "outcome": outcome}) == 1
