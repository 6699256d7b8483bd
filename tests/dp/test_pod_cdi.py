"""Resource option podCdi (issue 17): Allocate names the per-pod CDI device of every unit and
writes a devices-only placeholder spec for it, which the CNI's ADD replaces with the pod's rails.
Against the real daemon and the gRPC kubelet stand-in (tests/dp/conftest.py)."""

from __future__ import annotations

import json
import stat

from rdma_netns.publish.pod_cdi import build_spec
from tests.dp.conftest import RESOURCE, SLUG, Host
from tests.dp.test_allocate import ALL_NAMES


def pod_cdi_config(host: Host, **resource) -> dict:
    return {"mode": "shared", "cdi": {"specDir": str(host.cdi_dir)},
            "resources": [{"name": RESOURCE, "sharedUnits": 8, "podCdi": True, **resource}]}


def spec_file(host: Host, unit: str):
    return host.cdi_dir / f"rdma-netns-pod-{unit}.json"


def expected_nodes(host: Host) -> list[dict]:
    dev = host.dev_root
    return [{"path": f"/dev/infiniband/uverbs{host.fake.uverbs_number(n)}",
             "hostPath": f"{dev}/infiniband/uverbs{host.fake.uverbs_number(n)}", "permissions": "rw"}
            for n in sorted(ALL_NAMES)] + [
        {"path": "/dev/infiniband/rdma_cm", "hostPath": f"{dev}/infiniband/rdma_cm", "permissions": "rw"}]


def test_allocate_names_each_units_pod_cdi_device_and_writes_a_placeholder(host: Host):
    daemon, plugin = host.start_registered(config=pod_cdi_config(host))
    response = plugin.allocate(["hca-0001", "hca-0002"], ["hca-0005"])
    first, second = response.container_responses
    assert [c.name for c in first.cdi_devices] == ["rdma-netns.io/pod=hca-0001", "rdma-netns.io/pod=hca-0002"]
    assert [c.name for c in second.cdi_devices] == ["rdma-netns.io/pod=hca-0005"]
    assert len(first.devices) == len(ALL_NAMES) + 1, "the DeviceSpecs of today stay"
    assert dict(first.envs)["RDMA_NETNS_DEVICES"] == ",".join(sorted(ALL_NAMES))
    for unit in ("hca-0001", "hca-0002", "hca-0005"):
        path = spec_file(host, unit)
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        spec = json.loads(path.read_text())
        assert spec == {"cdiVersion": "0.5.0", "kind": "rdma-netns.io/pod", "devices": [
            {"name": unit, "containerEdits": {"deviceNodes": expected_nodes(host)}}]}, "devices only"
    assert not spec_file(host, "hca-0003").exists(), "only allocated units get a spec"


def test_allocate_replaces_a_previous_pods_spec_and_keeps_its_own_placeholder(host: Host):
    host.cdi_dir.mkdir(parents=True)
    stale = build_spec("rdma-netns.io/pod", "hca-0004", "/run/rdma-netns/pods/old/eth0.json",
                       {"NCCL_IB_GID_INDEX": "3"}, [])
    spec_file(host, "hca-0004").write_text(json.dumps(stale))
    daemon, plugin = host.start_registered(config=pod_cdi_config(host, podCdiKind="example.com/rails"))
    container = plugin.allocate(["hca-0004"]).container_responses[0]
    assert [c.name for c in container.cdi_devices] == ["example.com/rails=hca-0004"]
    spec = json.loads(spec_file(host, "hca-0004").read_text())
    assert spec["kind"] == "example.com/rails"
    assert "mounts" not in spec["devices"][0]["containerEdits"], "a previous pod's rails never reach a new pod"
    before = spec_file(host, "hca-0004").stat().st_mtime_ns
    plugin.allocate(["hca-0004"])
    assert spec_file(host, "hca-0004").stat().st_mtime_ns == before, "an unchanged placeholder is not rewritten"


def test_with_resource_cdi_too_the_placeholder_still_lists_the_devices(host: Host):
    config = pod_cdi_config(host)
    config["cdi"]["enabled"] = True
    daemon, plugin = host.start_registered(config=config)
    container = plugin.allocate(["hca-0000"]).container_responses[0]
    names = [c.name for c in container.cdi_devices]
    assert names == [f"rdma-netns.io/{SLUG}={n}" for n in sorted(ALL_NAMES)] + ["rdma-netns.io/pod=hca-0000"]
    assert list(container.devices) == []
    spec = json.loads(spec_file(host, "hca-0000").read_text())
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == expected_nodes(host)


def test_pod_cdi_is_off_by_default(host: Host):
    daemon, plugin = host.start_registered("--mode", "shared", "--resource-name", RESOURCE,
                                           "--cdi-dir", str(host.cdi_dir))
    container = plugin.allocate(["hca-0000"]).container_responses[0]
    assert list(container.cdi_devices) == [] and not host.cdi_dir.exists()


def test_pod_cdi_kind_is_validated(host: Host):
    daemon = host.start(config=pod_cdi_config(host, podCdiKind="not a kind"))
    assert daemon.proc.wait(10) != 0
    assert "podCdiKind" in daemon.stderr()
