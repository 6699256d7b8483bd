"""The CDI spec file: lets the container runtime inject the RDMA devices by name.

With CDI, Allocate returns names like "rdma-netns.io/rdma_hca=mlx5_0" and the runtime reads the
device nodes from this file when it creates the container, which is later than Allocate: the
spec is rewritten whenever a device's char devices change, so a renumbered uverbsN is right.
"""

from __future__ import annotations

import json
import os

from rdma_netns.kernel.rdma_devices import RdmaDevice
from rdma_netns.util import fsutil
from rdma_netns_dp.allocation import RDMA_CM, cdi_kind

CDI_VERSION = "0.5.0"  # what the spec needs; Podman 4.3 refuses 0.6.0 specs altogether


def spec_path(spec_dir: str, slug: str) -> str:
    return os.path.join(spec_dir, f"rdma-netns-{slug}.json")


def build_spec(slug: str, devices: list[RdmaDevice], dev_root: str, include_umad: bool, rdma_cm: bool) -> dict:
    entries = []
    for device in sorted(devices, key=lambda d: d.name):
        chars = ([device.uverbs] if device.uverbs else []) + (list(device.mad) if include_umad else [])
        if not chars:
            continue
        entries.append({"name": device.name, "containerEdits": {"deviceNodes": [
            {"path": c.container_path, "hostPath": os.path.join(dev_root, "infiniband", c.name),
             "permissions": "rw"} for c in chars]}})
    # Applied once whenever any device of this spec is injected; rdma_cm only where the node has
    # it (rdma_cm: rdma_ucm loaded): a device node the runtime cannot find fails the container.
    common = [{"path": f"/dev/infiniband/{RDMA_CM}", "hostPath": os.path.join(dev_root, "infiniband", RDMA_CM),
               "permissions": "rw"}] if rdma_cm else []
    return {
        "cdiVersion": CDI_VERSION,
        "kind": cdi_kind(slug),
        "devices": entries,
        "containerEdits": {"deviceNodes": common},
    }


def write_spec(spec_dir: str, slug: str, spec: dict) -> bool:
    """Write atomically (runtimes may read at any moment); False when the content is unchanged."""
    return write_if_changed(spec_dir, spec_path(spec_dir, slug), json.dumps(spec, indent=2, sort_keys=True) + "\n")


def write_if_changed(spec_dir: str, path: str, text: str) -> bool:
    """Write a spec file unless it already holds `text`; False when unchanged (no rewrite, so a
    runtime reading it never sees a churn). 0644: the runtime reads it. No fsync: the daemon
    rewrites every spec when it starts after a reboot."""
    try:
        with open(path) as f:
            if f.read() == text:
                return False
    except OSError:
        pass
    os.makedirs(spec_dir, mode=0o755, exist_ok=True)
    fsutil.write_atomic(path, text.encode(), 0o644)
    return True

