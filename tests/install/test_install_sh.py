"""install.sh as a node admin runs it: into a temp root (--root), then once for real on this
machine; idempotent, refuses to clobber, --dry-run changes nothing, --uninstall removes exactly
what it added."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "install.sh"
CONFLIST = REPO / "conf" / "rdma-netns-shared-1rail.conflist"


def install(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["bash", str(INSTALL), *args], capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def tree(root: Path) -> dict[str, str]:
    """Every path under root with a content digest (files) or a kind (dirs, links)."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if rel.startswith("opt/rdma-netns/"):
            continue  # the venv's own files: its top folder is listed
        out[rel] = path.read_text() if path.is_file() else "dir"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("node-root")
    (root / "etc/cni/net.d").mkdir(parents=True)
    (root / "etc/cni/net.d/10-primary.conflist").write_text('{"cniVersion": "1.0.0", "name": "primary"}\n')
    install("--root", str(root), "--conflist", str(CONFLIST), "--persist-mode", "exclusive")
    return root


def test_install_puts_each_part_in_place(installed):
    launcher = installed / "opt/cni/bin/rdma-netns"
    assert os.access(launcher, os.X_OK)
    assert str(installed / "opt/rdma-netns/bin/python") in launcher.read_text().splitlines()[0]
    assert (installed / "etc/cni/net.d/rdma-netns-shared-1rail.conflist").read_bytes() == CONFLIST.read_bytes()
    assert "options ib_core netns_mode=0" in (installed / "etc/modprobe.d/rdma-netns.conf").read_text()
    version = subprocess.run([str(launcher)], env={"CNI_COMMAND": "VERSION"}, input=b"{}",
                             capture_output=True, timeout=60)
    assert version.returncode == 0 and "1.1.0" in json.loads(version.stdout)["supportedVersions"]
    dp = subprocess.run([str(installed / "opt/rdma-netns/bin/rdma-netns-dp"), "--help"],
                        capture_output=True, text=True, timeout=60)
    assert dp.returncode == 0 and "rdma/hca" in dp.stdout
    manifest = (installed / "opt/rdma-netns/install-manifest").read_text()
    assert f"file {launcher}\n" in manifest and "10-primary" not in manifest


def test_rerun_is_idempotent_and_never_clobbers(installed, tmp_path):
    before = tree(installed)
    install("--root", str(installed), "--conflist", str(CONFLIST), "--persist-mode", "exclusive")
    assert tree(installed) == before
    other = tmp_path / CONFLIST.name
    other.write_text(CONFLIST.read_text().replace("fd00:1::", "fd00:77::"))
    refused = install("--root", str(installed), "--conflist", str(other), check=False)
    assert refused.returncode == 1 and "exists and differs" in refused.stderr and "--force" in refused.stderr
    assert tree(installed) == before, "a refused install must change nothing"
    dry = install("--root", str(installed), "--conflist", str(other), "--force", "--dry-run")
    assert "would run" in dry.stdout and tree(installed) == before


def test_force_then_uninstall_leaves_only_what_was_there(installed, tmp_path):
    other = tmp_path / CONFLIST.name
    other.write_text(CONFLIST.read_text().replace("fd00:1::", "fd00:77::"))
    install("--root", str(installed), "--conflist", str(other), "--force")
    assert "fd00:77::" in (installed / "etc/cni/net.d" / CONFLIST.name).read_text()
    done = install("--root", str(installed), "--uninstall")
    assert "removed" in done.stdout
    assert tree(installed) == {"etc": "dir", "etc/cni": "dir", "etc/cni/net.d": "dir",
                               "etc/cni/net.d/10-primary.conflist": '{"cniVersion": "1.0.0", "name": "primary"}\n'}
    again = install("--root", str(installed), "--uninstall")
    assert "nothing to uninstall" in again.stdout


def test_bad_arguments_are_refused_clearly(tmp_path):
    out = install("--root", str(tmp_path), "--persist-mode", "sideways", check=False)
    assert out.returncode == 1 and "shared or exclusive" in out.stderr
    out = install("--root", str(tmp_path), "--conflist", str(tmp_path / "missing.conflist"), check=False)
    assert out.returncode == 1 and "does not exist" in out.stderr
    out = install("--bogus", check=False)
    assert out.returncode == 1 and "unknown option" in out.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="the real install needs root")
def test_real_install_on_this_machine_and_uninstall():
    """For real, into / (with its own prefix and a CNI bin folder nobody else uses)."""
    # Not /opt/rdma-netns-test: integration/cri/fetch-containerd.sh keeps containerd 1.7 there.
    prefix, bin_dir = "/opt/rdma-netns-install-test", "/opt/cni/bin-rdma-netns-install-test"
    if os.path.exists(prefix) and not os.path.exists(f"{prefix}/install-manifest"):
        pytest.skip(f"{prefix} exists and is not ours")
    before_conf = sorted(os.listdir("/etc/cni/net.d")) if os.path.isdir("/etc/cni/net.d") else None
    try:
        install("--prefix", prefix, "--cni-bin-dir", bin_dir)
        version = subprocess.run([f"{bin_dir}/rdma-netns"], env={"CNI_COMMAND": "VERSION"}, input=b"{}",
                                 capture_output=True, timeout=60)
        assert version.returncode == 0, version.stdout
    finally:
        install("--prefix", prefix, "--cni-bin-dir", bin_dir, "--uninstall")
    assert not os.path.exists(prefix) and not os.path.exists(bin_dir)
    after_conf = sorted(os.listdir("/etc/cni/net.d")) if os.path.isdir("/etc/cni/net.d") else None
    assert after_conf == before_conf


