"""`rdma-netns status` on a fake node (fake sysfs, temp CNI folders, a real launcher): the verdicts,
their exit codes and fixes, the fixes of leftovers really clearing them, and no write anywhere."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from rdma_netns.admin import cli, cni_conf
from rdma_netns.kernel.rdma_sysfs import RdmaPort, RdmaSysfs
from tests.conftest import installed_executable
from tests.fake_rdma_sysfs import FakeRdmaSysfs

PRIMARY = '{\n  "cniVersion": "1.0.0",\n  "name": "k8s-pod-network",\n  "plugins": [\n    {"type": "calico"}\n  ]\n}\n'
NETWORK = "k8s-pod-network"
HOST_LOCAL = shutil.which("host-local", path="/usr/lib/cni:/opt/cni/bin")


CONTAINERD_CDI_ON = 'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  enable_cdi = true\n'


class Node:
    """A temp node: rxe0 on eth1 (1024-entry table) and mlx5_0 on ens1f0 (255 entries, 2 per
    address), a calico primary with the entry chained by `cni_conf.insert`, the launcher."""

    def __init__(self, root: Path, netns_mode: str = "Y") -> None:
        self.root = root
        self.fake = FakeRdmaSysfs(root / "hw", netns_mode)
        self.fake.add_soft_device("rxe0", "eth1")
        self.fake.soft_gid_table("rxe0")
        self.fake.add_pci_device("mlx5_0", "0000:1a:00.0", "ens1f0")
        self.fake.mlx5_gid_table("mlx5_0")
        self.conf_dir, self.record_dir = root / "net.d", root / "cni-conf"
        self.bin_dir, self.state_dir, self.ipam_dir = root / "bin", root / "state", root / "ipam"
        self.kubelet_dir = root / "kubelet"
        for folder in (self.conf_dir, self.bin_dir, self.state_dir, self.ipam_dir, self.kubelet_dir):
            folder.mkdir(parents=True)
        self.ipam = {"type": "host-local", "ranges": [[{"subnet": "fd00:1::/64"}]], "dataDir": str(self.ipam_dir)}
        self.entry = {"type": "rdma-netns", "mode": "shared", "pairing": False, "ipam": self.ipam,
                      "rails": [{"netdev": "eth1", "ifname": "rdma0"}, {"netdev": "ens1f0", "ifname": "rdma1"}]}
        self.entry_file = root / "entry.json"
        self.entry_file.write_text(json.dumps(self.entry))
        (self.conf_dir / "10-calico.conflist").write_text(PRIMARY)
        assert cni_conf.insert(self.conf_dir, self.entry, cni_conf.State(self.record_dir)) == "inserted"
        out = subprocess.run([installed_executable(), "install-launcher", str(self.bin_dir / "rdma-netns")],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        self.containerd_config = root / "containerd.toml"
        self.containerd_config.write_text(CONTAINERD_CDI_ON)

    def args(self, *extra: str) -> list[str]:
        return ["status", "--sysfs-root", str(self.fake.sys), "--cni-conf-dir", str(self.conf_dir),
                "--cni-conf-state-dir", str(self.record_dir), "--cni-bin-dir", str(self.bin_dir),
                "--state-dir", str(self.state_dir), "--ipam-dir", str(self.ipam_dir),
                "--kubelet-dir", str(self.kubelet_dir), "--pod-grants-socket", str(self.root / "pg.sock"),
                "--modprobe-file", str(self.root / "modprobe.conf"),
                "--containerd-config", str(self.containerd_config), *extra]

    def status(self, capsys, *extra: str) -> tuple[int, dict]:
        """In-process, --json: (exit code, document)."""
        code = cli.main(self.args("--json", *extra))
        return code, json.loads(capsys.readouterr().out)

    def run(self, *extra: str) -> subprocess.CompletedProcess:
        """The installed executable, as an admin runs it."""
        return subprocess.run([installed_executable(), *self.args(*extra)], capture_output=True, text=True,
                              timeout=60)

    def fill_gids(self, device: str, addresses: int) -> None:
        """`addresses` pod addresses on the device (their interfaces live in pods: not in class/net)."""
        for i in range(addresses):
            assert self.fake.add_gid(device, f"fd00:0001:0000:0000:0000:0000:0001:{i:04x}", f"pod{i}") is not None

    def add_state(self, cid: str, netns: str, ifname: str = "eth0", rails: list[dict] | None = None,
                  mode: str = "shared") -> Path:
        folder = self.state_dir / NETWORK
        folder.mkdir(exist_ok=True)
        record = {"format": 2, "phase": "ready", "mode": mode, "link": "macvlan", "containerID": cid,
                  "ifname": ifname, "netns": netns, "network": NETWORK,
                  "rails": rails if rails is not None else
                  [{"index": 0, "ifname": "rdma0", "netdev": "eth1", "ipam": self.ipam, "rdmaDevice": "rxe0",
                    "port": 1}]}
        path = folder / f"{cid}:{ifname}.json"
        path.write_text(json.dumps(record))
        return path

    def add_lease(self, ip: str, cid: str, ifname: str) -> Path:
        folder = self.ipam_dir / NETWORK
        folder.mkdir(exist_ok=True)
        path = folder / ip
        path.write_text(f"{cid}\r\n{ifname}")  # host-local's format
        return path


@pytest.fixture
def node():
    root = Path(tempfile.mkdtemp(prefix="status-", dir="/tmp"))
    try:
        yield Node(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def by_name(doc: dict) -> dict[str, dict]:
    return {f"{c['group']}/{c['name']}": c for c in doc["checks"]}


def failing(doc: dict) -> list[str]:
    return [f"{c['group']}/{c['name']}" for c in doc["checks"] if c["state"] == "fail"]


# --- a healthy node, and the JSON shape ---------------------------------------------------------------

def test_healthy_node_exits_0_with_every_part_seen(node: Node, capsys):
    code, doc = node.status(capsys, "--entry", str(node.entry_file))
    assert (code, failing(doc)) == (0, []), json.dumps(doc, indent=1)
    assert doc["ok"] is True
    for check in doc["checks"]:
        assert set(check) == {"group", "name", "state", "detail", "fix", "data"}
        assert check["state"] in ("ok", "warn", "fail")
    checks = by_name(doc)
    assert checks["Kernel/netns mode"]["data"]["mode"] == "shared"
    rail0, rail1 = checks["Rails/rail 0 rdma0"], checks["Rails/rail 1 rdma1"]
    assert rail0["data"].items() >= {"netdev": "eth1", "device": "rxe0", "gidsTotal": 1024, "perAddress": 1}.items()
    assert rail1["data"]["device"] == "mlx5_0" and rail1["data"]["perAddress"] == 2
    assert rail1["data"]["podsLeft"] == (255 - 2) // 2 // 2, "each pod: its address and the rail's link-local"
    assert "Rails/link-local" not in checks
    assert "equal to --entry" in checks["Chained entry/entry"]["detail"]
    assert "10-calico.conflist (plugin 2 of 2)" in checks["Chained entry/entry"]["detail"]
    assert checks["Launcher/launcher"]["data"]["supportedVersions"][-2:] == ["1.0.0", "1.1.0"]
    assert checks["Device plugin/device plugin"]["detail"].startswith("not deployed")
    assert checks["Attachments/attachments"]["data"]["count"] == 0


def test_text_output_is_grouped_and_says_all_ok(node: Node):
    out = node.run()
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    groups = [line for line in lines if line and not line.startswith(" ")]
    assert groups[1:-1] == ["Kernel", "Devices", "Rails", "Chained entry", "Runtime", "Launcher", "Device plugin",
                            "Pairing", "Attachments"]
    assert lines[-1] == "all ok"


# --- the GID table --------------------------------------------------------------------------------------

def test_full_gid_table_fails_with_the_mlx5_fix(node: Node, capsys):
    node.fill_gids("mlx5_0", 126)  # 2 + 2*126 = 254 of 255: no room for one more address
    usage = RdmaSysfs(str(node.fake.sys)).gid_usage(RdmaPort("mlx5_0", 1))
    assert usage is not None and usage.full
    code, doc = node.status(capsys)
    assert code == 1 and failing(doc) == ["Rails/rail 1 rdma1"]
    rail = by_name(doc)["Rails/rail 1 rdma1"]
    assert "GID table full" in rail["detail"] and "254/255" in rail["detail"]
    assert rail["data"]["podsLeft"] == 0 and rail["data"]["inPods"] == 252
    assert "two entries per address" in rail["fix"] and "fewer RDMA pods" in rail["fix"]
    out = node.run()
    assert out.returncode == 1
    assert "fix: the table takes two entries per address" in out.stdout


def test_nearly_full_table_warns_and_exits_0(node: Node, capsys):
    node.fill_gids("mlx5_0", 120)  # room for 6 more addresses: 3 pods, with their link-local addresses
    code, doc = node.status(capsys)
    rail = by_name(doc)["Rails/rail 1 rdma1"]
    assert (code, rail["state"], rail["data"]["podsLeft"]) == (0, "warn", 3)
    assert "nearly full" in rail["detail"]


def tenant_node(node: Node) -> None:
    """Three pods on mlx5_0 with their records (one address each), plus the link-local address
    each pod interface may have: every entry explained."""
    for i in range(3):
        node.add_state(f"{i}" * 64, "/proc/self/ns/net", rails=[
            {"index": 0, "ifname": "rdma1", "netdev": "ens1f0", "ipam": node.ipam, "rdmaDevice": "mlx5_0", "port": 1,
             "addresses": [f"fd00:1::1:{i:x}"]}])
        assert node.fake.add_gid("mlx5_0", f"fd00:0001:0000:0000:0000:0000:0001:{i:04x}", "rdma1") is not None
        assert node.fake.add_gid("mlx5_0", f"fe80:0000:0000:0000:0000:00ff:fe00:{i:04x}", "rdma1") is not None


def test_gid_entries_no_record_explains_are_reported_with_the_fix(node: Node, capsys):
    """Issue 36: a tenant with NET_ADMIN adds addresses on its rail until the shared table is full.
    The entries of pods' interfaces that no attachment record explains are counted per port."""
    tenant_node(node)
    code, doc = node.status(capsys)
    rail = by_name(doc)["Rails/rail 1 rdma1"]
    assert (rail["state"], rail["data"]["gidsUnexplained"]) == ("ok", 0), rail
    for j in range(5):  # the tenant's own addresses (and a second link-local, which no rail explains)
        assert node.fake.add_gid("mlx5_0", f"fd00:0001:0000:0000:0000:0000:0bad:{j:04x}", "rdma1") is not None
    assert node.fake.add_gid("mlx5_0", "fe80:0000:0000:0000:0000:0000:0000:0bad", "rdma1") is not None
    code, doc = node.status(capsys)
    rail = by_name(doc)["Rails/rail 1 rdma1"]
    assert (code, rail["state"], rail["data"]["gidsUnexplained"]) == (0, "warn", 12), rail  # 6 addresses, v1 + v2
    assert "12 GID entries of pods' interfaces that no attachment record explains" in rail["detail"]
    assert "fd00:1::bad:0 (on rdma1)" in rail["detail"]
    assert "forbid NET_ADMIN in pods with rails" in rail["fix"] and "docs/security.md" in rail["fix"]
    assert by_name(doc)["Rails/rail 0 rdma0"]["data"]["gidsUnexplained"] == 0
    out = node.run()
    assert "fix: " in out.stdout and "forbid NET_ADMIN" in out.stdout


