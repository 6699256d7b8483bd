"""The DRA driver's node side on kernel-shaped fake trees (RoCE LAG bonds with mlx5's 255-entry,
two-per-address GID tables; PCI functions under several root complexes), against an API stand-in
(tests/dra_api_standin.py) where a test injects what the real server does not do on cue. The real
kube-apiserver, scheduler and kubelet are integration/cluster/test_dra.py's."""

from __future__ import annotations

import json
import os
import stat
import threading
import time

import pytest

from rdma_netns.kernel.rdma_devices import DeviceSysfs
from rdma_netns.publish.pod_cdi import spec_path
from rdma_netns_dp.config import ResourceConfig, validate
from rdma_netns_dp.dra import devices as dra_devices
from rdma_netns_dp.dra import kube_api
from rdma_netns_dp.dra.checkpoint import Checkpoint, PreparedClaim
from rdma_netns_dp.dra.kube_api import ApiError
from rdma_netns_dp.dra.prepare import CdiSettings, PrepareError, Preparer
from rdma_netns_dp.dra.slices import MAX_DEVICES_PER_SLICE, SlicePublisher
from rdma_netns_dp.inventory import Pool
from rdma_netns_dp.pod_grants import dra_answer
from tests.dra_api_standin import ApiStandin
from tests.fake_rdma_sysfs import FakeRdmaSysfs, lingjun_host

DRIVER = "rdma-netns.io"
NODE = "gpu-node-1"


def lag_rails(tmp_path, addresses_per_pod: int = 2, blocked: str | None = None, limit: int = 0):
    fake = lingjun_host(tmp_path / "lag")
    sysfs = DeviceSysfs(str(fake.sys))
    found = sysfs.devices()
    pool = Pool(ResourceConfig(addressesPerPod=addresses_per_pod), "shared")
    gids = {p: sysfs.gid_usage(p) for p in pool.gid_ports(found)}
    pcie = {d.name: sysfs.pcie_root(d) for d in found}
    rails = dra_devices.rails_of(found, "rdma/hca", "shared", pcie, gids, addresses_per_pod, blocked)
    return fake, [dra_devices.to_device(r, DRIVER, limit) for r in rails]


def test_a_lag_node_publishes_one_shared_device_per_bond_with_its_gid_entries(tmp_path):
    _, devices = lag_rails(tmp_path)
    assert [d["name"] for d in devices] == ["mlx5-bond-0", "mlx5-bond-1", "mlx5-bond-2", "mlx5-bond-3"]
    first = devices[0]
    attrs = first["attributes"]
    assert attrs["rdmaDevice"] == {"string": "mlx5_bond_0"}
    assert attrs["netdev"] == {"string": "bond0"}  # the rail is the bond, not the member the device names
    assert attrs["bondMembers"]["string"].count(",") == 1
    assert attrs["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:00"}
    assert attrs["resource.kubernetes.io/pciBusID"]["string"].startswith("0000:")
    assert "int" in attrs["resource.kubernetes.io/numaNode"]
    assert attrs["kernelMode"] == {"string": "shared"} and attrs["linkLayer"] == {"string": "ethernet"}
    assert first["allowMultipleAllocations"] is True
    # 255 entries, the node's two default GIDs (RoCE v1 and v2 of the MAC) are its own: 253 for
    # pods, and a pod's two addresses (its own, the link-local) take two entries each.
    assert first["capacity"] == {"gidEntries": {"value": "253", "requestPolicy": {"default": "4", "validValues": ["4"]}}}
    assert "taints" not in first
    assert len(attrs) + len(first["capacity"]) <= 32  # the API's limit per device


