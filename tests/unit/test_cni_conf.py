"""`rdma-netns cni-conf`: chaining into the node's primary CNI config, the istio-cni way.

Real files in temp dirs and the installed executable (.venv/bin/rdma-netns): insert into primaries
written the way Calico, Flannel and the bridge example write them, idempotence, byte-for-byte
removal, a `.conf` primary, a primary CNI that rewrites its file while `watch` runs, SIGTERM,
invalid JSON left alone, file modes, and that no half-written config is ever visible to a runtime.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, installed_executable

ENTRY = REPO / "conf" / "rdma-netns-chained-entry.json"
LOADED = (".conf", ".conflist", ".json")

CALICO = """{
    "name": "k8s-pod-network",
    "cniVersion": "0.3.1",
    "plugins": [
        {
            "type": "calico",
            "log_level": "info",
            "datastore_type": "kubernetes",
            "nodename": "gpu-node-7",
            "mtu": 0,
            "ipam": {
                "type": "calico-ipam"
            },
            "policy": {
                "type": "k8s"
            },
            "kubernetes": {
                "kubeconfig": "/etc/cni/net.d/calico-kubeconfig"
            }
        },
        {
            "type": "portmap",
            "snat": true,
            "capabilities": {"portMappings": true}
        },
        {
            "type": "bandwidth",
            "capabilities": {"bandwidth": true}
        }
    ]
}"""

FLANNEL = """{
  "name": "cbr0",
  "cniVersion": "0.3.1",
  "plugins": [
    {
      "type": "flannel",
      "delegate": {
        "hairpinMode": true,
        "isDefaultGateway": true
      }
    },
    {
      "type": "portmap",
      "capabilities": {
        "portMappings": true
      }
    }
  ]
}
"""

BRIDGE = ('{"cniVersion":"1.0.0","name":"containerd-net","plugins":[{"type":"bridge","bridge":"cni0",'
          '"isGateway":true,"ipMasq":true,"promiscMode":true,"ipam":{"type":"host-local","ranges":'
          '[[{"subnet":"10.88.0.0/16"}],[{"subnet":"2001:4860:4860::/64"}]],"routes":[{"dst":"0.0.0.0/0"},'
          '{"dst":"::/0"}]}},{"type":"portmap","capabilities":{"portMappings":true}}]}\n')

SINGLE_CONF = """{
\t"cniVersion": "0.4.0",
\t"name": "mynet",
\t"type": "bridge",
\t"bridge": "cni0",
\t"isGateway": true,
\t"ipMasq": true,
\t"ipam": {
\t\t"type": "host-local",
\t\t"subnet": "10.22.0.0/16",
\t\t"routes": [{"dst": "0.0.0.0/0"}]
\t}
}
"""

SAMPLES = {"10-calico.conflist": CALICO, "10-flannel.conflist": FLANNEL, "10-containerd-net.conflist": BRIDGE}


def cli(*args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    proc = subprocess.run([installed_executable(), "cni-conf", *args], capture_output=True, text=True,
                          timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


class Node:
    """A conf dir and a state dir, and the cni-conf arguments that point at them."""

    def __init__(self, tmp_path: Path) -> None:
        self.conf = tmp_path / "net.d"
        self.conf.mkdir()
        self.state = tmp_path / "state" / "cni-conf"

    def args(self, *extra: str) -> list[str]:
        return ["--conf-dir", str(self.conf), "--state-dir", str(self.state), *extra]

    def insert(self, entry: Path = ENTRY, check: bool = True) -> subprocess.CompletedProcess:
        return cli("insert", *self.args("--entry", str(entry)), check=check)

    def remove(self) -> subprocess.CompletedProcess:
        return cli("remove", *self.args())

    def write_primary(self, name: str, text: str, mode: int = 0o644) -> Path:
        """As a CNI installer does it: a temp file, then rename."""
        path = self.conf / name
        tmp = self.conf / f".{name}.cni-tmp"
        tmp.write_text(text)
        tmp.chmod(mode)
        os.rename(tmp, path)
        return path

    def listing(self) -> list[str]:
        return sorted(os.listdir(self.conf))


def entry() -> dict:
    return json.loads(ENTRY.read_text())


def plugin_types(path: Path) -> list[str]:
    return [p["type"] for p in json.loads(path.read_text())["plugins"]]


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


# --- insert / remove ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(SAMPLES))
def test_insert_appends_last_and_remove_restores_byte_for_byte(node: Node, name: str):
    original = SAMPLES[name]
    primary = node.write_primary(name, original, mode=0o640)
    (node.conf / "99-rdma-netns.conflist").write_text((REPO / "conf/rdma-netns-shared-8rails.conflist").read_text())
    before = json.loads(original)

    out = node.insert()
    assert f"inserted the rdma-netns entry at the end of {name}" in out.stderr
    after = json.loads(primary.read_bytes())
    assert after["plugins"][:-1] == before["plugins"], "the primary's plugins are untouched"
    assert after["plugins"][-1] == entry()
    assert list(after) == list(before), "key order kept"
    assert {k: v for k, v in after.items() if k != "plugins"} == {k: v for k, v in before.items() if k != "plugins"}
    # Its formatting style is kept: indentation, compactness, trailing newline.
    text = primary.read_text()
    assert text.endswith("\n") == original.endswith("\n")
    if "\n" not in original.strip():
        assert "\n" not in text.strip() and '": ' not in text
    else:
        indent = original.splitlines()[1][: -len(original.splitlines()[1].lstrip())]
        assert text.splitlines()[1].startswith(indent) and not text.splitlines()[1].startswith(indent + " ")
    assert stat.S_IMODE(primary.stat().st_mode) == 0o640, "the file's mode is kept"
    # State: a private folder, private files.
    assert stat.S_IMODE(node.state.stat().st_mode) == 0o700
    files = list(node.state.iterdir())
    assert files and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert (node.state / "original").read_text() == original
    assert node.listing() == sorted([name, "99-rdma-netns.conflist"]), "no temp file left behind"

    out = node.remove()
    assert "restored" in out.stderr
    assert primary.read_text() == original, "byte for byte as the primary CNI wrote it"
    assert stat.S_IMODE(primary.stat().st_mode) == 0o640
    assert list(node.state.iterdir()) == [], "the state is cleaned"


def test_insert_is_idempotent_and_replaces_only_a_different_entry(node: Node, tmp_path: Path):
    primary = node.write_primary("10-flannel.conflist", FLANNEL)
    node.insert()
    first = primary.read_bytes()
    st = primary.stat()
    out = node.insert()
    assert "already" in out.stderr
    again = primary.stat()
    assert primary.read_bytes() == first and (again.st_ino, again.st_mtime_ns) == (st.st_ino, st.st_mtime_ns), \
        "an unchanged entry is not even rewritten"

    changed = tmp_path / "entry.json"
    changed.write_text(json.dumps(dict(entry(), podResourcesTimeoutMs=900)))
    out = node.insert(changed)
    assert "updated" in out.stderr
    doc = json.loads(primary.read_text())
    assert plugin_types(primary) == ["flannel", "portmap", "rdma-netns"], "replaced, not added twice"
    assert doc["plugins"][-1]["podResourcesTimeoutMs"] == 900
    node.remove()
    assert primary.read_text() == FLANNEL, "after an update, still the primary CNI's own bytes"


def test_an_entry_the_plugin_would_refuse_is_never_inserted(node: Node, tmp_path: Path):
    primary = node.write_primary("10-flannel.conflist", FLANNEL)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(dict(entry(), railz=[])))
    out = node.insert(bad, check=False)
    assert out.returncode == 1 and "railz" in out.stderr
    wrong = tmp_path / "wrong.json"
    wrong.write_text('{"type": "macvlan"}')
    out = node.insert(wrong, check=False)
    assert out.returncode == 1 and '"type": "rdma-netns"' in out.stderr
    assert primary.read_text() == FLANNEL and node.listing() == ["10-flannel.conflist"]


def test_a_single_plugin_conf_becomes_a_conflist_and_comes_back(node: Node):
    """go-cni loads a .conf with ConfFromFile: a plugins list there would be ignored, so the .conf is
    written as <stem>.conflist (which then sorts first) and put back on removal."""
    conf = node.write_primary("10-mynet.conf", SINGLE_CONF, mode=0o600)
    node.write_primary("20-other.conflist", FLANNEL)
    out = node.insert()
    assert "converted 10-mynet.conf to 10-mynet.conflist" in out.stderr
    assert node.listing() == ["10-mynet.conflist", "20-other.conflist"]
    conflist = node.conf / "10-mynet.conflist"
    doc = json.loads(conflist.read_text())
    assert doc["cniVersion"] == "0.4.0" and doc["name"] == "mynet"
    assert doc["plugins"] == [json.loads(SINGLE_CONF), entry()]
    assert "\t\"plugins\"" in conflist.read_text(), "tab indentation kept"
    assert stat.S_IMODE(conflist.stat().st_mode) == 0o600
    assert "primary: 10-mynet.conflist" in cli("show", *node.args()).stdout
    assert "already" in node.insert().stderr

    node.remove()
    assert node.listing() == ["10-mynet.conf", "20-other.conflist"]
    assert conf.read_text() == SINGLE_CONF and stat.S_IMODE(conf.stat().st_mode) == 0o600


def test_a_conf_that_cannot_become_the_first_conflist_is_left_alone(node: Node):
    """As <stem>.conflist it must still sort first, and it must not replace someone's file."""
    node.write_primary("10-mynet.conf", SINGLE_CONF)
    node.write_primary("10-mynet.conf-extra.json", SINGLE_CONF.replace("mynet", "extra"))  # '-' < 'l'
    out = node.insert(check=False)
    assert out.returncode == 1 and "would sort after 10-mynet.conf-extra.json" in out.stderr
    (node.conf / "10-mynet.conf-extra.json").unlink()
    node.write_primary("10-mynet.conflist", FLANNEL)
    out = node.insert(check=False)
    assert out.returncode == 1 and "10-mynet.conflist, which exists" in out.stderr
    assert node.listing() == ["10-mynet.conf", "10-mynet.conflist"]
    assert (node.conf / "10-mynet.conf").read_text() == SINGLE_CONF
    assert (node.conf / "10-mynet.conflist").read_text() == FLANNEL