def test_a_full_table_of_unexplained_entries_fails_naming_both(node: Node, capsys):
    tenant_node(node)
    for j in range(120):  # 2 + 2*3 + 2*3 = 14 entries in use; 2*120 more fill the 255 but one
        assert node.fake.add_gid("mlx5_0", f"fd00:0001:0000:0000:0000:0000:0bad:{j:04x}", "rdma1") is not None
    code, doc = node.status(capsys)
    rail = by_name(doc)["Rails/rail 1 rdma1"]
    assert (code, rail["state"], rail["data"]["gidsUnexplained"]) == (1, "fail", 240), rail
    assert "GID table full" in rail["detail"] and "240 GID entries" in rail["detail"]
    assert "fewer RDMA pods" in rail["fix"] and "forbid NET_ADMIN" in rail["fix"]


def test_no_link_local_doubles_the_room_and_warns_what_it_costs(node: Node, capsys):
    node.entry["linkLocal"] = False
    assert cni_conf.insert(node.conf_dir, node.entry, cni_conf.State(node.record_dir)) == "updated"
    code, doc = node.status(capsys)
    checks = by_name(doc)
    assert checks["Rails/rail 1 rdma1"]["data"]["podsLeft"] == (255 - 2) // 2
    warning = checks["Rails/link-local"]
    assert (code, warning["state"]) == (0, "warn")
    assert "Failed to modify QP to RTR" in warning["detail"] and "neighbour solicitation" in warning["detail"]
    assert "addressesPerPod 2" in warning["fix"]