def test_pod_addresses_already_in_the_table_are_capacity_the_scheduler_accounts_for(tmp_path):
    """Entries pods hold are the scheduler's to count (their claims consume them); only the
    node's own addresses lower the capacity."""
    fake = lingjun_host(tmp_path / "lag")
    fake.add_gid("mlx5_bond_0", "fd00::1:2", "bond0")           # the node's own address on the rail
    fake.add_gid("mlx5_bond_0", "fd00::1:3", "rdma0")           # a pod's (its netdev is not the host's)
    sysfs = DeviceSysfs(str(fake.sys))
    found = [d for d in sysfs.devices() if d.name == "mlx5_bond_0"]
    pool = Pool(ResourceConfig(), "shared")
    gids = {p: sysfs.gid_usage(p) for p in pool.gid_ports(found)}
    rail = dra_devices.rails_of(found, "rdma/hca", "shared", {}, gids, 2, None)[0]
    assert dra_devices.gid_capacity(rail) == 255 - 2 - 2
    assert dra_devices.gid_capacity(rail, limit=8) == 8


def test_unhealthy_rails_stay_listed_with_a_noschedule_taint(tmp_path):
    fake = lingjun_host(tmp_path / "lag")
    fake.set_port_state("mlx5_bond_1", "DOWN")
    sysfs = DeviceSysfs(str(fake.sys))
    found = sysfs.devices()
    rails = dra_devices.rails_of(found, "rdma/hca", "shared", {}, {}, 2, None)
    taints = {dra_devices.device_name(r.device.name): dra_devices.to_device(r, DRIVER).get("taints") for r in rails}
    assert taints["mlx5-bond-1"] == [{"key": "rdma-netns.io/unhealthy", "value": "port-down", "effect": "NoSchedule"}]
    assert taints["mlx5-bond-0"] is None
    _, blocked = lag_rails(tmp_path / "b", blocked="kernel RDMA netns mode is exclusive")
    assert all(d["taints"][0]["value"] == "kernel-netns-mode" for d in blocked)


def test_exclusive_devices_take_one_claim_each(tmp_path):
    fake = lingjun_host(tmp_path / "lag", netns_mode="N")
    found = DeviceSysfs(str(fake.sys)).devices()
    rails = dra_devices.rails_of(found, "rdma/hca", "exclusive", {}, {}, 2, None)
    device = dra_devices.to_device(rails[0], DRIVER)
    assert "allowMultipleAllocations" not in device and "capacity" not in device
    assert device["attributes"]["kernelMode"] == {"string": "exclusive"}


def test_pcie_root_is_the_root_complex_above_the_function(tmp_path):
    fake = FakeRdmaSysfs(tmp_path / "roots")
    fake.add_pci_device("mlx5_0", "0000:1a:00.0", "ens1f0", pcie_root="pci0000:15")
    fake.add_pci_device("mlx5_1", "0000:9a:00.0", "ens2f0", pcie_root="pci0000:97")
    fake.add_soft_device("rxe0", "eth0")
    fake.add_soft_device("rxe1", "eth1", parent_pci=("pci0000:c1", "0000:c2:00.0"))
    sysfs = DeviceSysfs(str(fake.sys))
    roots = {d.name: sysfs.pcie_root(d) for d in sysfs.devices()}
    # rxe1 sits on a PCI NIC's netdev: that NIC's root; rxe0's netdev is virtual: none
    assert roots == {"mlx5_0": "pci0000:15", "mlx5_1": "pci0000:97", "rxe0": None, "rxe1": "pci0000:c1"}


@pytest.mark.parametrize("kernel,dra", [("mlx5_bond_0", "mlx5-bond-0"), ("rxe0", "rxe0"), ("IRDMA_0", "irdma-0"),
                                        ("__", "rdma"), ("a" * 80, "a" * 63)])
def test_device_names_are_dns_labels(kernel, dra):
    assert dra_devices.device_name(kernel) == dra


