"""Issue 16, point 4: a kubelet restart is seen whatever the filesystem does with inode numbers,
registration follows within one poll interval with or without kubelet's socket wipe, and the
Register call waits as long as kubelet allows itself to dial the plugin back (10 s)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from rdma_netns.kernel.rdma_devices import DeviceSysfs
from rdma_netns_dp import registration, resource_plugin
from rdma_netns_dp.config import ResourceConfig
from rdma_netns_dp.inventory import Pool
from tests.dp.conftest import INTERVAL, RESOURCE, SOCKET, Host
from tests.kubelet_standin import wait_for_path

# One poll interval, plus the Register round trip and scheduling on a loaded 2-CPU machine.
WITHIN_ONE_POLL = INTERVAL + 0.8


def unlink(path) -> None:
    """kubelet.sock goes (gRPC's stop may already have removed it)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@pytest.fixture
def inproc(host: Host):
    """A ResourcePlugin in this process (so that its view of the filesystem can be faked),
    ticked by the test itself as the daemon's health loop would."""
    pool = Pool(ResourceConfig(name=RESOURCE, sharedUnits=4), "shared")
    pool.update([])
    plugin = resource_plugin.ResourcePlugin(pool, DeviceSysfs(str(host.fake.sys)), str(host.kubelet_dir),
                                            host.dev_root, use_cdi=False, registration="kubelet", workers=4)
    yield plugin
    plugin.stop()


def test_same_inode_new_ctime_is_a_restart(host: Host, inproc, monkeypatch):
    """ext4 may give a re-created kubelet.sock the old inode number: stat is faked so that every
    kubelet.sock has inode 4242; the new socket's ctime still tells the restart apart."""
    real_stat = os.stat

    def fake_stat(path, *args, **kwargs):
        st = real_stat(path, *args, **kwargs)
        if str(path).endswith("kubelet.sock"):
            fields = list(st)
            fields[1] = 4242  # st_ino
            return os.stat_result(fields, {"st_ctime_ns": st.st_ctime_ns})
        return st

    monkeypatch.setattr(resource_plugin.os, "stat", fake_stat)
    inproc.tick()
    host.kubelet.wait_registrations(1, 5)
    assert inproc.registered
    before = resource_plugin._inode(inproc.kubelet_socket)
    time.sleep(0.02)  # ctime has ns resolution, but be sure it moves on coarse-clock filesystems
    host.kubelet.stop()
    unlink(host.kubelet.socket)  # re-created without touching the plugin's socket
    host.kubelet.start()
    after = resource_plugin._inode(inproc.kubelet_socket)
    assert before[1] == after[1] == 4242 and before[2] != after[2]
    inproc.tick()  # the very next poll registers again
    regs = host.kubelet.wait_registrations(2, 2)
    assert regs[-1].accepted and regs[-1].request.endpoint == SOCKET


def test_inode_alone_would_have_missed_it(host: Host, inproc, monkeypatch):
    """Control: with inode and ctime both unchanged the plugin cannot tell (and does not re-register)."""
    real_stat = os.stat
    frozen: dict[str, os.stat_result] = {}

    def fake_stat(path, *args, **kwargs):
        st = real_stat(path, *args, **kwargs)
        if str(path).endswith("kubelet.sock"):
            return frozen.setdefault("k", st)
        return st

    monkeypatch.setattr(resource_plugin.os, "stat", fake_stat)
    inproc.tick()
    host.kubelet.wait_registrations(1, 5)
    host.kubelet.stop()
    unlink(host.kubelet.socket)
    host.kubelet.start()
    inproc.tick()
    time.sleep(0.3)
    assert len(host.kubelet.registrations) == 1


@pytest.mark.parametrize("wipe", [True, False])
def test_registration_within_one_poll_after_a_long_kubelet_outage(host: Host, wipe: bool):
    """kubelet down long enough for the back-off to reach seconds; when it comes back (with or
    without wiping the folder) the plugin registers at its next poll, not after its back-off."""
    daemon, first = host.start_registered("--mode", "shared", "--resource-name", RESOURCE)
    host.kubelet.stop()
    unlink(host.kubelet.socket)
    if wipe:
        host.kubelet.wipe_sockets()
    time.sleep(4.5)  # attempts at ~0, 0.5, 1.5, 3.5 s: the next one would be ~7.5 s
    assert daemon.alive(), daemon.output()
    host.kubelet.start()
    t0 = time.monotonic()
    regs = host.kubelet.wait_registrations(2, 10)
    took = regs[-1].time - t0
    assert took <= WITHIN_ONE_POLL, f"registered {took:.2f} s after kubelet came back\n{daemon.output()}"
    assert regs[-1].accepted and regs[-1].request.endpoint == SOCKET
    if wipe:
        assert wait_for_path(host.socket(), 2)
    second = host.kubelet.plugin(RESOURCE, 5, newer_than=first)
    assert len(second.wait_first().ids()) == 1000


def test_restart_without_wipe_registers_within_one_poll(host: Host):
    daemon, first = host.start_registered("--mode", "shared", "--resource-name", RESOURCE)
    for n in range(3):
        host.kubelet.stop()
        unlink(host.kubelet.socket)
        host.kubelet.start()
        t0 = time.monotonic()
        regs = host.kubelet.wait_registrations(n + 2, 5)
        took = regs[-1].time - t0
        assert took <= WITHIN_ONE_POLL, f"restart {n}: registered after {took:.2f} s\n{daemon.output()}"
    assert host.socket().exists()


def test_register_waits_for_kubelets_dial_back(host: Host, monkeypatch):
    """A kubelet whose Register answer takes 6 s (dialling a slow plugin back): still a success."""
    assert registration.KUBELET_DIAL_BACK_TIMEOUT == 10.0
    original = host.kubelet._on_register

    def slow(request, context):
        time.sleep(6)
        return original(request, context)

    monkeypatch.setattr(host.kubelet, "_on_register", slow)
    done: list[BaseException | None] = []

    def call() -> None:
        try:
            registration.register(str(host.kubelet.socket), "x.sock", RESOURCE,
                                  registration.api_pb2.DevicePluginOptions())
            done.append(None)
        except BaseException as exc:  # noqa: BLE001 - reported below
            done.append(exc)

    t = threading.Thread(target=call)
    t.start()
    t.join(15)
    assert done == [None], done
