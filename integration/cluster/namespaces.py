"""The cluster's network and mount namespaces, and the processes that run in them.

The network namespace is the control plane's and the host node's "host network" (so nothing of
it needs an address in this machine's own namespace); the mount namespace gives the node its own
/etc/cni/net.d, /var/lib/kubelet, ... (layout.NODE_BINDS). Both outlive `up`: the network namespace
as /run/netns/<name>, the mount namespace bound to a file (unshare --mount=<file>).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from integration.cluster.layout import (BRIDGE, CONTROL_IP, NETNS, NODE_BINDS, NODE_OVERLAYS, NODE_PREFIX_LEN,
                                        NODE_TMPFS, Layout)


def run(*args: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} -> exit {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def enter(layout: Layout) -> list[str]:
    """The command prefix that runs a program as the node does: its netns and mount namespace."""
    return ["nsenter", f"--net={layout.netns_path}", f"--mount={layout.mount_ns}", "--"]


def _identity(netns_path: Path) -> str:
    """Which namespace the bind mount at netns_path is (its nsfs inode)."""
    st = os.stat(netns_path)
    return f"{st.st_dev}:{st.st_ino}"


def make_network(layout: Layout) -> None:
    if layout.netns_path.exists():
        raise RuntimeError(f"network namespace {NETNS} exists already (scripts/cluster.sh down first)")
    run("ip", "netns", "add", NETNS)
    (layout.root / "netns.id").write_text(_identity(layout.netns_path))
    ns = ["ip", "-n", NETNS]
    run(*ns, "link", "set", "lo", "up")
    run(*ns, "link", "add", BRIDGE, "type", "bridge")
    run(*ns, "address", "add", f"{CONTROL_IP}/{NODE_PREFIX_LEN}", "dev", BRIDGE)
    run(*ns, "link", "set", BRIDGE, "up")


def make_mounts(layout: Layout, extra_steps: list[str] = (), extra_created: list[str] = ()) -> None:
    """The mount namespace, with the node's folders bound to the cluster folder's copies, then
    `extra_steps` (shell, run inside it); `extra_created`: folders those steps make on this machine."""
    layout.ns_dir.mkdir(parents=True, exist_ok=True)
    run("mount", "--bind", str(layout.ns_dir), str(layout.ns_dir))
    run("mount", "--make-private", str(layout.ns_dir))
    layout.mount_ns.touch()
    # slave: mounts of the machine still reach the node (as on a real node); the node's stay inside.
    run("unshare", f"--mount={layout.mount_ns}", "--propagation", "slave", "true")
    created: list[str] = list(extra_created)
    script = []
    for target, source in NODE_OVERLAYS.items():
        upper, work = layout.root / source / "upper", layout.root / source / "work"
        upper.mkdir(parents=True, exist_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        script.append(f"mount -t overlay overlay -o lowerdir={target},upperdir={upper},workdir={work} {target}")
    for target in NODE_TMPFS:
        script.append(f"mount -t tmpfs -o mode=755 tmpfs {target}")
    for target, source in NODE_BINDS.items():
        (layout.root / source).mkdir(parents=True, exist_ok=True)
        if not os.path.lexists(target):
            created.append(target)
        script.append(f"mkdir -p {target} && mount --bind {layout.root / source} {target}")
    layout.created_dirs.write_text("".join(f"{p}\n" for p in created))
    run("nsenter", f"--mount={layout.mount_ns}", "--", "sh", "-ec", " && ".join([*script, *extra_steps]))


def spawn(layout: Layout, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
    """Start a daemon of the cluster in its namespaces, detached; its pid goes to pids/<name>."""
    layout.logs.mkdir(parents=True, exist_ok=True)
    layout.pids.mkdir(parents=True, exist_ok=True)
    full_env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root"}
    full_env.update(env or {})
    with open(layout.logs / f"{name}.log", "ab") as log:
        proc = subprocess.Popen([*enter(layout), *argv], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                env=full_env, start_new_session=True)
    (layout.pids / name).write_text(f"{proc.pid}\n")
    return proc.pid


def pid_of(layout: Layout, name: str) -> int | None:
    """The daemon's pid when it still runs (not a zombie), else None."""
    try:
        pid = int((layout.pids / name).read_text())
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return None
    return None if state == "Z" else pid


