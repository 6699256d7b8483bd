"""Exclusive mode, devices away in pods: their CDI entries stay and follow the char device the
kernel gives them in the pod, and their health follows the kernel's mode like every unit's."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from rdma_netns_dp import away
from rdma_netns_dp.cni_state import device_netns, devices_in_pods
from rdma_netns_dp.config import ResourceConfig, load
from rdma_netns_dp.daemon import Daemon
from rdma_netns_dp.discovery import CharDevice
from rdma_netns_dp.inventory import Pool
from tests.unit.dp.test_logic import add_pci_device, write


@pytest.fixture
def root(tmp_path) -> Path:
    root = tmp_path / "sys"
    add_pci_device(root, "mlx5_0", "0000:3b:00.0", "ens1f0", 0, 0)
    add_pci_device(root, "mlx5_1", "0000:86:00.0", "ens2f0", 1, 1)
    write(root / "class/infiniband_verbs/abi_version", "6")
    write(root / "module/ib_core/parameters/netns_mode", "N")
    return root


def move_into_pod(root: Path, name: str, uverbs: int) -> None:
    """What the host's sysfs shows after a move: the device is gone from class/infiniband; its
    uverbs node is gone too (kernels differ: 7.3 keeps listing it, see test_renumbered_...)."""
    shutil.rmtree(root / "class/infiniband" / name)
    shutil.rmtree(root / f"class/infiniband_verbs/uverbs{uverbs}")


def save_cni_state(state_dir: Path, device: str, netns: str, container: str = "c0ffee") -> Path:
    folder = state_dir / "rdma-excl"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{container}:net1.json"
    path.write_text(json.dumps({"mode": "exclusive", "netns": netns, "phase": "ready",
                                "rails": [{"ifname": "net1", "rdmaDevice": device, "rdmaOnly": True}]}))
    return path


def daemon(tmp_path: Path, root: Path) -> Daemon:
    config = load(None, {"mode": "exclusive", "sysfsRoot": str(root), "devRoot": "/dev",
                         "cniStateDir": str(tmp_path / "cni"), "cdiEnabled": True,
                         "cdiSpecDir": str(tmp_path / "cdi"), "healthFile": "", "podGrantsSocket": "",
                         "kubeletDir": "/tmp/h13-kubelet-unused"})  # short: a socket path limit
    return Daemon(config)


def cdi_nodes(tmp_path: Path) -> dict[str, list[str]]:
    spec = json.loads((tmp_path / "cdi" / "rdma-netns-rdma_hca.json").read_text())
    return {d["name"]: [n["hostPath"] for n in d["containerEdits"]["deviceNodes"]] for d in spec["devices"]}


def test_cdi_entry_of_a_device_away_in_a_pod_stays_and_follows_its_uverbs(tmp_path, root, monkeypatch):
    d = daemon(tmp_path, root)
    d.poll()
    assert cdi_nodes(tmp_path) == {"mlx5_0": ["/dev/infiniband/uverbs0"], "mlx5_1": ["/dev/infiniband/uverbs1"]}

    # The CNI moved mlx5_0 into a pod: the host can neither see it nor ask its namespace (gone here).
    save_cni_state(tmp_path / "cni", "mlx5_0", str(tmp_path / "no-such-netns"))
    move_into_pod(root, "mlx5_0", 0)
    d.poll()
    assert cdi_nodes(tmp_path)["mlx5_0"] == ["/dev/infiniband/uverbs0"], "kept: the last node known"
    assert d.pools[0].in_pods == {"mlx5_0"}

    # The host's sysfs lists the re-created node under another number (kernel 7.3 keeps listing it).
    write(root / "class/infiniband_verbs/uverbs4/ibdev", "mlx5_0")
    d.poll()
    assert cdi_nodes(tmp_path)["mlx5_0"] == ["/dev/infiniband/uverbs4"]

    # The kernel's own answer from inside the pod wins over the host's view.
    asked = []

    def in_netns(device: str, netns: str):
        asked.append((device, netns))
        return CharDevice("uverbs7"), 231, 199

    monkeypatch.setattr(away, "uverbs_in_netns", in_netns)
    d.poll()
    assert asked == [("mlx5_0", str(tmp_path / "no-such-netns"))]
    assert cdi_nodes(tmp_path) == {"mlx5_0": ["/dev/infiniband/uverbs7"], "mlx5_1": ["/dev/infiniband/uverbs1"]}

    # DEL: the device is back on the host, the state gone; the host's view is used again.
    (tmp_path / "cni" / "rdma-excl" / "c0ffee:net1.json").unlink()
    shutil.rmtree(root / "class/infiniband_verbs/uverbs4")
    ib = root / "class/infiniband/mlx5_0"
    ib.mkdir(parents=True)
    os.symlink(root / "devices/pci0000:00/0000:3b:00.0", ib / "device")
    write(ib / "ports/1/state", "4: ACTIVE")
    write(ib / "ports/1/link_layer", "Ethernet")
    write(root / "class/infiniband_verbs/uverbs2/ibdev", "mlx5_0")
    d.poll()
    assert cdi_nodes(tmp_path)["mlx5_0"] == ["/dev/infiniband/uverbs2"]
    assert d.pools[0].in_pods == frozenset()


def test_a_device_that_left_without_a_pod_record_loses_its_cdi_entry(tmp_path, root):
    d = daemon(tmp_path, root)
    d.poll()
    move_into_pod(root, "mlx5_1", 1)  # unplugged: no CNI state names it
    d.poll()
    assert set(cdi_nodes(tmp_path)) == {"mlx5_0"}


def test_away_devices_follow_the_kernel_mode_rule(root):
    """docs/device-plugin.md: while the kernel's mode is wrong, every unit is Unhealthy, away ones included."""
    from rdma_netns_dp.discovery import Sysfs

    sysfs = Sysfs(str(root))
    pool = Pool(ResourceConfig(), "exclusive")
    pool.update(sysfs.devices())
    move_into_pod(root, "mlx5_0", 0)
    remaining = sysfs.devices()
    pool.update(remaining, {"mlx5_0"})
    assert [(u.id, u.healthy) for u in pool.snapshot()[1]] == [("0000:3b:00.0", True), ("0000:86:00.0", True)]
    assert pool.update(remaining, {"mlx5_0"}, blocked_reason="kernel is shared") is True
    assert [(u.id, u.healthy) for u in pool.snapshot()[1]] == [("0000:3b:00.0", False), ("0000:86:00.0", False)]
    assert pool.healthy_count() == 0
    assert pool.update(remaining, {"mlx5_0"}) is True and pool.healthy_count() == 2


