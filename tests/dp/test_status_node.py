"""`rdma-netns status` against real parts: the rdma-netns-dp daemon registered with the stand-in
kubelet (Registration and PodResources over unix sockets), its grants broker, the launcher written
by install-launcher, and a primary conflist with the entry chained by `cni_conf.insert`.
The CLI runs as a subprocess, as an admin runs it on a node."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from rdma_netns.admin import cni_conf
from tests.conftest import installed_executable
from tests.dp.conftest import RESOURCE, Host
from tests.kubelet_standin import KubeletStandIn, PodResourcesStandIn

PRIMARY = '{\n  "cniVersion": "1.0.0",\n  "name": "k8s-pod-network",\n  "plugins": [\n    {"type": "calico"}\n  ]\n}\n'


class StatusHost(Host):
    """The standard fake host (rxe0 on eth0 with a 2048-entry table), a kubelet stand-in with
    PodResources, the daemon with its broker, a CNI conf dir with the entry, the launcher."""

    def __init__(self) -> None:
        super().__init__("Y", kubelet=False)
        self.pod_resources = PodResourcesStandIn(self.kubelet_dir / "pod-resources" / "kubelet.sock")
        self.kubelet = KubeletStandIn(self.plugins_dir, pod_resources=self.pod_resources).start()
        self.grants = self.base / "pg.sock"
        self.conf_dir, self.record = self.base / "net.d", self.base / "cni-conf"
        self.bin_dir = self.base / "bin"
        for folder in (self.conf_dir, self.bin_dir):
            folder.mkdir()
        self.entry = {"type": "rdma-netns", "mode": "shared", "resourceName": RESOURCE,
                      "podResourcesSocket": str(self.pod_resources.socket), "podGrantsSocket": str(self.grants),
                      "ipam": {"type": "host-local", "ranges": [[{"subnet": "fd00:1::/64"}]]},
                      "rails": [{"netdev": "eth0", "ifname": "rdma0"}]}
        self.entry_file = self.base / "entry.json"
        self.entry_file.write_text(json.dumps(self.entry))
        (self.conf_dir / "10-calico.conflist").write_text(PRIMARY)
        assert cni_conf.insert(self.conf_dir, self.entry, cni_conf.State(self.record)) == "inserted"
        out = subprocess.run([installed_executable(), "install-launcher", str(self.bin_dir / "rdma-netns")],
                             capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        self.daemon, _plugin = self.start_registered("--mode", "shared", "--resource-name", RESOURCE)

    def status(self, *extra: str, netns: str | None = None) -> tuple[int, dict, str]:
        """(exit code, --json document, text output) of the installed CLI (in network namespace
        `netns` if given)."""
        args = [*(["ip", "netns", "exec", netns] if netns else []), installed_executable(), "status", "--sysfs-root", str(self.fake.sys),
                "--cni-conf-dir", str(self.conf_dir), "--cni-conf-state-dir", str(self.record),
                "--cni-bin-dir", str(self.bin_dir), "--state-dir", str(self.base / "state"),
                "--ipam-dir", str(self.base / "ipam"), "--kubelet-dir", str(self.kubelet_dir),
                "--pod-grants-socket", str(self.grants), "--modprobe-file", str(self.base / "modprobe.conf"),
                "--containerd-config", str(self.base / "containerd.toml"), "--entry", str(self.entry_file), *extra]
        as_json = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=60)
        as_text = subprocess.run(args, capture_output=True, text=True, timeout=60)
        assert as_json.returncode == as_text.returncode, as_text.stdout
        return as_json.returncode, json.loads(as_json.stdout), as_text.stdout

    def fill_gid_table(self, device: str = "rxe0") -> None:
        """Every entry of the device's table taken by pods' addresses (ndevs not in the host)."""
        port = self.fake.devices[device].folder / "ports/1"
        for i in range(1, len(list((port / "gids").iterdir()))):
            self.fake._set_gid(port, i, f"fd00:0001:0000:0000:0000:0000:0002:{i:04x}", "RoCE v2", f"pod{i}")
        assert self.fake.add_gid(device, "fd00:0001:0000:0000:0000:0000:0003:0001", "late") is None


@pytest.fixture
def node() -> Iterator[StatusHost]:
    h = StatusHost()
    yield h
    h.close()


def checks(doc: dict) -> dict[str, dict]:
    return {f"{c['group']}/{c['name']}": c for c in doc["checks"]}


def failing(doc: dict) -> list[str]:
    return [f"{c['group']}/{c['name']}" for c in doc["checks"] if c["state"] == "fail"]


def test_healthy_node(node: StatusHost):
    code, doc, text = node.status()
    assert (code, failing(doc)) == (0, []), text
    assert [c for c in doc["checks"] if c["state"] != "ok"] == [], text
    got = checks(doc)
    assert got[f"Device plugin/plugin {RESOURCE}"]["detail"] == f"serving on {node.socket()}"
    registered = got[f"Device plugin/registered {RESOURCE}"]
    assert registered["data"]["devices"] == 1000, registered  # shared mode: 1000 units, all Healthy
    broker = got["Pairing/grants broker"]
    assert broker["data"]["answer"] == {"v": 1, "found": False, "via": "Get"}
    assert ("Get", "rdma-netns-status", "probe") in node.pod_resources.calls  # the broker asked kubelet
    assert got["Rails/rail 0 rdma0"]["data"]["device"] == "rxe0"
    assert "equal to --entry" in got["Chained entry/entry"]["detail"]
    assert text.splitlines()[-1] == "all ok"


def test_device_plugin_down(node: StatusHost):
    node.daemon.terminate()
    code, doc, text = node.status()
    assert code == 1 and f"Device plugin/plugin {RESOURCE}" in failing(doc), text
    plugin = checks(doc)[f"Device plugin/plugin {RESOURCE}"]
    assert "not serving" in plugin["detail"] and "rdma-netns-dp" in plugin["fix"]
    assert checks(doc)["Pairing/grants broker"]["state"] == "warn"  # the CNI can still ask kubelet itself
    assert "fix: check the rdma-netns-dp pod on this node" in text


def test_entry_removed(node: StatusHost):
    (node.conf_dir / "10-calico.conflist").write_text(PRIMARY)  # the cluster CNI rewrote its file
    code, doc, text = node.status()
    assert (code, failing(doc)) == (1, ["Chained entry/entry"]), text
    entry = checks(doc)["Chained entry/entry"]
    assert "missing from" in entry["detail"]
    assert f"rdma-netns cni-conf insert --conf-dir {node.conf_dir}" in entry["fix"]
    assert f"--entry {node.entry_file}" in entry["fix"]


def test_full_gid_table(node: StatusHost):
    node.fill_gid_table()
    code, doc, text = node.status()
    assert code == 1 and "Rails/rail 0 rdma0" in failing(doc), text
    rail = checks(doc)["Rails/rail 0 rdma0"]
    assert "GID table full" in rail["detail"] and "2048/2048" in rail["detail"]
    assert "one entry per address" in rail["fix"] and "fewer RDMA pods" in rail["fix"]
    assert "fix: the table takes one entry per address" in text



def test_a_rail_without_an_address_in_the_fabric_prefix_fails_with_the_fix(node: StatusHost):
    """rangeFromNodeAddress: the node's pod range on a rail comes from its address inside `within`.
    A fabric on another prefix makes every RDMA pod's ADD fail (109) while everything else is
    healthy; status says so, with the key to change. The rail is a veth eth0 in a namespace of the
    test's own, where status runs (its sysfs stays the fake host's)."""
    netns = f"rnst-range-{node.base.name[-6:]}"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    try:
        for cmd in (["link", "add", "eth0", "type", "veth", "peer", "name", "eth0p"], ["link", "set", "eth0p", "up"], ["link", "set", "eth0", "up"],
                    ["-6", "address", "add", "fd00:1::5/64", "dev", "eth0", "nodad"]):
            subprocess.run(["ip", "-n", netns, *cmd], check=True)
        results = {}
        for within in ("fd00::/16", "fd20::/16"):
            node.entry["rangeFromNodeAddress"] = {"prefixLength": 112, "within": within}
            node.entry["ipam"] = {"type": "host-local", "routes": [{"dst": within}]}
            node.entry_file.write_text(json.dumps(node.entry))
            assert cni_conf.insert(node.conf_dir, node.entry, cni_conf.State(node.record)) == "updated"
            results[within] = node.status(netns=netns)
        code, doc, text = results["fd00::/16"]
        found = checks(doc)["Rails/rail 0 rdma0 range"]
        assert code == 0 and found["state"] == "ok" and "node address fd00:1::5/128 -> pods fd00:1::1-fd00:1::4" in found["detail"], text
        code, doc, text = results["fd20::/16"]
        assert (code, failing(doc)) == (1, ["Rails/rail 0 rdma0 range"]), text
        found = checks(doc)["Rails/rail 0 rdma0 range"]
        assert "no global IPv6 address within fd20::/16" in found["detail"] and "109" in found["detail"], found
        assert "rangeFromNodeAddress.within" in found["fix"] and "fabric.prefix" in found["fix"], found
        # A rail with its own ipam ranges is static for ADD (rail_range_rule): no range to check.
        node.entry["rails"] = [{"netdev": "eth0", "ifname": "rdma0",
                                "ipam": {"type": "host-local", "ranges": [[{"subnet": "fd00:1::/64"}]]}}]
        node.entry_file.write_text(json.dumps(node.entry))
        assert cni_conf.insert(node.conf_dir, node.entry, cni_conf.State(node.record)) == "updated"
        code, doc, text = node.status(netns=netns)
        assert code == 0 and "Rails/rail 0 rdma0 range" not in checks(doc), text
    finally:
        subprocess.run(["ip", "netns", "delete", netns], check=False)