def stop(layout: Layout, name: str, timeout: float = 20.0) -> None:
    pid = pid_of(layout, name)
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pid_of(layout, name) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    if pid_of(layout, name) is not None:
        os.kill(pid, signal.SIGKILL)


def _processes_in(kind: str, bound_at: Path) -> list[int]:
    """Every process (but this one) whose `kind` namespace (mnt, net) is the one bound at bound_at."""
    try:
        ours = os.stat(bound_at).st_ino
    except OSError:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}/ns/{kind}").st_ino == ours and int(entry) != os.getpid():
                    found.append(int(entry))
            except OSError:
                pass
    return found


def processes_inside(layout: Layout) -> list[int]:
    """Every process in the cluster's mount namespace (daemons, shims, containers' processes)."""
    return _processes_in("mnt", layout.mount_ns)


def processes_in_netns(netns_path: Path) -> list[int]:
    """Every process in the network namespace bound at netns_path (daemons, qemu of guest nodes)."""
    return _processes_in("net", netns_path)


def owner_of_netns(netns_path: Path, roots: list[Path]) -> Path | None:
    """Which cluster folder among `roots` made the namespace bound at netns_path (its netns.id)."""
    identity = _identity(netns_path)
    for root in roots:
        try:
            if (root / "netns.id").read_text() == identity:
                return root
        except OSError:
            pass
    return None


def processes_in_cgroups(cgroup_root: str) -> list[int]:
    """Every process under kubelet's cgroupRoot: the pods' containers, which runc gives mount
    namespaces of their own."""
    found: set[int] = set()
    for top in cgroup_tops(cgroup_root):
        if top.is_dir():
            for procs in top.rglob("cgroup.procs"):
                try:
                    found.update(int(p) for p in procs.read_text().split())
                except OSError:
                    pass
    return sorted(found)


def kill_inside(layout: Layout, cgroup_root: str, timeout: float = 15.0) -> None:
    """SIGKILL what still runs in the cluster's mount namespace or its pods' cgroups, and wait
    until it is gone."""
    deadline = time.monotonic() + timeout
    while ((pids := processes_inside(layout) + processes_in_cgroups(cgroup_root))
           and time.monotonic() < deadline):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)


def cgroup_tops(cgroup_root: str) -> list[Path]:
    base = Path("/sys/fs/cgroup")
    if (base / "cgroup.controllers").exists():  # v2: one tree
        return [base / cgroup_root.lstrip("/")]
    return [h / cgroup_root.lstrip("/") for h in sorted(base.iterdir()) if h.is_dir() and not h.is_symlink()]


def make_cgroups(cgroup_root: str) -> None:
    """kubelet's cgroupRoot must exist before it starts (it refuses a missing one). cgroup v1: in the
    cpuset hierarchy a new group starts with no CPUs and no memory nodes, so it gets its parent's.
    cgroup v2: the controllers kubelet needs must be enabled for the group and its children."""
    for top in cgroup_tops(cgroup_root):
        top.mkdir(exist_ok=True)
        for name in ("cpuset.cpus", "cpuset.mems"):
            if (top / name).exists() and not (top / name).read_text().strip():
                (top / name).write_text((top.parent / name).read_text())
        if (top / "cgroup.controllers").exists():  # v2
            for group in (top.parent, top):
                wanted = (group / "cgroup.controllers").read_text().split()
                (group / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in wanted))


def remove_cgroups(cgroup_root: str) -> None:
    """kubelet's cgroupRoot in every cgroup v1 hierarchy (or the v2 tree), deepest first."""
    for top in cgroup_tops(cgroup_root):
        if not top.is_dir():
            continue
        for folder in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            try:
                folder.rmdir()
            except OSError:
                pass
        try:
            top.rmdir()
        except OSError:
            pass


def remove_namespaces(layout: Layout) -> None:
    if layout.mount_ns.exists():
        run("umount", str(layout.mount_ns), check=False)
    if layout.ns_dir.exists():
        run("umount", str(layout.ns_dir), check=False)
    # The name is fixed (one cluster at a time): delete it only when it is the one this cluster
    # made, never a newer cluster's that started while this one was still going down.
    made = layout.root / "netns.id"
    if layout.netns_path.exists() and made.exists() and made.read_text() == _identity(layout.netns_path):
        run("ip", "netns", "delete", NETNS, check=False)
    if layout.created_dirs.exists():
        for folder in reversed(layout.created_dirs.read_text().split()):
            try:
                os.rmdir(folder)
            except OSError:
                pass
