"""`rdma-netns status`: one read-only look at the whole node, every problem with its fix.

Why one command: an RDMA pod needs seven parts to agree (the kernel's mode, the NICs and their GID
tables, the chained entry, the launcher, the device plugin, kubelet, the grants broker), and each
has its own place to look. This module runs the checks, which live in
status_hw (Kernel, Devices, Rails), status_conf (Chained entry, Runtime, Launcher), status_services
(Device plugin, Pairing) and status_attach (Attachments), on what they share (status_context:
the findings, the paths, the rdma-netns config found on the node, the attachment states, read
once); status_render prints them.

States. "fail": an RDMA pod started now would not get working rails, or kubelet would not give it
`rdma/hca` (the exit code is 1). "warn": the node works but something needs a look (leftovers,
a GID table nearly full, a primary changed since the insert, a broker missing while the CNI can
still ask kubelet itself). "ok": fine, or not used.

Not used, the rules:
- Chained entry: required when --entry is given (it must be in the runtime's primary and equal
  the file: what the DaemonSet writes) or when the cni-conf record says it was inserted (then a
  missing entry means the watch is not keeping it). With neither and no entry in the primary the
  node does not chain rdma-netns (Multus, the standalone conflist, or the DaemonSet's switch set
  to "false"): ok, "not used". An entry present without a record is ok (written by an older
  install or by hand). A primary whose bytes differ from the recorded ones: warn.
- Runtime: containerd's CDI setting (its config file): off fails when an rdma-netns config is on
  the node (pods get rails but not their NCCL/UCX settings), else warns; no config file: not
  checked (CRI-O and containerd 2.x have CDI on; containerd 1.7 without a file has it off).
- Launcher: required when any rdma-netns config is on the node (else its absence is a warn).
- Device plugin: required when the config names a resourceName, when --resource is given, or
  when a socket of ours is in kubelet's device-plugins folder; else "not deployed" is ok.
- Broker: used when the config names a resourceName and a podGrantsSocket; absent is a warn (the
  CNI then asks kubelet directly: slower, never wrong), a broker that cannot reach kubelet fails.
- Leftovers (a state whose netns is gone, a host-local lease without state) are warnings: they
  hold an address or files, not a working pod's rails.

Read-only: files are read, sockets connected to (each call bounded by Options.timeout), the
launcher run with CNI_COMMAND=VERSION and with --version (neither writes). No lock is taken and
no namespace entered.
"""

from __future__ import annotations

from rdma_netns.admin import status_attach, status_conf, status_hw, status_services
from rdma_netns.admin.status_context import FAIL, Check, Context, Options


def collect(opts: Options) -> list[Check]:
    """Every check, in GROUPS order."""
    ctx = Context(opts)
    checks: list[Check] = []
    for part in (status_hw.kernel, status_hw.devices, status_hw.rails, status_conf.chained_entry,
                 status_conf.runtime_cdi, status_conf.launcher, status_services.device_plugin, status_services.pairing,
                 status_attach.attachments):
        checks += part(ctx)
    return checks


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.state == FAIL for c in checks) else 0
