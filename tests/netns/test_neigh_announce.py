"""After ADD, a peer on the same L2 that held a stale neighbour entry for the pod's address sees the new MAC.

Pods get macvlan bridge rails on one veth, so two pods on rail0 share an L2. Each case first shows
the failure the announcement fixes: a control pod takes the address by hand (`nodad`, as the
plugin adds it) and the peer's entry stays on the old MAC. The frames themselves are captured on
the peer's interface and checked field by field (the ICMPv6 checksum the kernel filled in too).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.netns.conftest import ip, ipj

pytestmark = pytest.mark.netns

OLD_MAC = "02:00:00:00:be:ef"
CASES = {
    "ipv6": {"subnet": "fd00:1::/64", "peer": "fd00:1::10", "addr": "fd00:1::20", "plen": 64},
    "ipv4": {"subnet": "10.77.0.0/24", "peer": "10.77.0.10", "addr": "10.77.0.20", "plen": 24},
}

# Runs inside the peer's namespace: print "ready", then the hex of the first NA or ARP frame about
# the address (or nothing after the timeout).
CAPTURE = r"""
import socket, sys, time
ifname, target, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
family = socket.AF_INET6 if ":" in target else socket.AF_INET
packed = socket.inet_pton(family, target)
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
s.bind((ifname, 0))
s.settimeout(0.05)
print("ready", flush=True)
end = time.monotonic() + timeout
while time.monotonic() < end:
    try:
        frame = s.recv(2048)
    except TimeoutError:
        continue
    kind = frame[12:14]
    if kind == b"\x86\xdd" and frame[20] == 58 and frame[54] == 136 and frame[62:78] == packed:
        print(frame.hex(), flush=True); break
    if kind == b"\x08\x06" and frame[28:32] == packed:
        print(frame.hex(), flush=True); break
"""


def ipam_for(node, case: dict, address: str) -> dict:
    return node.ipam(case["subnet"], rangeStart=address, rangeEnd=address)


def neigh_mac(pod: str, address: str, dev: str = "net1") -> str | None:
    entries = ipj("-n", pod, "neigh", "show", address, "dev", dev)
    return entries[0].get("lladdr") if entries else None


def wait_for_mac(pod: str, address: str, mac: str, budget: float) -> tuple[str | None, float]:
    """Poll the peer's entry for at most `budget` seconds; (last MAC seen, seconds waited)."""
    start = time.monotonic()
    while True:
        seen = neigh_mac(pod, address)
        waited = time.monotonic() - start
        if seen == mac or waited > budget:
            return seen, waited
        time.sleep(0.01)


def make_stale(pod: str, address: str) -> None:
    ip("-n", pod, "neigh", "replace", address, "lladdr", OLD_MAC, "dev", "net1", "nud", "reachable")
    assert neigh_mac(pod, address) == OLD_MAC


def hand_made_pod(node, name_suffix: str) -> tuple[str, str]:
    """A pod with a macvlan on rail0 made with `ip`, not the plugin: the control, and the fallback case."""
    pod = node.pod()
    ifname = f"ctl{name_suffix}"
    ip("-n", node.name, "link", "add", ifname, "link", "rail0", "type", "macvlan", "mode", "bridge")
    ip("-n", node.name, "link", "set", ifname, "netns", pod)
    ip("-n", pod, "link", "set", ifname, "up")
    return pod, ifname


