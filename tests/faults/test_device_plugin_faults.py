"""The device plugin under faults (the tests/dp harness: the real rdma-netns-dp daemon on a fake
sysfs, the gRPC stand-in kubelet): 50 kubelet restarts under Allocate and ListAndWatch load, the
daemon SIGKILLed and restarted over its stale socket, broken config files, a config file that
changes while the daemon runs, and a bounded fuzz of the config parser."""

from __future__ import annotations

import json
import random
import signal
import statistics
import subprocess
import threading
import time

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.hypothesis_profiles import examples

from tests.dp.conftest import EXCLUSIVE_IDS, INTERVAL, RESOURCE, SOCKET, Host, dp_binary

RESTARTS = 50
RECOVERY_LIMIT = 2 * INTERVAL + 0.4  # two health intervals, plus gRPC server start and dial


def canonical(response) -> str:
    return response.SerializeToString(deterministic=True).hex()


def test_fifty_kubelet_restarts_under_allocate_and_listandwatch_load(host: Host):
    host.fake.set_netns_mode("N")
    daemon, plugin = host.start_registered("--mode", "exclusive", "--resource-name", RESOURCE)
    first = plugin.wait_first()
    reference_list = sorted((d.ID, d.health) for d in first.devices)
    assert {i for i, _ in reference_list} == EXCLUSIVE_IDS
    reference = {i: canonical(plugin.allocate([i])) for i in sorted(EXCLUSIVE_IDS)}

    stop = threading.Event()
    counts = {"ok": 0, "errors": 0, "wrong": []}

    def allocate_load() -> None:
        rng = random.Random(7)
        while not stop.is_set():
            with host.kubelet._cond:  # the connection kubelet has now, as kubelet would use it
                conn = host.kubelet._state.plugins.get(RESOURCE)
            if conn is None:
                time.sleep(0.005)
                continue
            device = rng.choice(sorted(EXCLUSIVE_IDS))
            try:
                answer = canonical(conn.allocate([device], timeout=1.0))
            except (grpc.RpcError, ValueError):  # ValueError: channel closed under us by a restart
                counts["errors"] += 1
                time.sleep(0.01)
                continue
            if answer != reference[device]:
                counts["wrong"].append(device)
            counts["ok"] += 1

    loader = threading.Thread(target=allocate_load, daemon=True)
    loader.start()
    latencies = []
    try:
        for n in range(RESTARTS):
            previous = host.kubelet.plugin(RESOURCE)
            host.kubelet.restart()
            started = host.kubelet.started_at
            regs = host.kubelet.wait_registrations(n + 2, 5)
            conn = host.kubelet.plugin(RESOURCE, 5, newer_than=previous, since=started)
            update = conn.wait_first(5)
            latencies.append(update.time - started)
            assert regs[-1].request.endpoint == SOCKET and regs[-1].accepted
            assert sorted((d.ID, d.health) for d in update.devices) == reference_list, f"restart {n}"
            time.sleep(0.05)  # some Allocate traffic on the new connection before the next restart
    finally:
        stop.set()
        loader.join(5)
    assert daemon.alive(), daemon.output()
    assert counts["wrong"] == [], f"wrong Allocate answers for {counts['wrong'][:10]}"
    assert counts["ok"] > RESTARTS, counts
    print(f"\nkubelet restarts: {RESTARTS}; Allocate ok {counts['ok']}, errors during restarts "
          f"{counts['errors']}; recovery median {statistics.median(latencies):.3f} s, max {max(latencies):.3f} s")
    slow = [round(x, 3) for x in latencies if x > RECOVERY_LIMIT]
    assert not slow, f"recoveries over {RECOVERY_LIMIT:.2f} s: {slow} (all: {[round(x, 3) for x in latencies]})"
    assert "Traceback" not in daemon.stderr()


def test_sigkilled_daemon_restarts_over_its_stale_socket(host: Host):
    host.fake.set_netns_mode("N")
    daemon, plugin = host.start_registered("--mode", "exclusive", "--resource-name", RESOURCE)
    reference = sorted((d.ID, d.health) for d in plugin.wait_first().devices)
    for round_ in range(3):
        daemon.terminate(signal.SIGKILL)
        assert host.socket().is_socket(), "a SIGKILLed daemon cannot clean up: its socket stays"
        assert plugin.wait_stream_end(5), "kubelet's ListAndWatch stream ends with the daemon"
        regs_before = len(host.kubelet.registrations)
        daemon = host.start("--mode", "exclusive", "--resource-name", RESOURCE)
        host.kubelet.wait_registrations(regs_before + 1, 10)
        plugin = host.kubelet.plugin(RESOURCE, 5, newer_than=plugin)
        assert sorted((d.ID, d.health) for d in plugin.wait_first(5).devices) == reference
        assert host.socket().is_socket()  # (the new socket may reuse the old inode number)
        assert canonical(plugin.allocate(["rxe0"]))
        deadline = time.monotonic() + 5
        while _health_pid(host) != daemon.pid:
            assert time.monotonic() < deadline, "the health file still names the killed daemon"
            time.sleep(INTERVAL / 2)
    assert daemon.terminate() == 0 and not host.socket().exists()