def test_a_symlinked_primary_is_written_through_and_stays_a_link(node: Node, tmp_path: Path):
    """A cluster CNI (or an admin) may keep its conflist elsewhere and link it into the conf dir.
    insert used to replace the link with a file, so the CNI's later edits no longer reached the
    runtime, and remove did not bring the link back. Now both write through to the target."""
    elsewhere = tmp_path / "calico-etc"
    elsewhere.mkdir()
    target = elsewhere / "10-calico.conflist"
    target.write_text(CALICO)
    target.chmod(0o640)
    link = node.conf / "10-calico.conflist"
    link.symlink_to(target)
    out = node.insert()
    assert link.is_symlink() and os.readlink(link) == str(target), "the link stays a link"
    assert "inserted" in out.stderr and "through the symlink" in out.stderr, out.stderr
    assert plugin_types(target) == ["calico", "portmap", "bandwidth", "rdma-netns"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(os.listdir(elsewhere)) == ["10-calico.conflist"] and node.listing() == ["10-calico.conflist"]
    assert "already" in node.insert().stderr
    node.remove()
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == CALICO, "byte for byte"


def test_a_symlinked_single_plugin_conf_comes_back_as_the_same_link(node: Node, tmp_path: Path):
    """A linked .conf becomes <stem>.conflist as a plain .conf does; remove puts the link back
    (pointing where it pointed), not a copy of its target."""
    target = tmp_path / "mynet.conf"
    target.write_text(SINGLE_CONF)
    link = node.conf / "10-mynet.conf"
    link.symlink_to("../mynet.conf")
    node.insert()
    assert node.listing() == ["10-mynet.conflist"] and target.read_text() == SINGLE_CONF
    node.remove()
    assert node.listing() == ["10-mynet.conf"]
    assert link.is_symlink() and os.readlink(link) == "../mynet.conf"
    assert target.read_text() == SINGLE_CONF


def test_a_dangling_or_read_only_link_is_refused_with_a_clear_message(node: Node, tmp_path: Path):
    link = node.conf / "10-calico.conflist"
    link.symlink_to(tmp_path / "gone.conflist")
    out = node.insert(check=False)
    assert out.returncode == 1 and "points to" in out.stderr and "gone.conflist" in out.stderr, out.stderr
    assert link.is_symlink() and node.listing() == ["10-calico.conflist"]


def test_the_cni_writing_its_conf_again_is_converted_again(node: Node):
    node.write_primary("10-mynet.conf", SINGLE_CONF)
    node.insert()
    rewritten = SINGLE_CONF.replace("10.22.0.0/16", "10.23.0.0/16")
    node.write_primary("10-mynet.conf", rewritten)  # the .conf sorts first again
    assert "primary: 10-mynet.conf" in cli("show", *node.args()).stdout
    node.insert()
    assert node.listing() == ["10-mynet.conflist"]
    assert json.loads((node.conf / "10-mynet.conflist").read_text())["plugins"][0]["ipam"]["subnet"] == "10.23.0.0/16"
    node.remove()
    assert node.listing() == ["10-mynet.conf"] and (node.conf / "10-mynet.conf").read_text() == rewritten


def test_after_the_primary_cni_rewrote_the_file_remove_takes_out_only_our_entry(node: Node):
    primary = node.write_primary("10-calico.conflist", CALICO)
    node.insert()
    # The CNI rewrote it and kept our entry, with a change of its own.
    doc = json.loads(primary.read_text())
    doc["plugins"][0]["mtu"] = 8950
    node.write_primary("10-calico.conflist", json.dumps(doc, indent=4) + "\n")
    out = node.remove()
    assert "removed the rdma-netns entry" in out.stderr
    left = json.loads(primary.read_text())
    assert plugin_types(primary) == ["calico", "portmap", "bandwidth"] and left["plugins"][0]["mtu"] == 8950
    assert primary.read_text().splitlines()[1].startswith("    \"name\"")

    # Rewritten without our entry: remove leaves it exactly alone.
    node.insert()
    node.write_primary("10-calico.conflist", CALICO)
    node.remove()
    assert primary.read_text() == CALICO and list(node.state.iterdir()) == []


def test_invalid_json_primary_is_left_alone(node: Node):
    primary = node.write_primary("10-calico.conflist", CALICO[:-40])
    out = node.insert(check=False)
    assert out.returncode == 1 and "10-calico.conflist is not valid JSON" in out.stderr and "leaving it alone" in out.stderr
    assert primary.read_text() == CALICO[:-40] and node.listing() == ["10-calico.conflist"]
    assert not (node.state / "state.json").exists()
    no_plugins = node.write_primary("10-calico.conflist", '{"cniVersion": "1.0.0", "name": "x"}')
    out = node.insert(check=False)
    assert out.returncode == 1 and "no \"plugins\" list" in out.stderr
    assert no_plugins.read_text() == '{"cniVersion": "1.0.0", "name": "x"}'


def test_our_own_file_is_never_the_primary_and_no_primary_means_nothing_to_do(node: Node):
    ours = node.conf / "99-rdma-netns.conflist"
    ours.write_text((REPO / "conf/rdma-netns-shared-8rails.conflist").read_text())
    out = node.insert()
    assert "no primary CNI config" in out.stderr
    assert node.listing() == ["99-rdma-netns.conflist"] and ours.read_text() == \
        (REPO / "conf/rdma-netns-shared-8rails.conflist").read_text()
    show = cli("show", *node.args(), "--json")
    assert json.loads(show.stdout)["primary"] is None
    # Not a conf file for the runtime: not a candidate either.
    (node.conf / "05-notes.txt").write_text("hello")
    (node.conf / "06-dir.conflist").mkdir()
    assert "no primary" in node.insert().stderr


def test_temp_files_are_never_a_name_the_runtime_loads(node: Node, monkeypatch):
    """In process, every rename cni-conf makes is recorded: the source is a hidden name whose
    extension libcni does not load, and the destination is whole, valid JSON at once."""
    from rdma_netns.admin import cni_conf
    from rdma_netns.util import fsutil

    renames: list[tuple[str, str]] = []
    real_rename = os.rename

    def spy(src, dst):
        renames.append((os.fspath(src), os.fspath(dst)))
        json.loads(Path(src).read_bytes())  # whole and valid before it gets a loaded name
        real_rename(src, dst)

    node.write_primary("10-mynet.conf", SINGLE_CONF)
    node.write_primary("20-calico.conflist", CALICO)
    monkeypatch.setattr(cni_conf.os, "rename", spy)
    monkeypatch.setattr(fsutil.posix, "rename", spy)  # fsutil's atomic writes (posix: the CNI path has no os)
    state = cni_conf.State(node.state)
    assert cni_conf.insert(node.conf, entry(), state) == "inserted"
    assert cni_conf.remove(node.conf, state) == "restored"
    (node.conf / "10-mynet.conf").unlink()  # (os.unlink: not a rename)
    assert cni_conf.insert(node.conf, entry(), state) == "inserted"
    assert cni_conf.remove(node.conf, state) == "restored"
    into_conf = [(s, d) for s, d in renames if Path(d).parent == node.conf]
    assert len(into_conf) == 4
    for src, dst in into_conf:
        name = Path(src).name
        assert name.startswith(".") and os.path.splitext(name)[1] not in LOADED, name
    assert node.listing() == ["20-calico.conflist"] and (node.conf / "20-calico.conflist").read_text() == CALICO


def test_a_write_racing_the_primary_cni_is_abandoned(node: Node, monkeypatch):
    """If the primary CNI replaces its file between our read and our rename, its file wins."""
    from rdma_netns.admin import cni_conf

    primary = node.write_primary("10-flannel.conflist", FLANNEL)
    real_guard = cni_conf.unchanged_guard

    def racing_guard(path, seen):
        check = real_guard(path, seen)

        def rewrite_then_check():
            node.write_primary("10-flannel.conflist", FLANNEL.replace("cbr0", "cbr1"))
            check()
        return rewrite_then_check

    monkeypatch.setattr(cni_conf, "unchanged_guard", racing_guard)
    with pytest.raises(cni_conf.CniConfError, match="changed while"):
        cni_conf.insert(node.conf, entry(), cni_conf.State(node.state))
    assert primary.read_text() == FLANNEL.replace("cbr0", "cbr1")
    assert node.listing() == ["10-flannel.conflist"]


# --- watch --------------------------------------------------------------------------------------------

INTERVAL = 0.2


class Watcher:
    def __init__(self, node: Node, *extra: str) -> None:
        self.proc = subprocess.Popen(
            [installed_executable(), "cni-conf", "watch", *node.args("--entry", str(ENTRY), "--interval",
                                                                      str(INTERVAL), *extra)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        self.proc.send_signal(sig)
        _, err = self.proc.communicate(timeout=30)
        return self.proc.returncode, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def wait_for(predicate, timeout: float) -> float:
    """Seconds until predicate() held; fails after timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if predicate():
                return time.monotonic() - start
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    pytest.fail(f"not within {timeout}s")


def has_our_entry(path: Path) -> bool:
    return plugin_types(path)[-1:] == ["rdma-netns"]


@pytest.fixture
def watcher_factory(node: Node):
    made: list[Watcher] = []

    def make(*extra: str) -> Watcher:
        made.append(Watcher(node, *extra))
        return made[-1]

    yield make
    for w in made:
        w.kill()


def test_watch_reinserts_after_the_primary_cni_rewrites_and_sigterm_removes(node: Node, watcher_factory):
    primary = node.write_primary("10-calico.conflist", CALICO)
    w = watcher_factory()
    wait_for(lambda: has_our_entry(primary), 10)
    delays = []
    for mtu in (1400, 1500, 9000):
        rewritten = CALICO.replace('"mtu": 0', f'"mtu": {mtu}')
        node.write_primary("10-calico.conflist", rewritten)
        delays.append(wait_for(lambda: has_our_entry(primary), 10))
        assert json.loads(primary.read_text())["plugins"][0]["mtu"] == mtu
    assert max(delays) <= 2 * INTERVAL + 0.3, f"re-inserted after {delays}"
    code, err = w.stop(signal.SIGTERM)
    assert code == 0, err
    assert primary.read_text() == CALICO.replace('"mtu": 0', '"mtu": 9000'), "the CNI's latest bytes, exactly"
    assert list(node.state.iterdir()) == []
    actions = [line for line in err.splitlines() if "inserted" in line]
    assert len(actions) == 4, err  # one line per action, no repeats while nothing changes


def test_watch_waits_for_a_primary_then_follows_a_new_one(node: Node, watcher_factory):
    w = watcher_factory()
    time.sleep(3 * INTERVAL)
    assert node.listing() == []
    flannel = node.write_primary("20-flannel.conflist", FLANNEL)
    wait_for(lambda: has_our_entry(flannel), 10)
    calico = node.write_primary("10-calico.conflist", CALICO)  # sorts first: the new primary
    wait_for(lambda: has_our_entry(calico), 10)
    wait_for(lambda: flannel.read_text() == FLANNEL, 10)  # the old one is put back as it was
    code, err = w.stop(signal.SIGINT)
    assert code == 0 and "waiting for one" in err
    assert calico.read_text() == CALICO and flannel.read_text() == FLANNEL


def test_watch_keep_on_exit_leaves_the_entry(node: Node, watcher_factory):
    primary = node.write_primary("10-flannel.conflist", FLANNEL)
    w = watcher_factory("--keep-on-exit")
    wait_for(lambda: has_our_entry(primary), 10)
    code, err = w.stop()
    assert code == 0 and "--keep-on-exit" in err and has_our_entry(primary)
    node.remove()
    assert primary.read_text() == FLANNEL, "a later remove still restores the bytes"


def test_watch_never_shows_a_runtime_a_partial_file(node: Node, watcher_factory):
    """A reader doing what the runtime does (list, pick *.conf/*.conflist/*.json, parse) while the
    primary CNI and the watch both rewrite the file: every loaded file parses, every time."""
    primary = node.write_primary("10-calico.conflist", CALICO)
    w = watcher_factory()
    wait_for(lambda: has_our_entry(primary), 10)
    stop = threading.Event()
    seen = {"reads": 0, "bad": []}

    def runtime() -> None:
        while not stop.is_set():
            for name in sorted(os.listdir(node.conf)):
                if os.path.splitext(name)[1] not in LOADED:
                    continue
                try:
                    data = (node.conf / name).read_bytes()
                except FileNotFoundError:
                    continue
                try:
                    json.loads(data)
                    seen["reads"] += 1
                except ValueError:
                    seen["bad"].append((name, data[:80]))

    reader = threading.Thread(target=runtime)
    reader.start()
    try:
        for i in range(15):
            node.write_primary("10-calico.conflist", CALICO.replace('"mtu": 0', f'"mtu": {1000 + i}'))
            wait_for(lambda: has_our_entry(primary), 10)
    finally:
        stop.set()
        reader.join()
    assert seen["bad"] == [] and seen["reads"] > 100
    code, _ = w.stop()
    assert code == 0 and primary.read_text() == CALICO.replace('"mtu": 0', '"mtu": 1014')


def test_show_require_entry_is_the_readiness_probe(node: Node):
    """Ready only while the config the runtime uses carries the entry (the DaemonSet's sidecar)."""
    assert cli("show", *node.args("--require-entry"), check=False).returncode == 1  # no primary yet
    node.write_primary("10-calico.conflist", CALICO)
    not_ready = cli("show", *node.args("--require-entry"), check=False)
    assert not_ready.returncode == 1 and "not ready" in not_ready.stderr
    node.insert()
    assert cli("show", *node.args("--require-entry")).returncode == 0
    # Another file sorting first takes over the runtime: not ready again until the entry follows.
    node.write_primary("05-other.conflist", FLANNEL)
    assert cli("show", *node.args("--require-entry"), check=False).returncode == 1
    node.insert()
    assert cli("show", *node.args("--require-entry")).returncode == 0
