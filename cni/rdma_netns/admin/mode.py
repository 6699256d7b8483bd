"""`rdma-netns mode [set shared|exclusive [--persist]]`: the kernel's RDMA netns mode.

The mode can change only while no other network namespace exists (the kernel answers EBUSY),
so on a live node it is set at boot: --persist writes `options ib_core netns_mode=` to
modprobe.d, which applies when ib_core loads.
"""

from __future__ import annotations

from rdma_netns.kernel import rdma_sysfs
from rdma_netns.kernel.netns import other_namespaces
from rdma_netns.mode_policy import MODPROBE_VALUE, fix_hint, mismatch
from rdma_netns.util import fsutil

MODPROBE_FILE = "/etc/modprobe.d/rdma-netns.conf"


def show() -> tuple[int, str]:
    mode = rdma_sysfs.netns_mode()
    if mode is None:
        return 1, "RDMA netns mode: unknown (this kernel has no RDMA subsystem: ib_core is not loaded)"
    lines = [f"RDMA netns mode: {mode}"]
    blockers = other_namespaces()
    if blockers:
        lines.append("a change is blocked now by these network namespaces (EBUSY until they are gone):")
        lines += [f"  {b}" for b in blockers]
    else:
        lines.append("no other network namespace exists: the mode can be changed now")
    persisted = persisted_mode()
    if persisted:
        lines.append(f"at boot: {persisted} (from {MODPROBE_FILE})")
    return 0, "\n".join(lines)


def persisted_mode(path: str = MODPROBE_FILE) -> str | None:
    try:
        with open(path) as f:
            for line in f:
                words = line.split()
                if words[:2] == ["options", "ib_core"]:
                    for word in words[2:]:
                        if word.startswith("netns_mode="):
                            return "shared" if word.split("=", 1)[1] in ("1", "Y", "y") else "exclusive"
    except OSError:
        return None
    return None


def persist(mode: str, path: str = MODPROBE_FILE) -> None:
    """Write the modprobe.d option atomically (our own file: no other option is touched)."""
    text = ("# Written by `rdma-netns mode set --persist`: the RDMA netns mode ib_core starts in.\n"
            f"options ib_core netns_mode={MODPROBE_VALUE[mode]}\n")
    fsutil.write_atomic(path, text.encode(), 0o644)  # modprobe reads it as any user


def set_mode(mode: str, persist_it: bool, modprobe_file: str = MODPROBE_FILE,
             live: bool = True) -> tuple[int, str]:
    """Set the live mode (if the kernel lets us now) and optionally persist it; explain either way.

    live=False only persists: install.sh uses it when installing into another root."""
    messages: list[str] = []
    status = 0
    if live:
        status = _set_live(mode, messages)
    if persist_it:
        persist(mode, modprobe_file)
        messages.append(f"wrote {modprobe_file}: ib_core starts in {mode} mode from the next boot (or module load)")
        if status and rdma_sysfs.netns_mode() is not None:
            messages.append("reboot the node (or set the mode before the container runtime starts) to apply it")
        status = 0  # what was asked for persistently is done; the message says what is still pending
    elif status and rdma_sysfs.netns_mode() is not None:
        messages.append(f"to make it {mode}: {fix_hint(mode)}")
    return status, "\n".join(messages)


def _set_live(mode: str, messages: list[str]) -> int:
    """Change the running kernel's mode now, if it lets us; 1 (and why, in messages) if not."""
    from rdma_netns.kernel.rdma_nldev import RdmaBusy, RdmaError, RdmaNetlink

    if rdma_sysfs.netns_mode() is None:
        messages.append("this kernel has no RDMA subsystem loaded: nothing to change now")
        return 1
    try:
        with RdmaNetlink() as rdma:
            if mismatch(mode, rdma.netns_mode()) is None:
                messages.append(f"RDMA netns mode is already {mode}")
            else:
                rdma.set_netns_mode(mode)
                messages.append(f"RDMA netns mode set to {mode}")
    except RdmaBusy as exc:
        messages.append(f"cannot change the mode now: {exc}")
        return 1
    except RdmaError as exc:
        messages.append(f"cannot change the mode: {exc}")
        return 1
    return 0
