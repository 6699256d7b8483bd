"""rangeFromNodeAddress: this node's pod range from its address on the rail (node_range.derive),
and the config contract around it. Netns tests run it against the kernel (tests/netns/test_node_range.py)."""

from __future__ import annotations

import ipaddress
import random

import pytest

from rdma_netns.config import model
from rdma_netns.kernel import rtnl
from rdma_netns.kernel.inet import Prefix
from rdma_netns.rails import node_range
from rdma_netns.spec.errors import NO_NODE_RANGE

LINK = rtnl.RT_SCOPE_LINK


def addr(text: str, flags: int = 0, scope: int = rtnl.RT_SCOPE_UNIVERSE) -> rtnl.Address:
    return rtnl.Address(7, Prefix.parse(text), flags, scope)


def covered(found: node_range.NodeRange) -> set[ipaddress.IPv6Address]:
    """Every address the ranges hand out (small blocks only)."""
    out = set()
    for r in found.ranges():
        first, last = int(ipaddress.IPv6Address(r["rangeStart"])), int(ipaddress.IPv6Address(r["rangeEnd"]))
        out.update(ipaddress.IPv6Address(v) for v in range(first, last + 1))
    return out


def test_the_block_of_the_node_address_less_the_node_and_the_block_start():
    found = node_range.derive("bond0", [addr("fe80::1/64", scope=LINK), addr("fd00:10::3:1/64")], {"prefixLength": 112})
    assert str(found.block) == "fd00:10::3:0/112"
    assert found.ranges() == [{"subnet": "fd00:10::/64", "rangeStart": "fd00:10::3:2", "rangeEnd": "fd00:10::3:ffff"}]
    assert [str(a) for a in found.node_addresses] == ["fd00:10::3:1/128"]
    assert found.to_state() == {"netdev": "bond0", "subnet": "fd00:10::/64", "block": "fd00:10::3:0/112",
                                "nodeAddresses": ["fd00:10::3:1/128"]}


def test_the_ipam_keeps_its_own_keys_and_gets_the_ranges():
    found = node_range.derive("eth1", [addr("fd00:10::3:1/64")], {"prefixLength": 112})
    ipam = found.ipam({"type": "host-local", "dataDir": "/x", "routes": [{"dst": "fd00::/16"}]})
    assert ipam == {"type": "host-local", "dataDir": "/x", "routes": [{"dst": "fd00::/16"}],
                    "ranges": [[{"subnet": "fd00:10::/64", "rangeStart": "fd00:10::3:2",
                                 "rangeEnd": "fd00:10::3:ffff"}]]}


def test_without_prefix_length_the_block_is_the_address_own_prefix():
    """A routed fabric giving each node's rail a prefix of its own: the whole prefix is the node's."""
    found = node_range.derive("eth1", [addr("2001:db8:7:12::a/120")], {})
    assert str(found.block) == "2001:db8:7:12::/120" and str(found.subnet) == "2001:db8:7:12::/120"
    assert found.ranges() == [
        {"subnet": "2001:db8:7:12::/120", "rangeStart": "2001:db8:7:12::1", "rangeEnd": "2001:db8:7:12::9"},
        {"subnet": "2001:db8:7:12::/120", "rangeStart": "2001:db8:7:12::b", "rangeEnd": "2001:db8:7:12::ff"}]


def test_every_node_address_in_the_block_is_left_out_whatever_its_flags():
    addresses = [addr("fd00:10::3:1/64"), addr("fd00:10::3:9/64", rtnl.IFA_F_DEPRECATED),
                 addr("fd00:10::3:20/64", rtnl.IFA_F_TEMPORARY), addr("fd00:10::3:ff/64", rtnl.IFA_F_TENTATIVE)]
    found = node_range.derive("eth1", addresses, {"prefixLength": 120})
    handed = covered(found)
    assert len(handed) == 256 - 1 - 4
    for a in addresses:
        assert ipaddress.IPv6Address(a.interface.address_text()) not in handed
    assert ipaddress.IPv6Address("fd00:10::3:0") not in handed


def test_no_global_address_is_a_clear_refusal():
    with pytest.raises(Exception) as err:
        node_range.derive("bond0", [addr("fe80::1/64", scope=LINK), addr("10.0.0.5/24")], {"prefixLength": 112})
    assert err.value.code == NO_NODE_RANGE
    assert "rail bond0 has no global IPv6 address" in err.value.msg


def test_a_temporary_or_failed_address_is_not_the_node_address():
    with pytest.raises(Exception) as err:
        node_range.derive("eth1", [addr("fd00:10::3:1/64", rtnl.IFA_F_DADFAILED),
                                   addr("fd00:10::3:2/64", rtnl.IFA_F_TEMPORARY)], {"prefixLength": 112})
    assert err.value.code == NO_NODE_RANGE