# --- rails and the kernel -------------------------------------------------------------------------------

def test_down_rail_and_wrong_mode_fail_with_their_fixes(node: Node, capsys):
    (node.fake.sys / "class/net/eth1/operstate").write_text("down\n")
    node.fake.set_netns_mode("N")
    code, doc = node.status(capsys)
    assert code == 1 and failing(doc) == ["Kernel/netns mode", "Rails/rail 0 rdma0"]
    checks = by_name(doc)
    assert "ip link set eth1 up" in checks["Rails/rail 0 rdma0"]["fix"]
    assert "rdma-netns mode set shared --persist" in checks["Kernel/netns mode"]["fix"]


def test_port_down_and_missing_netdev(node: Node, capsys):
    node.fake.set_port_state("mlx5_0", "DOWN")
    node.entry["rails"][0]["netdev"] = "eth9"
    assert cni_conf.insert(node.conf_dir, node.entry, cni_conf.State(node.record_dir)) == "updated"
    code, doc = node.status(capsys)
    checks = by_name(doc)
    assert code == 1
    assert "no such netdev" in checks["Rails/rail 0 rdma0"]["detail"]
    rail1 = checks["Rails/rail 1 rdma1"]
    assert "DOWN" in rail1["detail"] and "rdma link show mlx5_0/1" in rail1["fix"]
    assert checks["Devices/mlx5_0/1"]["state"] == "ok"  # the inventory reports, Rails judges


