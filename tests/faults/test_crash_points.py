"""SIGKILL at every crash point of ADD (RDMA_NETNS_FAULT_AT, cni/rdma_netns/faults.py), in shared
mode and in exclusive mode (the NIC itself moves into the pod), two rails each; then one of the
three ways a node gets its crashed attachment back:

- del:       the runtime's DEL (what containerd/CRI-O do after a failed ADD),
- add-again: a new ADD of the same attachment (the plugin undoes the interrupted one first), then DEL,
- gc:        no DEL ever comes; GC with an empty valid-attachments list (cniVersion 1.1.0).

Each must leave the node exactly as before the ADD (helpers.snapshot: links with names, MACs and
admin state, addresses, rules and routes of every table, host-local leases, state files) and
the pod namespace without rail interfaces, rules or routes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.faults.helpers import assert_same, ipam_leases, killed_by_sigkill, rail_links, snapshot

pytestmark = pytest.mark.netns

COMMON = ["state-written", "ipam-running", "ipam-done", "attached-0", "attached-1", "addressed-0", "addressed-1",
          "before-ready", "before-result"]
POINTS = [("shared", p) for p in COMMON] + [("exclusive", p) for p in COMMON] + \
         [("exclusive", "netdev-moved-rdma0"), ("exclusive", "netdev-moved-rdma1")]
RECOVERIES = ["del", "add-again", "gc"]


def conf_for(node, mode: str) -> dict:
    return node.conf(rails=2, mode=mode)


def expected_progress(point: str) -> tuple[int, int]:
    """(IPAM leases, rail interfaces in the pod) a kill at `point` leaves behind."""
    if point == "state-written":
        return 0, 0
    if point in ("ipam-running", "ipam-done"):  # every rail's IPAM runs at once; killed while they
        return 2, (0 if point == "ipam-running" else 2)  # run, they still finish (and hold leases);
                                                         # the links are made while they run
    if point.startswith("netdev-moved-rdma"):
        return 2, int(point[-1]) + 1
    if point.startswith("attached-") or point.startswith("addressed-"):
        return 2, (int(point[-1]) + 1 if point.startswith("attached-") else 2)
    return 2, 2  # before-ready, before-result


def crash(node, conf: dict, pod: str, point: str) -> dict:
    """Run the ADD that kills itself at `point`; check it died there; return the state it left."""
    result = node.cni("ADD", conf, pod, extra_env={"RDMA_NETNS_FAULT_AT": point})
    assert killed_by_sigkill(result), f"not killed at {point}: exit {result.code} {result.stdout} {result.stderr}"
    assert result.stdout == "", "a killed plugin printed a result"
    files = list((Path(node.state_dir) / "rdmanet").glob("*.json"))
    assert [f.name for f in files] == [f"c1:{conf['rails'][0]['ifname']}.json"], files  # CNI_IFNAME: rail 0's name
    state = json.loads(files[0].read_text())
    assert state["phase"] == ("ready" if point == "before-result" else "adding"), state
    leases, links = expected_progress(point)
    if point == "ipam-running" or point.startswith(("attached-", "netdev-moved-")):
        # Killed while the IPAM delegates ran (the rails' links are made meanwhile): the orphaned
        # delegates finish on their own time.
        deadline = time.monotonic() + 10
        while len(ipam_leases(node)) < leases and time.monotonic() < deadline:
            time.sleep(0.05)
    assert len(ipam_leases(node)) == leases, (point, ipam_leases(node))
    assert len(rail_links(node, pod)) == links, (point, node.links(pod))
    return state


@pytest.mark.parametrize("recovery", RECOVERIES)
@pytest.mark.parametrize("mode,point", POINTS, ids=[f"{m}-{p}" for m, p in POINTS])
def test_crash_then_recover(node, mode, point, recovery):
    pod = node.pod()
    conf = conf_for(node, mode)
    node.cni("VERSION", conf).ok()
    before = snapshot(node, [pod])
    crash(node, conf, pod, point)

    if recovery == "del":
        node.cni("DEL", conf, pod).ok()
    elif recovery == "add-again":
        again = node.cni("ADD", conf, pod)
        if point == "before-result":
            # The state already says "ready": the crashed ADD had finished everything but its
            # answer, so a second ADD without DEL is refused (spec: ADD twice needs a DEL
            # between) and the finished attachment is kept intact.
            again.error(102)
            node.cni("CHECK", conf, pod).ok()
        else:
            result = again.ok()
            assert {i["name"] for i in result["interfaces"]} == {"rdma0", "rdma1"}
            assert len(ipam_leases(node)) == 2, "the crashed ADD's leases were released, not kept twice"
            node.cni("CHECK", dict(conf, prevResult=result), pod).ok()
        node.cni("DEL", conf, pod).ok()
    else:
        node.cni("GC", dict(conf, **{"cni.dev/valid-attachments": []})).ok()

    assert_same(node, before, [pod])
    assert rail_links(node, pod) == set()
    node.cni("DEL", conf, pod).ok()  # and DEL stays idempotent afterwards
    assert_same(node, before, [pod])


@pytest.mark.parametrize("mode", ["shared", "exclusive"])
def test_gc_keeps_a_listed_crashed_attachment_and_cleans_it_once_unlisted(node, mode):
    """GC only releases what the runtime no longer lists; a listed crashed ADD waits for its DEL."""
    pod = node.pod()
    conf = conf_for(node, mode)
    node.cni("VERSION", conf).ok()
    before = snapshot(node, [pod])
    crash(node, conf, pod, "attached-0")
    node.cni("GC", dict(conf, **{"cni.dev/valid-attachments": [{"containerID": "c1", "ifname": conf["rails"][0]["ifname"]}]})).ok()
    assert len(ipam_leases(node)) == 2 and len(rail_links(node, pod)) == 1
    node.cni("GC", dict(conf, **{"cni.dev/valid-attachments": []})).ok()
    assert_same(node, before, [pod])


def test_crash_then_pod_namespace_gone_then_del(node):
    """Killed mid-ADD and the pod's namespace removed before the DEL: the leases still go."""
    pod = node.pod()
    conf = conf_for(node, "shared")
    node.cni("VERSION", conf).ok()
    before = snapshot(node)
    crash(node, conf, pod, "addressed-0")
    from tests.netns.conftest import ip
    ip("netns", "del", pod)
    node.pods.remove(pod)
    node.cni("DEL", conf, pod).ok()
    assert_same(node, before)
