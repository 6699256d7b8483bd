"""The device plugin's part of the per-pod CDI device (issue 17; the CNI's is rdma_netns.publish.pod_cdi).

With the resource option podCdi (shared mode), Allocate names `<podCdiKind>=<unit>` for every
unit it hands out. The runtime resolves that name when it creates each container, from the spec
`<specDir>/rdma-netns-pod-<unit>.json`, which the CNI writes at ADD with the pod's own rails. A
pod the CNI never sees (hostNetwork) must still start, so Allocate writes a devices-only
placeholder for the unit first; the pod's ADD, which comes after Allocate, replaces it.

Allocate replaces whatever spec the unit has: kubelet hands a unit to a new pod only after the
previous holder's containers are gone, so an existing spec is stale (a previous pod's rails, not
yet removed by its DEL), and that pod's DEL leaves the placeholder alone (not its own).
"""

from __future__ import annotations

from rdma_netns.publish.pod_cdi import placeholder_spec, spec_path, valid_unit
from rdma_netns.util import jsonio
from rdma_netns_dp.cdi import write_if_changed


def ensure_placeholder(spec_dir: str, kind: str, unit: str, nodes: list[dict]) -> bool:
    """Write the unit's placeholder unless it is already there as is; True when written."""
    if not valid_unit(unit):
        raise ValueError(f"unit ID {unit!r} cannot name a CDI device")
    return write_if_changed(spec_dir, spec_path(spec_dir, unit), jsonio.dumps(placeholder_spec(kind, unit, nodes)) + "\n")
