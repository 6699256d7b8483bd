"""Registration with a stand-in kubelet: request fields, re-registration after a kubelet restart
or a lost socket, kubelet absent at start, plugin-watcher mode, several resources."""

from __future__ import annotations

import json
import os
import time

from tests.dp.conftest import EXCLUSIVE_IDS, INTERVAL, RESOURCE, SOCKET, Host
from tests.kubelet_standin import PluginConnection, wait_for_path

REREGISTER_TIMEOUT = 5.0


def test_shared_registration_request(shared_dp):
    host, daemon, plugin = shared_dp
    regs = host.kubelet.registrations
    assert len(regs) == 1, [r.request for r in regs]
    req = regs[0].request
    assert req.version == "v1beta1"
    assert req.endpoint == SOCKET  # a basename inside the device-plugins folder
    assert req.resource_name == RESOURCE
    assert req.options.pre_start_required is False
    # shared too: lowest units first, so pods hold the ones the GID cap keeps Healthy (issue 20)
    assert req.options.get_preferred_allocation_available is True
    assert regs[0].endpoint_existed, "Register was called before the plugin socket existed"
    assert plugin.options == req.options, "GetDevicePluginOptions disagrees with the RegisterRequest"
    assert daemon.alive()


def test_exclusive_registration_request(exclusive_dp):
    host, daemon, plugin = exclusive_dp
    regs = host.kubelet.registrations
    assert len(regs) == 1
    req = regs[0].request
    assert (req.version, req.endpoint, req.resource_name) == ("v1beta1", SOCKET, RESOURCE)
    assert req.options.pre_start_required is False
    assert req.options.get_preferred_allocation_available is True
    assert plugin.options.get_preferred_allocation_available is True
    assert plugin.options.pre_start_required is False
    assert host.socket().is_socket()


def test_kubelet_restart_reregisters(host: Host):
    host.fake.set_netns_mode("N")
    daemon, first = host.start_registered("--mode", "exclusive", "--resource-name", RESOURCE)
    before = set(first.latest.ids())
    assert before == EXCLUSIVE_IDS
    wiped = host.kubelet.restart()
    assert SOCKET in wiped  # (grpc itself unlinks kubelet.sock when the server stops)
    t0 = time.monotonic()
    regs = host.kubelet.wait_registrations(2, REREGISTER_TIMEOUT)
    latency = regs[1].time - t0
    assert regs[1].request.endpoint == SOCKET and regs[1].request.resource_name == RESOURCE
    assert regs[1].endpoint_existed, "re-registered before re-creating its socket"
    second = host.kubelet.plugin(RESOURCE, REREGISTER_TIMEOUT, newer_than=first)
    assert set(second.wait_first().ids()) == before
    assert host.socket().is_socket()
    assert latency < 2.0, f"re-registration took {latency:.2f} s (interval {INTERVAL} s)"
    assert daemon.alive()


def test_two_quick_kubelet_restarts(host: Host):
    """Restarted twice within one interval: the plugin ends up registered with the live kubelet."""
    daemon, first = host.start_registered("--mode", "shared", "--resource-name", RESOURCE)
    host.kubelet.restart()
    time.sleep(INTERVAL / 4)
    host.kubelet.restart()
    live_since = host.kubelet.started_at
    deadline = time.monotonic() + REREGISTER_TIMEOUT
    while not [r for r in host.kubelet.registrations if r.time >= live_since]:
        assert time.monotonic() < deadline, f"never registered with the restarted kubelet\n{daemon.output()}"
        time.sleep(0.05)
    plugin = host.kubelet.plugin(RESOURCE, REREGISTER_TIMEOUT, since=live_since)
    assert len(plugin.wait_first().ids()) == 1000
    assert host.socket().is_socket()


def test_deleted_plugin_socket_is_recreated_and_reregistered(host: Host):
    daemon, first = host.start_registered("--mode", "shared", "--resource-name", RESOURCE)
    os.unlink(host.socket())
    assert wait_for_path(host.socket(), REREGISTER_TIMEOUT), f"socket not re-created\n{daemon.output()}"
    regs = host.kubelet.wait_registrations(2, REREGISTER_TIMEOUT)
    assert regs[1].request.endpoint == SOCKET
    second = host.kubelet.plugin(RESOURCE, REREGISTER_TIMEOUT, newer_than=first)
    assert len(second.wait_first().ids()) == 1000
    assert daemon.alive()


def test_kubelet_down_at_start_then_appears():
    host = Host("Y", kubelet=False)
    try:
        daemon = host.start("--mode", "shared", "--resource-name", RESOURCE)
        time.sleep(1.2)
        assert daemon.alive(), daemon.output()
        assert host.kubelet.registrations == []
        # The plugin serves before (and regardless of) a successful Register.
        assert wait_for_path(host.socket(), 3), f"no plugin socket while kubelet is down\n{daemon.output()}"
        direct = PluginConnection(host.socket(), RESOURCE)
        try:
            assert len(direct.wait_first().ids()) == 1000
        finally:
            direct.close()
        health = json.loads(host.health_file.read_text())
        assert health["resources"][RESOURCE]["registered"] is False, health
        ready = host.health_file.parent / "ready"  # what the readiness probe reads (daemon.ready_file)
        assert ready.read_text() == f"not ready: not registered with kubelet: {RESOURCE}\n"
        assert "retry" in daemon.stderr().lower(), f"failed registrations must be logged\n{daemon.output()}"
        host.kubelet.start()
        # Back-off is 0.5 s doubling (max 10 s): after ~1.2 s down, the next attempt is < 3 s away.
        regs = host.kubelet.wait_registrations(1, 11)
        assert regs[0].request.resource_name == RESOURCE
        plugin = host.kubelet.plugin(RESOURCE, 5)
        assert len(plugin.wait_first().ids()) == 1000
        deadline = time.monotonic() + 2
        while not json.loads(host.health_file.read_text())["resources"][RESOURCE]["registered"]:
            assert time.monotonic() < deadline, "health file never says registered"
            time.sleep(INTERVAL / 2)
        while ready.read_text() != "ready\n":
            assert time.monotonic() < deadline + 2, f"the ready file still says {ready.read_text()!r}"
            time.sleep(INTERVAL / 2)
        assert daemon.alive()
    finally:
        host.close()


