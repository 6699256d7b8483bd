"""Paths a network config names are refused, not adopted (issue 36, item 3).

A config is not always written by root's equals (a Multus NetworkAttachmentDefinition, a ConfigMap
an operator edits), yet the plugin runs as root. So stateDir, podInfoDir, cdiSpecDir and eventsFifo
are used only where nobody but root can change them (cni/rdma_netns/util/trusted_paths.py,
docs/security.md "Paths a config names"); a refused one is a code-7 error naming the key, and
nothing on the disk changes: no folder made, no mode changed, no file opened.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from tests.conftest import plugin_path

pytestmark = pytest.mark.netns

NOBODY = 65534


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def folder(path: Path, mode: int, uid: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)
    os.chown(path, uid, 0)
    return path


def test_a_state_dir_with_dotdot_makes_nothing(node, tmp_path):
    """Validation comes first: a refused `.../a/../b` used to make b/verified-configs and b/locks
    (the cache-fill lock made its folders before the model ran)."""
    pod = node.pod()
    (tmp_path / "a").mkdir()
    err = node.cni("ADD", node.conf(stateDir=f"{tmp_path}/a/../b"), pod).error(7)
    assert "stateDir" in err["msg"]
    for command in ("CHECK", "DEL", "STATUS", "GC"):
        node.cni(command, node.conf(stateDir=f"{tmp_path}/a/../b"), pod)
    assert not (tmp_path / "b").exists(), sorted(p.name for p in (tmp_path / "b").iterdir())


def test_an_otherwise_refused_config_makes_no_folder(node, tmp_path):
    pod = node.pod()
    state = tmp_path / "fresh-state"
    node.cni("ADD", node.conf(stateDir=str(state), mode="turbo"), pod).error(7)
    node.cni("CHECK", node.conf(stateDir=str(state), mode="turbo"), pod).error(7)
    assert not state.exists()


@pytest.mark.parametrize("mode,uid,why", [
    (0o1777, 0, "sticky"),            # /tmp's kind: a 1777 folder used to become drwx------
    (0o777, 0, "writable"),
    (0o770, 0, "writable"),
    (0o700, NOBODY, "uid 65534"),     # somebody else's folder
])
def test_a_state_dir_others_can_change_is_refused_and_left_alone(node, tmp_path, mode, uid, why):
    pod = node.pod()
    shared = folder(tmp_path / "shared", mode, uid)
    conf = node.conf(stateDir=str(shared))
    err = node.cni("ADD", conf, pod).error(7)
    assert "stateDir" in err["msg"] and why in err["msg"], err
    assert mode_of(shared) == mode and os.lstat(shared).st_uid == uid, "a refused folder keeps its mode and owner"
    assert list(shared.iterdir()) == [], "nothing is made in a refused folder"
    assert set(node.links(pod)) == {"lo"}
    node.cni("DEL", conf, pod).error(7)  # DEL cannot trust state kept there either (the '..' rule's code)
    assert list(shared.iterdir()) == []


def test_a_state_dir_below_a_folder_others_can_write_is_refused(node, tmp_path):
    """Whoever can write the parent can swap the folder for another between two calls."""
    pod = node.pod()
    open_parent = folder(tmp_path / "open", 0o777)
    err = node.cni("ADD", node.conf(stateDir=str(open_parent / "state")), pod).error(7)
    assert "stateDir" in err["msg"] and str(open_parent) in err["msg"]
    assert list(open_parent.iterdir()) == []


def test_a_state_dir_below_a_sticky_folder_is_made_private(node, tmp_path):
    """The /tmp case: others may add entries to a sticky folder but not move root's, so a folder
    the plugin makes there is safe; the sticky folder itself is left as it is."""
    pod = node.pod()
    sticky = folder(tmp_path / "tmp", 0o1777)
    state = sticky / "state"
    conf = node.conf(stateDir=str(state))
    node.cni("ADD", conf, pod).ok()
    node.cni("DEL", conf, pod).ok()
    assert mode_of(sticky) == 0o1777
    assert mode_of(state) == 0o700 and mode_of(state / "rdmanet") == 0o700 and mode_of(state / "locks") == 0o700


def test_an_existing_state_dir_keeps_its_mode(node, tmp_path):
    """Never chmod a folder the plugin did not make: an admin's 0755 folder (kubelet's
    DirectoryOrCreate makes them so) stays 0755; what the plugin makes in it is 0700."""
    pod = node.pod()
    state = folder(tmp_path / "admins", 0o755)
    conf = node.conf(stateDir=str(state))
    node.cni("ADD", conf, pod).ok()
    assert mode_of(state) == 0o755
    assert mode_of(state / "rdmanet") == 0o700
    assert stat.S_IMODE(os.stat(state / "rdmanet" / "c1:net1.json").st_mode) == 0o600
    node.cni("DEL", conf, pod).ok()


def test_a_state_dir_that_is_a_symlink_is_refused(node, tmp_path):
    pod = node.pod()
    real = folder(tmp_path / "real", 0o700)
    (tmp_path / "link").symlink_to(real)
    err = node.cni("ADD", node.conf(stateDir=str(tmp_path / "link")), pod).error(7)
    assert "stateDir" in err["msg"] and "symlink" in err["msg"]
    assert list(real.iterdir()) == []


@pytest.mark.parametrize("key", ["podInfoDir", "cdiSpecDir"])
@pytest.mark.parametrize("mode,uid,why", [(0o777, 0, "writable"), (0o755, NOBODY, "uid 65534"),
                                          (0o1777, 0, "sticky")])
def test_publish_folders_others_can_change_are_refused(node, tmp_path, key, mode, uid, why):
    pod = node.pod()
    target = folder(tmp_path / "publish", mode, uid)
    err = node.cni("ADD", node.conf(**{key: str(target)}), pod).error(7)
    assert key in err["msg"] and why in err["msg"], err
    assert list(target.iterdir()) == [] and mode_of(target) == mode
    assert set(node.links(pod)) == {"lo"} and node.allocations() == []


def strace_opens(tmp_path: Path) -> tuple[str, Path]:
    """A plugin wrapper that records every open of the plugin process under strace."""
    log = tmp_path / "strace.log"
    wrapper = tmp_path / "traced-rdma-netns"
    wrapper.write_text(f"#!/bin/sh\nexec strace -f -qq -e trace=open,openat -o {log} {plugin_path()} \"$@\"\n")
    wrapper.chmod(0o755)
    return str(wrapper), log


@pytest.mark.parametrize("refused", [False, True], ids=["valid-config", "refused-config"])
def test_an_events_fifo_that_is_a_device_is_never_opened(node, tmp_path, refused):
    """A /dev/watchdog there would reboot the node: the path is looked at (lstat), not opened.
    Here a char device 1:3 (what /dev/null is) stands in for it."""
    if not subprocess.run(["which", "strace"], capture_output=True).stdout:
        pytest.fail("strace is missing; scripts/setup.sh installs it")
    pod = node.pod()
    device = tmp_path / "dev" / "watchdog"
    device.parent.mkdir()
    os.mknod(device, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    plugin, log = strace_opens(tmp_path)
    conf = node.conf(eventsFifo=str(device))
    if refused:
        conf["mode"] = "turbo"
    err = node.cni("ADD", conf, pod, plugin=plugin).error(7)
    assert ("mode" if refused else "eventsFifo") in err["msg"], err
    if not refused:
        assert "character device" in err["msg"] and "FIFO" in err["msg"], err
    opened = [line for line in log.read_text().splitlines() if str(device) in line and "open" in line]
    assert opened == [], opened


def test_an_events_fifo_not_made_by_the_daemon_gets_no_event(node, tmp_path):
    """A FIFO somebody else made (not root's 0600 one) is refused, and no event is written to it."""
    pod = node.pod()
    fifo = tmp_path / "events"
    os.mkfifo(fifo, 0o666)
    os.chmod(fifo, 0o666)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        err = node.cni("ADD", node.conf(eventsFifo=str(fifo)), pod).error(7)
        assert "eventsFifo" in err["msg"] and "666" in err["msg"], err
        assert os.read(reader, 4096) == b"", "no writer ever opened it"
    finally:
        os.close(reader)


def test_the_daemons_fifo_gets_the_event(node, tmp_path):
    """The FIFO as rdma-netns-dp makes it (root, 0600, in a 0700 folder) still gets each call's line."""
    pod = node.pod()
    folder(tmp_path / "run", 0o700)
    fifo = tmp_path / "run" / "cni-events"
    os.mkfifo(fifo, 0o600)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        conf = node.conf(eventsFifo=str(fifo))
        node.cni("ADD", conf, pod).ok()
        node.cni("DEL", conf, pod).ok()
        lines = [json.loads(line) for line in os.read(reader, 65536).splitlines()]
        assert [(e["cmd"], e["code"]) for e in lines] == [("ADD", 0), ("DEL", 0)], lines
    finally:
        os.close(reader)
