"""The local cluster's life: up (build or reuse the binaries, start the control plane and the host
node), status, down (nothing left behind), and kubectl against it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from integration.cluster import components, host_rdma, namespaces
from integration.cluster.layout import CGROUP_ROOT, CONTROL_IP, HOST_NODE, HOST_POD_SUBNET, REPO, Layout
from integration.cluster.pki import ADMIN, Pki
from integration.cri import pause_image
from integration.cri.rig import CNI_PLUGINS, CONTAINERD_17

CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
HOST_NODE_DAEMONS = ("containerd", "kubelet")


class ComponentExited(Exception):
    """A daemon of the cluster is gone: waiting longer cannot help."""


def build_binaries() -> Path:
    """integration/kube/build.sh: the pinned release, built once and cached outside the checkout."""
    proc = subprocess.run([str(REPO / "integration" / "kube" / "build.sh")], stdout=subprocess.PIPE, text=True,
                          timeout=3600, check=True)
    return Path(proc.stdout.strip().splitlines()[-1])


class Cluster:
    def __init__(self, layout: Layout | None = None) -> None:
        self.layout = layout or Layout.default()

    # -- kubectl ----------------------------------------------------------------------------------

    @property
    def bin_dir(self) -> Path:
        return Path(self.layout.bin_file.read_text().strip())

    def kubectl(self, *args: str, check: bool = True, timeout: float = 120, stdin: str | None = None
                ) -> subprocess.CompletedProcess:
        argv = ["nsenter", f"--net={self.layout.netns_path}", "--", str(self.bin_dir / "kubectl"),
                "--kubeconfig", str(self.layout.admin_kubeconfig), *args]
        proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} -> exit {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def helm(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """Helm (integration/helm/build.sh) against the cluster; its own folders under the cluster's."""
        helm = subprocess.run([str(REPO / "integration" / "helm" / "build.sh")], stdout=subprocess.PIPE, text=True,
                              timeout=1800, check=True).stdout.strip()
        home = self.layout.root / "helm"
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "HOME": str(home), "HELM_CACHE_HOME": str(home / "cache"),
               "HELM_CONFIG_HOME": str(home / "config"), "HELM_DATA_HOME": str(home / "data")}
        argv = ["nsenter", f"--net={self.layout.netns_path}", "--", helm, "--kubeconfig",
                str(self.layout.admin_kubeconfig), *args]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"helm {' '.join(args)} -> exit {proc.returncode}: {proc.stderr.strip()}\n"
                               f"{proc.stdout.strip()}")
        return proc

    def get(self, *args: str) -> dict:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def wait_for(self, what: str, predicate, timeout: float) -> float:
        start = time.monotonic()
        last_error: Exception | None = None
        while True:
            try:
                if predicate():
                    return time.monotonic() - start
            except (RuntimeError, ValueError, KeyError) as error:
                last_error = error
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"{what}: not within {timeout:.0f} s (last error: {last_error})")
            time.sleep(0.5)

    # -- up -----------------------------------------------------------------------------------------

    def up(self) -> None:
        layout = self.layout
        if namespaces.pid_of(layout, "kube-apiserver") is not None:
            raise RuntimeError(f"a cluster runs already in {layout.root} (scripts/cluster.sh status)")
        if layout.root.exists():
            self.down()
        reclaim_abandoned(layout)
        layout.root.mkdir(mode=0o700, parents=True)
        bin_dir = build_binaries()
        layout.bin_file.write_text(f"{bin_dir}\n")
        pki = Pki(layout.pki)
        components.kubeconfig(layout.admin_kubeconfig, pki, ADMIN)
        namespaces.make_network(layout)
        fake = host_rdma.make(layout)
        namespaces.make_mounts(layout, host_rdma.mount_script(fake), host_rdma.created_outside())
        namespaces.spawn(layout, "etcd", components.etcd(bin_dir, layout))
        namespaces.spawn(layout, "kube-apiserver", components.apiserver(bin_dir, layout, pki))
        self.wait_for("the API server's /readyz", self._api_ready, timeout=180)
        namespaces.spawn(layout, "kube-controller-manager", components.controller_manager(bin_dir, layout, pki))
        namespaces.spawn(layout, "kube-scheduler", components.scheduler(bin_dir, layout, pki))
        self._start_host_node(bin_dir, pki)
        self.wait_for(f"node {HOST_NODE} Ready", lambda: self.node_ready(HOST_NODE), timeout=240)
        # The default ServiceAccount a pod needs appears once the controller manager runs.
        self.wait_for("the default namespace's ServiceAccount",
                      lambda: self.kubectl("get", "serviceaccount", "default", check=False).returncode == 0,
                      timeout=120)

    def _api_ready(self) -> bool:
        for name in ("etcd", "kube-apiserver"):
            if namespaces.pid_of(self.layout, name) is None:
                raise ComponentExited(f"{name} exited:\n{self.log_tail(name)}")
        return self.kubectl("get", "--raw", "/readyz", check=False, timeout=20).returncode == 0

    def _start_host_node(self, bin_dir: Path, pki: Pki) -> None:
        """This machine as a node: containerd 1.7 and kubelet in the cluster's namespaces, Debian's
        reference plugins in its /opt/cni/bin, a bridge as the primary CNI, veth rails with fake
        RDMA devices (host_rdma.py)."""
        layout = self.layout
        cni_bin = layout.node_source("/opt/cni/bin")
        for plugin in CNI_PLUGINS.iterdir():
            if plugin.is_file():
                shutil.copy2(plugin, cni_bin / plugin.name)
        components.write_json(layout.node_source("/etc/cni/net.d") / "10-local-pods.conflist",
                              components.primary_conflist(HOST_POD_SUBNET))
        image = pause_image.build()
        config = components.containerd_config(layout.containerd, image.name, shutil.which("runc") or "runc")
        env = {"PATH": f"{CONTAINERD_17.bin_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
        namespaces.spawn(layout, "containerd", [CONTAINERD_17.tool("containerd"), "--config", str(config)], env=env)
        self.wait_for("containerd's socket", lambda: layout.containerd_socket.exists(), timeout=60)
        self.ctr("images", "import", "--snapshotter", "overlayfs", str(image.tarball))
        namespaces.make_cgroups(CGROUP_ROOT)
        argv = components.kubelet(bin_dir, layout.root, layout.containerd_socket, HOST_NODE, CONTROL_IP, pki)
        (layout.root / "kubelet.argv").write_text("\0".join(argv))
        namespaces.spawn(layout, "kubelet", argv)

    def restart_kubelet(self) -> None:
        """Stop the host node's kubelet (SIGTERM, as a node's service manager does) and start it
        again with the same command line; pods keep running meanwhile."""
        argv = (self.layout.root / "kubelet.argv").read_text().split("\0")
        namespaces.stop(self.layout, "kubelet")
        namespaces.spawn(self.layout, "kubelet", argv)

    def ctr(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """containerd's own client against the host node's containerd (namespace k8s.io)."""
        return namespaces.run(*namespaces.enter(self.layout), CONTAINERD_17.tool("ctr"), "-a",
                              str(self.layout.containerd_socket), "-n", "k8s.io", *args, timeout=timeout)

    def node_path(self, path: str) -> Path:
        """`path` as the host node sees it (its mount namespace, through containerd's /proc root)."""
        pid = namespaces.pid_of(self.layout, "containerd")
        if pid is None:
            raise RuntimeError("the host node's containerd is not running")
        return Path(f"/proc/{pid}/root") / path.lstrip("/")

    def node_ready(self, node: str) -> bool:
        conditions = {c["type"]: c["status"] for c in self.get("node", node)["status"].get("conditions", [])}
        return conditions.get("Ready") == "True"

    # -- status / down ------------------------------------------------------------------------------

    def status(self) -> tuple[bool, str]:
        lines, healthy = [], True
        for name in (*CONTROL_PLANE, *HOST_NODE_DAEMONS):
            pid = namespaces.pid_of(self.layout, name)
            healthy &= pid is not None
            lines.append(f"{name:26} {'running, pid ' + str(pid) if pid else 'not running'}")
        if namespaces.pid_of(self.layout, "kube-apiserver") is not None:
            nodes = self.kubectl("get", "nodes", "-o", "wide", check=False)
            lines.append(nodes.stdout.strip() or nodes.stderr.strip())
        lines.append(f"kubectl: scripts/cluster.sh kubectl ... (kubeconfig {self.layout.admin_kubeconfig}, "
                     f"reachable inside network namespace {self.layout.netns_path.name})")
        return healthy, "\n".join(lines)

    def down(self) -> None:
        """Stop everything, then remove the namespaces, cgroups, mounts and the cluster folder."""
        layout = self.layout
        for name in ("kubelet", "kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            if (layout.pids / name).exists():
                namespaces.stop(layout, name)
        # containerd, its shims and whatever runs in pods: nothing of them may outlive the cluster.
        namespaces.kill_inside(layout, CGROUP_ROOT)
        namespaces.remove_cgroups(CGROUP_ROOT)
        namespaces.remove_namespaces(layout)
        if layout.root.exists():
            shutil.rmtree(layout.root)

    def log_tail(self, name: str, lines: int = 30) -> str:
        try:
            return "\n".join((self.layout.logs / f"{name}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def reclaim_abandoned(layout: Layout) -> None:
    """The network namespace's name is fixed (one cluster at a time). A cluster whose run was
    killed (a CI job stopped, a session that ended mid-suite) keeps it with nothing running inside:
    take that cluster down so a new one can start. One with a live process is refused."""
    if not layout.netns_path.exists():
        return
    live = namespaces.processes_in_netns(layout.netns_path)
    if live:
        raise RuntimeError(f"network namespace {layout.netns_path.name} exists already with processes {live} "
                           "(scripts/cluster.sh down first)")
    owner = namespaces.owner_of_netns(layout.netns_path,
                                      [Layout.default().root, *Path(tempfile.gettempdir()).glob("rk8s-*")])
    print(f"cluster: taking down an abandoned cluster ({owner or 'its folder is gone'}): "
          f"nothing ran in network namespace {layout.netns_path.name}", file=sys.stderr)
    if owner is not None and owner != layout.root:
        Cluster(Layout(owner)).down()
    namespaces.run("ip", "netns", "delete", layout.netns_path.name, check=False)


def leftovers(layout: Layout) -> list[str]:
    """What a cluster left on this machine (after down: nothing)."""
    found = [str(p) for p in (layout.root, layout.netns_path) if p.exists()]
    found += [f"pid {p}" for p in namespaces.processes_inside(layout) + namespaces.processes_in_cgroups(CGROUP_ROOT)]
    found += [str(top) for top in namespaces.cgroup_tops(CGROUP_ROOT) if top.exists()]
    mounts = Path("/proc/self/mountinfo").read_text()
    found += [f"mount {line.split()[4]}" for line in mounts.splitlines() if str(layout.root) in line.split()[4]]
    return found
