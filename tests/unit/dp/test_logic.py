"""Device-plugin logic without gRPC: config, selectors, pools, preferred allocation, the grant
and the CDI spec, on a kernel-shaped sysfs tree in a temp folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rdma_netns_dp import cdi
from rdma_netns_dp.allocation import AllocationError, grant
from rdma_netns_dp.cni_state import devices_in_pods
from rdma_netns_dp.config import ConfigError, ResourceConfig, Selectors, load, parse
from rdma_netns_dp.discovery import Sysfs
from rdma_netns_dp.inventory import Pool, UnknownDevice
from rdma_netns_dp.preferred import preferred
from rdma_netns_dp.selection import matches


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def add_pci_device(root: Path, name: str, pci: str, netdev: str, numa: int, uverbs: int,
                   state: str = "4: ACTIVE", vendor: str = "0x15b3", link: str = "Ethernet") -> None:
    dev = root / "devices/pci0000:00" / pci
    write(dev / "vendor", vendor)
    write(dev / "device", "0x101b")
    write(dev / "numa_node", str(numa))
    (dev / "net" / netdev).mkdir(parents=True)
    (root / "bus/pci/drivers/mlx5_core").mkdir(parents=True, exist_ok=True)
    os.symlink(root / "bus/pci/drivers/mlx5_core", dev / "driver")
    ib = root / "class/infiniband" / name
    ib.mkdir(parents=True)
    os.symlink(dev, ib / "device")
    write(ib / "ports/1/state", state)
    write(ib / "ports/1/phys_state", "5: LinkUp")
    write(ib / "ports/1/link_layer", link)
    write(root / f"class/infiniband_verbs/uverbs{uverbs}/ibdev", name)
    write(root / f"class/infiniband_mad/umad{uverbs}/ibdev", name)
    write(root / f"class/infiniband_mad/umad{uverbs}/port", "1")
    write(root / f"class/infiniband_mad/issm{uverbs}/ibdev", name)
    write(root / f"class/infiniband_mad/issm{uverbs}/port", "1")


@pytest.fixture
def sysfs(tmp_path) -> Sysfs:
    root = tmp_path / "sys"
    add_pci_device(root, "mlx5_0", "0000:3b:00.0", "ens1f0", 0, 0)
    add_pci_device(root, "mlx5_1", "0000:86:00.0", "ens2f0", 1, 1, state="1: DOWN")
    write(root / "class/infiniband/rxe0/parent", "veth0")
    write(root / "class/infiniband/rxe0/ports/1/state", "4: ACTIVE")
    write(root / "class/infiniband/rxe0/ports/1/link_layer", "Ethernet")
    write(root / "class/infiniband_verbs/uverbs2/ibdev", "rxe0")
    write(root / "class/infiniband_verbs/abi_version", "6")
    write(root / "module/ib_core/parameters/netns_mode", "N")
    return Sysfs(str(root))


def test_discovery_reads_the_kernel_layout(sysfs):
    devices = {d.name: d for d in sysfs.devices()}
    assert sorted(devices) == ["mlx5_0", "mlx5_1", "rxe0"]
    mlx = devices["mlx5_0"]
    assert (mlx.pci_address, mlx.vendor, mlx.device_id, mlx.driver, mlx.numa_node) == (
        "0000:3b:00.0", "15b3", "101b", "mlx5_core", 0)
    assert mlx.netdevs == ("ens1f0",) and mlx.uverbs.name == "uverbs0" and mlx.healthy
    assert [c.name for c in mlx.mad] == ["issm0", "umad0"]
    assert not devices["mlx5_1"].healthy and devices["mlx5_1"].ports[0].state == "DOWN"
    rxe = devices["rxe0"]
    assert (rxe.stable_id, rxe.netdevs, rxe.pci_address, rxe.numa_node) == ("rxe0", ("veth0",), None, None)
    assert sysfs.netns_mode() == "exclusive"


def test_selectors(sysfs):
    devices = {d.name: d for d in sysfs.devices()}
    assert matches(devices["rxe0"], Selectors())
    assert matches(devices["mlx5_0"], Selectors(netdevs=["ens*"], vendors=["0x15B3"], drivers=["mlx5_*"]))
    assert not matches(devices["rxe0"], Selectors(vendors=["15b3"]))
    assert not matches(devices["mlx5_0"], Selectors(linkTypes=["infiniband"]))
    assert matches(devices["mlx5_0"], Selectors(rdmaDevices=["mlx5_[01]"], linkTypes=["ethernet"]))
    with pytest.raises(ValueError):
        Selectors(vendors=["mellanox"])


def test_shared_pool_is_healthy_while_any_device_is(sysfs):
    pool = Pool(ResourceConfig(sharedUnits=1000), "shared")
    assert pool.update(sysfs.devices())
    version, units = pool.snapshot()
    assert len(units) == 1000 and units[0].id == "hca-0000" and all(u.healthy for u in units)
    assert not pool.update(sysfs.devices()), "an unchanged pass must not wake ListAndWatch"
    assert [d.name for d in pool.devices_for(["hca-0007"])] == ["mlx5_0", "mlx5_1", "rxe0"]
    with pytest.raises(UnknownDevice, match="hca-9999"):
        pool.devices_for(["hca-9999"])
    down = Pool(ResourceConfig(selectors=Selectors(rdmaDevices=["mlx5_1"])), "shared")
    down.update(sysfs.devices())
    assert down.healthy_count() == 0
    assert pool.update(sysfs.devices(), blocked_reason="wrong mode") and pool.healthy_count() == 0


def test_exclusive_pool_ids_topology_and_devices_inside_pods(sysfs):
    pool = Pool(ResourceConfig(), "exclusive")
    pool.update(sysfs.devices())
    _, units = pool.snapshot()
    assert [(u.id, u.healthy, u.numa_node) for u in units] == [
        ("0000:3b:00.0", True, 0), ("0000:86:00.0", False, 1), ("rxe0", True, None)]
    # mlx5_0 moves into a pod: gone from sysfs, but the CNI state says where it is.
    remaining = [d for d in sysfs.devices() if d.name != "mlx5_0"]
    assert pool.update(remaining, {"mlx5_0"}) is False, "kubelet sees no change while the pod uses it"
    assert [u.id for u in pool.snapshot()[1]] == ["0000:3b:00.0", "0000:86:00.0", "rxe0"]
    assert pool.in_pods == {"mlx5_0"}
    with pytest.raises(UnknownDevice, match="not on the node"):
        pool.devices_for(["0000:3b:00.0"])
    # Without such a record it was removed: the ID disappears.
    pool.update(remaining, set())
    assert [u.id for u in pool.snapshot()[1]] == ["0000:86:00.0", "rxe0"]


def test_cni_state_names_devices_moved_in_exclusive_mode(tmp_path):
    folder = tmp_path / "net1"
    folder.mkdir()
    (folder / "c1:rdma0.json").write_text(json.dumps({"mode": "exclusive", "rails": [{"rdmaDevice": "mlx5_3"}]}))
    (folder / "c2:rdma0.json").write_text(json.dumps({"mode": "shared", "rails": [{"rdmaDevice": "mlx5_4"}]}))
    (folder / "c3:rdma0.json").write_text("{broken")
    (tmp_path / "verified-configs").mkdir()
    assert devices_in_pods(str(tmp_path)) == {"mlx5_3"}
    assert devices_in_pods(str(tmp_path / "missing")) == set()


def test_grant_looks_char_devices_up_now(sysfs, tmp_path):
    devices = [d for d in sysfs.devices() if d.name in ("mlx5_0", "rxe0")]
    dev = tmp_path / "dev"
    (Path(sysfs.root) / "class/misc/rdma_cm").mkdir(parents=True)  # rdma_ucm loaded
    g = grant(devices, sysfs, str(dev), "rdma/hca", "rdma_hca", include_umad=False, use_cdi=False)
    assert [(n.container_path, n.host_path, n.permissions) for n in g.nodes] == [
        ("/dev/infiniband/uverbs0", f"{dev}/infiniband/uverbs0", "rw"),
        ("/dev/infiniband/uverbs2", f"{dev}/infiniband/uverbs2", "rw"),
        ("/dev/infiniband/rdma_cm", f"{dev}/infiniband/rdma_cm", "rw")]
    assert g.envs == {"RDMA_NETNS_RESOURCE": "rdma/hca", "RDMA_NETNS_DEVICES": "mlx5_0,rxe0",
                      "RDMA_NETNS_NETDEVS": "ens1f0,veth0",
                      "RDMA_NETNS_UVERBS": "/dev/infiniband/uverbs0,/dev/infiniband/uverbs2"}
    # The kernel re-created rxe0's char device as uverbs5 (after a namespace move); rdma_ucm is not
    # loaded on this node: no rdma_cm node, which the runtime could not find (the container would fail).
    root = Path(sysfs.root)
    (root / "class/misc/rdma_cm").rmdir()
    (root / "class/infiniband_verbs/uverbs2/ibdev").unlink()
    write(root / "class/infiniband_verbs/uverbs5/ibdev", "rxe0")
    g = grant(devices, sysfs, "/host/dev", "rdma/hca", "rdma_hca", include_umad=True, use_cdi=False)
    assert [n.host_path for n in g.nodes] == [
        "/host/dev/infiniband/uverbs0", "/host/dev/infiniband/issm0", "/host/dev/infiniband/umad0",
        "/host/dev/infiniband/uverbs5"]
    g = grant(devices + devices, sysfs, "/dev", "rdma/hca", "rdma_hca", include_umad=False, use_cdi=True)
    assert g.nodes == [] and g.cdi_devices == ["rdma-netns.io/rdma_hca=mlx5_0", "rdma-netns.io/rdma_hca=rxe0"]
    (root / "class/infiniband_verbs/uverbs5/ibdev").unlink()
    shared = grant(devices, sysfs, "/dev", "rdma/hca", "rdma_hca", False, False, skip_leaving=True)
    assert shared.envs["RDMA_NETNS_DEVICES"] == "mlx5_0", "shared mode leaves an unplugged device out"
    with pytest.raises(AllocationError, match="rxe0 has no uverbs"):
        grant(devices, sysfs, "/dev", "rdma/hca", "rdma_hca", include_umad=False, use_cdi=False)


def test_cdi_spec_is_written_atomically_and_only_on_change(sysfs, tmp_path):
    dev = tmp_path / "dev"
    assert cdi.build_spec("rdma_hca", sysfs.devices(), str(dev), False, False)["containerEdits"]["deviceNodes"] == [], \
        "no rdma_cm node on a node without rdma_ucm (the runtime would fail the container)"
    spec = cdi.build_spec("rdma_hca", sysfs.devices(), str(dev), include_umad=False, rdma_cm=True)
    assert spec["kind"] == "rdma-netns.io/rdma_hca" and spec["cdiVersion"] == "0.5.0"
    assert [d["name"] for d in spec["devices"]] == ["mlx5_0", "mlx5_1", "rxe0"]
    assert spec["devices"][2]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/infiniband/uverbs2", "hostPath": f"{dev}/infiniband/uverbs2", "permissions": "rw"}]
    assert spec["containerEdits"]["deviceNodes"][0]["path"] == "/dev/infiniband/rdma_cm"
    out = tmp_path / "cdi"
    assert cdi.write_spec(str(out), "rdma_hca", spec)
    assert not cdi.write_spec(str(out), "rdma_hca", spec)
    assert json.loads((out / "rdma-netns-rdma_hca.json").read_text()) == spec
    assert sorted(os.listdir(out)) == ["rdma-netns-rdma_hca.json"]


NUMA = {f"d{i}": i // 4 for i in range(8)}


@pytest.mark.parametrize("available,must,size,expect_nodes", [
    (list(NUMA), [], 4, {0}),
    (list(NUMA), ["d5"], 3, {1}),
    (["d0", "d1", "d4", "d5", "d6"], [], 3, {1}),        # only node 1 fits all three
    (["d0", "d4", "d5"], [], 3, {0, 1}),                  # must span: as few nodes as possible
    (list(NUMA), [], 8, {0, 1}),
])
def test_preferred_allocation_keeps_pods_on_one_numa_node(available, must, size, expect_nodes):
    chosen = preferred(available, must, size, NUMA)
    assert len(chosen) == size and len(set(chosen)) == size
    assert set(must) <= set(chosen) and set(chosen) <= set(available) | set(must)
    assert {NUMA[i] for i in chosen} == expect_nodes


def test_config_file_and_flags(tmp_path):
    path = tmp_path / "dp.yaml"
    path.write_text("mode: exclusive\nresources:\n  - name: rdma/rail\n    selectors: {netdevs: [ens*]}\n")
    config = load(str(path), {"healthIntervalSeconds": 0.5, "cdiEnabled": True})
    assert config.mode == "exclusive" and config.healthIntervalSeconds == 0.5 and config.cdi.enabled
    assert config.resources[0].name == "rdma/rail" and config.resources[0].selectors.netdevs == ["ens*"]
    assert load(None, {"sharedUnits": 8}).resources[0].sharedUnits == 8
    assert parse('{"resources": [{"name": "rdma/hca"}]}', "x.json").resources[0].sharedUnits == 1000


@pytest.mark.parametrize("text,needle", [
    ("mode: turbo\n", "mode"),
    ("resources: [{name: 'no slash'}]\n", "extended resource name"),
    ("resources: [{name: rdma/a}, {name: rdma/a}]\n", "distinct"),
    ("resources: []\n", "at least one"),
    ("healthIntervalSeconds: 0\n", "healthIntervalSeconds"),
    ("sharedUnits: 5\n", "sharedUnits"),  # belongs under resources: refused, not ignored
    ("[1, 2]\n", "mapping"),
    ("resources: [{name: example.com/" + "a" * 90 + "}]\n", "unix sockets allow 107"),
    ("{broken json\n", "not valid YAML/JSON"),
    ("mode: [\n", "not valid YAML/JSON"),
])
def test_config_errors_name_the_problem(text, needle):
    with pytest.raises(ConfigError, match=needle):
        parse(text, "dp.yaml")


def test_every_shipped_device_plugin_config_validates():
    files = sorted((Path(__file__).resolve().parents[3] / "conf").glob("rdma-netns-dp-*.yaml"))
    assert len(files) >= 2
    modes = {load(str(f), {}).mode for f in files}
    assert modes == {"shared", "exclusive"}


def test_probe_readiness_needs_every_resource_registered(tmp_path, capsys):
    import time as _time

    from rdma_netns_dp.main import main

    health = tmp_path / "health.json"
    health.write_text(json.dumps({"time": _time.time(), "resources": {
        "rdma/hca": {"registered": True}, "rdma/rail": {"registered": False}}}))
    assert main(["probe", "--health-file", str(health)]) == 0
    assert main(["probe", "--health-file", str(health), "--require-registered"]) == 1
    assert "rdma/rail" in capsys.readouterr().err
    health.write_text(json.dumps({"time": _time.time() - 60, "resources": {}}))
    assert main(["probe", "--health-file", str(health)]) == 1