def _health_pid(host: Host) -> int | None:
    try:
        return json.loads(host.health_file.read_text()).get("pid")
    except (FileNotFoundError, ValueError):
        return None


BROKEN_CONFIGS = [
    ("a-list", "- mode: shared\n"),
    ("a-scalar", "42\n"),
    ("python-tag", "!!python/object/apply:os.system ['touch /tmp/rdp-pwned']\n"),
    ("unknown-key", '{"mode": "shared", "modee": "exclusive"}'),
    ("interval-zero", '{"healthIntervalSeconds": 0}'),
    ("interval-negative", '{"healthIntervalSeconds": -1}'),
    ("no-resources", '{"resources": []}'),
    ("bad-resource-name", '{"resources": [{"name": "../../etc/passwd"}]}'),
    ("binary", "\x00\xff\xfe garbage"),
    ("huge-nesting", "[" * 100000),
]


@pytest.mark.parametrize("name,text", BROKEN_CONFIGS, ids=[c[0] for c in BROKEN_CONFIGS])
def test_broken_config_file_exits_2_without_a_socket(host: Host, name, text):
    """Beyond tests/dp/test_lifecycle.py's invalid values: shapes, tags, junk, nesting."""
    path = host.base / f"{name}.yaml"
    path.write_bytes(text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text)
    proc = subprocess.run([dp_binary(), *host.base_args(), "--config", str(path)],
                          capture_output=True, text=True, timeout=15)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.strip() and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert [p.name for p in host.plugins_dir.iterdir()] == ["kubelet.sock"]
    assert host.kubelet.registrations == []
    assert not __import__("os").path.exists("/tmp/rdp-pwned")


def test_config_path_that_is_a_directory_exits_2(host: Host):
    proc = subprocess.run([dp_binary(), *host.base_args(), "--config", str(host.base)],
                          capture_output=True, text=True, timeout=15)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert [p.name for p in host.plugins_dir.iterdir()] == ["kubelet.sock"]


def test_config_file_changes_while_running_are_ignored_until_restart(host: Host):
    """The daemon reads its config file once, at start: editing (or deleting) the file changes
    nothing while it runs (no reload, no crash); a restart applies the new file."""
    daemon = host.start(config={"mode": "shared", "resources": [{"name": RESOURCE, "sharedUnits": 10}]})
    host.kubelet.wait_registrations(1, 10)
    plugin = host.kubelet.plugin(RESOURCE, 5)
    assert len(plugin.wait_first().ids()) == 10
    path = host.base / "config.json"
    path.write_text(json.dumps({"mode": "shared", "resources": [{"name": RESOURCE, "sharedUnits": 3}]}))
    time.sleep(5 * INTERVAL)
    path.write_text("mode: [broken")
    time.sleep(5 * INTERVAL)
    path.unlink()
    time.sleep(5 * INTERVAL)
    assert daemon.alive() and len(plugin.latest.ids()) == 10
    assert len(host.kubelet.registrations) == 1, "no re-registration for a file change"
    assert daemon.terminate() == 0
    host.start(config={"mode": "shared", "resources": [{"name": RESOURCE, "sharedUnits": 3}]})
    host.kubelet.wait_registrations(2, 10)
    assert len(host.kubelet.plugin(RESOURCE, 5, newer_than=plugin).wait_first().ids()) == 3


# A bounded fuzz of the config parser in-process (the same code the daemon runs at start):
# every input is a config or a ConfigError, never another exception.
config_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12) |
    st.sampled_from(["shared", "exclusive", "auto", "rdma/hca", "kubelet", "watcher", "/x", "15b3", "mlx5_*"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["mode", "resources", "name", "sharedUnits", "includeUmad", "selectors", "rdmaDevices",
                         "netdevs", "drivers", "vendors", "deviceIDs", "linkTypes", "healthIntervalSeconds",
                         "registration", "cdi", "enabled", "specDir", "ensureKernelMode", "kubeletDir",
                         "healthFile", "cniStateDir", "x"]), inner, max_size=5),
    max_leaves=15)


@settings(max_examples=examples(150), deadline=None)
@given(value=config_values, as_yaml=st.booleans())
def test_config_parser_fuzz(value, as_yaml):
    from rdma_netns_dp import config

    text = json.dumps(value)
    if as_yaml:
        import yaml

        text = yaml.safe_dump(value)
    try:
        parsed = config.parse(text, "fuzz.yaml")
    except config.ConfigError as exc:
        assert str(exc).startswith("fuzz.yaml")
        return
    assert parsed.resources
