"""Which RDMA devices the CNI plugin has moved into pods (exclusive mode), from its state files.

In exclusive mode a device in a pod's namespace disappears from the node's sysfs. Without this
the device plugin would report an allocated device as removed, and kubelet would lower the
node's capacity while the pod is using it. The CNI plugin records every move before it makes it
(<stateDir>/<network>/<containerID>:<ifname>.json, "rails": [{"rdmaDevice": ...}], "netns": ...).
"""

from __future__ import annotations

import json
import os


def devices_in_pods(state_dir: str) -> set[str]:
    return set(device_netns(state_dir))


def device_netns(state_dir: str) -> dict[str, str]:
    """Device name -> the pod's netns path ("" when the state has none): where to ask the kernel
    for the device's char devices while it is away (away.py)."""
    found: dict[str, str] = {}
    try:
        networks = os.listdir(state_dir)
    except OSError:
        return found
    for network in networks:
        folder = os.path.join(state_dir, network)
        if network == "verified-configs" or not os.path.isdir(folder):
            continue
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            if not name.endswith(".json") or ":" not in name:
                continue
            try:
                with open(os.path.join(folder, name), "rb") as f:
                    state = json.loads(f.read(1 << 20))
            except (OSError, ValueError):
                continue
            if not isinstance(state, dict) or state.get("mode") == "shared":
                continue
            netns = state.get("netns") if isinstance(state.get("netns"), str) else ""
            for rail in state.get("rails") or []:
                if isinstance(rail, dict) and isinstance(rail.get("rdmaDevice"), str):
                    found[rail["rdmaDevice"]] = netns
    return found
