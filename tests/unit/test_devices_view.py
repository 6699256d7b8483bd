"""`rdma-netns devices` as a per-pod show_gids, on a fake sysfs tree shaped like the kernel's.

The layout is the one measured in the real-kernel guest (issue 17): rxe0 on the host's v0 has the
host's link-local GID at 0, then two pods' link-local and fd00:: GIDs, every pod entry with the
ndev name rdma0. Only the entries whose GID is an address of this namespace's rdma0 are the
pod's own; the other pod's entries carry the same ndev name and must not pass for its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rdma_netns.admin import cli, devices
from rdma_netns.kernel import rdma_sysfs
from rdma_netns.kernel.inet import Prefix
from tests.fake_rdma_sysfs import FakeRdmaSysfs, lingjun_host

MAC_A, MAC_B = "02:aa:00:00:00:01", "02:bb:00:00:00:02"


def gid(text: str) -> str:
    return rdma_sysfs.gid_text(Prefix.parse(text))


LL_A, LL_B = devices.eui64_link_local(MAC_A), devices.eui64_link_local(MAC_B)
POD_A, POD_B = gid("fd00:11::a"), gid("fd00:11::b")
ZERO = gid("::")


def set_gids(fake: FakeRdmaSysfs, device: str, entries: list[tuple[str, str, str]], port: int = 1) -> None:
    """Write GID entries 0..n-1 (gid, type, ndev); ZERO entries are empty slots, as in the kernel."""
    base = fake.devices[device].folder / "ports" / str(port)
    for i, (text, gid_type, ndev) in enumerate(entries):
        for rel, value in ((f"gids/{i}", text), (f"gid_attrs/types/{i}", gid_type), (f"gid_attrs/ndevs/{i}", ndev)):
            (base / rel).parent.mkdir(parents=True, exist_ok=True)
            (base / rel).write_text(value + "\n")


@pytest.fixture
def tree(tmp_path: Path) -> FakeRdmaSysfs:
    fake = FakeRdmaSysfs(tmp_path)
    fake.add_soft_device("rxe0", "v0")
    host_ll = (fake.devices["rxe0"].folder / "ports/1/gids/0").read_text().strip()
    set_gids(fake, "rxe0", [
        (host_ll, "RoCE v2", "v0"),
        (LL_A, "RoCE v2", "rdma0"),
        (LL_B, "RoCE v2", "rdma0"),
        (POD_A, "RoCE v2", "rdma0"),
        (ZERO, "", ""),                 # a slot freed by a deleted pod
        (POD_B, "RoCE v2", "rdma0"),
        (POD_A, "IB/RoCE v1", "rdma0"),  # a ConnectX-style v1 twin of a v2 entry
    ])
    return fake


POD_A_VIEW = {"lo": {gid("::1")}, "rdma0": {POD_A, gid("fe80::1")}}  # a's LL only through its MAC


def test_the_pods_own_gids_come_first_and_the_rest_is_marked(tree):
    sysfs = rdma_sysfs.RdmaSysfs(str(tree.sys))
    local = {name: set(g) for name, g in POD_A_VIEW.items()}
    local["rdma0"].add(LL_A)
    rows = devices.port_gids(sysfs, "rxe0", 1, local)
    assert [(r["index"], r["owner"]) for r in rows] == [
        (1, "self"), (3, "self"), (6, "self"), (0, "host"), (2, "other"), (5, "other")]
    assert [r["type"] for r in rows[:3]] == ["RoCE v2", "RoCE v2", "IB/RoCE v1"]
    assert rows[4]["gid"] == LL_B and rows[5]["gid"] == POD_B and rows[5]["ndev"] == "rdma0"


def test_same_ndev_name_is_not_enough_to_be_mine(tree):
    """Pod b's entry names rdma0 too: only the address content decides."""
    sysfs = rdma_sysfs.RdmaSysfs(str(tree.sys))
    rows = devices.port_gids(sysfs, "rxe0", 1, {"rdma0": {POD_B}})
    mine = [r["index"] for r in rows if r["owner"] == "self"]
    assert mine == [5]


def test_my_address_on_another_ndev_is_not_mine(tree):
    """An address of ours, but the entry's ndev is not our interface of that name."""
    sysfs = rdma_sysfs.RdmaSysfs(str(tree.sys))
    rows = devices.port_gids(sysfs, "rxe0", 1, {"eth0": {POD_A}})
    assert all(r["owner"] != "self" for r in rows)


def test_on_the_host_its_own_link_local_is_its_own(tree):
    sysfs = rdma_sysfs.RdmaSysfs(str(tree.sys))
    host_ll = (tree.devices["rxe0"].folder / "ports/1/gids/0").read_text().strip()
    rows = devices.port_gids(sysfs, "rxe0", 1, {"v0": {host_ll}})
    assert rows[0] == {"index": 0, "gid": host_ll, "type": "RoCE v2", "ndev": "v0", "owner": "self"}
    assert {r["owner"] for r in rows[1:]} == {"other"}


def test_the_limit_bounds_the_read(tree):
    sysfs = rdma_sysfs.RdmaSysfs(str(tree.sys))
    assert [r["index"] for r in devices.port_gids(sysfs, "rxe0", 1, {}, limit=3)] == [0, 1, 2]


def test_eui64_link_local():
    assert devices.eui64_link_local("52:54:00:12:34:56") == gid("fe80::5054:ff:fe12:3456")
    assert devices.eui64_link_local("00:00:00:00:00:00") is None  # lo
    assert devices.eui64_link_local("") is None


