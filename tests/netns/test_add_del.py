"""ADD and DEL in real namespaces: what the pod gets, and that DEL leaves nothing behind."""

from __future__ import annotations

import ipaddress
import os
import stat
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.netns.conftest import ip, ipj

pytestmark = pytest.mark.netns


def pod_sysctl(pod: str, ifname: str, key: str) -> str:
    return subprocess.run(["ip", "netns", "exec", pod, "cat", f"/proc/sys/net/ipv6/conf/{ifname}/{key}"],
                          check=True, capture_output=True, text=True).stdout.strip()


def test_add_gives_the_pod_a_macvlan_with_usable_ipv6(node):
    pod = node.pod()
    result = node.cni("ADD", node.conf(), pod).ok()

    assert result["cniVersion"] == "1.1.0"
    (iface,) = result["interfaces"]
    assert iface["name"] == "net1" and iface["sandbox"] == node.netns_path(pod)
    (addr,) = result["ips"]
    assert addr["interface"] == 0
    assert ipaddress.ip_interface(addr["address"]).network == ipaddress.ip_network("fd00:1::/64")
    assert addr["gateway"] == "fd00:1::1"

    link = node.links(pod)["net1"]
    assert link["linkinfo"]["info_kind"] == "macvlan"
    assert link["linkinfo"]["info_data"]["mode"] == "bridge"
    assert link["address"] == iface["mac"]
    assert "UP" in link["flags"]
    (global_addr,) = node.addresses(pod, "net1")
    assert f"{global_addr['local']}/{global_addr['prefixlen']}" == addr["address"]
    assert not global_addr.get("tentative"), "the address must be usable when ADD returns (nodad)"
    assert pod_sysctl(pod, "net1", "accept_ra") == "0"
    assert pod_sysctl(pod, "net1", "keep_addr_on_down") == "1"
    assert pod_sysctl(pod, "net1", "disable_ipv6") == "0"


def _link_local(node, pod: str, ifname: str) -> list[str]:
    out = ipj("-6", "-n", pod, "address", "show", "dev", ifname)
    return [a["local"] for a in out[0]["addr_info"] if a.get("scope") == "link"] if out else []


def test_rail_interfaces_keep_a_usable_link_local_address_unless_told_not_to(node):
    """RoCE resolves a peer's MAC with a neighbour solicitation whose source must be a link-local
    address that is not tentative (the kernel sends none otherwise, and an RC QP fails at RTR):
    each rail has one, out of DAD, when ADD returns. "linkLocal": false gives that up for GID room
    (addr_gen_mode 1): then only the pod's own address is on the rail."""
    pod = node.pod()
    node.cni("ADD", node.conf(rails=2), pod).ok()
    for ifname in ("rdma0", "rdma1"):
        assert pod_sysctl(pod, ifname, "addr_gen_mode") == "0"
        assert pod_sysctl(pod, ifname, "accept_dad") == "0"
        (link_local,) = [a for a in ipj("-6", "-n", pod, "address", "show", "dev", ifname)[0]["addr_info"]
                         if a.get("scope") == "link"]
        assert link_local["local"].startswith("fe80:")
        assert not link_local.get("tentative"), f"{ifname}: a tentative link-local sources no solicitation"
    refused = node.pod()
    node.cni("ADD", node.conf(rails=2, linkLocal=False), refused, container_id="c2").ok()
    for ifname in ("rdma0", "rdma1"):
        assert pod_sysctl(refused, ifname, "addr_gen_mode") == "1"
        assert _link_local(node, refused, ifname) == []
        assert len(node.addresses(refused, ifname)) == 1


def test_per_rail_table_and_source_rule(node):
    pod = node.pod()
    conf = node.conf(rails=2)
    for rail in conf["rails"]:  # every rail reaches the whole fabric through its own gateway
        rail["ipam"]["routes"] = [{"dst": "fd00::/16"}]
    result = node.cni("ADD", conf, pod).ok()
    assert [i["name"] for i in result["interfaces"]] == ["rdma0", "rdma1"]
    links = node.links(pod)
    rules = ipj("-6", "-n", pod, "rule")
    for ifname, ipinfo in zip(("rdma0", "rdma1"), result["ips"]):
        address = ipinfo["address"].split("/")[0]
        table = 100 + links[ifname]["ifindex"]
        assert {"priority": 1000, "src": address, "table": str(table)}.items() <= \
            next(r for r in rules if r.get("src") == address).items()
        routes = ipj("-6", "-n", pod, "route", "show", "table", str(table))
        assert any(r["dst"] == ipaddress.ip_interface(ipinfo["address"]).network.compressed and r["dev"] == ifname
                   for r in routes), routes
        # Traffic from this rail's address leaves by this rail, through its own gateway.
        (got,) = ipj("-6", "-n", pod, "route", "get", "fd00:99::1", "from", address)
        assert got["dev"] == ifname and got["gateway"] == ipinfo["gateway"], got


