"""Issue 20 through the real daemon and the gRPC kubelet stand-in: on a RoCE LAG node kubelet
admits as many pods as the GID tables can still wire (lowest units first), and ListAndWatch
reports fewer Healthy units once the host's own addresses take entries."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from tests.dp.conftest import INTERVAL, RESOURCE, Host
from tests.fake_rdma_sysfs import FakeRdmaSysfs, lingjun_host
from tests.kubelet_standin import AdmissionError, DeviceListUpdate

TABLE = 41                 # small tables: (41 - 2) // 2 = 19 addresses, two per pod (its own, the
PODS = (TABLE - 2) // 4    # rail's link-local one: the device plugin's default addressesPerPod): 9 pods
CARDS = [f"mlx5_bond_{i}" for i in range(4)]
CONFIG = {"mode": "shared", "resources": [{"name": RESOURCE, "sharedUnits": 16}]}


def small_lag_host(root, netns_mode) -> FakeRdmaSysfs:
    return lingjun_host(root, netns_mode, table=TABLE)


@pytest.fixture
def lag_host() -> Iterator[Host]:
    h = Host("Y", build=small_lag_host)
    yield h
    h.close()


def healthy(update: DeviceListUpdate) -> list[str]:
    return sorted(i for i, h in update.health().items() if h == "Healthy")


def address(n: int) -> str:
    return f"fd00:0000:0000:0000:0000:0000:0000:{n:04x}"


def link_local(n: int) -> str:
    return f"fe80:0000:0000:0000:0000:00ff:fe00:{n:04x}"


def test_kubelet_admits_what_the_gid_tables_wire(lag_host: Host):
    daemon, plugin = lag_host.start_registered(config=CONFIG)
    assert healthy(plugin.latest) == [f"hca-{i:04d}" for i in range(PODS)]
    assert plugin.options.get_preferred_allocation_available, "shared mode steers kubelet to low units"
    for n in range(PODS):
        grants = lag_host.kubelet.admit_pod("default", f"pod{n}", {"main": {RESOURCE: 1}})
        assert grants["main"][RESOURCE] == [f"hca-{n:04d}"]
        for card in CARDS:  # the pod's CNI ADD: its rail's link-local address and its own, on every rail
            assert lag_host.fake.add_gid(card, link_local(n), "rdma0") is not None
            assert lag_host.fake.add_gid(card, address(n), "rdma0") is not None
    time.sleep(3 * INTERVAL)
    assert len(healthy(plugin.latest)) == PODS, "the pods hold the Healthy units"
    with pytest.raises(AdmissionError, match="available 0"):
        lag_host.kubelet.admit_pod("default", "one-too-many", {"main": {RESOURCE: 1}})
    status = json.loads(lag_host.health_file.read_text())["resources"][RESOURCE]
    assert status["gidCapacity"]["morePods"] == 0 and status["healthy"] == PODS
    assert daemon.alive()


def test_listandwatch_reports_fewer_healthy_units_as_host_addresses_fill_a_table(lag_host: Host):
    daemon, plugin = lag_host.start_registered(config=CONFIG)
    assert len(healthy(plugin.latest)) == PODS
    for n in range(6):  # the admin adds addresses to bond2 on the host: the room of three pods
        lag_host.fake.add_gid("mlx5_bond_2", address(n), "bond2")
    fewer = plugin.wait_for(lambda u: len(healthy(u)) == PODS - 3, 5, f"{PODS - 3} Healthy")
    assert healthy(fewer) == [f"hca-{i:04d}" for i in range(PODS - 3)] and len(fewer.ids()) == 16
    for n in range(6, (TABLE - 2) // 2):
        lag_host.fake.add_gid("mlx5_bond_2", address(n), "bond2")
    plugin.wait_for(lambda u: healthy(u) == [], 5, "none Healthy with bond2's table full")
    lag_host.fake.remove_gids_of("mlx5_bond_2", "bond2")
    plugin.wait_for(lambda u: len(healthy(u)) == PODS, 5, "all back")
    assert daemon.alive()
