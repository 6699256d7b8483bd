"""This node's pod range on a rail, derived from the node's own address there (rangeFromNodeAddress).

Why: the DaemonSet gives every node the same config, and host-local keeps its leases on each
node, so a fixed range per rail hands the same addresses out on every node (on a flat rail the
newest duplicate's neighbour advertisement then steals the older pod's traffic). The node's own
global address on the rail is unique on that rail already. Its block at `prefixLength` (the
address's own prefix length by default) becomes this node's pod range, less the node's own
addresses and the block's first one; the pods' prefix length stays the rail's (the address's), so
every pod reaches every other node's pods on the segment. Two nodes can share a block only if
their addresses share it, which the address plan rules out (docs/configuration.md: "One config for the whole
cluster"). Computed at ADD from one address dump, recorded in the rail's state: DEL releases from
the recorded range even if the node's address changed meanwhile.
"""

from __future__ import annotations

from _socket import AF_INET6

from rdma_netns.kernel import rtnl
from rdma_netns.kernel.inet import Prefix
from rdma_netns.kernel.netlink import NetlinkSocket
from rdma_netns.spec.errors import NO_NODE_RANGE, CniError

# Room for pods in a block: /124 leaves 16 addresses, the node's and the block's first among them.
MAX_PREFIX_LENGTH = 124
# Node addresses that are not the node's own for long: privacy addresses and failed DAD.
NOT_NODE_ADDRESS = rtnl.IFA_F_TEMPORARY | rtnl.IFA_F_DADFAILED


class NodeRange:
    """The rail's pod range on this node: host-local's ranges for its IPAM config."""

    __slots__ = ("netdev", "subnet", "block", "node_addresses", "pieces")

    def __init__(self, netdev: str, subnet: Prefix, block: Prefix, node_addresses: list[Prefix],
                 pieces: list[tuple[int, int]]) -> None:
        self.netdev, self.subnet, self.block = netdev, subnet, block
        self.node_addresses = node_addresses  # the node's addresses in the block (left out of the range)
        self.pieces = pieces  # (first, last) as integers: the block less the excluded addresses

    def ranges(self) -> list[dict]:
        """One host-local range set (one address per pod) over every piece of the block."""
        return [{"subnet": str(self.subnet), "rangeStart": _text(first), "rangeEnd": _text(last)}
                for first, last in self.pieces]

    def ipam(self, ipam: dict) -> dict:
        """The rail's host-local config with this node's range (its other keys kept)."""
        return dict(ipam, ranges=[self.ranges()])

    def to_state(self) -> dict:
        return {"netdev": self.netdev, "subnet": str(self.subnet), "block": str(self.block),
                "nodeAddresses": [str(a) for a in self.node_addresses]}

    def describe(self) -> str:
        spans = ", ".join(f"{_text(a)}-{_text(b)}" for a, b in self.pieces)
        size = sum(b - a + 1 for a, b in self.pieces)
        node = ", ".join(str(a) for a in self.node_addresses)
        return f"{self.netdev}: node address {node} -> pods {spans} ({size} addresses, prefix /{self.subnet.prefixlen})"


def _int(prefix: Prefix) -> int:
    return int.from_bytes(prefix.packed, "big")


def _text(value: int) -> str:
    return Prefix(AF_INET6, value.to_bytes(16, "big"), 128).address_text()


def _block(address: Prefix, length: int) -> Prefix:
    return Prefix(AF_INET6, address.packed, length).network


def _contains(outer: Prefix, inner: Prefix) -> bool:
    return inner.prefixlen >= outer.prefixlen and Prefix(AF_INET6, inner.packed, outer.prefixlen).network == outer