def test_several_blocks_are_refused_and_within_chooses():
    addresses = [addr("fd00:10::3:1/64"), addr("2001:db8::3:1/64")]
    with pytest.raises(Exception) as err:
        node_range.derive("eth1", addresses, {"prefixLength": 112})
    assert err.value.code == NO_NODE_RANGE and "2 blocks" in err.value.msg and "within" in err.value.details
    found = node_range.derive("eth1", addresses, {"prefixLength": 112, "within": "fd00::/16"})
    assert str(found.block) == "fd00:10::3:0/112"
    with pytest.raises(Exception) as err:
        node_range.derive("eth1", addresses, {"prefixLength": 112, "within": "fd99::/16"})
    assert "within fd99::/16" in err.value.msg


def test_two_addresses_in_one_block_are_one_range():
    found = node_range.derive("eth1", [addr("fd00:10::3:1/64"), addr("fd00:10::3:2/64")], {"prefixLength": 112})
    assert found.ranges()[0]["rangeStart"] == "fd00:10::3:3"


def test_a_deprecated_address_gives_way_to_the_new_one():
    """Renumbering: the old address is on its way out, the new one decides."""
    found = node_range.derive("eth1", [addr("fd00:10::3:1/64", rtnl.IFA_F_DEPRECATED), addr("fd00:10::4:1/64")],
                              {"prefixLength": 112})
    assert str(found.block) == "fd00:10::4:0/112"


def test_a_block_wider_than_the_rail_prefix_or_too_small_is_refused():
    with pytest.raises(Exception) as err:
        node_range.derive("eth1", [addr("fd00:10::3:1/120")], {"prefixLength": 112})
    assert err.value.code == NO_NODE_RANGE and "shorter than" in err.value.msg
    with pytest.raises(Exception) as err:
        node_range.derive("eth1", [addr("fd00:10::3:1/127")], {})
    assert err.value.code == NO_NODE_RANGE and "no room" in err.value.msg


def test_distinct_node_addresses_in_distinct_blocks_never_share_a_pod_address():
    """The plan's promise kept: 200 nodes numbered in their own /112 of one flat /64."""
    rng = random.Random(7)
    blocks = rng.sample(range(1, 1 << 16), 200)
    seen: dict = {}
    for n in blocks:
        node = f"fd00:10::{n:x}:{rng.randrange(1, 1 << 16):x}/64"
        found = node_range.derive("eth1", [addr(node)], {"prefixLength": 112})
        for r in found.ranges():
            first = int(ipaddress.IPv6Address(r["rangeStart"]))
            last = int(ipaddress.IPv6Address(r["rangeEnd"]))
            for other, (a, b) in seen.items():
                assert last < a or first > b, f"{node} overlaps {other}"
        seen[node] = (int(ipaddress.IPv6Address(found.ranges()[0]["rangeStart"])),
                      int(ipaddress.IPv6Address(found.ranges()[-1]["rangeEnd"])))


def base(**extra) -> dict:
    conf = {"cniVersion": "1.0.0", "name": "n", "type": "rdma-netns", "mode": "shared", "pairing": False,
            "ipam": {"type": "host-local"}, "rangeFromNodeAddress": {"prefixLength": 112}}
    conf.update(extra)
    return conf


def test_model_accepts_the_rule_top_level_and_per_rail():
    out = model.validate(base())
    assert out["rangeFromNodeAddress"] == {"prefixLength": 112, "within": None}
    out = model.validate(base(rangeFromNodeAddress=None, rails=[
        {"netdev": "bond0", "rangeFromNodeAddress": {"within": "fd00:0:0::/16"}}]))
    assert out["rails"][0]["rangeFromNodeAddress"] == {"prefixLength": None, "within": "fd00::/16"}


@pytest.mark.parametrize("change, reason", [
    ({"ipam": {"type": "host-local", "ranges": [[{"subnet": "fd00::/64"}]]}}, "ranges"),
    ({"ipam": {"type": "static"}}, "host-local"),
    ({"mode": "exclusive"}, "shared mode"),
    ({"rangeFromNodeAddress": {"prefixLength": 126}}, "124"),
    ({"rangeFromNodeAddress": {"within": "10.0.0.0/8"}}, "IPv6 prefix"),
    ({"rangeFromNodeAddress": {"within": "fd00::"}}, "IPv6 prefix"),
    ({"rangeFromNodeAddress": {"prefix": 112}}, "unknown field"),
])
def test_model_refuses_what_the_rule_cannot_serve(change, reason):
    with pytest.raises(Exception) as err:
        model.validate(base(**change))
    assert reason in model.describe_errors(err.value)


def test_a_rail_with_its_own_ranges_stays_static_under_the_top_level_rule():
    from rdma_netns.config.netconf import NetConfig

    static = {"type": "host-local", "ranges": [[{"subnet": "fd00:9::/64"}]]}
    out = model.validate(base(stateDir="/s", rails=[{"netdev": "eth1"}, {"netdev": "eth2", "ipam": static},
                                                    {"netdev": "eth3", "ipam": {"type": "host-local"}}]))
    net = NetConfig(out)
    assert [net.range_rule(r) for r in net.rails] == [{"prefixLength": 112, "within": None}, None,
                                                      {"prefixLength": 112, "within": None}]
    with pytest.raises(Exception) as err:  # the rail's own rule with its own ranges: one or the other
        model.validate(base(rails=[{"netdev": "eth2", "ipam": static, "rangeFromNodeAddress": {}}]))
    assert "ranges" in model.describe_errors(err.value)
