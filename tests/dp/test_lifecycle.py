"""Process life: signals, invalid configuration, the health file and the probe subcommand."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from tests.dp.conftest import INTERVAL, RESOURCE, Host, dp_binary, wait_for_path


def wait_health_file(host: Host) -> None:
    """The file is first written one interval after start."""
    assert wait_for_path(host.health_file, 10 * INTERVAL, socket_only=False), \
        f"no health file after {10 * INTERVAL:.1f} s"


def test_sigterm_stops_cleanly(host: Host):
    sig = signal.SIGTERM
    host.fake.set_netns_mode("N")  # the kernel mode exclusive pods need
    daemon, plugin = host.start_registered("--mode", "exclusive", "--resource-name", RESOURCE)
    wait_health_file(host)
    t0 = time.monotonic()
    assert daemon.terminate(sig) == 0, daemon.output()
    assert time.monotonic() - t0 < 5
    assert not host.socket().exists(), "plugin socket left behind"
    assert not host.health_file.exists(), "health file left behind"
    assert (host.plugins_dir / "kubelet.sock").exists(), "the daemon must not touch kubelet.sock"
    assert "Traceback" not in daemon.stderr()


INVALID_CONFIGS = [
    ("bad-mode", '{"mode": "bogus"}', "mode"),
    ("yaml-syntax", "mode: [shared\nresources: {", None),
    ("interval-type", '{"healthIntervalSeconds": "soon"}', "healthIntervalSeconds"),
    ("resources-type", '{"resources": "rdma/hca"}', "resources"),
    ("link-type", '{"resources": [{"name": "rdma/hca", "selectors": {"linkTypes": 5}}]}', "linkTypes"),
    ("units-negative", '{"resources": [{"name": "rdma/hca", "sharedUnits": -5}]}', "sharedUnits"),
    ("duplicate-names", '{"resources": [{"name": "rdma/hca"}, {"name": "rdma/hca"}]}', "rdma/hca"),
]


@pytest.mark.parametrize("name,text,key", INVALID_CONFIGS, ids=[c[0] for c in INVALID_CONFIGS])
def test_invalid_config_exits_2(host: Host, name, text, key):
    path = host.write_config(text, f"{name}.yaml")
    proc = subprocess.run([dp_binary(), *host.base_args(), "--config", str(path)],
                          capture_output=True, text=True, timeout=15)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.strip(), "no message"
    assert "Traceback" not in proc.stderr, proc.stderr
    wanted = [key] if key else [path.name, "yaml", "json"]
    assert any(w.lower() in proc.stderr.lower() for w in wanted), \
        f"message does not point at {wanted}: {proc.stderr}"
    sockets = [p.name for p in host.plugins_dir.iterdir() if p.name != "kubelet.sock"]
    assert sockets == [], sockets
    assert host.kubelet.registrations == []
    assert not host.health_file.exists()


def test_missing_config_file_exits_2(host: Host):
    path = host.base / "no-such-config.yaml"
    proc = subprocess.run([dp_binary(), *host.base_args(), "--config", str(path)],
                          capture_output=True, text=True, timeout=15)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert path.name in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert [p.name for p in host.plugins_dir.iterdir()] == ["kubelet.sock"]


def test_sigterm_while_kubelet_is_down(host: Host):
    """Stopping must not wait for a registration back-off to run out."""
    host.kubelet.close()
    daemon = host.start("--mode", "shared", "--resource-name", RESOURCE)
    assert wait_for_path(host.socket(), 5), daemon.output()
    time.sleep(1.6)  # back-off now sleeping 2 s
    t0 = time.monotonic()
    assert daemon.terminate() == 0, daemon.output()
    assert time.monotonic() - t0 < 2.0, f"SIGTERM took {time.monotonic() - t0:.2f} s"
    assert not host.socket().exists()
    assert not host.health_file.exists()


def test_health_file_contents(host: Host):
    host.fake.set_netns_mode("N")  # the kernel mode exclusive pods need
    daemon, plugin = host.start_registered("--mode", "exclusive", "--resource-name", RESOURCE)

    def read() -> dict:
        return json.loads(host.health_file.read_text())

    wait_health_file(host)
    deadline = time.monotonic() + 3
    data = read()
    while not data["resources"].get(RESOURCE, {}).get("registered") and time.monotonic() < deadline:
        time.sleep(INTERVAL / 2)
        data = read()
    assert data["pid"] == daemon.pid
    assert abs(data["time"] - time.time()) < 2
    assert data["resources"][RESOURCE] == {"registered": True, "devices": 9, "healthy": 9}
    host.fake.set_port_state("mlx5_0", "DOWN")
    host.fake.set_port_state("rxe0", "DOWN")
    deadline = time.monotonic() + 3
    while read()["resources"][RESOURCE]["healthy"] != 7 and time.monotonic() < deadline:
        time.sleep(INTERVAL / 2)
    later = read()
    assert later["resources"][RESOURCE] == {"registered": True, "devices": 9, "healthy": 7}
    assert later["time"] > data["time"], "the health file must be rewritten every interval"
    deadline = time.monotonic() + 4 * INTERVAL  # written atomically: never a partial file
    reads = 0
    while time.monotonic() < deadline:
        assert isinstance(read()["time"], float)
        reads += 1
    assert reads > 10


def test_config_file_only(host: Host):
    """Every setting from the file (YAML), no flags; stopped with SIGINT."""
    host.fake.set_netns_mode("N")
    config = f"""
