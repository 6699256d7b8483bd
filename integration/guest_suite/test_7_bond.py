"""RoCE LAG on a real kernel (issue 20): rails on a bond whose RDMA device reports a member port.

Layout, the shape of a Lingjun node's `mlx5_bond_N`: `bond0` (active-backup) over the guest's two
virtio NICs (run-in-guest.sh --net-loop) and an rxe device `rxeb` made on the active member, so
that rxeb's `parent` (and the netdev NETLINK_RDMA reports) is the member while the bond carries the
addresses and the kernel fills rxeb's GID table from bond0 and every interface stacked on it. A
member can take no macvlan/ipvlan (EBUSY) and the bond cannot leave the host (its netns is
immutable), so every way of naming the rail (the bond, the RDMA device, a member's PCI address, no
rails at all) must give the pod a sub-interface of bond0 whose address is a RoCE v2 GID of rxeb.

Shared mode (the kernel's default). Facts behind the assertions (measured in this guest, kernel
7.3.4): rxe has 1024 GID entries and one per address; a full table makes the kernel log
`__ib_cache_gid_add: unable to add gid ... error=-28` and keep the address; macvlan and ipvlan
cannot share a parent (each refuses the other with EBUSY), so the GID-fill test fills the table
from a host macvlan of bond0 and the pods use macvlan there. Whatever a test does, the NICs go
back as the other tests expect them: un-enslaved, down, with their own MAC and name.
"""

from __future__ import annotations

import ipaddress
import json
import os
import time
from pathlib import Path

import pytest

from integration.guest_suite.conftest import in_pod, pod_address, sh, timed_cni
from integration.guest_suite.test_2_exclusive import virtio_nics
from integration.guest_suite.test_4_device_plugin import RESOURCE, start_dp  # noqa: F401 (fixture)
from rdma_netns.kernel import rdma_sysfs
from rdma_netns.kernel.inet import Prefix

pytestmark = pytest.mark.guest

BOND = "bond0"
DEVICE = "rxeb"
GID_SCAN = 48  # entries read per check: the tests keep the table nearly empty, the pod's sit early
RAIL_FORMS = ["netdev", "rdmaDevice", "pciAddress", "pciAddressBackup", "none"]


def pci_address(nic: str) -> str:
    """A virtio NIC's PCI function: /sys/class/net/<nic>/device is the virtio device, its parent
    the PCI function (0000:00:0a.0)."""
    return os.path.basename(os.path.dirname(os.path.realpath(f"/sys/class/net/{nic}/device")))


def link_json(name: str, netns: str | None = None) -> dict:
    cmd = ("ip", "-j", "-d", "link", "show", name)
    return json.loads((in_pod(netns, *cmd) if netns else sh(*cmd)).stdout)[0]


class Bond:
    """bond0 over the two virtio NICs and rxeb on its active member; close() restores the NICs."""

    def __init__(self) -> None:
        nics = virtio_nics()
        assert len(nics) >= 2, f"the bond needs the two virtio NICs of run-in-guest.sh --net-loop, found {nics}"
        self.nics = nics[:2]
        self.before = {nic: self._facts(nic) for nic in self.nics}
        # A missing bonding module fails the tests (a node with RoCE LAG has it): no skip.
        sh("modprobe", "bonding")
        sh("modprobe", "rdma_rxe")
        if os.path.exists(f"/sys/class/net/{BOND}"):  # a bond the module made at load, or a leftover
            sh("ip", "link", "del", BOND)
        sh("ip", "link", "add", BOND, "type", "bond", "mode", "active-backup", "miimon", "100")
        for nic in self.nics:
            sh("ip", "link", "set", nic, "down")
            sh("ip", "link", "set", nic, "master", BOND)
        sh("ip", "link", "set", BOND, "up")
        deadline = time.monotonic() + 30
        while not (active := Path(f"/sys/class/net/{BOND}/bonding/active_slave").read_text().strip()):
            assert time.monotonic() < deadline, "bond0 chose no active member"
            time.sleep(0.2)
        self.member = active
        self.backup = next(nic for nic in self.nics if nic != active)
        sh("rdma", "link", "add", DEVICE, "type", "rxe", "netdev", self.member)
        assert Path(f"/sys/class/infiniband/{DEVICE}/parent").read_text().strip() == self.member, \
            "rxeb reports the member as its netdev (as mlx5_bond_N does)"
        # The kernel fills rxeb's table from the bond: its link-local is there once bond0 is up.
        wait_until(lambda: any(g.ndev == BOND for g in table()), 30, "no GID of bond0 on rxeb")

    @staticmethod
    def _facts(nic: str) -> dict:
        link = link_json(nic)
        return {"address": link["address"], "up": "UP" in link["flags"]}

    def close(self) -> None:
        sh("rdma", "link", "delete", DEVICE, check=False)
        sh("ip", "link", "del", BOND, check=False)
        problems = []
        for nic in self.nics:
            if not os.path.exists(f"/sys/class/net/{nic}"):
                problems.append(f"{nic} is gone")
                continue
            sh("ip", "link", "set", nic, "nomaster", check=False)
            link = link_json(nic)
            if link["address"] != self.before[nic]["address"]:
                sh("ip", "link", "set", nic, "address", self.before[nic]["address"], check=False)
            if ("UP" in link["flags"]) != self.before[nic]["up"]:
                sh("ip", "link", "set", nic, "up" if self.before[nic]["up"] else "down", check=False)
            after = self._facts(nic)
            if after != self.before[nic] or "master" in link_json(nic):
                problems.append(f"{nic}: {after} (was {self.before[nic]})")
        assert not problems, f"the virtio NICs did not come back as they were: {problems}"


