"""Is this node ready to give pods their rails? The CNI config the runtime uses carries our entry,
and ADD can derive this node's pod range on each rail (rangeFromNodeAddress). One rule for
`cni-conf show --require-entry --require-node-fit` and for the readiness file `cni-conf watch`
keeps (probe_file: the DaemonSet's probe reads it with the shell)."""

from __future__ import annotations

import time
from pathlib import Path

from rdma_netns.admin import cni_conf, node_check, runtime_cdi
from rdma_netns.util import probe_file


def problems(conf_dir: Path, state: cni_conf.State, *, entry: bool = True, node_fit: bool = True,
             containerd_config: str | None = None) -> list[str]:
    """Why pods started now would get no rails, or no NCCL/UCX settings with them, every reason
    found (empty: they would get both). containerd_config: check that containerd passes CDI devices."""
    found: list[str] = []
    if containerd_config:
        try:
            cdi = runtime_cdi.containerd(containerd_config)
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            found.append(f"cannot read containerd's config {containerd_config}: {exc}")
        else:
            if cdi is not None and not cdi.enabled:
                found.append(cdi.problem())
    if entry:
        info = cni_conf.show(conf_dir, state)
        if not (info["entry"] and info["runtimeUses"] == info["primary"]):
            # Nothing chained: the node-fit check has no entry to judge.
            return [*found, f"no {cni_conf.PLUGIN_TYPE} entry in the CNI config the runtime uses "
                            f"({info['runtimeUses'] or 'none yet'} in {conf_dir})"]
    if node_fit:
        fits, lines = node_check.chained(str(conf_dir))
        if not fits:
            found += ["on this node every RDMA pod's ADD would fail:", *lines]
    return found


class ReadyFile:
    """Rewrites the readiness file after the watch acted and at least every `every` seconds (its
    age tells the probe the watch is alive); logs each change of the answer once."""

    def __init__(self, path: str, conf_dir: Path, state: cni_conf.State, every: float,
                 containerd_config: str | None = None) -> None:
        self.path, self.conf_dir, self.state, self.every = path, conf_dir, state, every
        self.containerd_config = containerd_config
        self._last_time = float("-inf")
        self._last_text: str | None = None

    def update(self, acted: bool) -> None:
        if not acted and time.monotonic() - self._last_time < self.every:
            return
        try:
            found = problems(self.conf_dir, self.state, containerd_config=self.containerd_config)
        except (cni_conf.CniConfError, OSError) as exc:
            found = [f"cannot check: {exc}"]
        text = probe_file.render(found)
        if text != self._last_text:
            cni_conf.log(text.rstrip("\n"))
            self._last_text = text
        probe_file.write(self.path, found)
        self._last_time = time.monotonic()