mode: exclusive
kubeletDir: {host.kubelet_dir}
sysfsRoot: {host.fake.sys}
devRoot: {host.dev_root}
healthIntervalSeconds: {INTERVAL}
healthFile: {host.health_file}
podGrantsSocket: {host.base}/pg.sock
registration: kubelet
cdi:
  enabled: true
  specDir: {host.cdi_dir}
resources:
  - name: rdma/roce
    includeUmad: false
    selectors:
      vendors: ["15b3"]
      linkTypes: [ethernet]
"""
    path = host.write_config(config, "only.yaml")
    daemon = host.start("--config", str(path), base=False)
    regs = host.kubelet.wait_registrations(1, 10)
    assert regs[0].request.endpoint == "rdma-netns-rdma_roce.sock", daemon.output()
    plugin = host.kubelet.plugin("rdma/roce", 5)
    assert set(plugin.wait_first().ids()) == {"0000:1a:00.0", "0000:3b:00.0", "0000:5e:00.0", "0000:86:00.0"}
    assert (host.cdi_dir / "rdma-netns-rdma_roce.json").exists()
    wait_health_file(host)
    assert daemon.terminate(signal.SIGINT) == 0, daemon.output()
    assert not host.health_file.exists()
    assert sorted(p.name for p in host.plugins_dir.iterdir()) == ["kubelet.sock"]


def probe(path, *extra: str) -> int:
    return subprocess.run([dp_binary(), "probe", "--health-file", str(path), *extra],
                          capture_output=True, timeout=15).returncode


def test_probe_on_written_files(tmp_path):
    path = tmp_path / "health.json"
    assert probe(path, "--max-age", "5") == 1, "missing file"
    path.write_text("{not json")
    assert probe(path, "--max-age", "5") == 1, "garbage"
    path.write_text(json.dumps({"time": time.time(), "pid": 1, "resources": {}}))
    assert probe(path, "--max-age", "5") == 0, "fresh"
    assert probe(path) == 0, "fresh, default max age"
    path.write_text(json.dumps({"time": time.time() - 60, "pid": 1, "resources": {}}))
    assert probe(path, "--max-age", "5") == 1, "stale"


def test_probe_on_live_daemon(host: Host):
    daemon, plugin = host.start_registered("--mode", "shared", "--resource-name", RESOURCE)
    wait_health_file(host)
    assert probe(host.health_file, "--max-age", "2") == 0
    daemon.proc.send_signal(signal.SIGSTOP)  # a hung daemon stops refreshing its file
    try:
        time.sleep(0.9)
        assert probe(host.health_file, "--max-age", "0.6") == 1
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    time.sleep(3 * INTERVAL)
    assert probe(host.health_file, "--max-age", "0.6") == 0


def test_devices_subcommand_json(host: Host):
    proc = subprocess.run([dp_binary(), "devices", "--json", "--sysfs-root", str(host.fake.sys)],
                          capture_output=True, text=True, timeout=15)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    text = json.dumps(data)
    for name in ("mlx5_0", "mlx5_5", "irdma1", "rxe0", "0000:1a:00.0", "0000:d9:00.0", "ens1f0", "eth0"):
        assert f'"{name}"' in text, f"{name} missing from {text[:2000]}"

    plain = subprocess.run([dp_binary(), "devices", "--sysfs-root", str(host.fake.sys)],
                           capture_output=True, text=True, timeout=15)
    assert plain.returncode == 0 and "mlx5_0" in plain.stdout and "rxe0" in plain.stdout, plain
