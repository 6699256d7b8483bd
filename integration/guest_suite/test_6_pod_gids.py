"""Per-pod GIDs on a real kernel (issue 17): what each pod is told to use is its own GID, on every rail.

Layout: two rails, each a veth pair with an rxe device on the host end (rxa on v0, rxb on w0:
the node's two "RDMA NICs"); shared mode, macvlan; two pods, each with both rails, ADDed at
the same time by the installed plugin (requireRdma, podInfoDir in a temp folder). The kernel
puts every pod address (and every pod interface's link-local address) in both devices' GID
tables with the pod's interface as ndev, so each pod sees the host's and the other pod's GIDs
too. Checked: the published JSON names, per rail, the node's device and the index whose GID is
the pod's own address with ndev = the pod's rail ifname; the indexes are equal on both rails
(the GID order lock), so NCCL_IB_GID_INDEX/UCX_IB_GID_INDEX are set; a QP built inside the pod
from those values carries that source GID; the naive choice (the first RoCE v2 entry) is not
the pod's GID. With unequal table layouts the index is left unset and NCCL_IB_ADDR_RANGE is set.
Facts for docs/security.md (the unprivileged QP with another pod's GID) go to pod-gids-facts.jsonl.
"""

from __future__ import annotations

import ipaddress
import json
import os
import platform
import threading
import time
from pathlib import Path

import pytest

from integration.guest_suite.conftest import RESULTS, SYSTEM_PYTHON, in_pod, sh, timed_cni
from rdma_netns.kernel import rdma_sysfs
from rdma_netns.kernel.inet import Prefix
from tests.conftest import plugin_path

pytestmark = pytest.mark.guest

# Inside a pod: open the device, build an RC QP, move it INIT -> RTR with the given source GID
# index towards the first destination GID that the kernel resolves, and query the QP back.
QP_PROBE = r"""
import json, os, sys
out = {"uid": os.getuid(), "capEff": next(l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff"))}
try:
    import pyverbs.enums as e
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.cq import CQ
    from pyverbs.device import Context
    from pyverbs.pd import PD
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    device, port, index = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ctx = Context(name=device)
    out.update(device=device, port=port, index=index, sgid=str(ctx.query_gid(port, index).gid))
    pd, cq = PD(ctx), CQ(ctx, 4)
    errors = []
    for dgid in sys.argv[4:]:
        try:
            init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq,
                              cap=QPCap(max_send_wr=1, max_recv_wr=1, max_send_sge=1, max_recv_sge=1))
            qp = QP(pd, init, QPAttr(port_num=port))
            attr = QPAttr(port_num=port)
            attr.path_mtu = e.IBV_MTU_1024
            attr.dest_qp_num = qp.qp_num
            attr.rq_psn = 0
            attr.max_dest_rd_atomic = 1
            attr.min_rnr_timer = 12
            attr.ah_attr = AHAttr(port_num=port, is_global=1,
                                  gr=GlobalRoute(dgid=GID(dgid), sgid_index=index, hop_limit=64))
            qp.to_rtr(attr)
            got, _init = qp.query(e.IBV_QP_STATE | e.IBV_QP_AV)
            out.update(ok=True, dgid=dgid, qpState=int(got.qp_state), qpSgidIndex=int(got.ah_attr.sgid_index))
            break
        except Exception as exc:
            errors.append(f"{dgid}: {type(exc).__name__}: {exc}")
    out["errors"] = errors
except Exception as exc:
    out["errors"] = [f"{type(exc).__name__}: {exc}"]
out.setdefault("ok", False)
print(json.dumps(out))
"""
UNPRIVILEGED = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all", "--no-new-privs")
IBV_QPS_RTR = 2
# ff02::1 needs no neighbour resolution: the probe's fallback destination
MULTICAST_DGID = "ff02:0000:0000:0000:0000:0000:0000:0001"


def exploded(text: str) -> str:
    return ipaddress.IPv6Address(text).exploded


