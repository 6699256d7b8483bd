"""Shared mode's GID cap (issue 20): no more Healthy units than the rails' GID tables can wire,
on fake trees shaped like mlx5 under RoCE LAG (lingjun_host: 255 entries, 2 per address), mlx5
per port, and Soft-RoCE (1024 entries, 1 per address).

capacity = the most pods wired on any port + the fewest more pods any port takes. A pod's GIDs
(ndev not in the host's class/net) count as wired: that pod holds one of the Healthy units, so
filling the tables with pods leaves the count alone and kubelet's free units run out; the host's
own addresses take entries no pod holds, so they lower the count itself.
"""

from __future__ import annotations

import json
import logging

import pytest

from rdma_netns.kernel.rdma_devices import DeviceSysfs
from rdma_netns.kernel.rdma_sysfs import GidUsage, RdmaPort
from rdma_netns_dp.api.deviceplugin.v1beta1 import api_pb2
from rdma_netns_dp.config import ConfigError, ResourceConfig, Selectors, validate
from rdma_netns_dp.daemon import Daemon
from rdma_netns_dp.inventory import Pool, gid_capacity
from rdma_netns_dp.preferred import lowest_units
from rdma_netns_dp.servicer import DevicePluginServicer
from tests.dp.conftest import soft_roce_gid_tables
from tests.fake_rdma_sysfs import FakeRdmaSysfs, lingjun_host, standard_host
from tests.unit.test_lag_devices import per_port_host

CARDS = [f"mlx5_bond_{i}" for i in range(4)]
LAG_PODS = (255 - 2) // 2  # entries 0 and 1 hold the default GID (v1 and v2)


def address(n: int) -> str:
    return f"fd00:0000:0000:0000:0000:0000:{n >> 16:04x}:{n & 0xffff:04x}"


def add_pods(fake: FakeRdmaSysfs, devices: list[str], first: int, count: int, ndev: str = "rdma0") -> None:
    """`count` pods, one address each on every rail, as the kernel adds their GIDs."""
    for n in range(first, first + count):
        for device in devices:
            assert fake.add_gid(device, address(n), ndev) is not None, f"{device} full at pod {n}"


def refresh(fake: FakeRdmaSysfs, pool: Pool) -> int:
    """One discovery pass as the daemon does it; the Healthy count."""
    sysfs = DeviceSysfs(str(fake.sys))
    devices = sysfs.devices()
    pool.update(devices, gids={p: sysfs.gid_usage(p) for p in pool.gid_ports(devices)})
    return pool.healthy_count()


def shared_pool(units: int = 1000, **resource) -> Pool:
    """The pods of these tests put one address on each rail (add_pods; the CNI's linkLocal: false)
    unless a test says otherwise; the default of two is test_the_default_counts_the_link_local's."""
    resource.setdefault("addressesPerPod", 1)
    return Pool(ResourceConfig(sharedUnits=units, **resource), "shared")


@pytest.fixture
def lag(tmp_path) -> FakeRdmaSysfs:
    return lingjun_host(tmp_path)


SMALL_PODS = (41 - 2) // 2


@pytest.fixture
def small_lag(tmp_path) -> FakeRdmaSysfs:
    """The same node with 41-entry tables, to fill them quickly."""
    return lingjun_host(tmp_path, table=41)


def test_a_lag_node_offers_what_its_tables_take(lag):
    pool = shared_pool()
    assert refresh(lag, pool) == LAG_PODS
    units = pool.snapshot()[1]
    assert [u.healthy for u in units[LAG_PODS - 1:LAG_PODS + 1]] == [True, False], "the lowest ones Healthy"
    capacity = pool.gid_capacity
    assert (capacity.units, capacity.more) == (LAG_PODS, LAG_PODS)
    assert [(p.device, u.used, u.total, u.per_address) for p, u in capacity.ports] == [
        (card, 2, 255, 2) for card in CARDS]
    assert refresh(lag, shared_pool(units=40)) == 40, "sharedUnits below the cap: all Healthy"


def test_pods_filling_the_tables_hold_every_healthy_unit(small_lag):
    pool = shared_pool()
    assert refresh(small_lag, pool) == SMALL_PODS
    done = 0
    for pods in (1, 10, SMALL_PODS - 1, SMALL_PODS):
        add_pods(small_lag, CARDS, done, pods - done)
        done = pods
        assert refresh(small_lag, pool) == SMALL_PODS, "each pod's GIDs: one unit more held, one less free"
        assert pool.gid_capacity.more == SMALL_PODS - pods
    assert small_lag.add_gid("mlx5_bond_0", address(999), "rdma0") is None, "the kernel takes no more"
    for card in CARDS:
        small_lag.remove_gids_of(card, "rdma0")
    assert refresh(small_lag, pool) == SMALL_PODS and pool.gid_capacity.more == SMALL_PODS


