"""Things that vanish or break under the plugin: the pod's namespace, a rail netdev, the state
folder (read-only, full), the IPAM plugin (missing, hanging, failing, garbage, killed).

What tests/netns/test_errors.py and test_add_del.py already cover is not repeated here (one-rail
DEL after the namespace died, a missing or down rail before a one-rail ADD, a missing IPAM
plugin for a one-rail ADD, IPAM exhaustion on the second rail).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.faults.fakeipam import FakeIpam, use_fake
from tests.faults.helpers import assert_same, ipam_leases, rail_links, snapshot, state_files
from tests.netns.conftest import ip, ipj

pytestmark = pytest.mark.netns


def host_link(node, name: str) -> dict | None:
    return next((lk for lk in ipj("-n", node.name, "link") if lk["ifname"] == name), None)


def without(view: dict, names: set[str]) -> dict:
    """A snapshot with the given node links (and everything on them) left out."""
    node = view["node"]
    routes = {fam: [r for r in rs if r.get("dev") not in names] for fam, rs in node["routes"].items()}
    return dict(view, node=dict(node, links=[lk for lk in node["links"] if lk[0] not in names],
                                addrs=[a for a in node["addrs"] if a[0] not in names], routes=routes))


# ------------------------------------------------------------------ the pod namespace


def test_pod_namespace_gone_two_rails_check_then_del(node):
    pod = node.pod()
    conf = node.conf(rails=2)
    node.cni("VERSION", conf).ok()
    before = snapshot(node)
    node.cni("ADD", conf, pod).ok()
    ip("netns", "del", pod)
    node.pods.remove(pod)
    err = node.cni("CHECK", conf, pod).error(4)
    assert "does not exist" in err["msg"]
    node.cni("DEL", conf, pod).ok()
    assert_same(node, before)
    node.cni("DEL", conf, pod).ok()


def test_pod_namespace_gone_exclusive_two_rails_gc(node):
    """Exclusive mode, no DEL ever comes: GC cleans the state and leases (the veth NICs died
    with the namespace; physical NICs would come back: the real-kernel suite covers that)."""
    pod = node.pod()
    conf = node.conf(rails=2, mode="exclusive")
    node.cni("ADD", conf, pod).ok()
    ip("netns", "del", pod)
    node.pods.remove(pod)
    node.cni("GC", dict(conf, **{"cni.dev/valid-attachments": []})).ok()
    assert ipam_leases(node) == {} and state_files(node) == {}


# ------------------------------------------------------------------ rail netdevs


def test_rail_netdev_deleted_between_add_and_del(node):
    """The macvlan dies with its lower device; DEL still releases the leases and the rules."""
    pod = node.pod()
    conf = node.conf(rails=2)
    node.cni("VERSION", conf).ok()
    before = snapshot(node)
    node.cni("ADD", conf, pod).ok()
    ip("-n", node.name, "link", "del", "rail1")
    assert rail_links(node, pod) == {"rdma0"}
    node.cni("DEL", conf, pod).ok()
    assert_same(node, without(before, {"rail1", "rail1p"}))
    assert rail_links(node, pod) == set()


@pytest.mark.parametrize("how", ["host-rail-deleted", "pod-link-deleted"])
def test_rail_gone_before_del_leaves_no_rule_in_the_pod(node, how):
    pod = node.pod()
    conf = node.conf(rails=2)
    node.cni("VERSION", conf).ok()
    before = snapshot(node, [pod])
    node.cni("ADD", conf, pod).ok()
    if how == "host-rail-deleted":
        ip("-n", node.name, "link", "del", "rail1")
    else:
        ip("-n", pod, "link", "del", "rdma1")
    node.cni("DEL", conf, pod).ok()
    if how == "host-rail-deleted":
        before = without(before, {"rail1", "rail1p"})
    assert_same(node, before, [pod], timeout=0.5)


@pytest.mark.parametrize("mode", ["shared", "exclusive"])
def test_rail_set_down_between_add_and_del(node, mode):
    """Shared: the host's rail goes down. Exclusive: the pod sets the NIC it was given down (and
    renames it): DEL finds it by MAC and restores its host name and up state."""
    pod = node.pod()
    conf = node.conf(rails=2, mode=mode)
    node.cni("VERSION", conf).ok()
    before = snapshot(node, [pod])
    node.cni("ADD", conf, pod).ok()
    if mode == "shared":
        ip("-n", node.name, "link", "set", "rail0", "down")
    else:
        ip("-n", pod, "link", "set", "rdma0", "down")
        ip("-n", pod, "link", "set", "rdma1", "down")
        ip("-n", pod, "link", "set", "rdma1", "name", "renamed")
    node.cni("DEL", conf, pod).ok()
    if mode == "shared":
        ip("-n", node.name, "link", "set", "rail0", "up")
    assert_same(node, before, [pod])


@pytest.mark.parametrize("mode", ["shared", "exclusive"])
def test_second_rail_missing_before_add(node, mode):
    pod = node.pod()
    conf = node.conf(rails=2, mode=mode)
    conf["rails"][1]["netdev"] = "gone0"
    node.cni("VERSION", conf).ok()
    before = snapshot(node, [pod])
    err = node.cni("ADD", conf, pod).error(101)
    assert "gone0" in err["msg"]
    assert_same(node, before, [pod])


def test_second_rail_down_before_shared_add(node):
    pod = node.pod()
    conf = node.conf(rails=2)
    ip("-n", node.name, "link", "set", "rail1", "down")
    node.cni("VERSION", conf).ok()
    before = snapshot(node, [pod])
    err = node.cni("ADD", conf, pod).error(101)
    assert "rail1" in err["msg"] and "down" in err["msg"]
    assert_same(node, before, [pod])


@pytest.mark.xfail(strict=True, reason="product bug: exclusive DEL forgets a NIC whose MAC the pod changed "
                   "(DEL succeeds, deletes the state, the NIC stays in the pod)")
def test_exclusive_nic_with_changed_mac_is_not_forgotten(node):
    """A pod with CAP_NET_ADMIN changes the MAC of the NIC it was given. DEL must either bring
    the NIC home or fail and keep the state for a retry, never succeed and forget it."""
    pod = node.pod()
    conf = node.conf(mode="exclusive")
    mac = host_link(node, "rail0")["address"]
    node.cni("ADD", conf, pod).ok()
    ip("-n", pod, "link", "set", "net1", "address", "02:11:22:33:44:55")
    result = node.cni("DEL", conf, pod)
    home = host_link(node, "rail0")
    if result.code == 0:
        assert home is not None, f"DEL succeeded but rail0 ({mac}) is still in the pod: {result.stderr}"
    else:
        assert state_files(node), "DEL failed and dropped the state: nobody can retry"


# ------------------------------------------------------------------ the state folder


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


def umount(path: str) -> None:
    subprocess.run(["umount", path], check=False, capture_output=True)


def test_state_folder_chmod_0500_still_works_and_keeps_its_mode(node):
    """As root, mode bits do not make a folder unwritable (CAP_DAC_OVERRIDE): the plugin works,
    and leaves the modes as it found them (it never changes a folder's mode: util/trusted_paths.py)."""
    pod = node.pod()
    conf = node.conf()
    node.cni("ADD", conf, pod).ok()
    node.cni("DEL", conf, pod).ok()
    for folder in (node.state_dir, f"{node.state_dir}/rdmanet", f"{node.state_dir}/locks"):
        os.chmod(folder, 0o500)
    node.cni("ADD", conf, pod).ok()
    assert oct(os.stat(f"{node.state_dir}/rdmanet").st_mode & 0o777) == "0o500"
    node.cni("DEL", conf, pod).ok()


def test_state_folder_read_only_fresh(node, tmp_path):
    """A read-only state folder the plugin never used: code 5 before any change."""
    pod = node.pod()
    ro = tmp_path / "ro-state"
    ro.mkdir()
    conf = node.conf(stateDir=str(ro))
    mount("--bind", str(ro), str(ro))
    try:
        mount("-o", "remount,ro,bind", str(ro))
        before = snapshot(node, [pod])
        err = node.cni("ADD", conf, pod).error(5)
        assert "Read-only" in err["msg"]
        assert_same(node, before, [pod])
        node.cni("DEL", conf, pod).error(5)
    finally:
        umount(str(ro))


def test_state_folder_read_only_after_use(node):
    """A state folder the plugin used before (folders and lock stripes exist) turned read-only."""
    pod = node.pod()
    conf = node.conf()
    node.cni("ADD", conf, pod).ok()
    node.cni("DEL", conf, pod).ok()
    before = snapshot(node, [pod])
    mount("--bind", node.state_dir, node.state_dir)
    try:
        mount("-o", "remount,ro,bind", node.state_dir)
        result = node.cni("ADD", conf, pod)
        assert_same(node, before, [pod])
        result.error(5)
    finally:
        umount(node.state_dir)


def fill(folder: Path, leave_pages: int = 0) -> None:
    """Fill a tmpfs up, then free `leave_pages` pages again."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    if leave_pages:
        os.truncate(filler, (os.path.getsize(filler) // 4096 - leave_pages) * 4096)


@pytest.fixture
def tiny_state(node, tmp_path):
    folder = tmp_path / "tiny-state"
    folder.mkdir()
    mount("-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(folder))
    try:
        yield folder
    finally:
        umount(str(folder))


def test_state_folder_full(node, tiny_state):
    """No space at all: ADD fails with code 5 and changes nothing; DEL still works on a full
    folder (unlinking needs no space)."""
    pod = node.pod()
    conf = node.conf(stateDir=str(tiny_state))
    node.cni("ADD", conf, pod, container_id="warm").ok()  # folders, config cache and lock stripes
    node.cni("DEL", conf, pod, container_id="warm").ok()
    node.cni("ADD", conf, pod, container_id="kept").ok()
    fill(tiny_state)
    before = snapshot(node, [pod])
    err = node.cni("ADD", conf, pod).error(5)
    assert "No space" in err["msg"] or "space" in err["msg"].lower(), err
    assert_same(node, before, [pod])
    assert [p.name for p in (tiny_state / "rdmanet").iterdir() if p.name != "released"] == ["kept:net1.json"], \
        "no temp file left"
    node.cni("DEL", conf, pod, container_id="kept").ok()
    assert rail_links(node, pod) == set() and ipam_leases(node) == {}


def test_state_folder_full_at_the_final_save(node, tiny_state):
    """Room for the first state write but not the second: the failed ADD must still roll back."""
    pod = node.pod()
    conf = node.conf(rails=2, stateDir=str(tiny_state))
    node.cni("ADD", conf, pod).ok()  # warm: folders, cache, the lock stripe
    node.cni("DEL", conf, pod).ok()
    before = snapshot(node, [pod])
    fill(tiny_state, leave_pages=1)
    result = node.cni("ADD", conf, pod)
    result.error(5)
    assert_same(node, before, [pod])


# ------------------------------------------------------------------ IPAM


@pytest.fixture
def fake(tmp_path) -> FakeIpam:
    return FakeIpam(tmp_path)


def test_ipam_missing_for_the_second_rail_takes_nothing(node):
    pod = node.pod()
    conf = node.conf(rails=2)
    conf["rails"][1]["ipam"]["type"] = "no-such-ipam"
    node.cni("VERSION", conf).ok()
    before = snapshot(node, [pod])
    err = node.cni("ADD", conf, pod).error(105)
    assert "no-such-ipam" in err["msg"]
    assert_same(node, before, [pod])


def test_ipam_hangs_on_add(node, fake):
    """A hanging IPAM ADD is killed after ipamTimeoutSeconds; the first rail's lease is released."""
    pod = node.pod()
    conf = use_fake(node, node.conf(rails=2, ipamTimeoutSeconds=1), rails=(1,))
    node.cni("VERSION", conf).ok()
    before = snapshot(node, [pod])
    fake.set("hang", "ADD")
    t0 = time.monotonic()
    err = node.cni("ADD", conf, pod, cni_path=fake.cni_path).error(105)
    took = time.monotonic() - t0
    assert "timed out" in err["msg"], err
    assert 1.0 <= took < 4.0, took
    assert_same(node, before, [pod])
    for pid, command, _ in fake.calls():
        assert not os.path.exists(f"/proc/{pid}") or command != "ADD", f"the hung IPAM {pid} is still running"


def test_ipam_hangs_on_add_and_del_keeps_the_state_for_a_later_del(node, fake):
    """When the rollback's IPAM DEL hangs too, ADD fails (105) after two time limits and keeps
    its state: the pod is clean, and the next DEL (IPAM healthy again) finishes the release."""
    pod = node.pod()
    conf = use_fake(node, node.conf(rails=2, ipamTimeoutSeconds=0.5), rails=(0, 1))
    node.cni("VERSION", conf).ok()
    before = snapshot(node, [pod])
    fake.set("hang", "ADD")
    fake.set("hang", "DEL")
    t0 = time.monotonic()
    err = node.cni("ADD", conf, pod, cni_path=fake.cni_path).error(105)
    assert time.monotonic() - t0 < 5
    assert "timed out" in err["msg"]
    assert rail_links(node, pod) == set()
    (state,) = state_files(node).values()
    assert json.loads(state)["phase"] == "adding"
    fake.clear()
    node.cni("DEL", conf, pod, cni_path=fake.cni_path).ok()
    assert_same(node, before, [pod])


@pytest.mark.parametrize("behaviour,words", [
    ("fail", "fake ipam says no (by request)"),
    ("garbage", "no JSON"),
    ("noip", "no IP address"),
    ("kill", "failed"),
])
def test_ipam_misbehaves_on_the_second_rail(node, fake, behaviour, words):
    pod = node.pod()
    conf = use_fake(node, node.conf(rails=2), rails=(0, 1))
    node.cni("VERSION", conf).ok()
    before = snapshot(node, [pod])
    fake.set(behaviour, "ADD", ifname="rdma1")  # the first rail's IPAM call is fine
    err = node.cni("ADD", conf, pod, cni_path=fake.cni_path).error(105)
    assert words in err["msg"], err
    assert_same(node, before, [pod])
    assert [c for _, c, i in fake.calls() if i == "rdma0"] == ["ADD", "DEL"], "rail 0's lease was given back"


def test_ipam_del_fails_during_del_keeps_state_then_retry(node, fake):
    """DEL removes the pod's links, but an IPAM DEL failure keeps the state (an error, 105: IPAM
    failed, the kernel did its part; issue 15): the runtime's retry finishes the job."""
    pod = node.pod()
    conf = use_fake(node, node.conf(rails=2), rails=(0, 1))
    node.cni("VERSION", conf).ok()
    before = snapshot(node, [pod])
    node.cni("ADD", conf, pod, cni_path=fake.cni_path).ok()
    fake.set("fail", "DEL")
    err = node.cni("DEL", conf, pod, cni_path=fake.cni_path).error(105)
    assert "fake ipam says no" in err["msg"]
    assert rail_links(node, pod) == set()
    assert state_files(node), "the state stays for the retry"
    fake.clear()
    node.cni("DEL", conf, pod, cni_path=fake.cni_path).ok()
    assert_same(node, before, [pod])
