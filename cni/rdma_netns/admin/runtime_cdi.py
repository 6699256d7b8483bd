"""Does containerd pass the CDI devices kubelet names? Read from its config file.

kubelet hands a device plugin's CDI names to the runtime (the CRI `CDIDevices` field); containerd
applies them only with `enable_cdi` on in its CRI plugin's section: off by default in 1.7, on in
2.x. Without it a granted pod gets its char devices but not its NCCL/UCX settings. CRI-O always
has CDI on. `rdma-netns status` and the DaemonSet's readiness check both ask here.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass

# containerd's config layouts: version -> (the CRI plugin's section, enable_cdi's default)
CONTAINERD_CRI = {1: ("cri", False), 2: ("io.containerd.grpc.v1.cri", False), 3: ("io.containerd.cri.v1.runtime", True)}


@dataclass(frozen=True)
class CdiSetting:
    path: str
    version: object
    section: str
    enabled: bool
    said: str  # how the file says it: "= true", "not set (off by default)", ...

    @property
    def where(self) -> str:
        return f'[plugins."{self.section}"]'

    @property
    def loss(self) -> str:
        """What a node with CDI off loses."""
        return (f"{self.path}: enable_cdi {self.said} in {self.where}: pods granted rdma/hca get their char "
                "devices, not their NCCL/UCX settings or /etc/rdma-netns/rails.json")

    @property
    def fix(self) -> str:
        return (f"set `enable_cdi = true` and `cdi_spec_dirs = [\"/etc/cdi\", \"/var/run/cdi\"]` under {self.where} "
                f"in {self.path} (containerd 1.7 or later), then restart containerd (running pods keep running)")

    def problem(self) -> str:
        """What a node with CDI off loses, and the fix, as one line (a readiness file's)."""
        return f"{self.loss}; {self.fix}"


def containerd(path: str) -> CdiSetting | None:
    """The setting in containerd's config at `path`; None when there is no such file. Raises
    OSError, UnicodeDecodeError or tomllib.TOMLDecodeError for a file that cannot be read."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.loads(f.read().decode())
    except FileNotFoundError:
        return None
    version = doc.get("version", 1)
    section, default = CONTAINERD_CRI.get(version, CONTAINERD_CRI[3] if isinstance(version, int) and version > 3
                                          else CONTAINERD_CRI[2])
    plugins = doc.get("plugins") if isinstance(doc.get("plugins"), dict) else {}
    cri = plugins.get(section) if isinstance(plugins.get(section), dict) else {}
    value = cri.get("enable_cdi", default)
    said = "not set (off by default)" if "enable_cdi" not in cri else f"= {json.dumps(value)}"
    return CdiSetting(path, version, section, value is True, "on" if value is True else said)
