"""Issue 16, point 3: what the plugin keeps on disk after DEL expires by itself (containerd 1.6
never sends GC), and DEL's fallback config for a config ADD would refuse."""

from __future__ import annotations

import os
import time

import pytest

from rdma_netns import state
from rdma_netns.config import loader
from rdma_netns.spec.errors import INCOMPATIBLE_VERSION, INVALID_CONFIG, CniError


def conf(state_dir: str, n: int) -> dict:
    return {"cniVersion": "1.0.0", "name": "net", "type": "rdma-netns", "mode": "shared", "stateDir": state_dir,
            "gidWaitMs": n, "pairing": False, "ipam": {"type": "host-local", "ranges": [[{"subnet": "fd00:1::/64"}]]}}


def test_verified_config_cache_keeps_the_newest(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "CACHE_KEEP", 5)
    cache = tmp_path / loader.CACHE_FOLDER
    for n in range(12):
        loader.load(conf(str(tmp_path), n))
        time.sleep(0.01)  # distinct mtimes
    files = list(cache.glob("*.json"))
    assert len(files) == 5
    # The newest config is still a cache hit (no re-validation): its file is among those kept.
    newest = max(files, key=lambda p: p.stat().st_mtime)
    mtime = newest.stat().st_mtime
    loader.load(conf(str(tmp_path), 11))
    assert newest.stat().st_mtime == mtime and len(list(cache.glob("*.json"))) == 5


def test_default_cache_bound_is_small():
    assert 8 <= loader.CACHE_KEEP <= 256


def mark(store: state.StateStore, n: int, age: float) -> None:
    store.mark_released(f"c{n}", "eth0")
    path = store._released_path(f"c{n}", "eth0")
    past = time.time() - age
    os.utime(path, (past, past))


def test_released_markers_expire_by_age_and_by_count(tmp_path, monkeypatch):
    monkeypatch.setattr(state, "RELEASED_KEEP", 50)
    store = state.StateStore(str(tmp_path), "net")
    store.prepare()
    for n in range(40):  # older than the TTL
        mark(store, n, state.RELEASED_TTL + 60)
    for n in range(40, 140):  # within the TTL, oldest first
        mark(store, n, 1000 - n)
    stamp = tmp_path / "net" / "released" / ".swept"
    os.utime(stamp, (0, 0))  # the last sweep was long ago
    store.mark_released("new", "eth0")
    left = {c for c, _ in store.released()}
    assert len(left) == 50
    assert "new" in left and "c139" in left and "c40" not in left and "c0" not in left


def test_released_sweep_runs_at_most_once_a_minute(tmp_path, monkeypatch):
    monkeypatch.setattr(state, "RELEASED_KEEP", 3)
    store = state.StateStore(str(tmp_path), "net")
    store.prepare()
    for n in range(10):
        store.mark_released(f"c{n}", "eth0")
    # The first mark swept (nothing to drop); the next nine came within the minute.
    assert len(store.released()) == 10
    os.utime(tmp_path / "net" / "released" / ".swept", (0, 0))
    store.mark_released("c10", "eth0")
    assert len(store.released()) == 3


def test_del_fallback_checks_only_name_and_state_dir(tmp_path):
    raw = dict(conf(str(tmp_path), 1), newKey=1, routeTableBase=-3)
    with pytest.raises(CniError) as exc:
        loader.load(raw)
    assert exc.value.code == INVALID_CONFIG
    cfg = loader.load_for_teardown(raw)
    assert cfg.refused and "newKey" in cfg.refused
    assert cfg.net.name == "net" and cfg.net.state_dir == str(tmp_path)
    assert cfg.net.route_table_base == 100 and cfg.net.lock_timeout == 10.0
    assert loader.load_for_teardown(conf(str(tmp_path), 1)).refused is None


@pytest.mark.parametrize("bad", [{"name": "../x"}, {"name": ".hidden"}, {"name": "a/b"}, {"name": 5},
                                 {"stateDir": "rel"}, {"stateDir": "/a/../b"}, {"stateDir": "/a\0b"}])
def test_del_fallback_refuses_what_would_leave_the_state_folder(tmp_path, bad):
    raw = dict(conf(str(tmp_path), 1), newKey=1, **bad)
    with pytest.raises(CniError) as exc:
        loader.load_for_teardown(raw)
    assert exc.value.code == INVALID_CONFIG and "DEL cannot find" in exc.value.msg


def test_del_fallback_keeps_the_version_check(tmp_path):
    with pytest.raises(CniError) as exc:
        loader.load_for_teardown(dict(conf(str(tmp_path), 1), cniVersion="9.9.9", newKey=1))
    assert exc.value.code == INCOMPATIBLE_VERSION


def test_model_defaults_are_the_teardown_defaults(tmp_path):
    net = loader.load(conf(str(tmp_path), 1)).net.source
    for key in ("routeTableBase", "rulePriorityBase", "ipamTimeoutSeconds", "lockTimeoutSeconds"):
        assert net[key] == loader.TEARDOWN_DEFAULTS[key]


def test_repeated_del_with_a_refused_config_loads_neither_model_nor_plugin(tmp_path):
    """The released/ fast path runs before validation: a repeat costs a marker lookup only."""
    import json
    import subprocess
    import sys

    (tmp_path / "net" / "released").mkdir(parents=True)
    (tmp_path / "net" / "released" / "c1:eth0").touch()
    (tmp_path / "locks").mkdir()  # as the first DEL left them
    raw = dict(conf(str(tmp_path), 1), newKey=1)
    script = (
        "import json, sys\n"
        "from rdma_netns import entry\n"
        "rc = entry.run_cni({'CNI_COMMAND': 'DEL', 'CNI_CONTAINERID': 'c1', 'CNI_IFNAME': 'eth0', 'CNI_NETNS': '',"
        " 'CNI_PATH': '/nonexistent'}, sys.argv[1].encode())\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('pydantic', 'ipaddress', 'subprocess')"
        " or m.startswith('rdma_netns.commands') or m == 'rdma_netns.config.model']\n"
        "print(json.dumps({'rc': rc, 'heavy': heavy}))\n")
    out = subprocess.run([sys.executable, "-I", "-c", script, json.dumps(raw)], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    assert json.loads(out) == {"rc": 0, "heavy": []}
