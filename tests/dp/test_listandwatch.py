"""ListAndWatch: device IDs, health and topology per mode; health flips; hot-plug; mode choice;
selectors."""

from __future__ import annotations

import time

import pytest

from tests.dp.conftest import EXCLUSIVE_IDS, INTERVAL, RESOURCE, Host

NUMA = {"0000:1a:00.0": 0, "0000:3b:00.0": 1, "0000:5e:00.0": 0, "0000:86:00.0": 1,
        "0000:af:00.0": 0, "0000:b1:00.0": 1, "0000:d8:00.0": 0, "0000:d9:00.0": 1}
FLIP_BOUND = 1.0  # seconds: "within one interval" (0.2 s) with generous slack for a loaded machine


def test_shared_list(shared_dp):
    _, _, plugin = shared_dp
    first = plugin.wait_first()
    ids = first.ids()
    assert sorted(ids) == [f"hca-{i:04d}" for i in range(1000)]
    assert len(ids) == len(set(ids)), "duplicate IDs"
    assert set(first.health().values()) == {"Healthy"}
    assert all(nodes == [] for nodes in first.numa().values()), "shared IDs carry no topology"
    assert first.time - plugin.connected_at < 2.0, "the first list must come at once"


def test_exclusive_list_ids_and_topology(exclusive_dp):
    _, _, plugin = exclusive_dp
    first = plugin.wait_first()
    assert sorted(first.ids()) == sorted(EXCLUSIVE_IDS)
    assert len(first.ids()) == len(EXCLUSIVE_IDS), "duplicate IDs"
    assert set(first.health().values()) == {"Healthy"}
    numa = first.numa()
    for pci, node in NUMA.items():
        assert numa[pci] == [node], f"{pci}: topology {numa[pci]}, numa_node is {node}"
    assert numa["rxe0"] == [], "a soft device has no NUMA node"


def _flip(plugin, device_id: str, expected: str, others: str = "Healthy") -> float:
    t0 = time.monotonic()
    update = plugin.wait_for(
        lambda u: u.health().get(device_id) == expected, 5, f"{device_id} {expected}")
    health = update.health()
    assert set(health) >= EXCLUSIVE_IDS - {device_id}, "a health update must carry the full list"
    assert {k: v for k, v in health.items() if k != device_id and k in EXCLUSIVE_IDS} == \
        {k: others for k in EXCLUSIVE_IDS if k != device_id}
    return update.time - t0


def test_exclusive_health_flip(host: Host):
    host.fake.set_netns_mode("N")
    daemon, plugin = host.start_registered("--mode", "exclusive", "--resource-name", RESOURCE)
    host.fake.set_port_state("mlx5_0", "DOWN")
    down = _flip(plugin, "0000:1a:00.0", "Unhealthy")
    host.fake.set_port_state("mlx5_0", "ACTIVE")
    up = _flip(plugin, "0000:1a:00.0", "Healthy")
    host.fake.set_port_state("rxe0", "DOWN")
    soft = _flip(plugin, "rxe0", "Unhealthy")
    host.fake.set_port_state("rxe0", "ACTIVE")
    _flip(plugin, "rxe0", "Healthy")
    host.fake.set_port_state("mlx5_2", "INIT")  # only ACTIVE counts
    _flip(plugin, "0000:5e:00.0", "Unhealthy")
    assert max(down, up, soft) < FLIP_BOUND, \
        f"health flips took {down:.2f}/{up:.2f}/{soft:.2f} s with a {INTERVAL} s interval"
    assert daemon.alive()


def test_exclusive_health_any_active_port(host: Host):
    host.fake.set_netns_mode("N")
    host.fake.add_pci_device("mlx5_8", "0000:e1:00.0", "ens9f0", numa_node=1, ports=2)
    daemon, plugin = host.start_registered("--mode", "exclusive", "--resource-name", RESOURCE)
    assert plugin.latest.health()["0000:e1:00.0"] == "Healthy"
    host.fake.set_port_state("mlx5_8", "DOWN", port=1)
    time.sleep(4 * INTERVAL)
    assert plugin.latest.health()["0000:e1:00.0"] == "Healthy", "port 2 is still ACTIVE"
    host.fake.set_port_state("mlx5_8", "DOWN", port=2)
    plugin.wait_for(lambda u: u.health().get("0000:e1:00.0") == "Unhealthy", 5, "mlx5_8 Unhealthy")