def test_table_lists_own_first_with_owner_words(tree, monkeypatch):
    monkeypatch.setattr(rdma_sysfs.default, "root", str(tree.sys))
    monkeypatch.setattr(devices, "local_gids", lambda: {"rdma0": {POD_A, LL_A}})
    monkeypatch.setattr(devices, "_ports_here", lambda: [("rxe0", 1, "ACTIVE", "v0")])
    rows = devices.collect()
    text = devices.table(rows)
    lines = [line.split() for line in text.splitlines() if line.startswith("  ") and line.split()[0].isdigit()]
    assert [line[0] for line in lines] == ["1", "3", "6", "0", "2", "5"]
    assert text.count("this namespace") == 3 and text.count("another namespace") == 2
    assert "INDEX" in text and "OWNER" in text and "RoCE v2" in text


def test_sysfs_fallback_without_rdma_netlink(tree, monkeypatch):
    """No NETLINK_RDMA (old kernel, a test host): devices and ports come from sysfs."""
    import rdma_netns.kernel.rdma_nldev as nldev

    class Refused:
        def __enter__(self):
            raise OSError(93, "Protocol not supported")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(nldev, "RdmaNetlink", Refused)
    monkeypatch.setattr(rdma_sysfs.default, "root", str(tree.sys))
    assert devices._ports_here() == [("rxe0", 1, "ACTIVE", "v0")]


def test_cli_json_in_this_namespace(tree):
    """The CLI end to end in a fresh process, against the fake tree: a JSON list, every GID with
    an owner, the table sorted own first (this namespace has no rdma0, so none is ours here)."""
    env = dict(os.environ, RDMA_NETNS_SYSFS_ROOT=str(tree.sys))
    out = subprocess.run([sys.executable, "-c", "import sys; from rdma_netns.admin import cli; "
                          "sys.exit(cli.main(sys.argv[1:]))", "devices", "--json", "--max-gids", "8"],
                         capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [(r["device"], r["port"]) for r in rows] == [("rxe0", 1)]
    assert all(g["owner"] in ("self", "host", "other") for g in rows[0]["gids"])
    assert {g["index"] for g in rows[0]["gids"]} == {0, 1, 2, 3, 5, 6}


def test_cli_refuses_a_silly_limit():
    with pytest.raises(SystemExit):
        cli.main(["devices", "--max-gids", "0"])


# --- RoCE LAG (issue 20): mlx5_bond_N's netdev is a member of the bond that carries the addresses
@pytest.fixture
def lag(tmp_path, monkeypatch) -> FakeRdmaSysfs:
    """Two LAG cards; on mlx5_bond_0 two pods' addresses (ndev rdma0) beside the bond's default GID."""
    import rdma_netns.kernel.rdma_nldev as nldev

    class Refused:  # no NETLINK_RDMA here: ports from sysfs, netdev = the member mlx5 reports
        def __enter__(self):
            raise OSError(93, "Protocol not supported")

        def __exit__(self, *exc):
            return False

    fake = lingjun_host(tmp_path, cards=2)
    fake.add_gid("mlx5_bond_0", POD_A, "rdma0")
    fake.add_gid("mlx5_bond_0", POD_B, "rdma0")
    monkeypatch.setattr(nldev, "RdmaNetlink", Refused)
    monkeypatch.setattr(rdma_sysfs.default, "root", str(fake.sys))
    monkeypatch.setattr(devices, "local_gids", lambda: {})
    return fake


def test_lag_rows_name_the_bond_and_how_full_each_table_is(lag):
    rows = devices.collect()
    assert [(r["device"], r["netdev"], r["bond"], r["bondMembers"]) for r in rows] == [
        ("mlx5_bond_0", "eth1", "bond0", ["eth1", "eth2"]), ("mlx5_bond_1", "eth3", "bond1", ["eth3", "eth4"])]
    assert [(r["gidsUsed"], r["gidsTotal"], r["gidEntriesPerAddress"]) for r in rows] == [(6, 255, 2), (2, 255, 2)]
    assert json.loads(json.dumps(rows)) == rows, "JSON-able, as --json prints it"


def test_a_gid_on_the_bond_is_the_hosts(lag):
    first = devices.collect()[0]
    assert [(g["index"], g["ndev"], g["owner"]) for g in first["gids"]] == [
        (0, "bond0", "host"), (1, "bond0", "host"), (2, "rdma0", "other"), (3, "rdma0", "other"),
        (4, "rdma0", "other"), (5, "rdma0", "other")]


def test_lag_table_shows_bond_members_and_gid_fill(lag):
    text = devices.table(devices.collect())
    header, first, second = text.splitlines()[:3]
    assert header.split() == ["DEVICE", "PORT", "STATE", "NETDEV", "PCI", "GIDS", "NAMESPACE"]
    assert first.split()[:7] == ["mlx5_bond_0", "1", "ACTIVE", "bond0", "(eth1+eth2)", "0000:1a:00.0", "6/255"]
    assert "bond1 (eth3+eth4)" in second and "2/255" in second
    assert first.index("0000:1a:00.0") == header.index("PCI"), "columns stay aligned"


def test_without_a_bond_the_row_is_as_before(tree, monkeypatch):
    port = tree.devices["rxe0"].folder / "ports/1"
    for kind in ("ndevs", "types"):  # the freed slot as the kernel shows it: no attributes to read
        (port / f"gid_attrs/{kind}/4").unlink()
    monkeypatch.setattr(rdma_sysfs.default, "root", str(tree.sys))
    monkeypatch.setattr(devices, "local_gids", lambda: {})
    monkeypatch.setattr(devices, "_ports_here", lambda: [("rxe0", 1, "ACTIVE", "v0")])
    (row,) = devices.collect()
    assert (row["bond"], row["bondMembers"], row["gidsUsed"], row["gidsTotal"], row["gidEntriesPerAddress"]) == (
        None, [], 6, 7, 1)
    assert devices.table([row]).splitlines()[1].split()[3:6] == ["v0", "-", "6/7"]
