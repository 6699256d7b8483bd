"""Allocate (DeviceSpecs, envs, umad/issm, fresh uverbs numbers, unknown IDs), preferred
allocation on one NUMA node, and CDI mode."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tests.dp.conftest import EXCLUSIVE_IDS, INTERVAL, RESOURCE, SLUG, Host
from tests.dp.test_listandwatch import NUMA

ALL_NAMES = ["irdma0", "irdma1", "mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5", "rxe0"]
NETDEV = {"mlx5_0": "ens1f0", "mlx5_1": "ens2f0", "mlx5_2": "ens3f0", "mlx5_3": "ens4f0",
          "mlx5_4": "ibp175s0", "mlx5_5": "ibp177s0", "irdma0": "ens7f0", "irdma1": "ens8f0", "rxe0": "eth0"}
PCI_OF = {"0000:1a:00.0": "mlx5_0", "0000:3b:00.0": "mlx5_1", "0000:5e:00.0": "mlx5_2",
          "0000:86:00.0": "mlx5_3", "0000:af:00.0": "mlx5_4", "0000:b1:00.0": "mlx5_5",
          "0000:d8:00.0": "irdma0", "0000:d9:00.0": "irdma1", "rxe0": "rxe0"}
INVALID = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)


def specs(container) -> list[tuple[str, str, str]]:
    return [(d.container_path, d.host_path, d.permissions) for d in container.devices]


def expected_specs(host: Host, names, umad: bool = False) -> set[tuple[str, str, str]]:
    dev = host.dev_root
    out = {("/dev/infiniband/rdma_cm", f"{dev}/infiniband/rdma_cm", "rw")}
    for name in names:
        n = host.fake.uverbs_number(name)
        out.add((f"/dev/infiniband/uverbs{n}", f"{dev}/infiniband/uverbs{n}", "rw"))
        if umad:
            for m in host.fake.mad_numbers(name):
                for kind in ("umad", "issm"):
                    out.add((f"/dev/infiniband/{kind}{m}", f"{dev}/infiniband/{kind}{m}", "rw"))
    return out


def check_container(host: Host, container, names, umad: bool = False,
                    netdevs: dict[str, str] | None = None) -> None:
    got = specs(container)
    assert len(got) == len(set(got)), f"duplicate DeviceSpecs: {got}"
    paths = [c for c, _, _ in got]
    assert len(paths) == len(set(paths)), f"a container path twice: {paths}"
    assert set(got) == expected_specs(host, names, umad)
    envs = dict(container.envs)
    assert envs.get("RDMA_NETNS_RESOURCE") == RESOURCE
    assert envs.get("RDMA_NETNS_DEVICES") == ",".join(sorted(names))
    assert sorted(envs.get("RDMA_NETNS_NETDEVS", "").split(",")) == sorted((netdevs or NETDEV)[n] for n in names)
    assert sorted(envs.get("RDMA_NETNS_UVERBS", "").split(",")) == \
        sorted(f"/dev/infiniband/uverbs{host.fake.uverbs_number(n)}" for n in names)
    assert list(container.cdi_devices) == []


# --- shared mode ---------------------------------------------------------------------------------
def test_shared_allocate_gives_every_device_once(shared_dp):
    host, daemon, plugin = shared_dp
    resp = plugin.allocate(["hca-0000", "hca-0001", "hca-0999"])
    assert len(resp.container_responses) == 1
    check_container(host, resp.container_responses[0], ALL_NAMES)


def test_shared_allocate_one_response_per_container(shared_dp):
    host, daemon, plugin = shared_dp
    resp = plugin.allocate(["hca-0003"], ["hca-0004", "hca-0005"])
    assert len(resp.container_responses) == 2
    for container in resp.container_responses:
        check_container(host, container, ALL_NAMES)


@pytest.mark.parametrize("ids", [["hca-1000"], ["hca-0001", "bogus-7"], ["0000:1a:00.0"]])
def test_shared_unknown_id_is_an_error(shared_dp, ids):
    host, daemon, plugin = shared_dp
    with pytest.raises(grpc.RpcError) as err:
        plugin.allocate(ids)
    unknown = [i for i in ids if not i.startswith("hca-0")][0]
    assert err.value.code() in INVALID, err.value
    assert unknown in err.value.details(), err.value.details()
    assert len(plugin.allocate(["hca-0002"]).container_responses) == 1, "the daemon still serves"
    assert daemon.alive()


def test_shared_allocate_follows_hot_plug(host: Host):
    daemon, plugin = host.start_registered("--mode", "shared", "--resource-name", RESOURCE)
    host.fake.remove_device("mlx5_3")
    host.fake.add_soft_device("rxe1", "eth1")
    names = sorted(set(ALL_NAMES) - {"mlx5_3"} | {"rxe1"})
    deadline = time.monotonic() + 3
    while True:  # the daemon may need one rescan interval to notice
        try:
            container = plugin.allocate(["hca-0000"]).container_responses[0]
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
        else:
            if dict(container.envs).get("RDMA_NETNS_DEVICES") == ",".join(names) or time.monotonic() > deadline:
                break
        time.sleep(0.1)
    check_container(host, container, names, netdevs={**NETDEV, "rxe1": "eth1"})
    assert len(plugin.latest.ids()) == 1000


def test_shared_allocate_right_after_unplug(host: Host):
    """Allocate hands out the selected devices present now: one unplugged a moment ago (before
    the next rescan) is left out rather than failing the whole Allocate."""
    daemon, plugin = host.start_registered("--mode", "shared", "--resource-name", RESOURCE)
    host.fake.remove_device("mlx5_3")
    container = plugin.allocate(["hca-0000"]).container_responses[0]
    check_container(host, container, sorted(set(ALL_NAMES) - {"mlx5_3"}))


def test_shared_selectors_apply_to_allocate_and_health(host: Host):
    config = {"mode": "shared", "resources": [
        {"name": RESOURCE, "sharedUnits": 3, "selectors": {"linkTypes": ["infiniband"]}}]}
    daemon, plugin = host.start_registered(config=config)
    assert sorted(plugin.latest.ids()) == ["hca-0000", "hca-0001", "hca-0002"]
    check_container(host, plugin.allocate(["hca-0001"]).container_responses[0], ["mlx5_4", "mlx5_5"])
    host.fake.set_port_state("mlx5_4", "DOWN")
    host.fake.set_port_state("mlx5_5", "DOWN")  # every other (unselected) device stays ACTIVE
    plugin.wait_for(lambda u: set(u.health().values()) == {"Unhealthy"}, 5,
                    "Unhealthy once no selected device has an ACTIVE port")


# --- exclusive mode ------------------------------------------------------------------------------
def test_exclusive_allocate_contents(exclusive_dp):
    host, daemon, plugin = exclusive_dp
    resp = plugin.allocate(["0000:1a:00.0", "rxe0"])
    check_container(host, resp.container_responses[0], ["mlx5_0", "rxe0"])
    resp = plugin.allocate(["0000:af:00.0"], ["0000:d9:00.0", "0000:3b:00.0"])
    check_container(host, resp.container_responses[0], ["mlx5_4"])
    check_container(host, resp.container_responses[1], ["irdma1", "mlx5_1"])


def test_exclusive_parallel_allocates(exclusive_dp):
    host, daemon, plugin = exclusive_dp
    ids = sorted(NUMA)
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda i: plugin.allocate([ids[i % 8]]), range(48)))
    for i, resp in enumerate(responses):
        check_container(host, resp.container_responses[0], [PCI_OF[ids[i % 8]]])


@pytest.mark.parametrize("ids", [["0000:ff:00.0"], ["0000:1a:00.0", "mlx5_0"], ["hca-0000"]])
def test_exclusive_unknown_id_is_an_error(exclusive_dp, ids):
    host, daemon, plugin = exclusive_dp
    with pytest.raises(grpc.RpcError) as err:
        plugin.allocate(ids)
    assert err.value.code() in INVALID, err.value
    assert ids[-1] in err.value.details(), err.value.details()
    check_container(host, plugin.allocate(["0000:5e:00.0"]).container_responses[0], ["mlx5_2"])
    assert daemon.alive()


def test_exclusive_allocate_uses_fresh_uverbs_number(host: Host):
    host.fake.set_netns_mode("N")
    daemon, plugin = host.start_registered("--mode", "exclusive", "--resource-name", RESOURCE)
    old = host.fake.uverbs_number("mlx5_0")
    new = host.fake.renumber_uverbs("mlx5_0")  # e.g. after a namespace round trip
    assert new != old
    container = plugin.allocate(["0000:1a:00.0"]).container_responses[0]  # no wait: looked up freshly
    paths = [c for c, _, _ in specs(container)]
    assert f"/dev/infiniband/uverbs{new}" in paths and f"/dev/infiniband/uverbs{old}" not in paths
    check_container(host, container, ["mlx5_0"])


def test_exclusive_removed_device_cannot_be_allocated(host: Host):
    host.fake.set_netns_mode("N")
    daemon, plugin = host.start_registered("--mode", "exclusive", "--resource-name", RESOURCE)
    host.fake.remove_device("mlx5_2")
    plugin.wait_for(lambda u: "0000:5e:00.0" not in u.ids(), 5, "mlx5_2 dropped")
    with pytest.raises(grpc.RpcError) as err:
        plugin.allocate(["0000:5e:00.0"])
    assert err.value.code() in INVALID and "0000:5e:00.0" in err.value.details()


def test_umad_only_with_include_umad(host: Host):
    host.fake.set_netns_mode("N")
    config = {"mode": "exclusive", "resources": [
        {"name": RESOURCE, "includeUmad": True, "selectors": {"rdmaDevices": ["mlx5_*"]}},
        {"name": "rdma/soft", "selectors": {"rdmaDevices": ["rxe*"]}},
    ]}
    host.fake.add_pci_device("mlx5_8", "0000:e1:00.0", "ibp225s0", numa_node=1, ports=2,
                             link_layer="InfiniBand")
    daemon = host.start(config=config)
    host.kubelet.wait_registrations(2, 10)
    hca = host.kubelet.plugin(RESOURCE, 5)
    soft = host.kubelet.plugin("rdma/soft", 5)
    hca.wait_first()
    soft.wait_first()
    container = hca.allocate(["0000:1a:00.0", "0000:af:00.0", "0000:e1:00.0"]).container_responses[0]
    assert len(host.fake.mad_numbers("mlx5_8")) == 2
    check_container(host, container, ["mlx5_0", "mlx5_4", "mlx5_8"], umad=True,
                    netdevs={**NETDEV, "mlx5_8": "ibp225s0"})
    soft_container = soft.allocate(["rxe0"]).container_responses[0]
    got = specs(soft_container)
    assert not [c for c, _, _ in got if "umad" in c or "issm" in c], got
    assert set(got) == expected_specs(host, ["rxe0"])
    assert dict(soft_container.envs)["RDMA_NETNS_RESOURCE"] == "rdma/soft"


# --- preferred allocation ------------------------------------------------------------------------
NODE0 = sorted(p for p, n in NUMA.items() if n == 0)
NODE1 = sorted(p for p, n in NUMA.items() if n == 1)
ALL_PCI = sorted(NUMA)  # interleaved: 0,1,0,1,...


def preferred_ids(plugin, available, must=(), size=1) -> list[str]:
    resp = plugin.preferred(available, must, size)
    assert len(resp.container_responses) == 1
    ids = list(resp.container_responses[0].deviceIDs)
    assert len(ids) == size and len(set(ids)) == size, f"asked {size}, got {ids}"
    assert set(ids) <= set(available), f"{ids} not within {available}"
    assert set(must) <= set(ids), f"{ids} misses must-include {must}"
    return ids


def nodes(ids) -> set[int]:
    return {NUMA[i] for i in ids}


def test_preferred_four_on_one_node(exclusive_dp):
    _, _, plugin = exclusive_dp
    assert len(nodes(preferred_ids(plugin, ALL_PCI, size=4))) == 1


def test_preferred_honours_must_include(exclusive_dp):
    _, _, plugin = exclusive_dp
    ids = preferred_ids(plugin, ALL_PCI, ["0000:3b:00.0"], 4)
    assert nodes(ids) == {1}
    ids = preferred_ids(plugin, ALL_PCI, ["0000:d8:00.0"], 2)
    assert nodes(ids) == {0}
    ids = preferred_ids(plugin, list(reversed(ALL_PCI)), ["0000:86:00.0", "0000:d9:00.0"], 3)
    assert nodes(ids) == {1}


def test_preferred_picks_the_node_that_fits(exclusive_dp):
    _, _, plugin = exclusive_dp
    available = NODE0[:3] + NODE1  # node 0 has only 3 left
    assert nodes(preferred_ids(plugin, sorted(available), size=4)) == {1}
    available = NODE0 + NODE1[1:]
    assert nodes(preferred_ids(plugin, sorted(available), size=4)) == {0}


def test_preferred_across_nodes_when_required(exclusive_dp):
    _, _, plugin = exclusive_dp
    ids = preferred_ids(plugin, ALL_PCI, [NODE0[0], NODE1[0]], 4)
    assert nodes(ids) == {0, 1}
    ids = preferred_ids(plugin, ALL_PCI, size=6)
    counts = sorted(sum(1 for i in ids if NUMA[i] == n) for n in (0, 1))
    assert counts == [2, 4], f"6 devices should fill one node and spill 2: {ids}"


# --- CDI ------------------------------------------------------------------------------------------
def read_spec(host: Host) -> dict:
    return json.loads((host.cdi_dir / f"rdma-netns-{SLUG}.json").read_text())


def check_spec(host: Host, spec: dict, names) -> None:
    assert spec["cdiVersion"] == "0.5.0"
    assert spec["kind"] == f"rdma-netns.io/{SLUG}"
    by_name = {d["name"]: d for d in spec["devices"]}
    assert sorted(by_name) == sorted(names)
    dev = host.dev_root
    for name in names:
        n = host.fake.uverbs_number(name)
        nodes_ = by_name[name]["containerEdits"]["deviceNodes"]
        assert {"path": f"/dev/infiniband/uverbs{n}", "hostPath": f"{dev}/infiniband/uverbs{n}",
                "permissions": "rw"} in [{k: d.get(k) for k in ("path", "hostPath", "permissions")}
                                         for d in nodes_], (name, nodes_)
    top = spec["containerEdits"]["deviceNodes"]
    assert [d for d in top if d["path"] == "/dev/infiniband/rdma_cm"
            and d.get("hostPath") == f"{dev}/infiniband/rdma_cm"], top


def test_cdi_mode(host: Host):
    host.fake.set_netns_mode("N")
    daemon, plugin = host.start_registered("--mode", "exclusive", "--resource-name", RESOURCE,
                                           "--cdi", "--cdi-dir", str(host.cdi_dir))
    check_spec(host, read_spec(host), ALL_NAMES)
    container = plugin.allocate(["0000:1a:00.0", "rxe0"]).container_responses[0]
    assert list(container.devices) == [], "no DeviceSpecs with CDI"
    assert sorted(c.name for c in container.cdi_devices) == [
        f"rdma-netns.io/{SLUG}=mlx5_0", f"rdma-netns.io/{SLUG}=rxe0"]
    assert dict(container.envs).get("RDMA_NETNS_DEVICES") == "mlx5_0,rxe0"
    host.fake.add_pci_device("mlx5_8", "0000:e1:00.0", "ens9f0", numa_node=1)
    plugin.wait_for(lambda u: "0000:e1:00.0" in u.ids(), 5, "mlx5_8 listed")
    deadline = time.monotonic() + 3
    while "mlx5_8" not in [d["name"] for d in read_spec(host)["devices"]] and time.monotonic() < deadline:
        time.sleep(0.05)
    check_spec(host, read_spec(host), ALL_NAMES + ["mlx5_8"])


def test_cdi_shared_mode_names_every_device(host: Host):
    daemon, plugin = host.start_registered("--mode", "shared", "--resource-name", RESOURCE,
                                           "--cdi", "--cdi-dir", str(host.cdi_dir))
    check_spec(host, read_spec(host), ALL_NAMES)
    container = plugin.allocate(["hca-0000", "hca-0001"]).container_responses[0]
    assert list(container.devices) == []
    assert sorted(c.name for c in container.cdi_devices) == [f"rdma-netns.io/{SLUG}={n}" for n in ALL_NAMES]


def test_cdi_spec_follows_uverbs_renumbering(host: Host):
    host.fake.set_netns_mode("N")
    daemon, plugin = host.start_registered("--mode", "exclusive", "--resource-name", RESOURCE,
                                           "--cdi", "--cdi-dir", str(host.cdi_dir))
    new = host.fake.renumber_uverbs("mlx5_0")

    def uverbs_in_spec() -> list[str]:
        dev = {d["name"]: d for d in read_spec(host)["devices"]}["mlx5_0"]
        return [n["path"] for n in dev["containerEdits"]["deviceNodes"]]

    deadline = time.monotonic() + 3
    while f"/dev/infiniband/uverbs{new}" not in uverbs_in_spec() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"/dev/infiniband/uverbs{new}" in uverbs_in_spec(), \
        f"spec still names {uverbs_in_spec()} after mlx5_0 became uverbs{new}"
    check_spec(host, read_spec(host), ALL_NAMES)


def test_cdi_entry_of_a_granted_device_stays_valid_while_it_is_in_a_pod(host: Host):
    """Allocate names mlx5_1 by CDI; the CNI then moves it into the pod (its state says so) and it
    vanishes from the host's sysfs. The container is created after that: the spec must still have
    mlx5_1, with the uverbs node the device has now (here the host's sysfs lists it re-created as
    another number, as kernel 7.3 does), and it must be Healthy while the kernel's mode is right,
    Unhealthy (with every other unit) when it is not. DEL brings it back: entry as before."""
    from rdma_netns.state import AttachmentState, StateStore

    host.fake.set_netns_mode("N")
    state_dir = host.base / "cni-state"
    daemon, plugin = host.start_registered("--mode", "exclusive", "--resource-name", RESOURCE,
                                           "--cdi", "--cdi-dir", str(host.cdi_dir),
                                           "--cni-state-dir", str(state_dir))
    container = plugin.allocate(["0000:3b:00.0"]).container_responses[0]
    assert [c.name for c in container.cdi_devices] == [f"rdma-netns.io/{SLUG}=mlx5_1"]
    old = host.fake.uverbs_number("mlx5_1")
    store = StateStore(str(state_dir), "rdma-exclusive")
    store.prepare()
    store.save("c0ffee", "net1", AttachmentState.from_json({
        "format": 1, "phase": "ready", "mode": "exclusive", "link": "rdma-device", "containerID": "c0ffee",
        "ifname": "net1", "netns": str(host.base / "gone-netns"), "network": "rdma-exclusive",
        "rails": [{"ifname": "net1", "rdmaDevice": "mlx5_1", "rdmaOnly": True, "ipam": None}]}))
    host.fake.remove_device("mlx5_1")  # moved: gone from class/infiniband, its uverbs re-created
    time.sleep(3 * INTERVAL)

    def entry() -> list[str] | None:
        dev = {d["name"]: d for d in read_spec(host)["devices"]}.get("mlx5_1")
        return None if dev is None else [n["hostPath"] for n in dev["containerEdits"]["deviceNodes"]]

    assert entry() == [f"{host.dev_root}/infiniband/uverbs{old}"], "the entry stays while the device is away"
    assert plugin.latest.health()["0000:3b:00.0"] == "Healthy"
    # The kernel re-created the node under a new number; the host's sysfs lists it.
    folder = host.fake.sys / "devices/virtual/infiniband_verbs/uverbs17"
    folder.mkdir(parents=True)
    (folder / "ibdev").write_text("mlx5_1\n")
    (folder / "dev").write_text("231:209\n")
    (host.fake.sys / "class/infiniband_verbs/uverbs17").symlink_to(folder)
    deadline = time.monotonic() + 3
    while entry() != [f"{host.dev_root}/infiniband/uverbs17"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert entry() == [f"{host.dev_root}/infiniband/uverbs17"], read_spec(host)
    # The kernel's mode goes wrong: every unit Unhealthy, the one in the pod too, and the
    # DaemonSet's pod not Ready (the file its readiness probe reads says why).
    ready = host.health_file.parent / "ready"
    assert ready.read_text() == "ready\n"
    host.fake.set_netns_mode("Y")
    update = plugin.wait_for(lambda u: set(u.health().values()) == {"Unhealthy"}, 5, "all Unhealthy")
    assert "0000:3b:00.0" in update.ids()
    deadline = time.monotonic() + 3
    while ready.read_text() == "ready\n" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.read_text().startswith("not ready: ") and "exclusive" in ready.read_text(), ready.read_text()
    host.fake.set_netns_mode("N")
    plugin.wait_for(lambda u: set(u.health().values()) == {"Healthy"}, 5, "all Healthy again")
    deadline = time.monotonic() + 3
    while ready.read_text() != "ready\n" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.read_text() == "ready\n"
    # DEL: back on the host, state gone.
    (host.fake.sys / "class/infiniband_verbs/uverbs17").unlink()
    host.fake.add_pci_device("mlx5_1", "0000:3b:00.0", "ens2f0", numa_node=1)
    store.delete("c0ffee", "net1")
    back = host.fake.uverbs_number("mlx5_1")
    deadline = time.monotonic() + 3
    while entry() != [f"{host.dev_root}/infiniband/uverbs{back}"] and time.monotonic() < deadline:
        time.sleep(0.05)
    check_spec(host, read_spec(host), ALL_NAMES)
    assert daemon.alive()