def test_host_addresses_filling_a_table_leave_no_healthy_unit(small_lag):
    """The host's own addresses on bond1 (its ndev is here): entries no pod holds."""
    pool = shared_pool()
    add_pods(small_lag, ["mlx5_bond_1"], 0, 5, ndev="bond1")
    assert refresh(small_lag, pool) == SMALL_PODS - 5
    add_pods(small_lag, ["mlx5_bond_1"], 5, SMALL_PODS - 5, ndev="bond1")
    assert refresh(small_lag, pool) == 0 and pool.gid_capacity.ports[1][1].used == 40
    assert all(not u.healthy for u in pool.snapshot()[1])
    assert small_lag.remove_gids_of("mlx5_bond_1", "bond1") == 2 * SMALL_PODS
    assert refresh(small_lag, pool) == SMALL_PODS, "back once the addresses are gone"


def test_the_most_wired_port_plus_the_fullest_port(lag):
    add_pods(lag, ["mlx5_bond_0"], 0, 10)               # 10 pods on rail 0 only
    add_pods(lag, ["mlx5_bond_1"], 0, 30, ndev="bond1")  # 30 host addresses on rail 1
    pool = shared_pool()
    assert refresh(lag, pool) == 10 + (253 - 60) // 2
    assert (pool.gid_capacity.units, pool.gid_capacity.more) == (106, 96)


def test_the_default_counts_the_link_local(lag):
    """Rails keep their link-local address by default (RoCE needs it to resolve peers), so a pod
    puts two addresses on each rail: a LAG node's 253 free entries, two per address, take 63 pods."""
    pool = Pool(ResourceConfig(sharedUnits=1000), "shared")
    assert refresh(lag, pool) == 253 // 4 == 63


def test_two_addresses_per_pod_halve_it(lag):
    pool = shared_pool(addressesPerPod=2)
    assert refresh(lag, pool) == 253 // 4
    add_pods(lag, CARDS, 0, 5)  # five addresses: two pods and a half (one pod's link-local came late)
    assert refresh(lag, pool) == 3 + (253 - 10) // 4
    assert pool.gid_capacity.more == (253 - 10) // 4


def test_mlx5_per_port_tables(tmp_path):
    fake = per_port_host(tmp_path)
    pool = shared_pool()
    assert refresh(fake, pool) == LAG_PODS
    add_pods(fake, ["mlx5_0", "mlx5_1"], 0, 20)
    add_pods(fake, ["mlx5_1"], 20, 5, ndev="eth2")  # host addresses on the second port
    assert refresh(fake, pool) == 20 + (253 - 50) // 2
    only_first = shared_pool(selectors=Selectors(netdevs=["eth1"]))
    assert refresh(fake, only_first) == LAG_PODS, "a resource is bounded by its own devices' tables"


def test_soft_roce_sized_tables_do_not_cap_the_default_units(tmp_path):
    fake = soft_roce_gid_tables(standard_host(tmp_path))
    pool = shared_pool()
    assert refresh(fake, pool) == 1000
    assert pool.gid_capacity.units == 1023  # rxe: 1024 entries, 1 per address, entry 0 the host's


def test_no_readable_table_no_cap(tmp_path):
    fake = standard_host(tmp_path)
    infiniband = shared_pool(selectors=Selectors(linkTypes=["infiniband"]))
    assert refresh(fake, infiniband) == 1000 and infiniband.gid_capacity is None
    assert infiniband.gid_ports(DeviceSysfs(str(fake.sys)).devices()) == []
    exclusive = Pool(ResourceConfig(), "exclusive")
    assert exclusive.gid_ports(DeviceSysfs(str(fake.sys)).devices()) == []
    unread = shared_pool()
    unread.update(DeviceSysfs(str(fake.sys)).devices())
    assert unread.healthy_count() == 1000 and unread.gid_capacity is None


def test_iwarp_ports_do_not_cap(tmp_path):
    """irdma in iWARP mode (E810's default): one MAC GID, its table reads as full, pods add none."""
    fake = standard_host(tmp_path)
    for name in ("irdma0", "irdma1"):
        (fake.devices[name].folder / "node_type").write_text("4: RNIC\n")
    iwarp = shared_pool(selectors=Selectors(drivers=["ice"]))
    assert refresh(fake, iwarp) == 1000 and iwarp.gid_capacity is None
    assert {d.node_type for d in DeviceSysfs(str(fake.sys)).devices()} == {"CA", "RNIC"}


def test_the_cap_never_makes_a_unit_healthy(lag):
    pool = shared_pool()
    for card in CARDS:
        lag.set_port_state(card, "DOWN")
    assert refresh(lag, pool) == 0
    sysfs = DeviceSysfs(str(lag.sys))
    devices = sysfs.devices()
    pool.update(devices, blocked_reason="wrong mode", gids={p: sysfs.gid_usage(p) for p in pool.gid_ports(devices)})
    assert pool.healthy_count() == 0


def test_wired_pods_round_up():
    port = RdmaPort("mlx5_bond_0", 1)
    capacity = gid_capacity({port: GidUsage(255, 7, 2, 5)}, 1)  # 5 pod entries: 3 pods, one half gone
    assert (capacity.units, capacity.more) == (3 + 124, 124)
    assert gid_capacity({}, 1) is None
    assert "mlx5_bond_0 port 1 7/255 entries used" in capacity.describe()
    assert capacity.describe().startswith("GID tables allow 124 more pods on this node: ")


