"""Which RDMA devices the CNI plugin has moved into pods (exclusive mode), from its state files.

In exclusive mode a device in a pod's namespace disappears from the node's sysfs. Without this
the device plugin would report an allocated device as removed, and kubelet would lower the
node's capacity while the pod is using it. The CNI plugin records every move before it makes it
(<stateDir>/<network>/<containerID>:<ifname>.json, "rails": [{"rdmaDevice": ...}], "netns": ...).
"""

from __future__ import annotations

from rdma_netns.state import all_records, read_state


def devices_in_pods(state_dir: str) -> set[str]:
    return set(device_netns(state_dir))


def device_netns(state_dir: str) -> dict[str, str]:
    """Device name -> the pod's netns path ("" when the state has none): where to ask the kernel
    for the device's char devices while it is away (away.py). Read through the CNI plugin's own
    record class (rdma_netns.state), so the two programs cannot disagree about the format; a
    record of any format counts, since a device it names is away whatever else it says."""
    found: dict[str, str] = {}
    for _network, _cid, _ifname, path in all_records(state_dir):
        state = read_state(path)
        if state is None or state.mode == "shared":
            continue
        for rail in state.rails:
            if isinstance(rail.get("rdmaDevice"), str):
                found[rail["rdmaDevice"]] = state.netns
    return found
