"""GetPreferredAllocation. Exclusive mode: keep a pod's RDMA devices on as few NUMA nodes as
possible, so its rails sit next to the GPUs the topology manager puts on the same node.

Devices must_include come first (kubelet requires them); then we fill from the NUMA nodes those
already use, then from the node with the most free devices (so a whole pod fits on one node
whenever it can); ties are broken by ID order, which follows PCI (and so rail) order.

Shared mode: the lowest-numbered units. The GID cap (inventory.py) makes the highest-numbered
units Unhealthy first; kubelet otherwise picks free units at random, and a pod holding a unit
beyond the cap would leave one more Healthy unit free than the GID tables can wire.
"""

from __future__ import annotations


def preferred(available: list[str], must_include: list[str], size: int,
              numa_of: dict[str, int | None]) -> list[str]:
    chosen = list(dict.fromkeys(i for i in must_include if i in available or i in numa_of))
    if size <= len(chosen):
        return chosen[:max(size, len(must_include))]
    free = sorted(i for i in dict.fromkeys(available) if i not in chosen)
    by_node: dict[int | None, list[str]] = {}
    for device in free:
        by_node.setdefault(numa_of.get(device), []).append(device)
    used_nodes = [numa_of.get(i) for i in chosen]
    while len(chosen) < size and by_node:
        preferred_nodes = [n for n in dict.fromkeys(used_nodes) if by_node.get(n)]
        if preferred_nodes:
            node = preferred_nodes[0]
        else:
            need = size - len(chosen)
            # The smallest node that still fits the rest, else the biggest: fewest nodes spanned.
            fitting = [n for n, ids in by_node.items() if len(ids) >= need]
            node = (min(fitting, key=lambda n: (len(by_node[n]), _order(n))) if fitting
                    else max(by_node, key=lambda n: (len(by_node[n]), -_order(n))))
        take = by_node[node][: size - len(chosen)]
        chosen += take
        used_nodes += [node] * len(take)
        del by_node[node][: len(take)]
        if not by_node[node]:
            del by_node[node]
    return chosen


def _order(node: int | None) -> int:
    return -1 if node is None else node


def lowest_units(available: list[str], must_include: list[str], size: int, order: dict[str, int]) -> list[str]:
    """must_include, then the free units lowest in the pool's order (not the IDs' text order:
    hca-10000 sorts before hca-1001)."""
    chosen = list(dict.fromkeys(must_include))
    free = sorted((i for i in dict.fromkeys(available) if i not in chosen), key=lambda i: order.get(i, len(order)))
    return (chosen + free)[:max(size, len(chosen))]
