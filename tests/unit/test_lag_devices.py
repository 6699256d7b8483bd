"""The device plugin's device records and selectors on mlx5's real shapes (fake sysfs trees built
from the kernel's layout): RoCE LAG, one mlx5_bond_N per card whose netdev is a member of the bond
that carries the addresses, and mlx5 per port beside it (one device per port, no bond)."""

from __future__ import annotations

import pytest

from rdma_netns.kernel.rdma_devices import DeviceSysfs, RdmaDevice
from rdma_netns_dp.config import Selectors
from rdma_netns_dp.selection import matches
from tests.fake_rdma_sysfs import FakeRdmaSysfs, lingjun_host


@pytest.fixture
def lag(tmp_path) -> dict[str, RdmaDevice]:
    fake = lingjun_host(tmp_path)
    return {d.name: d for d in DeviceSysfs(str(fake.sys)).devices()}


def per_port_host(root) -> FakeRdmaSysfs:
    """One dual-port ConnectX card without LAG: mlx5_0 on eth1, mlx5_1 on eth2, 255-entry tables."""
    fake = FakeRdmaSysfs(root)
    for name, pci, netdev in (("mlx5_0", "0000:1a:00.0", "eth1"), ("mlx5_1", "0000:1a:00.1", "eth2")):
        fake.add_pci_device(name, pci, netdev, device="0x101d")
        fake.mlx5_gid_table(name)
    return fake


@pytest.fixture
def per_port(tmp_path) -> dict[str, RdmaDevice]:
    return {d.name: d for d in DeviceSysfs(str(per_port_host(tmp_path).sys)).devices()}


def test_lag_records_name_the_bond_and_its_members(lag):
    assert sorted(lag) == [f"mlx5_bond_{i}" for i in range(4)]
    first = lag["mlx5_bond_0"]
    assert first.netdevs == ("eth1",), "mlx5 reports a member as the device's netdev"
    assert (first.bond, first.bond_members) == ("bond0", ("eth1", "eth2"))
    assert first.related_netdevs == ("eth1", "bond0", "eth2")
    assert (lag["mlx5_bond_3"].bond, lag["mlx5_bond_3"].bond_members) == ("bond3", ("eth7", "eth8"))
    assert first.stable_id == "0000:1a:00.0" and first.numa_node == 0 and lag["mlx5_bond_2"].numa_node == 1


def test_per_port_records_have_no_bond(per_port):
    assert [(d.name, d.netdevs, d.bond, d.bond_members) for d in per_port.values()] == [
        ("mlx5_0", ("eth1",), None, ()), ("mlx5_1", ("eth2",), None, ())]
    assert per_port["mlx5_0"].related_netdevs == ("eth1",)


def test_a_bond_over_per_port_devices_is_each_ones_bond(tmp_path):
    """Bonding without RoCE LAG (two RDMA devices stay): both devices' rails use the bond."""
    fake = per_port_host(tmp_path)
    fake.add_bond("bond0", ["eth1", "eth2"])
    found = {d.name: d for d in DeviceSysfs(str(fake.sys)).devices()}
    assert {d.bond for d in found.values()} == {"bond0"}
    assert found["mlx5_1"].bond_members == ("eth1", "eth2")


def test_soft_roce_made_on_a_bond_has_that_bond(tmp_path):
    fake = FakeRdmaSysfs(tmp_path)
    fake.add_soft_device("rxe0", "eth1")
    fake.add_soft_device("rxe1", "eth2")
    fake.add_bond("bond0", ["eth1", "eth2"])
    fake.add_soft_device("rxe2", "bond0")
    found = {d.name: d for d in DeviceSysfs(str(fake.sys)).devices()}
    assert found["rxe0"].bond == "bond0"
    assert (found["rxe2"].netdevs, found["rxe2"].bond, found["rxe2"].bond_members) == (
        ("bond0",), "bond0", ("eth1", "eth2"))


def test_existing_constructor_calls_still_work():
    device = RdmaDevice("rxe0", (), ("eth0",), None, None, None, None, None, None)
    assert (device.bond, device.bond_members, device.related_netdevs) == (None, (), ("eth0",))


@pytest.mark.parametrize("pattern,expected", [
    ("bond0", ["mlx5_bond_0"]),                 # the bond the rails use
    ("eth1", ["mlx5_bond_0"]),                  # the member mlx5 reports
    ("eth4", ["mlx5_bond_1"]),                  # the other member: no RDMA device of its own
    ("bond[23]", ["mlx5_bond_2", "mlx5_bond_3"]),
    ("bond*", [f"mlx5_bond_{i}" for i in range(4)]),
    ("ens*", []),
])
def test_netdevs_selector_matches_netdev_bond_or_member(lag, pattern, expected):
    assert [n for n, d in lag.items() if matches(d, Selectors(netdevs=[pattern]))] == expected


def test_other_selectors_on_lag_devices(lag):
    assert all(matches(d, Selectors(rdmaDevices=["mlx5_bond_*"], deviceIDs=["101d"], drivers=["mlx5_core"],
                                    linkTypes=["ethernet"])) for d in lag.values())
    assert not matches(lag["mlx5_bond_0"], Selectors(netdevs=["bond1"], rdmaDevices=["mlx5_bond_0"]))


def test_netdevs_selector_per_port(per_port):
    assert [n for n, d in per_port.items() if matches(d, Selectors(netdevs=["eth2"]))] == ["mlx5_1"]
    assert not any(matches(d, Selectors(netdevs=["bond*"])) for d in per_port.values())