def test_shared_health_follows_any_active_port(host: Host):
    daemon, plugin = host.start_registered("--mode", "shared", "--resource-name", RESOURCE)
    for name in list(host.fake.devices)[1:]:
        host.fake.set_port_state(name, "DOWN")
    time.sleep(4 * INTERVAL)
    assert set(plugin.latest.health().values()) == {"Healthy"}, "one ACTIVE port keeps all Healthy"
    first = next(iter(host.fake.devices))
    host.fake.set_port_state(first, "DOWN")
    t0 = time.monotonic()
    down = plugin.wait_for(lambda u: set(u.health().values()) == {"Unhealthy"}, 5, "all Unhealthy")
    assert len(down.ids()) == 1000
    host.fake.set_port_state("rxe0", "ACTIVE")
    up = plugin.wait_for(lambda u: set(u.health().values()) == {"Healthy"}, 5, "all Healthy")
    assert len(up.ids()) == 1000
    assert down.time - t0 < FLIP_BOUND


def test_exclusive_hot_add_and_remove(host: Host):
    host.fake.set_netns_mode("N")
    daemon, plugin = host.start_registered("--mode", "exclusive", "--resource-name", RESOURCE)
    fake = host.fake
    fake.add_pci_device("mlx5_8", "0000:e1:00.0", "ens9f0", numa_node=-1)
    added = plugin.wait_for(lambda u: "0000:e1:00.0" in u.ids(), 5, "mlx5_8 listed")
    assert added.health()["0000:e1:00.0"] == "Healthy"
    assert added.numa()["0000:e1:00.0"] == [], "numa_node -1 means no topology"
    assert set(added.ids()) == EXCLUSIVE_IDS | {"0000:e1:00.0"}
    fake.remove_device("mlx5_1")
    fake.remove_device("rxe0")
    gone = plugin.wait_for(lambda u: "0000:3b:00.0" not in u.ids() and "rxe0" not in u.ids(), 5,
                           "mlx5_1 and rxe0 dropped")
    assert set(gone.ids()) == EXCLUSIVE_IDS - {"0000:3b:00.0", "rxe0"} | {"0000:e1:00.0"}
    fake.add_soft_device("rxe1", "eth1")
    back = plugin.wait_for(lambda u: "rxe1" in u.ids(), 5, "rxe1 listed")
    assert back.health()["rxe1"] == "Healthy"
    assert daemon.alive()


@pytest.mark.parametrize("netns_mode,expected", [("Y", "shared"), ("N", "exclusive"), (None, "shared")])
def test_mode_auto_follows_kernel(host: Host, netns_mode, expected):
    host.fake.set_netns_mode(netns_mode)
    daemon, plugin = host.start_registered("--mode", "auto", "--resource-name", RESOURCE)
    req = host.kubelet.registrations[0].request
    ids = plugin.latest.ids()
    assert req.options.get_preferred_allocation_available is True  # both modes (shared: issue 20)
    assert (len(ids) == 1000) if expected == "shared" else (set(ids) == EXCLUSIVE_IDS)


def test_shared_units_flag(host: Host):
    daemon, plugin = host.start_registered("--mode", "shared", "--resource-name", RESOURCE,
                                           "--shared-units", "5")
    assert sorted(plugin.latest.ids()) == [f"hca-{i:04d}" for i in range(5)]


def test_cli_overrides_config_and_yaml_config(host: Host):
    host.fake.set_netns_mode("N")  # the kernel mode exclusive pods need
    config = (f"mode: shared\nresources:\n  - name: {RESOURCE}\n    sharedUnits: 7\n"
              "    selectors:\n      vendors: ['15b3']\n")
    daemon, plugin = host.start_registered("--mode", "exclusive", config=config)
    ids = set(plugin.latest.ids())
    assert ids == {pci for pci in NUMA if pci not in ("0000:d8:00.0", "0000:d9:00.0")}, \
        "--mode exclusive must override the file's mode; the file's selectors still apply"


def test_shared_units_from_config(host: Host):
    config = {"mode": "shared", "resources": [{"name": RESOURCE, "sharedUnits": 3}]}
    daemon, plugin = host.start_registered(config=config)
    assert sorted(plugin.latest.ids()) == ["hca-0000", "hca-0001", "hca-0002"]


