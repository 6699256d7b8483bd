"""Issue 17 in real namespaces: what ADD publishes for a pod's containers, and that DEL, GC and a
failed ADD take it away again.

Unpaired: the per-attachment JSON file. Paired (kubelet stand-in, tests/netns/test_pairing.py):
also one CDI spec per granted unit. RDMA devices and GID indexes come from the fake sysfs tree
(tests/fake_rdma_sysfs.py, RDMA_NETNS_SYSFS_ROOT for the plugin's process): soft devices on the
node's veth rails, static IPAM addresses and a pre-written RoCE v2 GID entry for each, so ADD
runs with requireRdma true and really waits for (and finds) the index.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tests.fake_rdma_sysfs import FakeRdmaSysfs
from tests.netns.test_pairing import RESOURCE, k8s_args, kubelet, paired, short_tmp  # noqa: F401 (fixtures)

pytestmark = pytest.mark.netns

ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"


def exploded(address: str) -> str:
    import ipaddress

    return ipaddress.ip_address(address).exploded


class Rig:
    """A node with two rails that are RoCE ports of fake soft devices rxe0/rxe1, and where
    ADD publishes (podInfoDir, cdiSpecDir under the test's folder)."""

    def __init__(self, node, tmp: Path) -> None:
        self.node = node
        self.fake = FakeRdmaSysfs(tmp / "fake")
        for i in range(2):
            self.fake.add_soft_device(f"rxe{i}", f"rail{i}")
        self.pods_dir = tmp / "pods"
        self.cdi_dir = tmp / "cdi"
        self.env = {"RDMA_NETNS_SYSFS_ROOT": str(self.fake.sys), "RDMA_NETNS_DEV_ROOT": str(self.fake.dev)}

    def gid(self, device: str, index: int, address: str, ndev: str) -> None:
        """The kernel's GID entry for `address` (indexes below it exist, empty, as in a real table)."""
        port = self.fake.devices[device].folder / "ports" / "1"
        for i in range(1, index + 1):
            if i < index and (port / "gids" / str(i)).exists():
                continue
            (port / "gids" / str(i)).write_text((exploded(address) if i == index else ZERO_GID) + "\n")
            (port / "gid_attrs" / "types" / str(i)).write_text("RoCE v2\n")
            (port / "gid_attrs" / "ndevs" / str(i)).write_text((ndev if i == index else "") + "\n")

    def conf(self, addresses: list[str], **extra) -> dict:
        conf = self.node.conf(rails=2, requireRdma=True, **{"podInfoDir": str(self.pods_dir),
                                                            "cdiSpecDir": str(self.cdi_dir), **extra})
        for rail, address in zip(conf["rails"], addresses):
            rail["ipam"] = {"type": "static", "addresses": [{"address": address}]}
        return conf

    def cni(self, command: str, conf: dict, pod: str | None, **kw):
        kw["extra_env"] = {**self.env, **(kw.get("extra_env") or {})}
        return self.node.cni(command, conf, pod, **kw)

    def info(self, container_id: str, ifname: str = "rdma0") -> Path:
        return self.pods_dir / container_id / f"{ifname}.json"

    def spec(self, unit: str) -> Path:
        return self.cdi_dir / f"rdma-netns-pod-{unit}.json"


@pytest.fixture
def rig(node, tmp_path):
    return Rig(node, tmp_path)


def test_unpaired_add_writes_the_pod_info_file_and_del_removes_it(node, tmp_path):
    pods = tmp_path / "pods"
    conf = node.conf(rails=2, podInfoDir=str(pods))
    pod = node.pod()
    result = node.cni("ADD", conf, pod).ok()
    info = pods / "c1" / "rdma0.json"
    assert stat.S_IMODE(info.stat().st_mode) == 0o644, "a container user reads it"
    assert stat.S_IMODE(info.parent.stat().st_mode) == 0o755
    record = json.loads(info.read_text())
    addresses = [ip["address"] for ip in result["ips"]]
    assert record == {
        "version": 1, "network": "rdmanet", "containerID": "c1", "ifname": "rdma0", "mode": "shared",
        "rails": [{"ifname": f"rdma{i}", "netdev": f"rail{i}", "addresses": [addresses[i]], "rdmaDevice": None,
                   "port": None, "gidIndex": None, "gid": None} for i in range(2)],
        "gidIndexesEqual": False,
        "env": {"NCCL_SOCKET_IFNAME": "=rdma0,rdma1", "RDMA_NETNS_RAILS_FILE": "/etc/rdma-netns/rails.json"}}
    assert [a["local"] for a in node.addresses(pod, "rdma0")] == [addresses[0].split("/")[0]]
    assert not (tmp_path / "cdi").exists(), "no pairing, no CDI spec"
    node.cni("DEL", conf, pod).ok()
    assert not info.exists() and not info.parent.exists(), "DEL removes the file and its empty folder"
    assert pods.is_dir()


def test_pod_info_dir_empty_publishes_nothing(node, tmp_path):
    conf = node.conf(podInfoDir="")
    pod = node.pod()
    node.cni("ADD", conf, pod).ok()
    state = json.loads((Path(node.state_dir) / "rdmanet" / "c1:net1.json").read_text())
    assert "published" not in state
    node.cni("DEL", conf, pod).ok()


def test_paired_add_publishes_a_cdi_spec_per_granted_unit_with_the_pods_gid_index(rig, kubelet):
    rig.gid("rxe0", 3, "fd00:1::5", "rdma0")
    rig.gid("rxe1", 3, "fd00:2::5", "rdma1")
    kubelet.set_pod("team-a", "trainer", {"main": {RESOURCE: ["hca-0007"]}, "side": {RESOURCE: ["hca-0009"]}})
    conf = paired(rig.node, kubelet, rails=2)
    conf.update(rig.conf(["fd00:1::5/64", "fd00:2::5/64"], **{k: conf[k] for k in
                         ("resourceName", "podResourcesSocket", "podGrantsSocket", "podResourcesTimeoutMs")}))
    pod = rig.node.pod()
    rig.cni("ADD", conf, pod, extra_env=k8s_args("trainer")).ok()
    record = json.loads(rig.info("c1").read_text())
    assert [(r["rdmaDevice"], r["port"], r["gidIndex"], r["gid"]) for r in record["rails"]] == [
        ("rxe0", 1, 3, exploded("fd00:1::5")), ("rxe1", 1, 3, exploded("fd00:2::5"))]
    env = record["env"]
    assert record["gidIndexesEqual"] is True
    assert env == {"NCCL_IB_HCA": "=rxe0:1,rxe1:1", "NCCL_SOCKET_IFNAME": "=rdma0,rdma1",
                   "NCCL_IB_ADDR_FAMILY": "AF_INET6", "NCCL_IB_GID_INDEX": "3", "UCX_NET_DEVICES": "rxe0:1,rxe1:1",
                   "UCX_IB_GID_INDEX": "3", "RDMA_NETNS_RAILS_FILE": "/etc/rdma-netns/rails.json"}
    for unit in ("hca-0007", "hca-0009"):
        spec = json.loads(rig.spec(unit).read_text())
        assert stat.S_IMODE(rig.spec(unit).stat().st_mode) == 0o644
        assert spec["kind"] == "rdma-netns.io/pod" and spec["cdiVersion"] == "0.5.0"
        (device,) = spec["devices"]
        edits = device["containerEdits"]
        assert device["name"] == unit
        # NCCL's settings go in NCCL's own file, so that the pod spec's NCCL_* win (NCCL applies
        # its file with setenv(..., 0)); the env edits carry the rest.
        assert sorted(edits["env"]) == sorted(f"{k}={v}" for k, v in env.items() if not k.startswith("NCCL_"))
        nccl_file = rig.info("c1").with_name("rdma0.nccl.conf")
        assert edits["mounts"] == [{"hostPath": str(rig.info("c1")), "containerPath": "/etc/rdma-netns/rails.json",
                                    "options": ["ro", "bind"]},
                                   {"hostPath": str(nccl_file), "containerPath": "/etc/nccl.conf",
                                    "options": ["ro", "bind"]}]
        lines = [ln for ln in nccl_file.read_text().splitlines() if "=" in ln]
        assert sorted(lines) == sorted(f"{k}={v}" for k, v in env.items() if k.startswith("NCCL_"))
        assert stat.S_IMODE(nccl_file.stat().st_mode) == 0o644
        dev = rig.fake.dev
        assert edits["deviceNodes"] == [
            {"path": f"/dev/infiniband/uverbs{n}", "hostPath": f"{dev}/infiniband/uverbs{n}", "permissions": "rw"}
            for n in (rig.fake.uverbs_number("rxe0"), rig.fake.uverbs_number("rxe1"))] + [
            {"path": "/dev/infiniband/rdma_cm", "hostPath": f"{dev}/infiniband/rdma_cm", "permissions": "rw"}]
    state = json.loads((Path(rig.node.state_dir) / "rdmanet" / "c1:rdma0.json").read_text())
    assert [s["unit"] for s in state["published"]["cdiSpecs"]] == ["hca-0007", "hca-0009"]
    rig.cni("DEL", conf, pod).ok()
    assert not rig.spec("hca-0007").exists() and not rig.spec("hca-0009").exists()
    assert not rig.info("c1").exists() and not rig.info("c1").parent.exists(), "DEL removes both files"


def test_unequal_indexes_leave_the_gid_index_to_nccl_within_the_pods_addresses(rig):
    rig.gid("rxe0", 2, "fd00:1::5", "rdma0")
    rig.gid("rxe1", 4, "fd00:1::9", "rdma1")
    conf = rig.conf(["fd00:1::5/64", "fd00:1::9/64"])
    pod = rig.node.pod()
    rig.cni("ADD", conf, pod).ok()
    record = json.loads(rig.info("c1").read_text())
    assert [r["gidIndex"] for r in record["rails"]] == [2, 4] and record["gidIndexesEqual"] is False
    assert "NCCL_IB_GID_INDEX" not in record["env"] and "UCX_IB_GID_INDEX" not in record["env"]
    assert record["env"]["NCCL_IB_ADDR_RANGE"] == "fd00:1::/124"
    rig.cni("DEL", conf, pod).ok()


def test_a_spec_a_newer_pod_took_over_survives_the_old_pods_del(rig, kubelet):
    rig.gid("rxe0", 1, "fd00:1::5", "rdma0")
    rig.gid("rxe1", 1, "fd00:2::5", "rdma1")
    rig.gid("rxe0", 2, "fd00:1::6", "rdma0")
    rig.gid("rxe1", 2, "fd00:2::6", "rdma1")
    kubelet.set_pod("team-a", "old", {"main": {RESOURCE: ["hca-0001"]}})
    kubelet.set_pod("team-a", "new", {"main": {RESOURCE: ["hca-0001"]}})
    base = paired(rig.node, kubelet, rails=2)
    keys = {k: base[k] for k in ("resourceName", "podResourcesSocket", "podGrantsSocket", "podResourcesTimeoutMs")}
    old_conf = rig.conf(["fd00:1::5/64", "fd00:2::5/64"], **keys)
    new_conf = rig.conf(["fd00:1::6/64", "fd00:2::6/64"], **keys)
    old, new = rig.node.pod(), rig.node.pod()
    rig.cni("ADD", old_conf, old, container_id="old", extra_env=k8s_args("old")).ok()
    rig.cni("ADD", new_conf, new, container_id="new", extra_env=k8s_args("new")).ok()
    spec = rig.spec("hca-0001")
    assert json.loads(spec.read_text())["devices"][0]["containerEdits"]["mounts"][0]["hostPath"] == \
        str(rig.info("new"))
    rig.cni("DEL", old_conf, old, container_id="old").ok()
    assert spec.exists(), "the unit's spec is the newer pod's now: the old pod's DEL keeps it"
    assert not rig.info("old").exists() and rig.info("new").exists()
    rig.cni("DEL", new_conf, new, container_id="new").ok()
    assert not spec.exists() and not rig.info("new").exists()


def test_gc_removes_the_files_of_attachments_it_no_longer_has(rig, kubelet):
    rig.gid("rxe0", 1, "fd00:1::5", "rdma0")
    rig.gid("rxe1", 1, "fd00:2::5", "rdma1")
    kubelet.set_pod("team-a", "trainer", {"main": {RESOURCE: ["hca-0003"]}})
    base = paired(rig.node, kubelet, rails=2)
    conf = rig.conf(["fd00:1::5/64", "fd00:2::5/64"], **{k: base[k] for k in
                    ("resourceName", "podResourcesSocket", "podGrantsSocket", "podResourcesTimeoutMs")})
    pod = rig.node.pod()
    rig.cni("ADD", conf, pod, extra_env=k8s_args("trainer")).ok()
    # Orphans: a crashed version's file and spec whose state is gone, and another network's file.
    ghost = rig.pods_dir / "ghost" / "rdma0.json"
    ghost.parent.mkdir()
    ghost.write_text(json.dumps({"version": 1, "network": "rdmanet", "containerID": "ghost"}))
    rig.spec("hca-0666").write_text(json.dumps({"cdiVersion": "0.5.0", "kind": "rdma-netns.io/pod", "devices": [
        {"name": "hca-0666", "containerEdits": {"mounts": [
            {"hostPath": str(rig.pods_dir / "gone" / "rdma0.json"), "containerPath": "/etc/rdma-netns/rails.json"}]}}]}))
    other = rig.pods_dir / "ghost" / "eth9.json"
    other.write_text(json.dumps({"version": 1, "network": "othernet", "containerID": "ghost"}))
    placeholder = rig.spec("hca-0100")
    placeholder.write_text(json.dumps({"cdiVersion": "0.5.0", "kind": "rdma-netns.io/pod", "devices": [
        {"name": "hca-0100", "containerEdits": {"deviceNodes": [{"path": "/dev/infiniband/rdma_cm"}]}}]}))
    valid = {"cni.dev/valid-attachments": [{"containerID": "c1", "ifname": "rdma0"}]}
    rig.cni("GC", {**conf, **valid}, None).ok()
    assert not ghost.exists() and not rig.spec("hca-0666").exists()
    assert other.exists(), "another network's file is that network's to collect"
    assert placeholder.exists(), "the device plugin's placeholder belongs to no attachment"
    assert rig.info("c1").exists() and rig.spec("hca-0003").exists()
    rig.cni("GC", {**conf, "cni.dev/valid-attachments": []}, None).ok()
    assert not rig.info("c1").exists() and not rig.spec("hca-0003").exists()
    assert "rdma0" not in rig.node.links(pod) and rig.node.attachment_records() == []


def test_a_failure_while_publishing_rolls_the_add_back(rig, kubelet):
    rig.gid("rxe0", 1, "fd00:1::5", "rdma0")
    rig.gid("rxe1", 1, "fd00:2::5", "rdma1")
    kubelet.set_pod("team-a", "trainer", {"main": {RESOURCE: ["hca-0003"]}})
    # A folder where the unit's spec should be: the spec's write fails after the JSON file's.
    # (A file where the spec folder should be is refused before anything: code 7, test_config_paths.py.)
    rig.spec("hca-0003").mkdir(parents=True)
    base = paired(rig.node, kubelet, rails=2, ipam=None)
    conf = rig.conf(["fd00:1::5/64", "fd00:2::5/64"], **{k: base[k] for k in
                    ("resourceName", "podResourcesSocket", "podGrantsSocket", "podResourcesTimeoutMs")})
    for rail, prefix in zip(conf["rails"], ("fd00:1::", "fd00:2::")):
        # host-local (its leases show what a rollback released), pinned to the address of the GID entry
        rail["ipam"] = rig.node.ipam(f"{prefix}/64", rangeStart=f"{prefix}5", rangeEnd=f"{prefix}5")
    pod = rig.node.pod()
    err = rig.cni("ADD", conf, pod, extra_env=k8s_args("trainer")).error(5)
    assert "publish" in err["msg"]
    assert set(rig.node.links(pod)) == {"lo"}, "no rail link is left in the pod"
    assert rig.node.allocations() == [], "no lease is left"
    assert rig.node.attachment_records() == []
    assert not rig.info("c1").exists() and list(rig.pods_dir.iterdir()) == [], "the JSON written first is gone"
    rig.spec("hca-0003").rmdir()
    rig.cni("ADD", conf, pod, extra_env=k8s_args("trainer")).ok()
    assert rig.spec("hca-0003").exists()
    rig.cni("DEL", conf, pod).ok()