@pytest.fixture(scope="module")
def bond():
    made = Bond()
    try:
        yield made
    finally:
        made.close()


@pytest.fixture(autouse=True)
def settled(bond):
    """Torn down after `lab` (autouse fixtures come first): a pod namespace that a failed test left
    is dismantled by the kernel later, and until then its macvlan would keep an ipvlan off bond0
    (EBUSY). Its addresses' GIDs go with it: wait until only bond0's own entries are left."""
    yield
    deadline = time.monotonic() + 60
    while [g for g in table() if g.ndev != BOND] and time.monotonic() < deadline:
        time.sleep(0.5)


def wait_until(predicate, seconds: float, message: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, message
        time.sleep(0.2)


def table(limit: int = GID_SCAN) -> list[rdma_sysfs.GidEntry]:
    return rdma_sysfs.gids(rdma_sysfs.RdmaPort(DEVICE, 1), limit)


def gid_ndevs(address: str) -> list[str]:
    """The ndevs of rxeb's RoCE v2 GID entries whose content is `address`."""
    want = rdma_sysfs.gid_text(Prefix.parse(address))
    return [g.ndev for g in table() if g.gid == want and g.gid_type == "RoCE v2"]


def link_local_gids(ndev: str) -> list[str]:
    return [g.gid for g in table() if g.ndev == ndev and g.gid.startswith("fe80:")]


def conf(lab, form: str, bond: Bond, link: str, **extra) -> dict:
    name = f"bond-{form.lower()}-{link}"
    ipam = lab.ipam("fd00:71::/64")
    rail: dict = {"ifname": "rdma0", "ipam": ipam}
    if form == "netdev":
        rail["netdev"] = BOND
    elif form == "rdmaDevice":
        rail["rdmaDevice"] = DEVICE
    elif form == "pciAddress":
        rail["pciAddress"] = pci_address(bond.member)
    elif form == "pciAddressBackup":  # the other member's function is the same rail (one bond)
        rail["pciAddress"] = pci_address(bond.backup)
    net = {"cniVersion": "1.1.0", "name": name, "type": "rdma-netns", "mode": "shared", "link": link,
           "stateDir": str(lab.tmp / "state"), "podInfoDir": str(lab.tmp / "podinfo"),
           "cdiSpecDir": str(lab.tmp / "cdi"), "gidWaitMs": 5000, "pairing": False, **extra}
    if form == "none":  # one rail per RDMA device of the node: rxeb, on its bond
        net["ipam"] = ipam
    else:
        net["rails"] = [rail]
    return net


def cni(command: str, net: dict, pod: str, **kw):
    return timed_cni(f"bond-{net['link']}", command, net, container_id=pod, netns=f"/var/run/netns/{pod}",
                     ifname="rdma0", **kw)


def pod_links(pod: str) -> list[str]:
    return sorted(link["ifname"] for link in json.loads(in_pod(pod, "ip", "-j", "link").stdout))


def leftovers(lab, net: dict, pod: str) -> dict:
    """What a DEL (or a failed ADD) may not leave: pod interfaces, attachment records, published
    files, IPAM leases, sub-interfaces of bond0 in the host."""
    state = lab.tmp / "state" / net["name"]
    leases = lab.tmp / "ipam" / net["name"]
    subs = [link["ifname"] for link in json.loads(sh("ip", "-j", "-d", "link").stdout)
            if link.get("link") == BOND or link.get("linkinfo", {}).get("info_kind") in ("macvlan", "ipvlan")]
    return {
        "pod links": [name for name in pod_links(pod) if name != "lo"],
        "records": sorted(p.name for p in state.glob("*.json")) if state.exists() else [],
        "pod info": sorted(str(p) for p in (lab.tmp / "podinfo").rglob("*.json")),
        "cdi": sorted(p.name for p in (lab.tmp / "cdi").glob("*.json")) if (lab.tmp / "cdi").exists() else [],
        "leases": sorted(p.name for p in leases.iterdir()
                         if p.name != "lock" and not p.name.startswith("last_reserved_ip")) if leases.exists() else [],
        "host sub-interfaces of bond0": subs,
    }


def clean(found: dict, allow_subs: tuple[str, ...] = ()) -> dict:
    found = dict(found)
    found["host sub-interfaces of bond0"] = [s for s in found["host sub-interfaces of bond0"] if s not in allow_subs]
    return {k: v for k, v in found.items() if v}


def check_attached(lab, net: dict, pod: str, result: dict) -> str:
    """ADD's effects: the pod's interface is a sub-interface of bond0, its address a RoCE v2 GID
    of rxeb with the pod's interface as ndev, its link-local one too, and the rail published as rxeb."""
    address = pod_address(result)
    iface = result["interfaces"][0]
    assert iface["name"] == "rdma0" and iface.get("sandbox") == f"/var/run/netns/{pod}", result
    assert iface.get("pciID") == DEVICE, f"the result names the rail's RDMA device: {iface}"
    inner = link_json("rdma0", pod)
    assert inner["linkinfo"]["info_kind"] == net["link"], inner
    parent = link_json(BOND)
    # Its lower lives in the host: `ip -j` gives its ifindex there (link_index, with link_netnsid).
    assert inner.get("link_index") == parent["ifindex"], f"rdma0's parent is not bond0 ({parent['ifindex']}): {inner}"
    if net["link"] == "ipvlan":
        assert inner["address"] == parent["address"], "an ipvlan carries its parent's (bond0's) MAC"
    wait_until(lambda: gid_ndevs(address) == ["rdma0"], 10,
               f"{address} is not a RoCE v2 GID of {DEVICE} with ndev rdma0: "
               f"{[(g.index, g.gid, g.gid_type, g.ndev) for g in table()]}")
    # One link-local address on the pod's interface (RoCE resolves peers from it), out of DAD, and
    # its GID: the pod's second entry per rail (an ipvlan's is its own too: each has its dev_id).
    lls = [a for a in json.loads(in_pod(pod, "ip", "-j", "-6", "addr", "show", "dev", "rdma0").stdout)[0]
           .get("addr_info", []) if a.get("scope") == "link"]
    assert len(lls) == 1 and not lls[0].get("tentative"), f"rdma0's link-local addresses: {lls}"
    wait_until(lambda: link_local_gids("rdma0") == [rdma_sysfs.gid_text(Prefix.parse(lls[0]["local"]))], 10,
               f"rdma0's link-local {lls[0]['local']} is not a GID: {link_local_gids('rdma0')}")
    info = json.loads((lab.tmp / "podinfo" / pod / "rdma0.json").read_text())
    rail = info["rails"][0]
    assert (rail["ifname"], rail["netdev"], rail["rdmaDevice"], rail["port"]) == ("rdma0", BOND, DEVICE, 1), rail
    at = [g for g in table() if g.index == rail["gidIndex"]]
    assert at and (at[0].gid, at[0].ndev) == (rdma_sysfs.gid_text(Prefix.parse(address)), "rdma0"), \
        f"published gidIndex {rail['gidIndex']} holds {at}"
    assert info["env"]["NCCL_IB_HCA"] == f"={DEVICE}:1", info["env"]
    return address


@pytest.mark.parametrize("link", ["macvlan", "ipvlan"])
@pytest.mark.parametrize("form", RAIL_FORMS)
def test_every_rail_form_attaches_the_pod_to_the_bond_and_its_rdma_device(lab, bond, form, link):
    net = conf(lab, form, bond, link)
    pod = lab.pod()
    assert clean(leftovers(lab, net, pod)) == {}, "a leftover of an earlier test"
    result = cni("ADD", net, pod).ok()
    address = check_attached(lab, net, pod, result)
    cni("CHECK", {**net, "prevResult": result}, pod).ok()
    cni("DEL", {**net, "prevResult": result}, pod).ok()
    assert clean(leftovers(lab, net, pod)) == {}
    assert gid_ndevs(address) == [], f"{address} is still a GID of {DEVICE} after DEL"
    # The bond is intact: both members still enslaved, rxeb still on the member.
    assert sorted(Path(f"/sys/class/net/{BOND}/bonding/slaves").read_text().split()) == sorted(bond.nics)
    assert DEVICE in os.listdir("/sys/class/infiniband")


def test_no_link_local_with_the_config_key(lab, bond):
    """"linkLocal": false: half the entries per pod, no fe80 GID of the pod's interface (and RC to
    unresolved peers fails: test_1_shared)."""
    net = conf(lab, "netdev", bond, "macvlan", linkLocal=False)
    pod = lab.pod()
    result = cni("ADD", net, pod).ok()
    address = pod_address(result)
    assert gid_ndevs(address) == ["rdma0"]
    assert link_local_gids("rdma0") == [], f"a link-local GID with \"linkLocal\": false: {link_local_gids('rdma0')}"
    cni("DEL", {**net, "prevResult": result}, pod).ok()
    assert clean(leftovers(lab, net, pod)) == {}


def fill_table(netdev: str) -> tuple[int, list[str]]:
    """Addresses on `netdev` until rxeb's table is full and the kernel refuses more; returns the
    table size and the addresses added."""
    port = rdma_sysfs.RdmaPort(DEVICE, 1)
    usage = rdma_sysfs.gid_usage(port)
    assert usage is not None
    added: list[str] = []
    # rxe: one entry per address. A few more than the free entries, so the last ones are refused.
    count = usage.total - usage.used + 4
    batch = Path("/tmp") / f"guestbond-fill-{os.getpid()}.batch"
    lines = []
    for i in range(1, count + 1):
        address = str(ipaddress.IPv6Address("fd00:7f::") + i)
        added.append(address)
        lines.append(f"address add {address}/128 dev {netdev} nodad")
    batch.write_text("\n".join(lines) + "\n")
    try:
        sh("ip", "-b", str(batch), timeout=600)
    finally:
        batch.unlink(missing_ok=True)
    wait_until(lambda: rdma_sysfs.gid_usage(port).used == usage.total, 60,
               f"{DEVICE}'s table never filled: {rdma_sysfs.gid_usage(port)}")
    last = rdma_sysfs.find_gid(port, Prefix.parse(added[-1]))
    assert last is None, f"the table is full, yet {added[-1]} got GID {last.index if last else None}"
    return usage.total, added


def dp_healthy(dp, at_most: int | None = None, at_least: int | None = None, timeout: float = 120) -> dict:
    """The device plugin's health file once its healthy count is within the bounds (it re-reads
    the GID tables every pass; a pass over rxe's 1024 entries takes about a second here)."""
    deadline = time.monotonic() + timeout
    while True:
        line = dp.health()["resources"][RESOURCE]
        if (at_most is None or line["healthy"] <= at_most) and (at_least is None or line["healthy"] >= at_least):
            return line
        assert time.monotonic() < deadline, f"healthy units stayed at {line['healthy']}: {line}\n{dp.log()}"
        time.sleep(1)


def test_a_full_gid_table_fails_add_with_104_and_leaves_nothing(lab, bond, start_dp):
    dp = start_dp("shared", {"rdmaDevices": [DEVICE]})
    dp.connect()
    before = dp_healthy(dp, at_least=1000)
    assert before["gidCapacity"]["ports"][0]["total"] == 1024, before
    filler = "bfill"
    sh("ip", "link", "add", filler, "link", BOND, "type", "macvlan", "mode", "bridge")
    lab.links.append(filler)
    sh("ip", "link", "set", filler, "addrgenmode", "none")
    sh("ip", "link", "set", filler, "up")
    sh("dmesg", "-C")
    total, added = fill_table(filler)
    dmesg = sh("dmesg").stdout
    assert "__ib_cache_gid_add: unable to add gid" in dmesg and "error=-28" in dmesg, \
        f"the kernel did not log the refused GIDs: {dmesg[-2000:]}"

    net = conf(lab, "netdev", bond, "macvlan", gidWaitMs=3000)
    pod = lab.pod()
    err = cni("ADD", net, pod).error(104)
    print("ADD on a full table:", err["msg"])
    assert f"GID table of {DEVICE} port 1 is full ({total}/{total} entries" in err["msg"], err
    assert clean(leftovers(lab, net, pod), allow_subs=(filler,)) == {}, "the failed ADD left something"
    cni("DEL", net, pod).ok()  # the runtime's rollback DEL
    # The device plugin saw it too: no table entry left, so no Healthy unit for the scheduler.
    full = dp_healthy(dp, at_most=0)
    assert full["gidCapacity"]["morePods"] == 0 and full["devices"] == 1000, full

    # Free the addresses: the next ADD works and its address becomes a GID.
    sh("ip", "link", "del", filler)
    lab.links.remove(filler)
    wait_until(lambda: rdma_sysfs.gid_usage(rdma_sysfs.RdmaPort(DEVICE, 1)).used < 8, 60,
               "the filler's GIDs did not go")
    assert dp_healthy(dp, at_least=1000)["healthy"] == 1000, "the units come back when the addresses go"
    result = cni("ADD", net, pod).ok()
    address = check_attached(lab, net, pod, result)
    cni("DEL", {**net, "prevResult": result}, pod).ok()
    assert clean(leftovers(lab, net, pod)) == {} and gid_ndevs(address) == []
