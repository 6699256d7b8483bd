"""`rdma-netns uninstall-node` on a fake node root: what the DaemonSet and the CNI left, then nothing
of rdma-netns, the primary CNI config byte for byte as before (the deploy suite does it for real)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.conftest import installed_executable

PRIMARY = '{\n  "cniVersion": "1.0.0",\n  "name": "k8s-pod-network",\n  "plugins": [\n    {"type": "calico"}\n  ]\n}\n'
ENTRY = {"type": "rdma-netns", "mode": "shared", "pairing": False, "ipam": {"type": "host-local"},
         "rangeFromNodeAddress": {"prefixLength": 112}, "rails": [{"netdev": "eth1"}]}


@pytest.fixture
def root():
    """A short path: the device plugin's socket must fit a unix socket address."""
    folder = Path(tempfile.mkdtemp(prefix="rnu-", dir="/tmp"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def tree(root: Path) -> dict[str, str]:
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        out[rel] = "dir" if path.is_dir() and not path.is_symlink() else \
            "link" if path.is_symlink() else "socket" if path.is_socket() else path.read_text(errors="replace")
    return out


def rdma_netns(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([installed_executable(), *args], capture_output=True, text=True)


def a_node(root: Path) -> dict[str, str]:
    """The node before the install, then as the DaemonSet and a pod's CNI calls leave it."""
    for folder in ("etc/cni/net.d", "opt/cni/bin", "var/lib/kubelet/device-plugins", "var/lib/kubelet/plugins_registry",
                   "var/lib/cni/results",  # libcni's cache: a node with a CRI runtime has it
                   "var/run/cdi", "run"):
        (root / folder).mkdir(parents=True)
    (root / "etc/cni/net.d/10-calico.conflist").write_text(PRIMARY)
    (root / "opt/cni/bin/calico").write_text("#!/bin/sh\n")
    (root / "var/run/cdi/nvidia.yaml").write_text("cdiVersion: 0.5.0\n")
    before = tree(root)
    entry = root / "entry.json"
    entry.write_text(json.dumps(ENTRY))
    out = rdma_netns("cni-conf", "insert", "--conf-dir", str(root / "etc/cni/net.d"), "--entry", str(entry),
                     "--state-dir", str(root / "var/lib/rdma-netns/cni-conf"))
    assert out.returncode == 0, out.stderr
    entry.unlink()
    release = root / "opt/rdma-netns-ds/0.2.0-abc"
    (release / "venv/bin").mkdir(parents=True)
    (release / "BUILD-STAMP").write_text("x\n")
    (root / "opt/rdma-netns-ds/current").symlink_to("0.2.0-abc")
    assert rdma_netns("install-launcher", str(root / "opt/cni/bin/rdma-netns")).returncode == 0
    (root / "var/lib/cni/rdma-netns/verified-configs").mkdir(parents=True)
    (root / "var/lib/cni/rdma-netns/k8s-pod-network/released").mkdir(parents=True)
    (root / "run/rdma-netns/pods/abc").mkdir(parents=True)
    (root / "var/run/cdi/rdma-netns-rdma_hca.json").write_text("{}")
    (root / "var/run/cdi/rdma-netns-pod-hca-7.json").write_text("{}")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(root / "var/lib/kubelet/device-plugins/rdma-netns-rdma_hca.sock"))
    return before


def test_uninstall_leaves_the_node_as_it_was(root: Path):
    before = a_node(root)
    assert json.loads((root / "etc/cni/net.d/10-calico.conflist").read_text())["plugins"][-1]["type"] == "rdma-netns"
    out = rdma_netns("uninstall-node", "--host-root", str(root))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "nothing of rdma-netns is left" in out.stdout
    assert tree(root) == before
    assert (root / "etc/cni/net.d/10-calico.conflist").read_text() == PRIMARY, "byte for byte"
    again = rdma_netns("uninstall-node", "--host-root", str(root))
    assert again.returncode == 0 and tree(root) == before


def test_uninstall_refuses_while_pods_have_rails_and_changes_nothing(root: Path):
    a_node(root)
    record = root / "var/lib/cni/rdma-netns/k8s-pod-network/abc:eth0.json"
    record.write_text("{}")
    installed = tree(root)
    out = rdma_netns("uninstall-node", "--host-root", str(root))
    assert out.returncode == 1 and "k8s-pod-network/abc:eth0.json" in out.stderr and "--force" in out.stderr
    assert tree(root) == installed


def test_a_launcher_someone_else_wrote_is_kept(root: Path):
    a_node(root)
    foreign = root / "opt/cni/bin/rdma-netns"
    foreign.write_text("#!/bin/sh\necho not ours\n")
    os.chmod(foreign, 0o755)
    out = rdma_netns("uninstall-node", "--host-root", str(root))
    assert out.returncode == 0 and foreign.exists() and "kept" in out.stdout
