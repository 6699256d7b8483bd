"""The one RDMA sysfs reader (kernel/rdma_sysfs.py) and the device plugin's records built on it
(kernel/rdma_devices.py), on the fake kernel-shaped tree the device-plugin tests use.

The point: the CNI plugin and the device plugin read the same files with the same rules, above all
which netdev a device runs on (they used to differ on the gid_attrs/ndevs/0 fallback).
"""

from __future__ import annotations

import os
import shutil

import pytest

from rdma_netns.kernel import rdma_sysfs
from rdma_netns.kernel.rdma_devices import CharDevice, DeviceSysfs, PortInfo
from rdma_netns.kernel.rdma_sysfs import RdmaPort, RdmaSysfs
from tests.fake_rdma_sysfs import FakeRdmaSysfs, standard_host


@pytest.fixture
def host(tmp_path) -> FakeRdmaSysfs:
    return standard_host(tmp_path / "node")


def test_one_reader_for_both_programs(host):
    cni, dp = RdmaSysfs(str(host.sys)), DeviceSysfs(str(host.sys))
    records = {d.name: d for d in dp.devices()}
    assert sorted(records) == cni.device_names()
    for name, record in records.items():
        assert list(record.netdevs) == cni.netdevs_of_device(name)
        assert [p.number for p in record.ports] == cni.ports(name)
    assert cni.netdevs_of_device("mlx5_0") == ["ens1f0"]      # the PCI function's net/
    assert cni.netdevs_of_device("rxe0") == ["eth0"]          # the soft device's parent file


def test_netdev_falls_back_to_the_default_gid_in_both(host):
    """A RoCE device with no net/ under its function and no parent file (the netdev's folder is
    gone from this view): the netdev of port 1's default GID names it, for the CNI and the dp alike."""
    shutil.rmtree(host.sys / "devices/pci0000:00/0000:3b:00.0/net")
    cni, dp = RdmaSysfs(str(host.sys)), DeviceSysfs(str(host.sys))
    assert cni.netdevs_of_device("mlx5_1") == ["ens2f0"]
    assert {d.name: d.netdevs for d in dp.devices()}["mlx5_1"] == ("ens2f0",)
    assert cni.device_of_netdev("ens2f0") == RdmaPort("mlx5_1", 1)


def test_infiniband_device_without_netdev(host):
    shutil.rmtree(host.sys / "devices/pci0000:00/0000:af:00.0/net")  # IB: no ndevs/0 either
    assert RdmaSysfs(str(host.sys)).netdevs_of_device("mlx5_4") == []
    assert {d.name: d.netdevs for d in DeviceSysfs(str(host.sys)).devices()}["mlx5_4"] == ()


def test_ports_pci_facts_and_char_devices(host):
    reader = DeviceSysfs(str(host.sys))
    host.set_port_state("mlx5_2", "DOWN")
    records = {d.name: d for d in reader.devices()}
    mlx = records["mlx5_2"]
    assert mlx.ports == (PortInfo(1, "DOWN", "Disabled", "Ethernet"),) and not mlx.healthy
    assert (mlx.pci_address, mlx.vendor, mlx.device_id, mlx.driver, mlx.numa_node) == \
        ("0000:5e:00.0", "15b3", "1017", "mlx5_core", 0)
    assert mlx.uverbs == CharDevice(f"uverbs{host.uverbs_number('mlx5_2')}")
    n = host.mad_numbers("mlx5_2")[0]
    assert mlx.mad == (CharDevice(f"issm{n}", 1), CharDevice(f"umad{n}", 1))
    assert records["mlx5_4"].link_types == {"infiniband"}
    soft = records["rxe0"]
    assert (soft.pci_address, soft.vendor, soft.driver, soft.numa_node, soft.stable_id) == \
        (None, None, None, None, "rxe0")
    assert reader.pci_address_of_device("mlx5_2") == "0000:5e:00.0" and reader.pci_address_of_device("rxe0") is None


def test_fresh_char_devices_follow_a_renumbering(host):
    reader = DeviceSysfs(str(host.sys))
    number = host.renumber_uverbs("mlx5_0")
    uverbs, mad = reader.fresh_char_devices(["mlx5_0", "gone0"])["mlx5_0"]
    assert uverbs == CharDevice(f"uverbs{number}") and len(mad) == 2
    assert reader.fresh_char_devices(["gone0"]) == {"gone0": (None, ())}


def test_removed_device_and_mode(host):
    reader = DeviceSysfs(str(host.sys))
    assert reader.netns_mode() == "shared" and reader.subsystem_present()
    host.remove_device("mlx5_0", with_netdev=True)
    host.set_netns_mode("N")
    assert "mlx5_0" not in [d.name for d in reader.devices()]
    assert reader.netns_mode() == "exclusive"
    host.set_netns_mode(None)
    assert reader.netns_mode() is None


def test_missing_root_reads_as_no_rdma(tmp_path):
    reader = DeviceSysfs(str(tmp_path / "nothing"))
    assert (reader.device_names(), reader.devices(), reader.netns_mode(), reader.subsystem_present()) == \
        ([], [], None, False)
    assert reader.device_by_id("0000:3b:00.0") is None


def test_module_functions_follow_use_root(host):
    """The CNI's module-level names read through the default reader; use_root re-roots it."""
    previous = rdma_sysfs.use_root(str(host.sys) + "/")
    try:
        assert rdma_sysfs.default.root == str(host.sys)
        assert rdma_sysfs.devices() == RdmaSysfs(str(host.sys)).device_names()
        assert rdma_sysfs.device_by_id("0000:1a:00.0") == "mlx5_0"
        assert rdma_sysfs.netdevs_of_pci("0000:1a:00.0") == ["ens1f0"]
        assert rdma_sysfs.ports("mlx5_0") == [1]
        assert [g.ndev for g in rdma_sysfs.gids(RdmaPort("mlx5_0", 1))] == ["ens1f0"]
    finally:
        rdma_sysfs.use_root(previous)
    assert rdma_sysfs.default.root == previous


def test_default_root_comes_from_the_environment(host):
    """Subprocess CNI runs point the default reader at a test tree with RDMA_NETNS_SYSFS_ROOT."""
    import subprocess
    import sys

    env = dict(os.environ, RDMA_NETNS_SYSFS_ROOT=str(host.sys))
    out = subprocess.run([sys.executable, "-c", "from rdma_netns.kernel import rdma_sysfs; "
                          "print(rdma_sysfs.netdevs_of_device('rxe0'))"],
                         env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['eth0']"