def derive(netdev: str, addresses: list[rtnl.Address], rule: dict) -> NodeRange:
    """The pod range from the rail netdev's addresses (all of them, as the kernel lists them).

    rule: {"prefixLength": int | None, "within": "fd00::/16" | None}. Refuses (109), never guesses:
    no global address, addresses in several blocks, or a block that does not fit the rail's prefix.
    """
    within = Prefix.parse(rule["within"]) if rule.get("within") else None
    where = f" within {within}" if within else ""
    mine = [a for a in addresses if a.interface.family == AF_INET6]
    candidates = [a for a in mine if a.scope == rtnl.RT_SCOPE_UNIVERSE and not a.flags & NOT_NODE_ADDRESS
                  and (within is None or _contains(within, a.interface.ip))]
    preferred = [a for a in candidates if not a.flags & rtnl.IFA_F_DEPRECATED]
    candidates = preferred or candidates  # renumbering: the new address, not the one on its way out
    if not candidates:
        raise CniError(NO_NODE_RANGE, f"rail {netdev} has no global IPv6 address{where} to derive this node's pod "
                       "range from (rangeFromNodeAddress)",
                       f"give the node its own address on {netdev} before RDMA pods start (static, or the fabric's "
                       "RA/DHCPv6); until then ADD refuses rather than hand out an address another node may use too")
    blocks: dict[Prefix, list[Prefix]] = {}
    for cand in candidates:
        own = cand.interface
        length = rule.get("prefixLength") or own.prefixlen
        if length < own.prefixlen:
            raise CniError(NO_NODE_RANGE, f"rangeFromNodeAddress.prefixLength {length} is shorter than rail {netdev}'s "
                           f"own prefix ({own}): the block would reach past the rail's subnet",
                           f"use a prefixLength of {own.prefixlen} or more")
        if length > MAX_PREFIX_LENGTH:
            raise CniError(NO_NODE_RANGE, f"rail {netdev}'s address {own} leaves no room for pods (a /{length} block)",
                           f"give the rail a shorter prefix, or set rangeFromNodeAddress.prefixLength (at most "
                           f"{MAX_PREFIX_LENGTH})")
        blocks.setdefault(_block(own, length), []).append(own)
    if len(blocks) > 1:
        seen = "; ".join(f"{', '.join(str(a) for a in owns)} in {block}" for block, owns in blocks.items())
        raise CniError(NO_NODE_RANGE, f"rail {netdev} has global IPv6 addresses in {len(blocks)} blocks ({seen}): "
                       "which one is this node's pod range is not clear",
                       "set rangeFromNodeAddress.within to the prefix of the rail's fabric addresses")
    block, owns = next(iter(blocks.items()))
    subnet = min((a.network for a in owns), key=lambda p: p.prefixlen)  # the rail's on-link prefix
    first = _int(block)
    last = first | ((1 << (128 - block.prefixlen)) - 1)
    # Every address of the node's in the block is left out (deprecated, temporary and tentative
    # ones too: all are the node's), and the block's first (a subnet-router anycast when the block
    # is the whole subnet).
    inside = sorted({a.interface.ip for a in mine if _contains(block, a.interface.ip)}, key=_int)
    excluded = sorted({first} | {_int(a) for a in inside})
    pieces: list[tuple[int, int]] = []
    start = first
    for value in excluded + [last + 1]:
        if value > start:
            pieces.append((start, value - 1))
        start = max(start, value + 1)
    return NodeRange(netdev, subnet, block, inside, pieces)


def apply(sock: NetlinkSocket, rails: list, parents: list[rtnl.Link]) -> None:
    """Give each rail with a rule its node range and the host-local config for it (one address
    dump for all rails). rails: nics.Rail objects, parents: their host netdevs."""
    pending = [(rail, parent) for rail, parent in zip(rails, parents) if rail.range_rule is not None]
    if not pending:
        return
    addresses = rtnl.list_addresses(sock, AF_INET6)
    for rail, parent in pending:
        found = derive(rail.netdev, [a for a in addresses if a.index == parent.index], rail.range_rule)
        rail.node_range = found
        rail.ipam = found.ipam(rail.ipam)