def test_exclusive_mode_rail_in_a_pod_is_ok(node: Node, capsys):
    node.fake.set_netns_mode("N")
    node.entry.update(mode="exclusive")
    assert cni_conf.insert(node.conf_dir, node.entry, cni_conf.State(node.record_dir)) == "updated"
    node.fake.remove_device("rxe0", with_netdev=True)  # moved into the pod's namespace, with eth1
    node.add_state("a" * 64, "/proc/self/ns/net", mode="exclusive",
                   rails=[{"index": 0, "ifname": "rdma0", "netdev": "eth1", "rdmaDevice": "rxe0", "port": 1}])
    code, doc = node.status(capsys)
    assert (code, failing(doc)) == (0, []), json.dumps(doc, indent=1)
    checks = by_name(doc)
    assert "in the pod of container aaaaaaaaaaaa" in checks["Rails/rail 0 rdma0"]["detail"]
    assert "gidsTotal" not in checks["Rails/rail 1 rdma1"]["data"]  # one pod per device: no GID budget
    node.fake.remove_device("mlx5_0", with_netdev=True)  # gone, and no state says a pod has it
    code, doc = node.status(capsys)
    assert code == 1 and failing(doc) == ["Rails/rail 1 rdma1"]


# --- the chained entry ----------------------------------------------------------------------------------