def test_lowest_units_in_the_pools_order():
    order = {f"hca-{i:04d}": i for i in range(10002)}
    assert lowest_units(["hca-10000", "hca-1001", "hca-0002"], [], 2, order) == ["hca-0002", "hca-1001"]
    assert lowest_units(["hca-0005", "hca-0001", "hca-0003"], ["hca-0005"], 2, order) == ["hca-0005", "hca-0001"]
    assert lowest_units(["hca-0001"], ["hca-0007", "hca-0008"], 1, order) == ["hca-0007", "hca-0008"]


def test_shared_mode_offers_and_answers_preferred_allocation(lag):
    pool = shared_pool(units=200)
    refresh(lag, pool)
    servicer = DevicePluginServicer(pool, DeviceSysfs(str(lag.sys)), str(lag.dev), False)
    assert servicer.options().get_preferred_allocation_available is True
    request = api_pb2.PreferredAllocationRequest(container_requests=[
        api_pb2.ContainerPreferredAllocationRequest(available_deviceIDs=["hca-0100", "hca-0007", "hca-0042"],
                                                    allocation_size=2)])
    answer = servicer.GetPreferredAllocation(request, None)
    assert list(answer.container_responses[0].deviceIDs) == ["hca-0007", "hca-0042"]


def test_the_config_key():
    resource = {"name": "rdma/hca"}
    assert validate({"resources": [resource]}, "t").resources[0].addressesPerPod == 2
    assert validate({"resources": [{**resource, "addressesPerPod": 1}]}, "t").resources[0].addressesPerPod == 1
    for bad in (0, 17, "two"):
        with pytest.raises(ConfigError, match="addressesPerPod"):
            validate({"resources": [{**resource, "addressesPerPod": bad}]}, "t")


# --- the daemon's pass ------------------------------------------------------------------------
def lag_daemon(fake: FakeRdmaSysfs, tmp_path, **resource) -> Daemon:
    resource.setdefault("addressesPerPod", 1)  # as shared_pool: add_pods puts one address per rail
    return Daemon(validate({
        "mode": "shared", "sysfsRoot": str(fake.sys), "devRoot": str(fake.dev), "kubeletDir": str(tmp_path / "k"),
        "healthFile": str(tmp_path / "health.json"), "podGrantsSocket": "", "cniStateDir": str(tmp_path / "cni"),
        "resources": [{"name": "rdma/hca", "sharedUnits": 200, **resource}]}, "test"))


def gid_messages(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith("GID tables allow")]


def test_the_daemon_recomputes_it_each_pass_and_logs_each_change_once(lag, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="rdma_netns_dp.daemon")
    daemon = lag_daemon(lag, tmp_path)
    pool = daemon.pools[0]
    daemon.poll()
    daemon.poll()
    assert pool.healthy_count() == LAG_PODS
    (first,) = gid_messages(caplog)
    assert first.levelname == "WARNING" and first.gid_capacity == LAG_PODS and first.shared_units == 200
    assert first.getMessage().startswith(f"GID tables allow {LAG_PODS} more pods on this node: "
                                         "mlx5_bond_0 port 1 2/255 entries used, mlx5_bond_1 port 1")
    add_pods(lag, CARDS, 0, 20)
    daemon.poll()
    assert pool.healthy_count() == LAG_PODS and len(gid_messages(caplog)) == 1, "pods: the count stays"
    add_pods(lag, ["mlx5_bond_2"], 0, 3, ndev="bond2")
    daemon.poll()
    daemon.poll()
    assert pool.healthy_count() == LAG_PODS - 3
    assert len(gid_messages(caplog)) == 2 and "mlx5_bond_2 port 1 48/255" in gid_messages(caplog)[1].getMessage()


def test_the_health_file_shows_the_gid_capacity(lag, tmp_path):
    daemon = lag_daemon(lag, tmp_path, addressesPerPod=2)
    add_pods(lag, CARDS, 0, 4)
    daemon.poll()
    daemon.write_health()
    status = json.loads((tmp_path / "health.json").read_text())["resources"]["rdma/hca"]
    assert (status["devices"], status["healthy"]) == (200, 2 + (253 - 8) // 4)
    capacity = status["gidCapacity"]
    assert (capacity["units"], capacity["morePods"]) == (63, 61)
    assert capacity["ports"][0] == {"device": "mlx5_bond_0", "port": 1, "used": 10, "total": 255,
                                    "perAddress": 2, "inPods": 8}


def test_the_daemon_reads_only_the_tables_that_bound_a_pool(lag, tmp_path, monkeypatch):
    daemon = lag_daemon(lag, tmp_path, selectors={"netdevs": ["bond1"]})
    read: list[RdmaPort] = []
    original = DeviceSysfs.gid_usage
    monkeypatch.setattr(DeviceSysfs, "gid_usage", lambda self, port: read.append(port) or original(self, port))
    daemon.poll()
    assert read == [RdmaPort("mlx5_bond_1", 1)]
    assert [p.device for p, _ in daemon.pools[0].gid_capacity.ports] == ["mlx5_bond_1"]
