"""Where the local cluster keeps everything, and the fixed names and addresses it uses.

Everything the cluster writes lives under one folder (RDMA_NETNS_CLUSTER_DIR, default
/tmp/rdma-netns-cluster); its processes run in one network namespace of its own (the control
plane's and the host node's "host network") and one mount namespace in which the node's well-known
folders (/etc/cni/net.d, /opt, /var/lib, /run, ...) are that folder's (NODE_OVERLAYS, NODE_TMPFS,
NODE_BINDS), so a DaemonSet applied as written writes there and never into this machine's own
folders.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NETNS = "rdma-netns-k8s"
BRIDGE = "rk8s0"                 # the "node network" inside NETNS: the control plane and nodes meet here
CONTROL_IP = "10.251.0.1"        # the API server, and the host node's InternalIP
NODE_PREFIX_LEN = 24
SERVICE_CIDR = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = "10.96.0.1"
API_PORT = 6443
HOST_NODE = "rk8s-host"
# The host node's pods' eth0 (the primary CNI: a bridge with host-local IPv4).
HOST_POD_SUBNET = "10.252.1.0/24"
CGROUP_ROOT = "/rdma-netns-k8s"  # kubelet's cgroupRoot: everything of the cluster's pods under it

# The node's own copies of this machine's folders, in its mount namespace (like a kind node's):
# - overlays: the machine's folder read through, what the node writes kept in the cluster folder
#   (so the DaemonSet's hostPath /opt/rdma-netns-ds, /var/lib/cni/rdma-netns, ... are plain folders
#   on the node, as on a real one, and its uninstall can remove them);
# - a fresh tmpfs at /run, as a node boots with;
# - binds: folders the manifests mount as hostPaths of their own.
NODE_OVERLAYS = {"/opt": "node/opt", "/var/lib": "node/var-lib"}
NODE_TMPFS = ("/run",)
NODE_BINDS = {
    "/etc/cni/net.d": "node/etc-cni-net.d",
    "/opt/cni/bin": "node/opt-cni-bin",
    "/etc/cdi": "node/etc-cdi",
    "/var/log/pods": "node/var-log-pods",
    "/var/log/containers": "node/var-log-containers",
}


@dataclass(frozen=True)
class Layout:
    root: Path

    @classmethod
    def default(cls) -> "Layout":
        return cls(Path(os.environ.get("RDMA_NETNS_CLUSTER_DIR", "/tmp/rdma-netns-cluster")))

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    @property
    def ns_dir(self) -> Path:
        """A private mount holding the mount namespace's file (a namespace bound to a file must not
        sit on a shared mount)."""
        return self.root / "ns"

    @property
    def mount_ns(self) -> Path:
        return self.ns_dir / "mnt"

    @property
    def netns_path(self) -> Path:
        return Path("/run/netns") / NETNS

    @property
    def etcd_data(self) -> Path:
        return self.root / "etcd"

    @property
    def containerd(self) -> Path:
        return self.root / "node" / "containerd"

    @property
    def containerd_socket(self) -> Path:
        return self.containerd / "containerd.sock"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.root / "admin.kubeconfig"

    @property
    def created_dirs(self) -> Path:
        """Folders `up` had to create on this machine (bind targets): `down` removes them."""
        return self.root / "created-dirs"

    @property
    def bin_file(self) -> Path:
        """The folder of the built Kubernetes binaries this cluster runs."""
        return self.root / "kube-bin"

    def node_source(self, target: str) -> Path:
        return self.root / NODE_BINDS[target]