def test_entry_missing_fails_with_the_insert_fix(node: Node, capsys):
    (node.conf_dir / "10-calico.conflist").write_text(PRIMARY)  # the cluster CNI rewrote its file
    code, doc = node.status(capsys)  # no --entry: the record says it was inserted
    entry = by_name(doc)["Chained entry/entry"]
    assert code == 1 and failing(doc) == ["Chained entry/entry"]
    assert "missing from" in entry["detail"] and "records an insert" in entry["detail"]
    assert f"rdma-netns cni-conf insert --conf-dir {node.conf_dir}" in entry["fix"]
    out = node.run("--entry", str(node.entry_file))
    assert out.returncode == 1
    assert f"--entry {node.entry_file}" in out.stdout and "fix: `rdma-netns cni-conf insert" in out.stdout


def test_no_entry_and_no_record_is_not_used(node: Node, capsys):
    assert cni_conf.remove(node.conf_dir, cni_conf.State(node.record_dir)) == "restored"
    code, doc = node.status(capsys)
    entry = by_name(doc)["Chained entry/entry"]
    assert (code, entry["state"]) == (0, "ok") and entry["detail"].startswith("not used")
    code, doc = node.status(capsys, "--entry", str(node.entry_file))  # the DaemonSet wants one
    assert code == 1 and "missing from" in by_name(doc)["Chained entry/entry"]["detail"]


def test_entry_other_than_the_daemonsets_fails(node: Node, capsys):
    other = dict(node.entry, link="ipvlan")
    node.entry_file.write_text(json.dumps(other))
    code, doc = node.status(capsys, "--entry", str(node.entry_file))
    entry = by_name(doc)["Chained entry/entry"]
    assert code == 1 and entry["data"]["differs"] == ["link"]


def test_primary_changed_since_insert_warns(node: Node, capsys):
    path = node.conf_dir / "10-calico.conflist"
    path.write_text(json.dumps(json.loads(path.read_text())))  # same content, other bytes
    code, doc = node.status(capsys)
    entry = by_name(doc)["Chained entry/entry"]
    assert (code, entry["state"]) == (0, "warn") and "changed since" in entry["detail"]


def test_missing_launcher_fails_while_a_config_uses_it(node: Node, capsys):
    (node.bin_dir / "rdma-netns").unlink()
    code, doc = node.status(capsys)
    launcher = by_name(doc)["Launcher/launcher"]
    assert code == 1 and launcher["state"] == "fail"
    assert f"rdma-netns install-launcher {node.bin_dir}/rdma-netns" in launcher["fix"]


def test_a_device_plugin_socket_makes_the_plugin_required(node: Node, capsys):
    import socket

    folder = node.kubelet_dir / "device-plugins"
    folder.mkdir()
    with socket.socket(socket.AF_UNIX) as stale:  # bound, never listening: a dead daemon's socket
        stale.bind(str(folder / "rdma-netns-rdma_hca.sock"))
        code, doc = node.status(capsys)
    got = by_name(doc)
    assert code == 1 and failing(doc) == ["Device plugin/kubelet", "Device plugin/plugin rdma/hca",
                                          "Device plugin/kubelet PodResources"]
    assert "not serving" in got["Device plugin/plugin rdma/hca"]["detail"]
    assert "rdma-netns-dp" in got["Device plugin/plugin rdma/hca"]["fix"]


# --- attachments and leftovers ----------------------------------------------------------------------------

def test_live_attachment_is_counted_not_reported(node: Node, capsys):
    node.add_state("a" * 64, "/proc/self/ns/net")
    node.add_lease("fd00:1::2", "a" * 64, "rdma0")
    code, doc = node.status(capsys)
    assert code == 0 and [c for c in doc["checks"] if c["state"] != "ok"] == []
    assert by_name(doc)["Attachments/attachments"]["data"] == {"count": 1, "phases": {"ready": 1},
                                                               "networks": [NETWORK]}