# --- "RDMA for non-hostNetwork pods": chained into the primary CNI config ---------------------------

ENTRY = REPO / "conf" / "rdma-netns-chained-entry.json"
CALICO = """{
  "name": "k8s-pod-network",
  "cniVersion": "0.3.1",
  "plugins": [
    {
      "type": "calico",
      "datastore_type": "kubernetes",
      "ipam": {"type": "calico-ipam"},
      "policy": {"type": "k8s"}
    },
    {
      "type": "portmap",
      "snat": true,
      "capabilities": {"portMappings": true}
    }
  ]
}
"""


def test_chain_into_primary_idempotent_off_and_uninstall_byte_for_byte(tmp_path):
    root = tmp_path / "node"
    conf_dir = root / "etc/cni/net.d"
    conf_dir.mkdir(parents=True)
    primary = conf_dir / "10-calico.conflist"
    primary.write_text(CALICO)
    primary.chmod(0o600)
    original_tree = tree(root)

    out = install("--root", str(root), "--chain-into-primary", str(ENTRY))
    plugins = json.loads(primary.read_text())["plugins"]
    assert [p["type"] for p in plugins] == ["calico", "portmap", "rdma-netns"]
    assert plugins[-1] == json.loads(ENTRY.read_text())
    assert oct(primary.stat().st_mode & 0o777) == oct(0o600), "the primary keeps its mode"
    state = root / "var/lib/rdma-netns/cni-conf"
    assert state.stat().st_mode & 0o777 == 0o700 and (state / "original").read_text() == CALICO
    manifest = (root / "opt/rdma-netns/install-manifest").read_text()
    assert f"chain {conf_dir} {state}\n" in manifest and "10-calico" not in manifest
    assert "no primary CNI config" not in out.stdout

    # Again: nothing changes (not even the primary's inode).
    before, inode = tree(root), primary.stat().st_ino
    install("--root", str(root), "--chain-into-primary", str(ENTRY))
    assert tree(root) == before and primary.stat().st_ino == inode

    # Off: the device plugin stays, the entry goes, the primary is byte-for-byte Calico's.
    install("--root", str(root), "--rdma-pods", "off")
    assert primary.read_text() == CALICO
    assert os.access(root / "opt/cni/bin/rdma-netns", os.X_OK)
    assert "chain " not in (root / "opt/rdma-netns/install-manifest").read_text()

    # On again, then uninstall: everything as it was before the first install.
    install("--root", str(root), "--chain-into-primary", str(ENTRY), "--rdma-pods", "on")
    assert json.loads(primary.read_text())["plugins"][-1]["type"] == "rdma-netns"
    install("--root", str(root), "--uninstall")
    assert primary.read_text() == CALICO and primary.stat().st_mode & 0o777 == 0o600
    assert tree(root) == original_tree


def test_chain_with_no_primary_yet_says_so_and_off_removes_a_standalone_conflist(tmp_path):
    root = tmp_path / "node"
    (root / "etc/cni/net.d").mkdir(parents=True)
    out = install("--root", str(root), "--chain-into-primary", str(ENTRY), "--conflist", str(CONFLIST))
    assert "no primary CNI config" in out.stdout
    standalone = root / "etc/cni/net.d" / CONFLIST.name
    assert standalone.read_bytes() == CONFLIST.read_bytes(), "our own file is never taken as the primary"
    install("--root", str(root), "--rdma-pods", "off")
    assert not standalone.exists() and list((root / "etc/cni/net.d").iterdir()) == []
    install("--root", str(root), "--uninstall")
    assert tree(root) == {"etc": "dir", "etc/cni": "dir", "etc/cni/net.d": "dir"}


def test_rdma_pods_arguments_are_checked(tmp_path):
    out = install("--root", str(tmp_path), "--rdma-pods", "maybe", check=False)
    assert out.returncode == 1 and "on or off" in out.stderr
    out = install("--root", str(tmp_path), "--rdma-pods", "on", check=False)
    assert out.returncode == 1 and "--chain-into-primary" in out.stderr
    out = install("--root", str(tmp_path), "--rdma-pods", "off", "--conflist", str(CONFLIST), check=False)
    assert out.returncode == 1 and "installs no network config" in out.stderr
    out = install("--root", str(tmp_path), "--chain-into-primary", str(tmp_path / "none.json"), check=False)
    assert out.returncode == 1 and "does not exist" in out.stderr
    assert list(tmp_path.iterdir()) == []
