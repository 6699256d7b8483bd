"""RDMA lookups through sysfs, on a fake sysfs tree laid out like the kernel's.

The real-kernel suite checks the same code against Soft-RoCE devices; this pins the layout
rules (mlx5-style PCI netdevs, rxe-style parent files, GID matching by content and type).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rdma_netns.kernel import rdma_sysfs
from rdma_netns.kernel.inet import Prefix
from rdma_netns.rails import nics
from rdma_netns.spec.errors import CniError
from tests.fake_rdma_sysfs import FakeRdmaSysfs


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


@pytest.fixture
def sysfs(tmp_path, monkeypatch):
    """mlx5_0 on PCI 0000:3b:00.0 with netdev ens1f0; rxe0 (soft) on netdev veth0; each port with
    an address GID twice (index 1 RoCE v1, index 2 RoCE v2 on ndev rdma0) among empty entries."""
    fake = FakeRdmaSysfs(tmp_path, netns_mode="Y")
    fake.add_pci_device("mlx5_0", "0000:3b:00.0", "ens1f0")
    fake.add_soft_device("rxe0", "veth0")
    for dev, ndev in (("mlx5_0", "ens1f0"), ("rxe0", "veth0")):
        port = fake.sys / "class/infiniband" / dev / "ports/1"
        for i in range(1, 4):
            write(port / f"gids/{i}", "0000:0000:0000:0000:0000:0000:0000:0000")
            write(port / f"gid_attrs/types/{i}", "RoCE v2")
            write(port / f"gid_attrs/ndevs/{i}", ndev)
        write(port / "gids/2", "fd00:0001:0000:0000:0000:0000:0000:0005")
        write(port / "gid_attrs/types/1", "IB/RoCE v1")
        write(port / "gids/1", "fd00:0001:0000:0000:0000:0000:0000:0005")
        write(port / "gid_attrs/ndevs/2", "rdma0")
    monkeypatch.setattr(rdma_sysfs.default, "root", str(fake.sys))
    return fake.sys


def test_devices_and_netdevs(sysfs):
    assert rdma_sysfs.devices() == ["mlx5_0", "rxe0"]
    assert rdma_sysfs.netdevs_of_device("mlx5_0") == ["ens1f0"]
    assert rdma_sysfs.netdevs_of_device("rxe0") == ["veth0"]
    assert rdma_sysfs.device_of_netdev("veth0") == rdma_sysfs.RdmaPort("rxe0", 1)
    assert rdma_sysfs.device_of_netdev("eth9") is None
    assert rdma_sysfs.netdevs_of_pci("0000:3b:00.0") == ["ens1f0"]
    assert rdma_sysfs.pci_address_of_device("mlx5_0") == "0000:3b:00.0"


def test_netns_mode_follows_the_live_parameter(sysfs):
    assert rdma_sysfs.netns_mode() == "shared"
    write(sysfs / "module/ib_core/parameters/netns_mode", "N")
    assert rdma_sysfs.netns_mode() == "exclusive"


def test_gid_found_by_content_and_roce_v2_type(sysfs):
    entry = rdma_sysfs.find_gid(rdma_sysfs.RdmaPort("rxe0", 1), Prefix.parse("fd00:1::5"))
    assert (entry.index, entry.gid_type, entry.ndev) == (2, "RoCE v2", "rdma0")  # index 1 is RoCE v1
    assert rdma_sysfs.find_gid(rdma_sysfs.RdmaPort("rxe0", 1), Prefix.parse("fd00:1::6")) is None


def test_ipv4_gid_text_is_mapped():
    assert rdma_sysfs.gid_text(Prefix.parse("10.0.0.1")) == "0000:0000:0000:0000:0000:ffff:0a00:0001"


def net(**kw):
    from rdma_netns.config.netconf import NetConfig

    base = {"name": "n", "stateDir": "/nonexistent", "rails": None, "ipam": {"type": "host-local"},
            "requireRdma": True, "mtu": None}
    base.update(kw)
    return NetConfig(base)


def rail(**kw):
    base = {"netdev": None, "rdmaDevice": None, "pciAddress": None, "ifname": None, "ipam": None, "mtu": None}
    base.update(kw)
    return base


def test_plan_discovers_every_rdma_netdev(sysfs):
    plan = nics.plan(net(), "net1", None, chained=True)
    assert [(r.netdev, r.ifname, r.rdma.device) for r in plan] == [("ens1f0", "rdma0", "mlx5_0"),
                                                                    ("veth0", "rdma1", "rxe0")]


def test_plan_resolves_rdma_device_and_pci(sysfs):
    plan = nics.plan(net(rails=[rail(rdmaDevice="rxe0"), rail(pciAddress="0000:3b:00.0", ifname="r1")]), "net1",
                      None, chained=True)
    assert [(r.netdev, r.ifname) for r in plan] == [("veth0", "rdma0"), ("ens1f0", "r1")]


def test_pods_only_network_names_rail_0_cni_ifname(sysfs):
    """A CRI runtime takes the pod IP from CNI_IFNAME only: as the pod's only network, rail 0 is it."""
    two = [rail(rdmaDevice="rxe0", ifname="rdma0"), rail(pciAddress="0000:3b:00.0", ifname="rdma1")]
    assert [r.ifname for r in nics.plan(net(rails=two), "eth0", None, chained=False)] == ["eth0", "rdma1"]
    assert [r.ifname for r in nics.plan(net(rails=two), "eth0", None, chained=True)] == ["rdma0", "rdma1"]
    named = [rail(rdmaDevice="rxe0"), rail(pciAddress="0000:3b:00.0", ifname="eth0")]
    assert [r.ifname for r in nics.plan(net(rails=named), "eth0", None, chained=False)] == ["rdma0", "eth0"]


