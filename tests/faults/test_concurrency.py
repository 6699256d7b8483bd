"""Concurrent invocations: ADD and DEL racing on one attachment, lock time-outs (code 11), and 32
ADDs of different attachments at once."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from zlib import crc32

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


def other_stripe(cid: str, ifname: str = "net1") -> str:
    mine = crc32(f"{cid}:{ifname}".encode()) % 256
    return next(c for c in (f"x{i}" for i in range(1000)) if crc32(f"{c}:{ifname}".encode()) % 256 != mine)


def test_lock_timeout_gives_code_11_and_changes_nothing(node, slow_ipam):
    """While a slow ADD (IPAM takes 1.5 s) holds the attachment's lock, a second ADD and a DEL
    of the same attachment with lockTimeoutSeconds 0.3 give up with 11 and touch nothing;
    an unrelated attachment (another lock stripe) is not held up."""
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


def test_other_stripe_not_held_up(node, slow_ipam):
    """Locks are per attachment (striped): a slow ADD does not delay an unrelated one."""
    pod, other_pod = node.pod(), node.pod()
    slow_conf = use_fake(node, node.conf(lockTimeoutSeconds=0.3))
    fast_conf = node.conf(lockTimeoutSeconds=0.3)
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(node.cni, "ADD", slow_conf, pod, cni_path=slow_ipam.cni_path)
        time.sleep(0.5)
        t0 = time.monotonic()
        node.cni("ADD", fast_conf, other_pod, container_id=other_stripe("c1")).ok()
        assert time.monotonic() - t0 < 1.0
        slow.result().ok()
    node.cni("DEL", slow_conf, pod, cni_path=slow_ipam.cni_path).ok()
    node.cni("DEL", fast_conf, other_pod, container_id=other_stripe("c1")).ok()
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
