"""State store, locks and the plugin runner, on real files and processes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest

from rdma_netns import execplugin
from rdma_netns.spec.errors import CniError
from rdma_netns.state import StateStore


def test_state_round_trip_and_permissions(tmp_path):
    store = StateStore(str(tmp_path / "s"), "net")
    store.prepare()
    store.save("cid", "eth0", {"a": 1})
    assert store.load("cid", "eth0") == {"a": 1}
    assert store.attachments() == [("cid", "eth0")]
    path = tmp_path / "s" / "net" / "cid:eth0.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    store.delete("cid", "eth0")
    store.delete("cid", "eth0")
    assert store.load("cid", "eth0") is None and store.attachments() == []


def test_state_never_follows_symlinks(tmp_path):
    store = StateStore(str(tmp_path / "s"), "net")
    store.prepare()
    secret = tmp_path / "secret.json"
    secret.write_text('{"stolen": true}')
    os.symlink(secret, tmp_path / "s" / "net" / "cid:eth0.json")
    assert store.load("cid", "eth0") is None


def test_state_dir_that_is_a_symlink_is_refused(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "s")
    with pytest.raises(CniError) as err:
        StateStore(str(tmp_path / "s"), "net").prepare()
    assert err.value.code == 5


def test_loose_permissions_are_tightened(tmp_path):
    (tmp_path / "s").mkdir(mode=0o777)
    os.chmod(tmp_path / "s", 0o777)
    StateStore(str(tmp_path / "s"), "net").prepare()
    assert stat.S_IMODE((tmp_path / "s").stat().st_mode) == 0o700


def test_lock_times_out_with_try_again_later(tmp_path):
    store = StateStore(str(tmp_path / "s"), "net")
    store.prepare()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; sys.path.insert(0, sys.argv[1]);"
        "from rdma_netns.state import StateStore;"
        "s = StateStore(sys.argv[2], 'net');"
        "l = s.locked('cid', 'eth0', 5); l.__enter__(); print('held', flush=True); time.sleep(30)"),
        os.path.dirname(os.path.dirname(execplugin.__file__)), str(tmp_path / "s")], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"held"
        start = time.monotonic()
        with pytest.raises(CniError) as err:
            with store.locked("cid", "eth0", 0.3):
                pass
        assert err.value.code == 11
        assert 0.25 < time.monotonic() - start < 2
        with store.locked("other", "eth0", 0.3) as waited:  # another attachment is not blocked (another stripe)
            assert waited < 0.3
    finally:
        holder.kill()
        holder.wait()
    with store.locked("cid", "eth0", 1) as waited:  # released when the holder died
        assert waited < 1


def script(tmp_path, body: str) -> str:
    path = tmp_path / "plugin"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_exec_passes_stdin_env_and_collects_output(tmp_path):
    path = script(tmp_path, 'cat; echo "$CNI_COMMAND" >&2; exit 3\n')
    big = b"x" * 300_000  # more than a pipe buffer both ways
    out = execplugin.run(path, big, {"CNI_COMMAND": "ADD", "PATH": "/usr/bin:/bin"}, timeout=10)
    assert out.returncode == 3 and out.stdout == big and out.stderr == b"ADD\n"


def test_exec_timeout_kills(tmp_path):
    path = script(tmp_path, "sleep 30\n")
    start = time.monotonic()
    with pytest.raises(execplugin.TimedOut):
        execplugin.run(path, b"{}", {"PATH": "/usr/bin:/bin"}, timeout=0.3)
    assert time.monotonic() - start < 5


def test_exec_of_a_plugin_that_ignores_stdin(tmp_path):
    path = script(tmp_path, "echo done\n")
    out = execplugin.run(path, b"y" * 200_000, {"PATH": "/usr/bin:/bin"}, timeout=10)
    assert out.returncode == 0 and out.stdout == b"done\n"
