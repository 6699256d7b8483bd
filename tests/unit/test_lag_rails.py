"""Rails on mlx5's real shapes, on fake sysfs trees built from the kernel's layout: RoCE LAG
(mlx5_bond_N under PF0's function, net/ = a member, the bond virtual with lower_* links, the
members' master links; GIDs on the bond and the pods' interfaces) and mlx5 per port beside it.

The real-kernel guest reproduces LAG with Soft-RoCE made on a bond member
(integration/guest_suite/test_7_bond.py); these pin the rules on the hardware's shape.
"""

from __future__ import annotations

import pytest

from rdma_netns.commands.add import _missing_gid
from rdma_netns.kernel import rdma_sysfs, rtnl
from rdma_netns.kernel.rdma_sysfs import RdmaPort
from rdma_netns.modes.exclusive import ExclusiveMode
from rdma_netns.rails import nics
from rdma_netns.spec.errors import CniError
from tests.fake_rdma_sysfs import FakeRdmaSysfs, lingjun_host
from tests.unit.test_rdma_sysfs import net, rail


@pytest.fixture
def lag(tmp_path, monkeypatch):
    fake = lingjun_host(tmp_path)
    monkeypatch.setattr(rdma_sysfs.default, "root", str(fake.sys))
    return fake


def test_the_kernel_layer_maps_a_lag_device_to_its_bond_and_back(lag):
    assert rdma_sysfs.netdevs_of_device("mlx5_bond_0") == ["eth1"]  # what mlx5 reports: a member
    assert rdma_sysfs.rail_netdevs_of_device("mlx5_bond_0") == ["bond0"]
    assert rdma_sysfs.bond_members("bond0") == ["eth1", "eth2"]
    assert rdma_sysfs.default.bond_of("eth2") == "bond0"
    assert rdma_sysfs.default.bond_of("bond0") is None
    for netdev in ("bond0", "eth1", "eth2"):
        assert rdma_sysfs.device_of_netdev(netdev) == RdmaPort("mlx5_bond_0", 1)
    assert rdma_sysfs.device_of_netdev("bond9") is None


@pytest.mark.parametrize("form", [{"netdev": "bond1"}, {"rdmaDevice": "mlx5_bond_1"},
                                  {"pciAddress": "0000:3b:00.0"}, {"pciAddress": "0000:3b:00.1"},
                                  {"netdev": "eth4"}])
def test_every_rail_form_is_the_same_bond_rail(lag, form):
    (only,) = nics.plan(net(rails=[rail(**form)]), "net1", None, chained=True)
    assert (only.netdev, only.rdma) == ("bond1", RdmaPort("mlx5_bond_1", 1))


def test_rails_omitted_one_per_lag_device_never_per_member(lag):
    plan = nics.plan(net(), "eth0", None, chained=True)
    assert [(r.ifname, r.netdev, r.rdma.device) for r in plan] == [
        ("rdma0", "bond0", "mlx5_bond_0"), ("rdma1", "bond1", "mlx5_bond_1"),
        ("rdma2", "bond2", "mlx5_bond_2"), ("rdma3", "bond3", "mlx5_bond_3")]


def test_kubelet_grants_and_device_ids_name_lag_rails(lag):
    both = [rail(netdev="bond0"), rail(netdev="bond1")]
    paired = net(rails=both, resourceName="rdma/hca")
    for unit in ("0000:1a:00.0", "mlx5_bond_0", "0000:1a:00.1"):
        assert [r.netdev for r in nics.plan(paired, "eth0", None, True, [unit])] == ["bond0"]
    assert [r.netdev for r in nics.plan(net(rails=both), "net1", "0000:3b:00.1", chained=False)] == ["bond1"]


def test_a_bond_over_ports_without_rdma_says_so(tmp_path, monkeypatch):
    fake = FakeRdmaSysfs(tmp_path)
    fake.add_pci_device("mlx5_0", "0000:1a:00.0", "ens1f0")
    fake._add_netdev(fake.sys / "devices/virtual/net/eth7", "eth7")
    fake.add_bond("bond7", ["eth7"])
    monkeypatch.setattr(rdma_sysfs.default, "root", str(fake.sys))
    with pytest.raises(CniError) as err:
        nics.plan(net(rails=[rail(netdev="bond7")]), "net1", None, chained=False)
    assert err.value.code == 104 and "bond members eth7" in err.value.msg


def test_mlx5_per_port_beside_lag(tmp_path, monkeypatch):
    """One card per port (no LAG: each PF its own RDMA device and rail) beside a LAG card."""
    fake = FakeRdmaSysfs(tmp_path)
    fake.add_pci_device("mlx5_0", "0000:1a:00.0", "ens1f0np0")
    fake.add_pci_device("mlx5_1", "0000:1a:00.1", "ens1f1np1")
    fake.add_lag_device("mlx5_bond_0", ("0000:3b:00.0", "0000:3b:00.1"), ("eth3", "eth4"), "bond0")
    monkeypatch.setattr(rdma_sysfs.default, "root", str(fake.sys))
    plan = nics.plan(net(), "eth0", None, chained=True)
    assert [(r.netdev, r.rdma.device) for r in plan] == [("ens1f0np0", "mlx5_0"), ("ens1f1np1", "mlx5_1"),
                                                         ("bond0", "mlx5_bond_0")]


