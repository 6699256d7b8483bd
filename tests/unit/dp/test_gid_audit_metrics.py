"""Issue 36: a tenant with CAP_NET_ADMIN in a shared-mode pod adds addresses on its rail until the
port's GID table is full. rdma_netns.rails.gid_audit counts the entries of pods' interfaces that no
attachment record explains; the device plugin exports them per port as
rdma_netns_gid_entries_unexplained, audited in a thread, never at scrape time. Kernel-shaped fake
sysfs (mlx5: 255 entries, v1 and v2 per address; Soft-RoCE: 1024, v2 only)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from rdma_netns.kernel.rdma_sysfs import RdmaPort, RdmaSysfs
from rdma_netns.rails import gid_audit
from rdma_netns_dp.gid_audit_metrics import GidAuditCollector
from tests.fake_rdma_sysfs import FakeRdmaSysfs

MLX5, RXE = RdmaPort("mlx5_0", 1), RdmaPort("rxe0", 1)


def gid(prefix: str, n: int) -> str:
    return f"{prefix}:0000:0000:0000:0000:0001:{n:04x}"


def host(tmp_path: Path) -> FakeRdmaSysfs:
    fake = FakeRdmaSysfs(tmp_path / "hw")
    fake.add_pci_device("mlx5_0", "0000:1a:00.0", "ens1f0")
    fake.mlx5_gid_table("mlx5_0")
    fake.add_soft_device("rxe0", "eth1")
    fake.soft_gid_table("rxe0")
    return fake


def record(state_dir: Path, cid: str, device: str, addresses: list[str]) -> None:
    folder = state_dir / "net"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{cid}:eth0.json").write_text(json.dumps({
        "format": 2, "phase": "ready", "mode": "shared", "link": "macvlan", "containerID": cid, "ifname": "eth0",
        "netns": "/proc/self/ns/net", "network": "net",
        "rails": [{"index": 0, "ifname": "rdma0", "netdev": "ens1f0", "rdmaDevice": device, "port": 1,
                   "addresses": addresses}]}))


def test_only_entries_no_record_explains_count(tmp_path):
    fake, state = host(tmp_path), tmp_path / "state"
    for i in range(3):  # three pods: their recorded address and their interface's link-local
        record(state, f"{i}" * 64, "mlx5_0", [f"fd00:1::1:{i:x}"])
        fake.add_gid("mlx5_0", gid("fd00:0001", i), "rdma0")
        fake.add_gid("mlx5_0", f"fe80:0000:0000:0000:0000:00ff:fe00:{i:04x}", "rdma0")
    fake.add_gid("mlx5_0", gid("fd00:0099", 1), "ens1f0")  # the host's own address: not a pod's
    sysfs = RdmaSysfs(str(fake.sys))
    found = gid_audit.audit(sysfs, [MLX5, RXE], gid_audit.records(str(state)))
    assert (found[MLX5].in_pods, found[MLX5].unexplained) == (12, 0)
    assert found[RXE].unexplained == 0
    # the tenant: two addresses of its own, a second link-local, and an IPv4 address
    fake.add_gid("mlx5_0", gid("fd00:0bad", 1), "rdma0")
    fake.add_gid("mlx5_0", gid("fd00:0bad", 2), "rdma0")
    fake.add_gid("mlx5_0", "fe80:0000:0000:0000:0000:0000:0000:0bad", "rdma0")
    fake.add_gid("mlx5_0", "0000:0000:0000:0000:0000:ffff:0a00:0005", "rdma0")
    found = gid_audit.audit(sysfs, [MLX5], gid_audit.records(str(state)))[MLX5]
    assert (found.in_pods, found.unexplained) == (20, 8)  # 4 addresses, RoCE v1 + v2 each
    shown = [gid_audit.address_of(g) for g, _ndev in found.samples]
    assert shown == ["fd00:bad::1:1", "fd00:bad::1:2", "fe80::bad", "10.0.0.5"]
    # a record of the same address explains it (a pod whose ADD gave it)
    record(state, "9" * 64, "mlx5_0", ["fd00:bad::1:1", "10.0.0.5"])
    found = gid_audit.audit(sysfs, [MLX5], gid_audit.records(str(state)))[MLX5]
    assert found.unexplained == 2  # fd00:bad::1:2 only: the extra rail allows one more link-local pair


def test_the_metric_is_audited_in_the_background_and_scrapes_read_the_result(tmp_path):
    fake, state = host(tmp_path), tmp_path / "state"
    record(state, "a" * 64, "rxe0", ["fd00:1::1:1"])
    fake.add_gid("rxe0", gid("fd00:0001", 1), "rdma0")
    for n in range(5):
        fake.add_gid("rxe0", gid("fd00:0bad", n), "rdma0")
    collector = GidAuditCollector(RdmaSysfs(str(fake.sys)), lambda: [RXE, MLX5], str(state), interval=0.05)
    registry = CollectorRegistry()
    registry.register(collector)
    assert "rdma_netns_gid_entries_unexplained{" not in generate_latest(registry).decode()  # no audit yet
    collector.start()
    try:
        deadline = time.monotonic() + 10
        while not collector.last and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        collector.stop()
    text = generate_latest(registry).decode()
    assert 'rdma_netns_gid_entries_unexplained{device="rxe0",port="1"} 5.0' in text
    assert 'rdma_netns_gid_entries_unexplained{device="mlx5_0",port="1"} 0.0' in text
    # a scrape reads no sysfs and no state file: gone, and the scrape still answers the last audit
    shutil.rmtree(fake.sys)
    shutil.rmtree(state)
    assert 'rdma_netns_gid_entries_unexplained{device="rxe0",port="1"} 5.0' in generate_latest(registry).decode()