def test_granted_units_narrow_the_rails(sysfs):
    both = [rail(netdev="veth0"), rail(netdev="ens1f0")]
    paired = net(rails=both, resourceName="rdma/hca")
    assert [(r.netdev, r.ifname) for r in nics.plan(paired, "eth0", None, True, ["0000:3b:00.0"])] == \
        [("ens1f0", "rdma0")]
    assert [r.netdev for r in nics.plan(paired, "eth0", None, True, ["rxe0", "0000:3b:00.0"])] == \
        ["veth0", "ens1f0"]
    for foreign in (["0000:99:00.0"], ["0000:3b:00.0", "mlx5_9"]):
        with pytest.raises(CniError) as err:
            nics.plan(paired, "eth0", None, True, foreign)
        assert err.value.code == 108


def test_single_rail_takes_cni_ifname_unless_chained(sysfs):
    assert nics.plan(net(rails=[rail(netdev="veth0")]), "net1", None, chained=False)[0].ifname == "net1"
    assert nics.plan(net(rails=[rail(netdev="veth0")]), "eth0", None, chained=True)[0].ifname == "rdma0"


def test_device_id_narrows_to_one_rail(sysfs):
    both = [rail(netdev="veth0"), rail(netdev="ens1f0")]
    plan = nics.plan(net(rails=both), "net1", "0000:3b:00.0", chained=False)
    assert [r.netdev for r in plan] == ["ens1f0"]
    with pytest.raises(CniError) as err:
        nics.plan(net(rails=both), "net1", "0000:99:00.0", chained=False)
    assert err.value.code == 101


def test_rail_without_rdma_device_is_refused(sysfs):
    with pytest.raises(CniError) as err:
        nics.plan(net(rails=[rail(netdev="eth9")]), "net1", None, chained=False)
    assert err.value.code == 104
    assert nics.plan(net(rails=[rail(netdev="eth9")], requireRdma=False), "n", None, False)[0].rdma is None


def test_duplicate_netdevs_refused(sysfs):
    with pytest.raises(CniError):
        nics.plan(net(rails=[rail(netdev="veth0"), rail(rdmaDevice="rxe0")]), "n", None, False)


def test_mode_follows_or_checks_the_kernel():
    from rdma_netns import modes

    assert modes.effective_mode("auto", "exclusive") == "exclusive"
    assert modes.effective_mode("auto", None) == "shared"
    assert modes.effective_mode("shared", "shared") == "shared"
    assert modes.effective_mode("shared", None) == "shared"  # no RDMA core: plain netdevs
    with pytest.raises(CniError) as err:
        modes.effective_mode("shared", "exclusive")
    assert err.value.code == 103 and "netns_mode=1" in err.value.details


def test_status_refuses_a_shared_network_on_an_exclusive_kernel(sysfs):
    from rdma_netns import modes

    write(sysfs / "module/ib_core/parameters/netns_mode", "N")
    with pytest.raises(CniError) as err:
        modes.select(net(mode="shared", link="macvlan", linkMode="bridge"))
    assert err.value.code == 103