def test_cni_state_says_which_namespace_holds_each_device(tmp_path):
    save_cni_state(tmp_path, "mlx5_3", "/var/run/netns/pod-a", "c1")
    folder = tmp_path / "rdma-excl"
    (folder / "c2:net1.json").write_text(json.dumps({"mode": "exclusive", "rails": [{"rdmaDevice": "mlx5_4"}]}))
    (folder / "c3:net1.json").write_text(json.dumps({"mode": "shared", "netns": "/x",
                                                     "rails": [{"rdmaDevice": "mlx5_5"}]}))
    assert device_netns(str(tmp_path)) == {"mlx5_3": "/var/run/netns/pod-a", "mlx5_4": ""}
    assert devices_in_pods(str(tmp_path)) == {"mlx5_3", "mlx5_4"}


@pytest.mark.parametrize("major,minor", [(231, 192), (231, 255), (231, 256), (10, 260), (4095, 1048575)])
def test_dev_t_from_netlink_decodes_like_the_kernel_encodes(major, minor):
    # huge_encode_dev(): (minor & 0xff) | (major << 8) | ((minor & ~0xff) << 12)
    encoded = (minor & 0xFF) | (major << 8) | ((minor & ~0xFF) << 12)
    assert away.decode_dev_t(encoded) == (major, minor)
    assert away.decode_dev_t(os.makedev(major, minor)) == (major, minor)  # glibc's dev_t agrees


def test_asking_a_namespace_that_is_gone_or_has_no_rdma_is_none(tmp_path):
    assert away.uverbs_in_netns("mlx5_0", str(tmp_path / "gone")) is None
    (tmp_path / "plain").write_text("")
    assert away.uverbs_in_netns("mlx5_0", str(tmp_path / "plain")) is None  # not a netns
    # Our own namespace: this build machine's kernel has no NETLINK_RDMA (or no such device).
    assert away.uverbs_in_netns("no-such-rdma-device", "/proc/self/ns/net") is None