@pytest.mark.skipif(HOST_LOCAL is None, reason="host-local (containernetworking-plugins) is not installed")
def test_state_without_netns_is_a_leftover_whose_fix_clears_it(node: Node, capsys):
    cid = "b" * 64
    state = node.add_state(cid, str(node.root / "netns-gone"))
    lease = node.add_lease("fd00:1::3", cid, "rdma0")
    os.symlink(HOST_LOCAL, node.bin_dir / "host-local")
    code, doc = node.status(capsys)
    problems = [c for c in doc["checks"] if c["state"] != "ok"]
    assert code == 0 and [c["name"] for c in problems] == [f"state {cid[:12]}:eth0"]
    leftover = problems[0]
    assert leftover["state"] == "warn" and "netns-gone is gone" in leftover["detail"]
    assert f"CNI_CONTAINERID={cid} CNI_IFNAME=eth0 CNI_NETNS=" in leftover["fix"]
    command = leftover["data"]["command"]
    assert leftover["fix"].endswith(command)
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not state.exists() and not lease.exists()
    code, doc = node.status(capsys)
    assert code == 0 and [c for c in doc["checks"] if c["state"] != "ok"] == []


def test_lease_without_state_is_a_leftover_whose_fix_clears_it(node: Node, capsys):
    orphan = node.add_lease("fd00:1::4", "c" * 64, "rdma1")
    primary_lease = node.add_lease("fd00:1::5", "d" * 64, "eth0")  # the primary CNI's own: not ours
    code, doc = node.status(capsys)
    problems = [c for c in doc["checks"] if c["state"] != "ok"]
    assert code == 0 and [c["name"] for c in problems] == ["lease fd00:1::4"]
    assert problems[0]["data"].items() >= {"containerID": "c" * 64, "ifname": "rdma1", "path": str(orphan)}.items()
    command = problems[0]["data"]["command"]
    assert command == f"flock {node.ipam_dir}/{NETWORK}/lock rm -f {orphan}" and problems[0]["fix"].endswith(command)
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert not orphan.exists() and primary_lease.exists()
    code, doc = node.status(capsys)
    assert [c for c in doc["checks"] if c["state"] != "ok"] == []


# --- usage and read-only ---------------------------------------------------------------------------------

def test_bad_usage_exits_2(node: Node):
    assert node.run("--entry", str(node.root / "nope.json")).returncode == 2
    assert node.run("--no-such-flag").returncode == 2


def snapshot(root: Path) -> dict[str, tuple]:
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        content = path.read_bytes() if path.is_file() and not path.is_symlink() else None
        out[str(path.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, content)
    return out


def test_status_writes_nothing(node: Node):
    node.fill_gids("mlx5_0", 126)
    node.add_state("e" * 64, str(node.root / "gone"))
    node.add_lease("fd00:1::6", "f" * 64, "rdma0")
    (node.conf_dir / "10-calico.conflist").write_text(PRIMARY)
    before = snapshot(node.root)
    for extra in ((), ("--json",), ("--entry", str(node.entry_file))):
        assert node.run(*extra).returncode == 1
    assert snapshot(node.root) == before


def test_containerd_with_cdi_off_fails_with_the_fix(tmp_path: Path, capsys):
    """containerd 1.7 passes a pod's CDI devices (its NCCL/UCX settings) only with enable_cdi on."""
    node = Node(tmp_path)
    code, doc = node.status(capsys)
    cdi = by_name(doc)["Runtime/CDI"]
    assert code == 0 and cdi["state"] == "ok" and "enable_cdi on" in cdi["detail"], cdi
    for text, said in (('version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  sandbox_image = "p"\n', "not set"),
                       ('version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  enable_cdi = false\n', "= false"),
                       ('[plugins.cri]\n  systemd_cgroup = false\n', "not set")):
        node.containerd_config.write_text(text)
        code, doc = node.status(capsys)
        cdi = by_name(doc)["Runtime/CDI"]
        assert code == 1 and cdi["state"] == "fail" and f"enable_cdi {said}" in cdi["detail"], cdi
        assert "enable_cdi = true" in cdi["fix"] and "restart containerd" in cdi["fix"], cdi
    # containerd 2.x: on unless turned off; no config file: not checked.
    node.containerd_config.write_text('version = 3\n[plugins."io.containerd.cri.v1.runtime"]\n')
    code, doc = node.status(capsys)
    assert code == 0 and by_name(doc)["Runtime/CDI"]["state"] == "ok", doc
    node.containerd_config.unlink()
    code, doc = node.status(capsys)
    assert code == 0 and "not checked" in by_name(doc)["Runtime/CDI"]["detail"], doc