def test_dra_mode_needs_a_node_name_to_serve_but_not_to_be_read(monkeypatch, tmp_path, capsys):
    from rdma_netns_dp.main import main

    monkeypatch.delenv("NODE_NAME", raising=False)
    # The init containers read the same config without NODE_NAME: only serving needs it.
    assert validate({"dra": {"enabled": True}}, "test").dra.node == ""
    config = tmp_path / "dp.yaml"
    config.write_text("dra: {enabled: true}\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert "needs the node's name" in capsys.readouterr().err
    monkeypatch.setenv("NODE_NAME", NODE)
    assert validate({"dra": {"enabled": True}}, "test").dra.node == NODE
    with pytest.raises(Exception, match="DNS subdomain"):
        validate({"dra": {"enabled": True, "driverName": "Not_A_Name"}}, "test")


# --- ResourceSlices --------------------------------------------------------------------------

def publisher(api: ApiStandin) -> SlicePublisher:
    api.put_object(f"/api/v1/nodes/{NODE}", {"metadata": {"name": NODE, "uid": "node-uid-1"}})
    return SlicePublisher(api, DRIVER, NODE).start()


def slices(api: ApiStandin) -> list[dict]:
    return [o for p, o in sorted(api.objects.items()) if p.startswith(kube_api.resource_slices_path() + "/")]


def test_slices_are_written_once_per_change_under_a_new_generation(tmp_path):
    api = ApiStandin()
    pub = publisher(api)
    _, devices = lag_rails(tmp_path)
    assert pub.publish(devices)
    [written] = slices(api)
    assert written["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    assert written["spec"]["nodeName"] == NODE and written["spec"]["driver"] == DRIVER
    assert written["metadata"]["ownerReferences"][0]["uid"] == "node-uid-1"
    writes = len([c for c in api.calls if c[0] in ("create", "replace")])
    assert not pub.publish(devices)  # unchanged: no API call at all
    assert len([c for c in api.calls if c[0] in ("create", "replace")]) == writes
    assert pub.publish(devices[:2])
    [written] = slices(api)
    assert written["spec"]["pool"]["generation"] == 2 and len(written["spec"]["devices"]) == 2


def test_more_than_128_devices_split_into_slices_of_one_generation():
    api = ApiStandin()
    pub = publisher(api)
    many = [{"name": f"d{i}"} for i in range(MAX_DEVICES_PER_SLICE + 5)]
    pub.publish(many)
    written = slices(api)
    assert [len(s["spec"]["devices"]) for s in written] == [MAX_DEVICES_PER_SLICE, 5]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in written} == {2}
    pub.publish(many[:3])
    assert [len(s["spec"]["devices"]) for s in slices(api)] == [3]  # the second slice deleted


def test_a_restarted_driver_continues_the_pools_generation(tmp_path):
    api = ApiStandin()
    _, devices = lag_rails(tmp_path)
    first = publisher(api)
    first.publish(devices)
    first.publish(devices[:1])
    again = SlicePublisher(api, DRIVER, NODE).start()
    again.publish(devices)
    assert slices(api)[0]["spec"]["pool"]["generation"] == 3


def test_a_slice_deleted_behind_the_drivers_back_is_written_again(tmp_path):
    api = ApiStandin()
    pub = publisher(api)
    _, devices = lag_rails(tmp_path)
    pub.publish(devices)
    name = slices(api)[0]["metadata"]["name"]
    api.delete(kube_api.resource_slices_path(name))  # an admin's kubectl delete
    deadline = time.monotonic() + 5
    while not pub._dirty.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pub.publish(devices)
    assert [s["metadata"]["name"] for s in slices(api)] == [name]
    pub.stop()
    api.events.put(None)


# --- prepare / unprepare ----------------------------------------------------------------------

def claim(uid: str = "c-1", pool: str = NODE, devices: tuple[str, ...] = ("mlx5-bond-0", "mlx5-bond-2"),
          config: list | None = None, pods: tuple[str, ...] = ("p-uid-1",)) -> dict:
    results = [{"request": "rails", "driver": DRIVER, "pool": pool, "device": d, "shareID": f"s-{d}"}
               for d in devices]
    results.append({"request": "gpu", "driver": "gpu.example.com", "pool": pool, "device": "gpu-0"})
    return {"metadata": {"name": "train-rails", "namespace": "ml", "uid": uid},
            "status": {"allocation": {"devices": {"results": results, "config": config or []}},
                       "reservedFor": [{"resource": "pods", "name": f"pod-{p}", "uid": p} for p in pods]}}


@pytest.fixture
def prep(tmp_path):
    fake, _ = lag_rails(tmp_path)
    sysfs = DeviceSysfs(str(fake.sys))
    rails = {dra_devices.device_name(d.name): d for d in sysfs.devices()}
    api = ApiStandin()
    checkpoint = Checkpoint(str(tmp_path / "plugins" / DRIVER / "checkpoint.json"))
    cdi = CdiSettings(str(tmp_path / "cdi"), "rdma-netns.io/pod", str(fake.dev), False)
    return Preparer(api, DRIVER, NODE, checkpoint, lambda: rails, sysfs, cdi, ResourceConfig()), api, tmp_path


def test_prepare_records_the_claims_rails_and_pods_and_writes_a_placeholder(prep):
    preparer, api, tmp = prep
    api.put_object(kube_api.resource_claims_path("ml", "train-rails"), claim())
    done = preparer.prepare("ml", "train-rails", "c-1")
    assert [(d.device, d.rdma_device, d.share_id) for d in done.devices] == [
        ("mlx5-bond-0", "mlx5_bond_0", "s-mlx5-bond-0"), ("mlx5-bond-2", "mlx5_bond_2", "s-mlx5-bond-2")]
    assert done.cdi_ids == ["rdma-netns.io/pod=claim-c-1"]
    spec = json.loads(open(spec_path(str(tmp / "cdi"), "claim-c-1")).read())
    assert spec["kind"] == "rdma-netns.io/pod" and spec["devices"][0]["name"] == "claim-c-1"
    paths = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
    assert len([p for p in paths if "uverbs" in p]) == 2  # the two rails' char devices, no others
    assert preparer.pod_grant("ml", "pod-p-uid-1", "p-uid-1") == (["mlx5_bond_0", "mlx5_bond_2"], ["claim-c-1"])
    assert preparer.pod_grant("ml", "other", "p-uid-2") is None
    assert preparer.pod_grant("ml", "pod-p-uid-1", "") is not None  # a runtime that sends no UID
    assert preparer.pod_grant("other-ns", "pod-p-uid-1", "p-uid-1") is None
    calls = len(api.calls)
    assert preparer.prepare("ml", "train-rails", "c-1") == done  # kubelet's retry: from the checkpoint,
    assert [verb for verb, _ in api.calls[calls:]] == ["get"]    # its pods read again, nothing written


def test_the_checkpoint_survives_a_restart_private(prep):
    preparer, api, tmp = prep
    api.put_object(kube_api.resource_claims_path("ml", "train-rails"), claim())
    done = preparer.prepare("ml", "train-rails", "c-1")
    path = tmp / "plugins" / DRIVER / "checkpoint.json"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert Checkpoint(str(path)).load().get("c-1") == done


@pytest.mark.parametrize("change,message", [
    (lambda c: c["metadata"].update(uid="c-2"), "not the one kubelet asked for"),
    (lambda c: c["status"].pop("allocation"), "not allocated"),
    (lambda c: c["status"]["allocation"]["devices"]["results"][0].update(pool="gpu-node-2"), "another node's"),
    (lambda c: c["status"]["allocation"]["devices"]["results"][0].update(device="mlx5-bond-9"), "not on node"),
    (lambda c: c["status"]["allocation"]["devices"]["config"].append(
        {"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "rdma-netns.io/v1alpha1", "kind": "RailConfig", "linkTyp": "ipvlan"}}}), "unknown fields"),
    (lambda c: c["status"]["allocation"]["devices"]["config"].append(
        {"source": "FromClass", "opaque": {"driver": DRIVER, "parameters": {"kind": "Other"}}}), "apiVersion/kind"),
])
def test_a_claim_that_cannot_be_prepared_says_why_and_leaves_nothing(prep, change, message):
    preparer, api, tmp = prep
    bad = claim()
    change(bad)
    api.put_object(kube_api.resource_claims_path("ml", "train-rails"), bad)
    with pytest.raises(PrepareError, match=message):
        preparer.prepare("ml", "train-rails", "c-1")
    assert preparer.checkpoint.all() == []
    assert not os.path.exists(spec_path(str(tmp / "cdi"), "claim-c-1"))


def test_another_drivers_opaque_config_is_not_ours_to_judge(prep):
    preparer, api, _ = prep
    api.put_object(kube_api.resource_claims_path("ml", "train-rails"), claim(config=[
        {"source": "FromClaim", "opaque": {"driver": "gpu.example.com", "parameters": {"anything": 1}}}]))
    assert preparer.prepare("ml", "train-rails", "c-1").devices


def test_unprepare_removes_the_placeholder_but_not_the_pods_own_spec(prep):
    preparer, api, tmp = prep
    api.put_object(kube_api.resource_claims_path("ml", "train-rails"), claim())
    preparer.prepare("ml", "train-rails", "c-1")
    path = spec_path(str(tmp / "cdi"), "claim-c-1")
    preparer.unprepare("c-1")
    assert not os.path.exists(path) and preparer.checkpoint.all() == []
    preparer.unprepare("c-1")  # kubelet's retry
    preparer.prepare("ml", "train-rails", "c-1")
    owned = {"cdiVersion": "0.5.0", "kind": "rdma-netns.io/pod", "devices": [{"name": "claim-c-1", "containerEdits": {
        "mounts": [{"hostPath": "/run/rdma-netns/pods/abc/net1.json", "containerPath": "/etc/rdma-netns/rails.json"}]}}]}
    open(path, "w").write(json.dumps(owned))  # the pod's ADD replaced the placeholder
    preparer.unprepare("c-1")
    assert json.loads(open(path).read()) == owned  # its DEL removes it


def test_the_broker_answers_a_dra_pod_from_its_claims():
    answer = dra_answer({"namespace": "ml", "name": "p", "uid": "u"},
                        lambda ns, name, uid: (["mlx5_bond_0"], ["claim-c-1"]) if uid == "u" else None)
    assert answer == {"v": 1, "found": True, "deviceIDs": ["claim-c-1"], "rails": ["mlx5_bond_0"], "via": "dra"}
    none = dra_answer({"namespace": "ml", "name": "q", "uid": "w"}, lambda *a: None)
    assert none["found"] is True and none["rails"] == [] and none["deviceIDs"] == []

    def broken(*a):
        raise KeyError("x")
    assert dra_answer({"namespace": "ml", "name": "q"}, broken)["error"] == "failed"


def test_the_api_standin_refuses_a_stale_replace_as_the_server_does():
    api = ApiStandin()
    api.put_object("/x/a", {"metadata": {"name": "a"}})
    stale = api.get("/x/a")
    api.replace("/x/a", stale)
    with pytest.raises(ApiError) as info:
        api.replace("/x/a", stale)
    assert info.value.status == 409


# --- after ADD: the claim's status.devices ------------------------------------------------------

def test_network_data_comes_from_the_attachment_that_published_the_claims_unit(prep, tmp_path):
    from rdma_netns.state import AttachmentState, StateStore
    from rdma_netns_dp.dra.network_status import NetworkStatusWriter

    preparer, api, _ = prep
    api.put_object(kube_api.resource_claims_path("ml", "train-rails"), claim(devices=("mlx5-bond-2",)))
    claim_status = api.objects[kube_api.resource_claims_path("ml", "train-rails")]["status"]
    claim_status["devices"] = [{"driver": "gpu.example.com", "pool": NODE, "device": "gpu-0"}]
    prepared = preparer.prepare("ml", "train-rails", "c-1")
    state_dir = str(tmp_path / "cni-state")
    writer = NetworkStatusWriter(api, DRIVER, state_dir)
    writer.sync([prepared])
    assert writer.written == set()  # no ADD yet: nothing to write, and it looks again next pass
    store = StateStore(state_dir, "rdma")
    store.prepare()
    state = AttachmentState(mode="shared", link="ipvlan", container_id="sbx", ifname="eth0", netns="/x", network="rdma",
                            rails=[{"ifname": "rdma0", "rdmaDevice": "mlx5_bond_2", "netdev": "bond2"}], phase="ready",
                            published={"podInfoFile": "/p", "cdiKind": "rdma-netns.io/pod",
                                       "cdiSpecs": [{"unit": "claim-c-1", "path": "/s"}]},
                            result={"interfaces": [{"name": "eth0", "sandbox": "/x"},
                                                   {"name": "rdma0", "mac": "02:aa:00:00:00:02", "sandbox": "/x"}],
                                    "ips": [{"address": "10.0.0.2/24", "interface": 0},
                                            {"address": "fd00:12::1:5/64", "interface": 1}]})
    store.save("sbx", "eth0", state)
    writer.sync([prepared])
    devices = api.objects[kube_api.resource_claims_path("ml", "train-rails")]["status"]["devices"]
    assert devices == [{"driver": "gpu.example.com", "pool": NODE, "device": "gpu-0"},
                       {"driver": DRIVER, "pool": NODE, "device": "mlx5-bond-2", "shareID": "s-mlx5-bond-2",
                        "networkData": {"interfaceName": "rdma0", "ips": ["fd00:12::1:5/64"],
                                        "hardwareAddress": "02:aa:00:00:00:02"}}]
    writes = len(api.calls)
    writer.sync([prepared])
    assert len(api.calls) == writes  # written once


def test_the_cni_attaches_a_dra_grants_rails_in_every_mode():
    from rdma_netns.commands.add import granted_rails
    from rdma_netns.grants.client import Grant

    class Shared:
        grant_names_devices = False

    class Exclusive:
        grant_names_devices = True

    dra = Grant(True, ["claim-c-1"], "dra", rails=["mlx5_bond_2"])
    units = Grant(True, ["hca-0001"], "Get")
    assert granted_rails(dra, Shared) == ["mlx5_bond_2"] and granted_rails(dra, Exclusive) == ["mlx5_bond_2"]
    assert granted_rails(units, Shared) is None and granted_rails(units, Exclusive) == ["hca-0001"]
    assert granted_rails(None, Shared) is None


def test_status_on_a_dra_node_asks_the_driver_and_counts_its_claims(tmp_path):
    """`rdma-netns status` on a DRA node: the driver's socket answers a real gRPC call, the plugin
    watcher's registration socket is there, and the checkpoint's claims are listed."""
    from types import SimpleNamespace

    from rdma_netns.admin import status_services
    from rdma_netns_dp.dra.service import DeviceHealth, DraServer

    kubelet = tmp_path / "k"
    ctx = SimpleNamespace(opts=SimpleNamespace(kubelet_dir=str(kubelet), timeout=5.0))
    server = DraServer(str(kubelet), DRIVER, preparer=None, health=DeviceHealth(NODE)).start()
    try:
        Checkpoint(str(kubelet / "plugins" / DRIVER / "checkpoint.json")).put(
            PreparedClaim(
                uid="c-1", namespace="ml", name="train-rails"))
        checks = {c.name: c for c in status_services.device_plugin(ctx)}
        assert checks[f"driver {DRIVER}"].state == "ok", checks
        assert checks["registration"].state == "ok"
        assert checks["prepared claims"].data["claims"] == ["ml/train-rails"]
    finally:
        server.stop()
    checks = {c.name: c for c in status_services.dra_driver(ctx, str(kubelet / "plugins" / DRIVER))}
    assert checks[f"driver {DRIVER}"].state == "fail" and checks["registration"].state == "fail"


def test_a_claim_shared_by_a_second_pod_is_answered_for_it_too(prep):
    """kubelet prepares a claim once per pod using it: the second pod's call refreshes the pods
    the claim is reserved for, so the broker gives that pod its rails as well."""
    preparer, api, _ = prep
    path = kube_api.resource_claims_path("ml", "train-rails")
    api.put_object(path, claim())
    preparer.prepare("ml", "train-rails", "c-1")
    assert preparer.pod_grant("ml", "pod-p-uid-2", "p-uid-2") is None
    api.put_object(path, claim(pods=("p-uid-1", "p-uid-2")))
    again = preparer.prepare("ml", "train-rails", "c-1")
    assert [p["uid"] for p in again.pods] == ["p-uid-1", "p-uid-2"]
    assert preparer.pod_grant("ml", "pod-p-uid-2", "p-uid-2") == (["mlx5_bond_0", "mlx5_bond_2"], ["claim-c-1"])
    api.fail_next = ApiError(0, "Unavailable", "connection refused")  # after a node restart, say
    assert preparer.prepare("ml", "train-rails", "c-1") == again


def test_network_status_stops_looking_for_a_pod_that_never_gets_an_add(prep, tmp_path, monkeypatch):
    from rdma_netns_dp.dra import network_status

    preparer, api, _ = prep
    api.put_object(kube_api.resource_claims_path("ml", "train-rails"), claim())
    prepared = preparer.prepare("ml", "train-rails", "c-1")
    writer = network_status.NetworkStatusWriter(api, DRIVER, str(tmp_path / "no-state"))
    writer.sync([prepared])
    assert writer.written == set()
    monkeypatch.setattr(network_status, "LOOK_SECONDS", -1)
    writer.sync([prepared])
    assert writer.written == {"c-1"}  # a hostNetwork pod: given up, the state folder no longer read
    writer.sync([])
    assert writer.written == set() and writer.first_seen == {}


def test_the_daemon_without_api_credentials_says_so(monkeypatch, tmp_path, capsys):
    from rdma_netns_dp.main import main

    for var in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NODE_NAME", NODE)
    config = tmp_path / "dp.yaml"
    config.write_text(f"dra: {{enabled: true}}\nkubeletDir: {tmp_path}/k\nhealthFile: {tmp_path}/h.json\n"
                      f"podGrantsSocket: ''\nsysfsRoot: {tmp_path}/sys\n")
    assert main(["serve", "--config", str(config)]) == 2
    assert "cannot start the DRA driver" in capsys.readouterr().err


def test_the_health_stream_sends_each_devices_health_and_every_change(tmp_path):
    """kubelet's DRAResourceHealth client: a first message with every device, another on a change."""
    import grpc

    from rdma_netns_dp.api.drahealth.v1 import api_pb2 as health_pb2
    from rdma_netns_dp.api.drahealth.v1 import api_pb2_grpc as health_grpc
    from rdma_netns_dp.dra.service import DeviceHealth, DraServer

    health = DeviceHealth(NODE)
    health.update({"rxe0": None, "rxe1": "port-down"})
    server = DraServer(str(tmp_path / "k"), DRIVER, preparer=None, health=health).start()
    try:
        with grpc.insecure_channel(f"unix://{server.endpoint}") as channel:
            stream = health_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                health_pb2.NodeWatchResourcesRequest(), timeout=10)
            first = next(stream)
            assert [(d.device.pool_name, d.device.device_name, d.health, d.message) for d in first.devices] == [
                (NODE, "rxe0", health_pb2.HEALTHY, ""), (NODE, "rxe1", health_pb2.UNHEALTHY, "port-down")]
            assert all(d.health_check_timeout_seconds > 0 and d.last_updated_time > 0 for d in first.devices)
            health.update({"rxe0": None, "rxe1": None})
            second = next(stream)
            assert [d.health for d in second.devices] == [health_pb2.HEALTHY, health_pb2.HEALTHY]
            stream.cancel()
    finally:
        server.stop()
