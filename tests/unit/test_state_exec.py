"""State store, locks and the plugin runner, on real files and processes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time

import pytest

from rdma_netns.rails import execplugin
from rdma_netns.spec.errors import CniError
from rdma_netns.state import AttachmentState, StateStore


def test_state_round_trip_and_permissions(tmp_path):
    store = StateStore(str(tmp_path / "s"), "net")
    store.prepare()
    record = AttachmentState(mode="shared", link="macvlan", container_id="cid", ifname="eth0", netns="/n",
                             network="net", rails=[{"ifname": "eth0"}], teardown={"routeTableBase": 100})
    store.save("cid", "eth0", record)
    assert store.load("cid", "eth0").to_json() == record.to_json() == {
        "format": 2, "phase": "adding", "mode": "shared", "link": "macvlan", "containerID": "cid", "ifname": "eth0",
        "netns": "/n", "network": "net", "teardown": {"routeTableBase": 100}, "rails": [{"ifname": "eth0"}]}
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
    assert err.value.code == 7 and "symlink" in err.value.msg


def test_loose_permissions_are_refused_not_tightened(tmp_path):
    """A folder others can write is refused (code 7) and keeps its mode: the plugin never changes
    a folder it did not make (util/trusted_paths.py)."""
    (tmp_path / "s").mkdir(mode=0o777)
    os.chmod(tmp_path / "s", 0o777)
    with pytest.raises(CniError) as err:
        StateStore(str(tmp_path / "s"), "net").prepare()
    assert err.value.code == 7 and "writable by group or others" in err.value.msg
    assert stat.S_IMODE((tmp_path / "s").stat().st_mode) == 0o777
    assert list((tmp_path / "s").iterdir()) == []


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
        with store.locked("other", "eth0", 0.3) as waited:  # another attachment is not blocked (another file)
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


def test_run_many_runs_at_once_and_keeps_each_outcome(tmp_path):
    """A pod's rails' IPAM delegates: they run together (0.5 s each, about 0.5 s for all), each
    outcome in its place: a result, a failure, a timeout, one that could not be started."""
    env = {"PATH": "/usr/bin:/bin"}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    sleepy = script(tmp_path / "a", 'cat >/dev/null; sleep 0.5; echo "$CNI_IFNAME"\n')
    failing = script(tmp_path / "b", "cat >/dev/null; echo nope >&2; exit 4\n")
    hanging = script(tmp_path / "c", "sleep 30\n")
    calls = [(sleepy, b"x" * 200_000, dict(env, CNI_IFNAME=f"rdma{i}")) for i in range(6)]
    calls += [(failing, b"{}", env), (hanging, b"{}", env), (str(tmp_path / "missing"), b"{}", env)]
    started = time.monotonic()
    outcomes = execplugin.run_many(calls, timeout=2.0)
    took = time.monotonic() - started
    assert [o.stdout for o in outcomes[:6]] == [f"rdma{i}\n".encode() for i in range(6)]
    assert outcomes[6].returncode == 4 and outcomes[6].stderr == b"nope\n"
    assert isinstance(outcomes[7], execplugin.TimedOut) and isinstance(outcomes[8], OSError)
    assert took < 4, f"{took:.1f} s: the hanging one is killed at the shared deadline"
    fast = execplugin.run_many(calls[:6], timeout=10)
    assert all(o.returncode == 0 for o in fast)


def test_run_many_calls_its_hook_once_every_input_is_written(tmp_path):
    seen: list[int] = []
    path = script(tmp_path, "cat | wc -c\n")
    outcomes = execplugin.run_many([(path, b"y" * 300_000, {"PATH": "/usr/bin:/bin"}),
                                    (path, b"", {"PATH": "/usr/bin:/bin"})], 10,
                                   spawned_hook=lambda: seen.append(len(seen)))
    assert seen == [0]
    assert [int(o.stdout) for o in outcomes] == [300_000, 0]


# ---------------------------------------------------------------- per-attachment locks (issue 15)


def test_unrelated_attachments_never_wait_for_each_other(tmp_path):
    """64 attachments with random container IDs (as runtimes make them) hold their locks at once:
    none waits for another (the 256 crc32 stripes this replaces put ~8 pairs on one stripe)."""
    import secrets
    import threading

    store = StateStore(str(tmp_path / "s"), "net")
    store.prepare()
    ids = [secrets.token_hex(32) for _ in range(64)]
    barrier = threading.Barrier(len(ids))
    waited: dict[str, float] = {}

    def hold(cid: str) -> None:
        with store.locked(cid, "eth0", 5) as w:
            waited[cid] = w
            barrier.wait(timeout=10)  # every lock is held at the same moment

    threads = [threading.Thread(target=hold, args=(cid,)) for cid in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(waited) == 64 and max(waited.values()) < 0.05, sorted(waited.values())[-3:]
    assert os.listdir(tmp_path / "s" / "locks") == []  # each lock file went with its release


def test_lock_file_removal_never_lets_two_holders_in(tmp_path):
    """Many callers of one attachment, each releasing (and so unlinking) the lock: the inode check
    after flock keeps the critical section exclusive."""
    import threading

    store = StateStore(str(tmp_path / "s"), "net")
    store.prepare()
    inside = [0]
    worst = [0]
    guard = threading.Lock()

    def work() -> None:
        for _ in range(30):
            with store.locked("same", "eth0", 10):
                with guard:
                    inside[0] += 1
                    worst[0] = max(worst[0], inside[0])
                time.sleep(0.0005)
                with guard:
                    inside[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert worst[0] == 1
    assert os.listdir(tmp_path / "s" / "locks") == []


def test_gc_sweeps_lock_files_left_by_killed_calls(tmp_path):
    store = StateStore(str(tmp_path / "s"), "net")
    store.prepare()
    locks = tmp_path / "s" / "locks"
    (locks / "dead:eth0").touch()  # a call killed while holding: the kernel dropped its flock
    (locks / "verified-configs.fill").touch()  # the config cache's fill lock is not an attachment's
    with store.locked("busy", "eth0", 1):
        assert store.sweep_locks() == 1
        assert sorted(os.listdir(locks)) == ["busy:eth0", "verified-configs.fill"]
    assert os.listdir(locks) == ["verified-configs.fill"]


def test_state_format_is_checked_on_read(tmp_path):
    store = StateStore(str(tmp_path / "s"), "net")
    store.prepare()
    path = tmp_path / "s" / "net" / "c:eth0.json"
    base = {"phase": "ready", "mode": "shared", "link": "macvlan", "containerID": "c", "ifname": "eth0",
            "netns": "", "network": "net", "rails": [{"ifname": "eth0", "x": 1}]}
    path.write_text(json.dumps(base))  # format 1 (0.1.0 wrote no teardown)
    assert store.load("c", "eth0").unreadable() is None
    newer = dict(base, format=7, futureField={"a": 1})  # a newer additive format: readable, kept whole
    path.write_text(json.dumps(newer))
    state = store.load("c", "eth0")
    assert state.unreadable() is None and state.to_json()["futureField"] == {"a": 1}
    for bad in (dict(base, formatMajor=2), dict(base, format="2.0"), dict(base, format=True)):
        path.write_text(json.dumps(bad))
        state = store.load("c", "eth0")
        assert state.unreadable() and state.rails == [{"ifname": "eth0", "x": 1}]  # still usable by DEL
    path.write_text(json.dumps(dict(base, rails="nonsense", netns=5)))
    state = store.load("c", "eth0")
    assert state.rails == [] and state.netns == ""