def test_two_pods_ping_over_ipv6_right_after_add(node):
    pod_a, pod_b = node.pod(), node.pod()
    res_a = node.cni("ADD", node.conf(), pod_a, container_id="a").ok()
    res_b = node.cni("ADD", node.conf(), pod_b, container_id="b").ok()
    addr_b = res_b["ips"][0]["address"].split("/")[0]
    addr_a = res_a["ips"][0]["address"].split("/")[0]
    assert addr_a != addr_b
    ping = subprocess.run(["ip", "netns", "exec", pod_a, "ping", "-6", "-c", "2", "-W", "2", "-I", addr_a, addr_b],
                          capture_output=True, text=True)
    assert ping.returncode == 0, ping.stdout + ping.stderr


def kernel_has_ipvlan() -> bool:
    """Probe in a throw-away namespace: does this kernel know the ipvlan link type?"""
    if os.geteuid() != 0:
        return False
    ip("netns", "add", "rnt-ipvlan-probe", check=False)
    try:
        probe = ip("-n", "rnt-ipvlan-probe", "link", "add", "p", "link", "lo", "type", "ipvlan", check=False)
        return "Unknown device type" not in probe.stderr
    finally:
        ip("netns", "del", "rnt-ipvlan-probe", check=False)


@pytest.mark.skipif(not kernel_has_ipvlan(), reason="this kernel is built without ipvlan (CONFIG_IPVLAN off)")
def test_ipvlan_link(node):
    pod = node.pod()
    node.cni("ADD", node.conf(link="ipvlan"), pod).ok()
    link = node.links(pod)["net1"]
    assert link["linkinfo"]["info_kind"] == "ipvlan"
    assert link["linkinfo"]["info_data"]["mode"] == "l2"
    node.cni("DEL", node.conf(link="ipvlan"), pod).ok()
    assert "net1" not in node.links(pod)


def test_del_releases_everything_and_is_idempotent(node):
    pod = node.pod()
    conf = node.conf(rails=2)
    node.cni("ADD", conf, pod).ok()
    assert len(node.allocations()) == 2
    node.cni("DEL", conf, pod).ok()
    assert set(node.links(pod)) == {"lo"}
    assert [r for r in ipj("-6", "-n", pod, "rule") if r.get("src", "all") != "all"] == []
    assert node.allocations() == []
    assert node.attachment_records() == []
    node.cni("DEL", conf, pod).ok()  # twice


def test_del_after_the_netns_is_gone(node):
    pod = node.pod()
    node.cni("ADD", node.conf(), pod).ok()
    ip("netns", "del", pod)
    node.cni("DEL", node.conf(), pod).ok()
    assert node.allocations() == []
    assert node.attachment_records() == []


def test_del_with_empty_netns_and_with_missing_state(node):
    pod = node.pod()
    node.cni("ADD", node.conf(), pod, container_id="x").ok()
    node.cni("DEL", node.conf(), netns="", container_id="x").ok()
    assert node.allocations() == []

    node.cni("ADD", node.conf(), pod, container_id="y").ok()
    for f in (Path(node.state_dir) / "rdmanet").glob("*.json"):
        f.unlink()
    node.cni("DEL", node.conf(), pod, container_id="y").ok()
    assert node.allocations() == [], "DEL without state still releases IPAM from the config"
    assert "net1" not in node.links(pod), "and removes the sub-interface it would have made"


def test_del_when_the_rail_link_was_already_removed(node):
    pod = node.pod()
    node.cni("ADD", node.conf(), pod).ok()
    ip("-n", pod, "link", "del", "net1")
    node.cni("DEL", node.conf(), pod).ok()
    assert node.allocations() == []