def test_watcher_registration(host: Host):
    host.fake.set_netns_mode("N")  # the kernel mode exclusive pods need
    daemon = host.start("--mode", "exclusive", "--resource-name", RESOURCE, "--registration", "watcher")
    registry = host.kubelet_dir / "plugins_registry" / SOCKET
    assert wait_for_path(registry, 10), f"no {registry}\n{daemon.output()}"
    info, plugin = host.kubelet.connect_via_watcher(SOCKET)
    assert info.type == "DevicePlugin"
    assert info.name == RESOURCE
    assert info.endpoint == str(host.socket())
    assert list(info.supported_versions) == ["v1beta1"]
    assert set(plugin.wait_first().ids()) == EXCLUSIVE_IDS
    assert plugin.options.get_preferred_allocation_available is True
    time.sleep(3 * INTERVAL)
    assert host.kubelet.registrations == [], "watcher mode must not call Register"
    assert daemon.alive()
    assert daemon.terminate() == 0
    assert not registry.exists() and not host.socket().exists()


def test_several_resources_register_separately(host: Host):
    host.fake.set_netns_mode("N")  # the kernel mode exclusive pods need
    config = {"mode": "exclusive", "resources": [
        {"name": "rdma/eth", "selectors": {"linkTypes": ["ethernet"]}},
        {"name": "rdma/ib", "selectors": {"linkTypes": ["infiniband"]}},
    ]}
    daemon = host.start(config=config)
    regs = host.kubelet.wait_registrations(2, 10)
    by_name = {r.request.resource_name: r.request for r in regs}
    assert set(by_name) == {"rdma/eth", "rdma/ib"}, daemon.output()
    assert by_name["rdma/eth"].endpoint == "rdma-netns-rdma_eth.sock"
    assert by_name["rdma/ib"].endpoint == "rdma-netns-rdma_ib.sock"
    eth = host.kubelet.plugin("rdma/eth", 5).wait_first()
    ib = host.kubelet.plugin("rdma/ib", 5).wait_first()
    assert set(ib.ids()) == {"0000:af:00.0", "0000:b1:00.0"}
    assert set(eth.ids()) == EXCLUSIVE_IDS - {"0000:af:00.0", "0000:b1:00.0"}
    health = host.health_file
    assert wait_for_path(health, 2, socket_only=False)
    deadline = time.monotonic() + 2
    while True:
        resources = json.loads(health.read_text())["resources"]
        if all(r.get("registered") for r in resources.values()) or time.monotonic() > deadline:
            break
        time.sleep(INTERVAL / 2)
    assert resources == {"rdma/eth": {"registered": True, "devices": 7, "healthy": 7},
                         "rdma/ib": {"registered": True, "devices": 2, "healthy": 2}}
    assert daemon.terminate() == 0
    assert sorted(p.name for p in host.plugins_dir.iterdir()) == ["kubelet.sock"]


def test_kubelet_sock_recreated_without_wipe(host: Host):
    """kubelet.sock re-created (new inode) while the plugin socket stays: register again."""
    daemon, first = host.start_registered("--mode", "shared", "--resource-name", RESOURCE)
    host.kubelet.stop()
    host.kubelet.start()
    regs = host.kubelet.wait_registrations(2, REREGISTER_TIMEOUT)
    assert regs[1].request.resource_name == RESOURCE
    second = host.kubelet.plugin(RESOURCE, REREGISTER_TIMEOUT, newer_than=first)
    assert len(second.wait_first().ids()) == 1000


def test_kubelet_restart_with_downtime(host: Host):
    """kubelet gone for a while after wiping the sockets: the plugin comes back once it is up."""
    daemon, first = host.start_registered("--mode", "shared", "--resource-name", RESOURCE)
    host.kubelet.stop()
    host.kubelet.wipe_sockets()
    time.sleep(0.6)
    assert daemon.alive(), daemon.output()
    host.kubelet.start()
    regs = host.kubelet.wait_registrations(2, 8)
    assert regs[-1].request.endpoint == SOCKET
    assert wait_for_path(host.socket(), 2)
    second = host.kubelet.plugin(RESOURCE, 5, newer_than=first)
    assert len(second.wait_first().ids()) == 1000


def test_rejected_register_is_retried_with_backoff(host: Host):
    host.kubelet.reject_registrations = 2
    daemon, plugin = host.start_registered("--mode", "shared", "--resource-name", RESOURCE, count=3)
    regs = host.kubelet.registrations
    assert [r.accepted for r in regs[:3]] == [False, False, True]
    gap1, gap2 = regs[1].time - regs[0].time, regs[2].time - regs[1].time
    # 0.5 s doubling; allow scheduling slack (and a health-interval granularity of 0.2 s).
    assert 0.35 <= gap1 <= 1.0, f"first retry after {gap1:.2f} s, expected ~0.5 s"
    assert 0.8 <= gap2 <= 1.6 and gap2 > gap1, f"second retry after {gap2:.2f} s, expected ~1 s"
    assert len(plugin.wait_first().ids()) == 1000
    assert daemon.alive()