def test_two_rails_naming_one_bond_are_refused(lag):
    with pytest.raises(CniError) as err:
        nics.plan(net(rails=[rail(netdev="bond0"), rail(rdmaDevice="mlx5_bond_0")]), "n", None, False)
    assert err.value.code == 7 and "same netdev" in err.value.msg


def test_exclusive_mode_refuses_a_bond_rail_before_anything_moves(lag):
    (bond_rail,) = nics.plan(net(rails=[rail(netdev="bond0")]), "net1", None, chained=False)
    parent = rtnl.Link(index=9, name="bond0", flags=rtnl.IFF_UP, mac="02:00:00:00:00:09", kind="bond",
                       parent_index=0)
    with pytest.raises(CniError) as err:
        ExclusiveMode().prepare(bond_rail, parent)
    assert err.value.code == 101
    assert "bond0 is a bond (over eth1, eth2, RDMA device mlx5_bond_0)" in err.value.msg
    assert "shared mode" in err.value.details


def test_mlx5_gid_table_capacity(lag):
    port = RdmaPort("mlx5_bond_0", 1)
    usage = rdma_sysfs.gid_usage(port)
    assert (usage.total, usage.used, usage.per_address, usage.in_pods) == (255, 2, 2, 0)
    assert usage.free_addresses == 126  # pods per rail without link-local GIDs (63 with them)
    assert lag.add_gid("mlx5_bond_0", "fd00:0001:0000:0000:0000:0000:0000:0002", "rdma0") == 3
    usage = rdma_sysfs.gid_usage(port)
    assert (usage.used, usage.in_pods, usage.free_addresses) == (4, 2, 125)
    pod_gid = rdma_sysfs.find_gid(port, rdma_sysfs.Prefix.parse("fd00:1::2"))
    assert (pod_gid.index, pod_gid.gid_type, pod_gid.ndev) == (3, "RoCE v2", "rdma0")


def test_a_full_table_is_named_in_the_error(lag):
    n = 0
    while lag.add_gid("mlx5_bond_0", f"fd00:0001:0000:0000:0000:0000:0001:{n:04x}", "rdma0") is not None:
        n += 1
    assert n == 126
    (bond_rail,) = nics.plan(net(rails=[rail(netdev="bond0")]), "rdma0", None, chained=True)
    err = _missing_gid(bond_rail, "mlx5_bond_0", 1, "fd00:1::2:1", 3.0, None)
    assert err.code == 104
    assert err.msg.startswith("GID table of mlx5_bond_0 port 1 is full (254/255 entries used, 2 per address)")
    lag.remove_gids_of("mlx5_bond_0", "rdma0")
    err = _missing_gid(bond_rail, "mlx5_bond_0", 1, "fd00:1::2:1", 3.0, None)
    assert "no GID for fd00:1::2:1 appeared on mlx5_bond_0 port 1" in err.msg and "2/255 entries" in err.msg
    assert "its bond" in err.details


def test_a_gid_of_another_type_only_is_named(lag):
    p = lag.devices["mlx5_bond_0"].folder / "ports/1"
    gid = "fd00:0001:0000:0000:0000:0000:0000:0009"
    lag._set_gid(p, 2, gid, "IB/RoCE v1", "rdma0")
    (bond_rail,) = nics.plan(net(rails=[rail(netdev="bond0")]), "rdma0", None, chained=True)
    err = _missing_gid(bond_rail, "mlx5_bond_0", 1, "fd00:1::9", 3.0, None)
    assert "only as IB/RoCE v1, not RoCE v2" in err.msg


def test_the_shipped_lag_entry_resolves_to_the_lag_devices(lag, tmp_path):
    """conf/rdma-netns-chained-entry-lag.json (docs/roce-lag.md's Lingjun entry) on a 4-card LAG node."""
    import json

    from rdma_netns.config import loader
    from tests.conftest import REPO

    entry = json.loads((REPO / "conf" / "rdma-netns-chained-entry-lag.json").read_text())
    cfg = loader.load({"cniVersion": "1.1.0", "name": "k8s-pod-network", **entry, "stateDir": str(tmp_path)})
    assert (cfg.net.link, cfg.net.link_mode, cfg.net.link_local) == ("ipvlan", "l2", True)
    plan = nics.plan(cfg.net, "eth0", None, chained=True)
    assert [(r.ifname, r.netdev, r.rdma.device) for r in plan] == [
        (f"rdma{i}", f"bond{i}", f"mlx5_bond_{i}") for i in range(4)]


def test_a_virtio_nic_is_found_by_its_pci_address(tmp_path, monkeypatch):
    """virtio-net puts its netdev one level down (<pci>/virtioN/net/<netdev>): the guest's NICs,
    and cloud VMs'; a bond over them resolves from either member's PCI address."""
    fake = FakeRdmaSysfs(tmp_path)
    pci = fake.sys / "devices/pci0000:00/0000:00:0a.0"
    fake._add_netdev(pci / "virtio8/net/enp0s10", "enp0s10")
    (fake.sys / "bus/pci/devices/0000:00:0a.0").symlink_to(pci)
    fake.add_soft_device("rxeb", "enp0s10")
    fake.add_bond("bond0", ["enp0s10"])
    monkeypatch.setattr(rdma_sysfs.default, "root", str(fake.sys))
    assert rdma_sysfs.netdevs_of_pci("0000:00:0a.0") == ["enp0s10"]
    (only,) = nics.plan(net(rails=[rail(pciAddress="0000:00:0a.0")]), "net1", None, chained=False)
    assert (only.netdev, only.rdma) == ("bond0", RdmaPort("rxeb", 1))