def test_state_files_are_private(node):
    pod = node.pod()
    node.cni("ADD", node.conf(), pod).ok()
    root = Path(node.state_dir)
    for folder in (root, root / "rdmanet", root / "locks", root / "verified-configs"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    for f in list((root / "rdmanet").iterdir()) + list((root / "verified-configs").iterdir()):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


@pytest.mark.parametrize("version", ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"])
def test_result_in_every_supported_version(node, version):
    pod = node.pod()
    result = node.cni("ADD", node.conf(version=version), pod).ok()
    assert result["cniVersion"] == version
    (ipinfo,) = result["ips"]
    if version.startswith("0."):
        assert ipinfo["version"] == "6"
    else:
        assert "version" not in ipinfo
    node.cni("DEL", node.conf(version=version), pod).ok()


def test_chained_after_another_plugin_passes_prev_result_on(node):
    pod = node.pod()
    prev = {"cniVersion": "1.0.0", "interfaces": [{"name": "eth0", "sandbox": node.netns_path(pod)}],
            "ips": [{"address": "10.1.0.5/24", "interface": 0}], "dns": {"nameservers": ["10.0.0.10"]}}
    result = node.cni("ADD", node.conf(prevResult=prev), pod, ifname="eth0").ok()
    assert [i["name"] for i in result["interfaces"]] == ["eth0", "rdma0"]
    assert result["ips"][0] == {"address": "10.1.0.5/24", "interface": 0}
    assert result["ips"][1]["interface"] == 1
    assert result["dns"] == {"nameservers": ["10.0.0.10"]}
    node.cni("DEL", node.conf(prevResult=prev), pod, ifname="eth0").ok()
    assert "rdma0" not in node.links(pod)


def test_runtime_config_mac(node):
    pod = node.pod()
    conf = node.conf(runtimeConfig={"mac": "02:11:22:33:44:55"})
    result = node.cni("ADD", conf, pod).ok()
    assert result["interfaces"][0]["mac"] == "02:11:22:33:44:55"
    assert node.links(pod)["net1"]["address"] == "02:11:22:33:44:55"


def test_cni_args_mac_as_podman_sends_it(node):
    pod = node.pod()
    result = node.cni("ADD", node.conf(), pod,
                      extra_env={"CNI_ARGS": "IgnoreUnknown=1;MAC=02:11:22:33:44:66"}).ok()
    assert node.links(pod)["net1"]["address"] == "02:11:22:33:44:66" == result["interfaces"][0]["mac"]
    bad = node.cni("ADD", node.conf(), node.pod(), extra_env={"CNI_ARGS": "IgnoreUnknown=1;MAC=zz"})
    assert bad.error(4)


def test_two_networks_in_one_pod_get_separate_tables(node):
    pod = node.pod()
    node.cni("ADD", node.conf(), pod, ifname="net1").ok()
    other = node.conf(name="second", rails=1)
    other["rails"][0]["netdev"] = "rail1"
    node.cni("ADD", other, pod, ifname="net2").ok()
    tables = {r["table"] for r in ipj("-6", "-n", pod, "rule") if r.get("src", "all") != "all"}
    assert len(tables) == 2
    node.cni("DEL", other, pod, ifname="net2").ok()
    node.cni("CHECK", node.conf(), pod, ifname="net1").ok()


def test_concurrent_adds_and_dels(node):
    pods = [node.pod() for _ in range(12)]
    conf = node.conf()
    with ThreadPoolExecutor(max_workers=12) as pool:
        results = list(pool.map(lambda p: node.cni("ADD", conf, p, container_id=p), pods))
    addresses = {r.ok()["ips"][0]["address"] for r in results}
    assert len(addresses) == 12
    with ThreadPoolExecutor(max_workers=12) as pool:
        for r in pool.map(lambda p: node.cni("DEL", conf, p, container_id=p), pods):
            r.ok()
    assert node.allocations() == []


def test_config_verdict_is_cached_once_per_config(node):
    pod = node.pod()
    node.cni("ADD", node.conf(), pod).ok()
    cache = list((Path(node.state_dir) / "verified-configs").iterdir())
    assert len(cache) == 1
    # The runtime's per-call keys do not make a new entry.
    node.cni("DEL", node.conf(runtimeConfig={"mac": "02:00:00:00:00:01"}), pod).ok()
    assert list((Path(node.state_dir) / "verified-configs").iterdir()) == cache
    assert os.path.getsize(cache[0]) > 0


def test_del_takes_the_rails_links_together_and_nothing_else(node):
    """DEL deletes a pod's rail links as one device group (one RCU grace period for all); the
    pod's other interfaces (another plugin's eth0, a link already in some group, another
    network's rail) stay as they were."""
    pod = node.pod()
    ip("-n", pod, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0p")
    ip("-n", pod, "link", "add", "grouped", "type", "veth", "peer", "name", "groupedp")
    ip("-n", pod, "link", "set", "grouped", "group", "7")
    conf = node.conf(rails=2)
    other = node.conf(name="second", rails=1)
    other["rails"][0]["netdev"] = "rail1"
    other["rails"][0]["ifname"] = "extra0"
    node.cni("ADD", conf, pod).ok()
    node.cni("ADD", other, pod, ifname="extra0").ok()
    before = set(node.links(pod))
    assert {"rdma0", "rdma1", "extra0", "eth0", "grouped"} <= before
    deleted = node.cni("DEL", conf, pod)
    deleted.ok()
    assert "one by one" not in deleted.stderr, deleted.stderr  # the group deletion itself worked
    assert set(node.links(pod)) == before - {"rdma0", "rdma1"}
    assert node.links(pod)["grouped"].get("group") in (7, "7")
    node.cni("DEL", other, pod, ifname="extra0").ok()  # one rail: the plain deletion
    assert "extra0" not in node.links(pod)
    assert node.allocations() == [] and node.allocations("second") == []