def fact(record: dict) -> None:
    """A measured fact for the docs, kept whatever the outcome."""
    record = {"kernel": platform.release(), "time": time.strftime("%H:%M:%S"), **record}
    print("FACT", json.dumps(record))
    with open(RESULTS / "pod-gids-facts.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


class Rails:
    """Two rails: veth pairs v0-v1 and w0-w1 with an rxe device on v0 and on w0."""

    def __init__(self, lab) -> None:
        t = lab.tag
        self.netdevs = [f"v0{t}", f"w0{t}"]
        self.devices = [f"rxa{t}", f"rxb{t}"]
        self.ifnames = ["rdma0", "rdma1"]
        lab.veth(f"v0{t}", f"v1{t}")
        lab.veth(f"w0{t}", f"w1{t}")
        for device, netdev in zip(self.devices, self.netdevs):
            lab.rxe_on(device, netdev)
        self.pod_info = lab.tmp / "podinfo"
        self.conf = {
            "cniVersion": "1.1.0", "name": f"gids{t}", "type": "rdma-netns", "mode": "shared", "link": "macvlan",
            "stateDir": str(lab.tmp / "state"), "gidWaitMs": 10000, "requireRdma": True, "pairing": False,
            "podInfoDir": str(self.pod_info),
            "rails": [{"netdev": self.netdevs[0], "ifname": "rdma0", "ipam": lab.ipam("fd00:21::/64")},
                      {"netdev": self.netdevs[1], "ifname": "rdma1", "ipam": lab.ipam("fd00:22::/64")}]}

    def cni(self, command: str, pod: str):
        return timed_cni("pod-gids", command, self.conf, container_id=pod, netns=f"/var/run/netns/{pod}",
                         ifname="rdma0")

    def info_path(self, pod: str) -> Path:
        return self.pod_info / pod / "rdma0.json"

    def info(self, pod: str) -> dict:
        return json.loads(self.info_path(pod).read_text())


def table(device: str, limit: int = 16) -> list[rdma_sysfs.GidEntry]:
    return rdma_sysfs.gids(rdma_sysfs.RdmaPort(device, 1), limit)


def entry_at(device: str, index: int) -> rdma_sysfs.GidEntry:
    found = [g for g in table(device, index + 1) if g.index == index]
    assert found, f"{device} has no GID at index {index}"
    return found[0]


def pod_gid(info: dict, rail: int) -> str:
    return rdma_sysfs.gid_text(Prefix.parse(info["rails"][rail]["addresses"][0]))


def check_published_rail(rails: Rails, info: dict, rail: int) -> int:
    """The JSON's rail names the node's device, and its gidIndex holds the pod's own address
    with the pod's rail ifname as ndev. Returns the index."""
    entry = info["rails"][rail]
    assert entry["ifname"] == rails.ifnames[rail] and entry["netdev"] == rails.netdevs[rail]
    assert entry["rdmaDevice"] == rails.devices[rail] and entry["port"] == 1
    own = pod_gid(info, rail)
    assert entry["gid"] == own
    at = entry_at(rails.devices[rail], entry["gidIndex"])
    assert (at.gid, at.gid_type, at.ndev) == (own, "RoCE v2", rails.ifnames[rail]), \
        f"rail {rail}: index {entry['gidIndex']} holds {at.gid} {at.gid_type} {at.ndev}, not the pod's {own}"
    return entry["gidIndex"]


def qp_probe(pod: str, device: str, index: int, dgids: list[str], unprivileged: bool = False) -> dict:
    cmd = (*(UNPRIVILEGED if unprivileged else ()), SYSTEM_PYTHON, "-c", QP_PROBE, device, "1", str(index), *dgids)
    out = in_pod(pod, *cmd, check=False, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert lines, f"QP probe printed nothing: {out.returncode} {out.stdout} {out.stderr}"
    return json.loads(lines[-1])


def devices_in_pod(pod: str) -> tuple[list[dict], str]:
    rows = json.loads(in_pod(pod, plugin_path(), "devices", "--json", "--max-gids", "16", timeout=300).stdout)
    text = in_pod(pod, plugin_path(), "devices", "--max-gids", "16", timeout=300).stdout
    return rows, text


def test_two_pods_get_their_own_gid_index_on_both_rails(lab):
    rails = Rails(lab)
    pods = [lab.pod(), lab.pod()]
    results: dict[str, object] = {}

    def add(pod: str) -> None:
        results[pod] = rails.cni("ADD", pod)

    # At the same time: without the GID order lock their changes would interleave per rail.
    threads = [threading.Thread(target=add, args=(pod,)) for pod in pods]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for pod in pods:
        results[pod].ok()
    infos = {pod: rails.info(pod) for pod in pods}
    tables = {device: [(g.index, g.gid, g.gid_type, g.ndev) for g in table(device)] for device in rails.devices}
    print("GID tables", json.dumps(tables, indent=1))

    indexes = {}
    for pod, info in infos.items():
        assert info["version"] == 1 and info["containerID"] == pod and info["mode"] == "shared"
        indexes[pod] = [check_published_rail(rails, info, rail) for rail in (0, 1)]
        assert info["gidIndexesEqual"] is True, f"{pod}: indexes {indexes[pod]} differ between the rails"
        env = info["env"]
        assert env["NCCL_IB_GID_INDEX"] == env["UCX_IB_GID_INDEX"] == str(indexes[pod][0])
        assert env["NCCL_IB_HCA"] == f"={rails.devices[0]}:1,{rails.devices[1]}:1"
        assert env["UCX_NET_DEVICES"] == f"{rails.devices[0]}:1,{rails.devices[1]}:1"
        assert env["NCCL_SOCKET_IFNAME"] == "=rdma0,rdma1" and env["NCCL_IB_ADDR_FAMILY"] == "AF_INET6"
        assert "NCCL_IB_ADDR_RANGE" not in env
    a, b = pods
    assert indexes[a][0] != indexes[b][0]

    # The naive choice, the first RoCE v2 entry of each device, is the host's (or the other pod's).
    naive_facts = []
    for pod, other in ((a, b), (b, a)):
        for rail, device in enumerate(rails.devices):
            naive = next(g for g in table(device) if g.gid_type == "RoCE v2")
            own, theirs = pod_gid(infos[pod], rail), pod_gid(infos[other], rail)
            assert naive.gid != own and naive.index != infos[pod]["rails"][rail]["gidIndex"]
            whose = "host" if naive.ndev == rails.netdevs[rail] else "other pod" if naive.gid == theirs else "?"
            assert whose in ("host", "other pod"), (naive.index, naive.gid, naive.ndev)
            naive_facts.append({"pod": pod, "device": device, "naiveIndex": naive.index, "naiveGid": naive.gid,
                                "naiveNdev": naive.ndev, "naiveIs": whose,
                                "publishedIndex": infos[pod]["rails"][rail]["gidIndex"]})

    # A QP built inside the pod from the published values carries the pod's own source GID.
    qp_facts = []
    for pod, other in ((a, b), (b, a)):
        for rail, device in enumerate(rails.devices):
            index = infos[pod]["rails"][rail]["gidIndex"]
            probe = qp_probe(pod, infos[pod]["rails"][rail]["rdmaDevice"], index,
                             [exploded(infos[other]["rails"][rail]["addresses"][0].split("/")[0]), MULTICAST_DGID])
            assert probe["ok"], probe
            assert probe["qpState"] == IBV_QPS_RTR and probe["qpSgidIndex"] == index, probe
            assert exploded(probe["sgid"]) == exploded(pod_gid(infos[pod], rail)), probe
            qp_facts.append({"pod": pod, "device": device, "index": index, "dgid": probe["dgid"],
                             "sgid": probe["sgid"]})

    # `rdma-netns devices` in pod a: its own GIDs first, pod b's marked as another namespace's.
    rows, text = devices_in_pod(a)
    print(text)
    by_device = {r["device"]: r for r in rows}
    for rail, device in enumerate(rails.devices):
        gids = by_device[device]["gids"]
        owners = [g["owner"] for g in gids]
        mine = owners.count("self")
        assert mine >= 1 and owners[:mine] == ["self"] * mine, owners
        first = {g["index"]: g["owner"] for g in gids}
        assert first[infos[a]["rails"][rail]["gidIndex"]] == "self"
        assert first[infos[b]["rails"][rail]["gidIndex"]] == "other"
        assert first[0] == "host"
    assert "another namespace" in text and "this namespace" in text

    # Measured for docs/security.md's statement: pod a, unprivileged (uid 65534, no
    # capabilities), moves an RC QP to RTR with pod b's GID index (recorded, not asserted).
    index_b = infos[b]["rails"][0]["gidIndex"]
    probe = qp_probe(a, rails.devices[0], index_b,
                     [exploded(infos[a]["rails"][0]["addresses"][0].split("/")[0]), MULTICAST_DGID],
                     unprivileged=True)
    host_probe = qp_probe(a, rails.devices[0], 0, [MULTICAST_DGID], unprivileged=True)
    fact({"what": "unprivileged process in pod a moves an RC QP to RTR with another pod's GID index",
          "uid": probe.get("uid"), "capEff": probe.get("capEff"), "device": rails.devices[0],
          "index": index_b, "indexIsPodB": True, "sgid": probe.get("sgid"), "ok": probe.get("ok"),
          "qpState": probe.get("qpState"), "qpSgidIndex": probe.get("qpSgidIndex"), "dgid": probe.get("dgid"),
          "errors": probe.get("errors"),
          "hostIndex0": {"ok": host_probe.get("ok"), "qpSgidIndex": host_probe.get("qpSgidIndex"),
                         "sgid": host_probe.get("sgid"), "errors": host_probe.get("errors")}})
    fact({"what": "equal GID indexes with concurrent ADDs", "indexes": indexes, "tables": tables,
          "naive": naive_facts, "qp": qp_facts})

    for pod in pods:
        rails.cni("DEL", pod).ok()
        assert not rails.info_path(pod).exists() and not rails.info_path(pod).parent.exists()
    assert not rails.pod_info.exists() or os.listdir(rails.pod_info) == []


def test_unequal_table_layouts_leave_the_index_unset(lab):
    rails = Rails(lab)
    # The host end of rail 1 gets an extra address first: its GID takes a slot that rail 0's
    # table keeps free, so the pod's entries land one index further on rail 1.
    sh("ip", "addr", "add", "fd00:99::1/64", "dev", rails.netdevs[1], "nodad")
    extra = rdma_sysfs.gid_text(Prefix.parse("fd00:99::1"))
    deadline = time.monotonic() + 30
    while not any(g.gid == extra for g in table(rails.devices[1])):
        assert time.monotonic() < deadline, "the extra address never became a GID"
        time.sleep(0.1)
    pod = lab.pod()
    rails.cni("ADD", pod).ok()
    info = rails.info(pod)
    indexes = [check_published_rail(rails, info, rail) for rail in (0, 1)]
    assert indexes[0] != indexes[1]
    assert info["gidIndexesEqual"] is False
    env = info["env"]
    assert "NCCL_IB_GID_INDEX" not in env and "UCX_IB_GID_INDEX" not in env
    span = Prefix.parse(env["NCCL_IB_ADDR_RANGE"])
    for rail in (0, 1):
        address = ipaddress.IPv6Address(info["rails"][rail]["addresses"][0].split("/")[0])
        assert address in ipaddress.IPv6Network(str(span)), (address, span)
    assert env["NCCL_IB_ADDR_FAMILY"] == "AF_INET6"
    fact({"what": "unequal layouts", "indexes": indexes, "addrRange": env["NCCL_IB_ADDR_RANGE"],
          "tables": {d: [(g.index, g.gid, g.ndev) for g in table(d)] for d in rails.devices}})
    rails.cni("DEL", pod).ok()
    assert not rails.info_path(pod).exists()