def capture(pod: str, address: str, timeout: float = 3.0) -> subprocess.Popen:
    proc = subprocess.Popen(["ip", "netns", "exec", pod, sys.executable, "-c", CAPTURE, "net1", address, str(timeout)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    return proc


def icmpv6_checksum_ok(src: bytes, dst: bytes, body: bytes) -> bool:
    data = src + dst + len(body).to_bytes(4, "big") + b"\0\0\0" + bytes([58]) + body
    if len(data) % 2:
        data += b"\0"
    total = sum(int.from_bytes(data[i:i + 2], "big") for i in range(0, len(data), 2))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return total == 0xFFFF


def check_frame(hexframe: str, case: dict, mac: str) -> None:
    frame = bytes.fromhex(hexframe)
    mac_b = bytes.fromhex(mac.replace(":", ""))
    family = 6 if ":" in case["addr"] else 4
    from rdma_netns.kernel.inet import Prefix

    packed = Prefix.parse(case["addr"]).packed
    assert frame[6:12] == mac_b, "Ethernet source must be the pod's MAC"
    if family == 6:
        ip6, icmp = frame[14:54], frame[54:]
        payload_len = int.from_bytes(ip6[4:6], "big")
        icmp = icmp[:payload_len]
        assert frame[0:6] == bytes.fromhex("333300000001"), "to the all-nodes group's MAC"
        assert ip6[7] == 255, "hop limit must be 255 or receivers drop the NA"
        assert ip6[8:24] == packed, "source = the address itself"
        assert ip6[24:40] == Prefix.parse("ff02::1").packed
        assert icmp[0] == 136 and icmp[1] == 0
        assert icmp[4] & 0xE0 == 0x20, "O set, R and S clear"
        assert icmp[8:24] == packed
        assert icmp[24:32] == b"\x02\x01" + mac_b, "Target Link-Layer Address option"
        assert icmp[2:4] != b"\0\0" and icmpv6_checksum_ok(ip6[8:24], ip6[24:40], icmp), "the kernel fills the checksum"
    else:
        arp = frame[14:42]
        assert frame[0:6] == b"\xff" * 6, "broadcast"
        assert frame[12:14] == b"\x08\x06"
        assert arp[0:8] == bytes.fromhex("0001080006040001"), "Ethernet/IPv4 ARP request"
        assert arp[8:14] == mac_b, "sender MAC = the pod's"
        assert arp[14:18] == packed and arp[24:28] == packed, "sender IP = target IP = the address"


@pytest.mark.parametrize("family", sorted(CASES))
def test_peer_with_a_stale_entry_learns_the_new_mac_right_after_add(node, family):
    case = CASES[family]
    peer = node.pod()
    conf = node.conf()
    conf["rails"][0]["ipam"] = ipam_for(node, case, case["peer"])
    node.cni("ADD", conf, peer, container_id="peer").ok()
    make_stale(peer, case["addr"])

    # Control: the address taken the way the plugin takes it, without an announcement. The peer
    # keeps the old MAC, so the check below can fail.
    control, ctl_if = hand_made_pod(node, "0")
    extra = ["nodad"] if family == "ipv6" else []
    ip("-n", control, "addr", "add", f"{case['addr']}/{case['plen']}", "dev", ctl_if, *extra)
    time.sleep(0.3)
    assert neigh_mac(peer, case["addr"]) == OLD_MAC, "without an announcement the peer must stay stale"
    ip("-n", control, "link", "del", ctl_if)
    make_stale(peer, case["addr"])

    sniffer = capture(peer, case["addr"])
    pod = node.pod()
    conf["rails"][0]["ipam"] = ipam_for(node, case, case["addr"])
    result = node.cni("ADD", conf, pod, container_id="new").ok()
    mac = result["interfaces"][0]["mac"]
    assert result["ips"][0]["address"] == f"{case['addr']}/{case['plen']}"
    seen, waited = wait_for_mac(peer, case["addr"], mac, budget=0.2)
    assert seen == mac, f"peer still has {seen} for {case['addr']} {waited * 1000:.0f} ms after ADD, not {mac}"

    out, err = sniffer.communicate(timeout=10)
    assert out.strip(), f"no announcement captured on the peer: {err}"
    check_frame(out.strip(), case, mac)
    # The kernel-sent gratuitous ARP uses a throw-away neighbour entry: none may be left in the pod.
    assert ipj("-n", pod, "neigh") == []


def test_secondary_ipv4_address_is_announced_too(node):
    """The kernel would send a secondary's probe from the primary; it goes out by AF_PACKET instead."""
    case = CASES["ipv4"]
    peer = node.pod()
    conf = node.conf()
    conf["rails"][0]["ipam"] = ipam_for(node, case, case["peer"])
    node.cni("ADD", conf, peer, container_id="peer").ok()
    addresses = ["10.77.0.30", "10.77.0.31", "fd00:1::31"]
    for address in addresses:
        make_stale(peer, address)
    pod, ifname = hand_made_pod(node, "1")
    ip("-n", pod, "addr", "add", "10.77.0.30/24", "dev", ifname)
    ip("-n", pod, "addr", "add", "10.77.0.31/24", "dev", ifname)
    ip("-n", pod, "addr", "add", "fd00:1::31/64", "dev", ifname, "nodad")
    (secondary,) = [a for a in ipj("-n", pod, "addr", "show", "dev", ifname)[0]["addr_info"]
                    if a.get("local") == "10.77.0.31"]
    assert secondary.get("secondary"), secondary
    mac = ipj("-n", pod, "link", "show", ifname)[0]["address"]

    script = (
        "import json, sys\n"
        "from rdma_netns.kernel import neigh_announce, rtnl\n"
        "from rdma_netns.kernel.inet import Prefix\n"
        "from rdma_netns.kernel.netlink import NetlinkSocket\n"
        "with NetlinkSocket() as s:\n"
        "    link = rtnl.get_link(s, sys.argv[1])\n"
        "    print(json.dumps(neigh_announce.send(s, link, [Prefix.parse(a) for a in sys.argv[2:]])))\n"
    )
    proc = subprocess.run(["ip", "netns", "exec", pod, sys.executable, "-c", script, ifname,
                           "10.77.0.30/24", "10.77.0.31/24", "fd00:1::31/64"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    sent, failures = json.loads(proc.stdout)
    assert (sent, failures) == (3, []), "every announcement must go out (tests fail loudly, ADD does not)"
    for address in addresses:
        seen, waited = wait_for_mac(peer, address, mac, budget=0.2)
        assert seen == mac, f"{address}: peer has {seen} after {waited * 1000:.0f} ms, not {mac}"
    assert ipj("-n", pod, "neigh") == []