SELECTORS = [
    ({"netdevs": ["ens1*", "ens2*"]}, {"0000:1a:00.0", "0000:3b:00.0"}),
    ({"vendors": ["8086"]}, {"0000:d8:00.0", "0000:d9:00.0"}),
    ({"vendors": ["0x15b3"], "linkTypes": ["infiniband"]}, {"0000:af:00.0", "0000:b1:00.0"}),
    ({"linkTypes": ["ethernet"]}, EXCLUSIVE_IDS - {"0000:af:00.0", "0000:b1:00.0"}),
    ({"rdmaDevices": ["mlx5_[0-3]"]}, {"0000:1a:00.0", "0000:3b:00.0", "0000:5e:00.0", "0000:86:00.0"}),
    ({"drivers": ["ice"]}, {"0000:d8:00.0", "0000:d9:00.0"}),
    ({"deviceIDs": ["0x1017"]}, {"0000:5e:00.0", "0000:86:00.0"}),
    ({"rdmaDevices": ["rxe*"], "netdevs": []}, {"rxe0"}),
]


def test_selectors_narrow_exclusive_list(host: Host):
    """Each selector set as its own resource of one daemon (rdma/sel<i>)."""
    host.fake.set_netns_mode("N")  # the kernel mode exclusive pods need
    config = {"mode": "exclusive", "resources": [
        {"name": f"rdma/sel{i}", "selectors": selectors} for i, (selectors, _) in enumerate(SELECTORS)]}
    daemon = host.start(config=config)
    regs = host.kubelet.wait_registrations(len(SELECTORS), 10)
    assert sorted(r.request.endpoint for r in regs) == sorted(
        f"rdma-netns-rdma_sel{i}.sock" for i in range(len(SELECTORS)))
    wrong = {}
    for i, (selectors, expected) in enumerate(SELECTORS):
        got = set(host.kubelet.plugin(f"rdma/sel{i}", 5).wait_first().ids())
        if got != expected:
            wrong[str(selectors)] = {"expected": sorted(expected), "got": sorted(got)}
    assert wrong == {}, daemon.output()


def test_exclusive_device_moved_into_pod_is_kept(host: Host):
    """A device the CNI state dir records as moved into a pod stays listed (Healthy) while it is
    gone from the host's sysfs; an unrecorded vanished device is dropped."""
    from rdma_netns.state import AttachmentState, StateStore  # the CNI plugin's own state writer

    host.fake.set_netns_mode("N")
    state_dir = host.base / "cni-state"
    daemon, plugin = host.start_registered("--mode", "exclusive", "--resource-name", RESOURCE,
                                           "--cni-state-dir", str(state_dir))
    store = StateStore(str(state_dir), "rdma-exclusive")
    store.prepare()
    # What the CNI plugin saves (chained exclusive ADD) before it moves mlx5_1 into the pod.
    store.save("c0ffee", "net1", AttachmentState.from_json({
        "format": 1, "phase": "ready", "mode": "exclusive", "link": "rdma-device", "containerID": "c0ffee",
        "ifname": "net1", "netns": "/var/run/netns/pod", "network": "rdma-exclusive",
        "rails": [{"ifname": "net1", "rdmaDevice": "mlx5_1", "rdmaOnly": True, "ipam": None}],
        "result": {"cniVersion": "1.0.0", "interfaces": [
            {"name": "net1", "sandbox": "/var/run/netns/pod", "pciID": "0000:3b:00.0"}]}}))
    host.fake.remove_device("mlx5_1")  # moved into the pod
    host.fake.remove_device("mlx5_2")  # unplugged
    update = plugin.wait_for(lambda u: "0000:5e:00.0" not in u.ids(), 5, "mlx5_2 dropped")
    time.sleep(3 * INTERVAL)
    update = plugin.latest
    assert "0000:3b:00.0" in update.ids(), f"a device in a pod must stay listed: {update.health()}"
    assert update.health()["0000:3b:00.0"] == "Healthy"
    assert set(update.ids()) == EXCLUSIVE_IDS - {"0000:5e:00.0"}
    # The pod goes: the CNI DEL moves the device back and removes its state.
    host.fake.add_pci_device("mlx5_1", "0000:3b:00.0", "ens2f0", numa_node=1)
    store.delete("c0ffee", "net1")
    time.sleep(3 * INTERVAL)
    assert plugin.latest.health()["0000:3b:00.0"] == "Healthy"
    host.fake.remove_device("mlx5_1")  # now gone for real: dropped
    plugin.wait_for(lambda u: "0000:3b:00.0" not in u.ids(), 5, "mlx5_1 dropped once no pod holds it")
