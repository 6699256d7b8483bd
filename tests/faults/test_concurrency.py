"""Concurrent invocations: ADD and DEL racing on one attachment, lock time-outs (code 11), 32
ADDs of different attachments at once, and unrelated attachments with random container IDs
never waiting for each other's locks."""

from __future__ import annotations

import json
import threading
import time
import secrets
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.faults.fakeipam import FakeIpam, use_fake
from tests.faults.helpers import assert_same, ipam_leases, rail_links, snapshot, state_files

pytestmark = pytest.mark.netns

ROUNDS = 15


def consistent(node, pod: str, conf: dict) -> str:
    """The attachment is either fully there (ready state, links, leases, CHECK passes) or fully
    absent; returns which."""
    states = state_files(node)
    if states:
        (state,) = states.values()
        assert json.loads(state)["phase"] == "ready", state
        assert rail_links(node, pod) == {"rdma0", "rdma1"}
        assert len(ipam_leases(node)) == 2, ipam_leases(node)
        node.cni("CHECK", conf, pod).ok()
        return "present"
    assert rail_links(node, pod) == set(), node.links(pod)
    assert ipam_leases(node) == {}, ipam_leases(node)
    return "absent"


def test_add_and_del_race_on_one_attachment(node):
    pod = node.pod()
    conf = node.conf(rails=2)
    node.cni("VERSION", conf).ok()
    before = snapshot(node, [pod])
    outcomes: dict[str, int] = {}
    for _ in range(ROUNDS):
        barrier = threading.Barrier(3)

        def call(command: str):
            barrier.wait()
            return node.cni(command, conf, pod)

        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(call, c) for c in ("ADD", "DEL", "ADD")]
            results = [f.result() for f in futures]
        for r in results:
            assert r.code == 0 or r.json["code"] == 102, (r.stdout, r.stderr)  # never 11, never 999
        assert sum(r.code == 0 for r in (results[0], results[2])) >= 1
        results[1].ok()
        kind = consistent(node, pod, conf)
        outcomes[kind] = outcomes.get(kind, 0) + 1
        node.cni("DEL", conf, pod).ok()
        assert_same(node, before, [pod], timeout=0.5)
    assert sum(outcomes.values()) == ROUNDS


@pytest.fixture
def slow_ipam(tmp_path) -> FakeIpam:
    fake = FakeIpam(tmp_path)
    fake.set("slow", "ADD")
    return fake


def test_lock_timeout_gives_code_11_and_changes_nothing(node, slow_ipam):
    """While a slow ADD (IPAM takes 1.5 s) holds the attachment's lock, a second ADD and a DEL
    of the same attachment with lockTimeoutSeconds 0.3 give up with 11 and touch nothing;
    an unrelated attachment (another lock file) is not held up."""
    pod = node.pod()
    conf = use_fake(node, node.conf(lockTimeoutSeconds=0.3))
    node.cni("VERSION", conf).ok()
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(node.cni, "ADD", conf, pod, cni_path=slow_ipam.cni_path)
        time.sleep(0.5)  # the slow ADD is inside its IPAM call now
        for command in ("ADD", "DEL", "CHECK"):
            t0 = time.monotonic()
            err = node.cni(command, conf, pod, cni_path=slow_ipam.cni_path).error(11)
            assert 0.3 <= time.monotonic() - t0 < 1.0
            assert "lock" in err["msg"]
        result = slow.result().ok()
    assert [i["name"] for i in result["interfaces"]] == ["net1"]
    assert rail_links(node, pod) == {"net1"} and len(ipam_leases(node)) == 1
    slow_ipam.clear()
    node.cni("CHECK", conf, pod, cni_path=slow_ipam.cni_path).ok()
    node.cni("DEL", conf, pod, cni_path=slow_ipam.cni_path).ok()
    assert ipam_leases(node) == {} and state_files(node) == {}


def test_other_attachment_not_held_up(node, slow_ipam):
    """Locks are per attachment: a slow ADD does not delay an unrelated one."""
    pod, other_pod = node.pod(), node.pod()
    slow_conf = use_fake(node, node.conf(lockTimeoutSeconds=0.3))
    fast_conf = node.conf(lockTimeoutSeconds=0.3)
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(node.cni, "ADD", slow_conf, pod, cni_path=slow_ipam.cni_path)
        time.sleep(0.5)
        t0 = time.monotonic()
        node.cni("ADD", fast_conf, other_pod, container_id="c2").ok()
        assert time.monotonic() - t0 < 1.0
        slow.result().ok()
    node.cni("DEL", slow_conf, pod, cni_path=slow_ipam.cni_path).ok()
    node.cni("DEL", fast_conf, other_pod, container_id="c2").ok()
    assert ipam_leases(node) == {} and state_files(node) == {}


def test_32_concurrent_adds_then_dels(node):
    pods = [node.pod() for _ in range(32)]
    conf = node.conf(rails=2)
    node.cni("VERSION", conf).ok()
    before = snapshot(node, pods)
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda p: node.cni("ADD", conf, p, container_id=p), pods))
    addresses = [ip["address"] for r in results for ip in r.ok()["ips"]]
    assert len(addresses) == len(set(addresses)) == 64
    assert len(ipam_leases(node)) == 64 and len(state_files(node)) == 32
    for p in pods:
        assert rail_links(node, p) == {"rdma0", "rdma1"}
    with ThreadPoolExecutor(32) as pool:
        for r in pool.map(lambda p: node.cni("DEL", conf, p, container_id=p), pods):
            r.ok()
    assert_same(node, before, pods)


def lock_files(node) -> list[str]:
    """Attachment lock files (their names have a ':'; the config cache's fill lock has none)."""
    folder = Path(node.state_dir) / "locks"
    return sorted(f.name for f in folder.iterdir() if ":" in f.name) if folder.exists() else []


def test_random_container_ids_never_wait_for_each_other(node):
    """Issue 15: runtimes make 64-hex random container IDs. With the old 256 crc32 stripes a burst
    put unrelated pods on one stripe, each waiting for the other's whole ADD; per-attachment
    lock files mean no ADD or DEL of this burst waits for a lock at all (a wait is logged, with
    its duration, on stderr), and no lock file outlives its DEL."""
    pods = [node.pod() for _ in range(24)]
    ids = {p: secrets.token_hex(32) for p in pods}
    conf = node.conf()
    node.cni("VERSION", conf).ok()
    before = snapshot(node, pods)
    for command in ("ADD", "DEL"):
        barrier = threading.Barrier(len(pods))

        def call(pod: str, command: str = command, barrier: threading.Barrier = barrier):
            barrier.wait()
            return node.cni(command, conf, pod, container_id=ids[pod])

        with ThreadPoolExecutor(len(pods)) as pool:
            results = list(pool.map(call, pods))
        for r in results:
            r.ok()
            assert "for the lock of" not in r.stderr, r.stderr
    assert lock_files(node) == []
    assert_same(node, before, pods)


def test_gc_removes_lock_files_of_killed_calls(node):
    pod = node.pod()
    conf = node.conf()
    cid = secrets.token_hex(32)
    node.cni("ADD", conf, pod, container_id=cid).ok()
    assert lock_files(node) == []  # released with the ADD
    orphan = f"{secrets.token_hex(32)}:net1"
    (Path(node.state_dir) / "locks" / orphan).touch()  # a call SIGKILLed while holding its lock
    gc = dict(conf, cniVersion="1.1.0", **{"cni.dev/valid-attachments": []})
    node.cni("GC", gc).ok()
    assert lock_files(node) == [] and state_files(node) == {}
