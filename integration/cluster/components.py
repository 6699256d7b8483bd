"""Command lines and config files of the cluster's components: etcd, the API server (TLS, service
accounts, RBAC, NodeRestriction and Pod Security on), the controller manager, the scheduler, and a
node's containerd 1.7 (CDI on) and kubelet. Settings are the ones kubeadm writes unless a comment
says why not."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from integration.cluster import pki as pki_mod
from integration.cluster.layout import (API_PORT, CGROUP_ROOT, CONTROL_IP, KUBERNETES_SERVICE_IP, SERVICE_CIDR,
                                        Layout)

API_URL = f"https://{CONTROL_IP}:{API_PORT}"


def kubeconfig(path: Path, pki: pki_mod.Pki, identity: pki_mod.Identity) -> Path:
    cert, key = pki.client(identity)
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "local",
        "clusters": [{"name": "local", "cluster": {"server": API_URL, "certificate-authority": str(pki.ca_cert)}}],
        "users": [{"name": identity.user, "user": {"client-certificate": str(cert), "client-key": str(key)}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": identity.user}}],
    }))
    path.chmod(0o600)
    return path


def etcd(bin_dir: Path, layout: Layout) -> list[str]:
    # --unsafe-no-fsync: a cluster that lives for one test run; fsync on this VM's disk costs seconds.
    return [str(bin_dir / "etcd"), "--name", "local", "--data-dir", str(layout.etcd_data),
            "--listen-client-urls", "http://127.0.0.1:2379", "--advertise-client-urls", "http://127.0.0.1:2379",
            "--listen-peer-urls", "http://127.0.0.1:2380", "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
            "--initial-cluster", "local=http://127.0.0.1:2380", "--unsafe-no-fsync", "--log-level", "warn"]


def apiserver(bin_dir: Path, layout: Layout, pki: pki_mod.Pki) -> list[str]:
    cert, key = pki.server("apiserver", "kube-apiserver",
                           ["kubernetes", "kubernetes.default", "kubernetes.default.svc",
                            "kubernetes.default.svc.cluster.local", "localhost"],
                           [CONTROL_IP, KUBERNETES_SERVICE_IP, "127.0.0.1"])
    kubelet_cert, kubelet_key = pki.client(pki_mod.APISERVER_KUBELET_CLIENT)
    return [str(bin_dir / "kube-apiserver"),
            "--etcd-servers", "http://127.0.0.1:2379",
            "--bind-address", CONTROL_IP, "--advertise-address", CONTROL_IP, "--secure-port", str(API_PORT),
            "--tls-cert-file", str(cert), "--tls-private-key-file", str(key),
            "--client-ca-file", str(pki.ca_cert),
            "--service-cluster-ip-range", SERVICE_CIDR,
            "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
            "--service-account-key-file", str(pki.sa_pub),
            "--service-account-signing-key-file", str(pki.sa_key),
            "--authorization-mode", "Node,RBAC",
            # PodSecurity is on by default (its default level: privileged; namespaces set theirs).
            "--enable-admission-plugins", "NodeRestriction",
            "--allow-privileged=true",
            "--kubelet-client-certificate", str(kubelet_cert), "--kubelet-client-key", str(kubelet_key),
            "--kubelet-certificate-authority", str(pki.ca_cert),
            "--kubelet-preferred-address-types", "InternalIP",
            "--profiling=false"]


def controller_manager(bin_dir: Path, layout: Layout, pki: pki_mod.Pki) -> list[str]:
    config = kubeconfig(layout.root / "controller-manager.kubeconfig", pki, pki_mod.CONTROLLER_MANAGER)
    return [str(bin_dir / "kube-controller-manager"),
            "--kubeconfig", str(config), "--authentication-kubeconfig", str(config),
            "--authorization-kubeconfig", str(config),
            "--bind-address", "127.0.0.1", "--leader-elect=false",
            "--service-account-private-key-file", str(pki.sa_key), "--root-ca-file", str(pki.ca_cert),
            "--use-service-account-credentials=true",
            "--cluster-signing-cert-file", str(pki.ca_cert), "--cluster-signing-key-file", str(pki.ca_key),
            "--service-cluster-ip-range", SERVICE_CIDR, "--profiling=false"]


def scheduler(bin_dir: Path, layout: Layout, pki: pki_mod.Pki) -> list[str]:
    config = kubeconfig(layout.root / "scheduler.kubeconfig", pki, pki_mod.SCHEDULER)
    return [str(bin_dir / "kube-scheduler"), "--kubeconfig", str(config),
            "--authentication-kubeconfig", str(config), "--authorization-kubeconfig", str(config),
            "--bind-address", "127.0.0.1", "--leader-elect=false", "--profiling=false"]


def containerd_config(folder: Path, sandbox_image: str, runc: str) -> Path:
    """containerd 1.7 as a node runs it, with CDI on (docs/install.md): its CNI and CDI folders are
    the node's well-known ones (on the host node bound to the cluster folder in its mount
    namespace); its root, state, socket and runc root in `folder`."""
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    path = folder / "config.toml"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(f"""\
version = 2
root = "{folder / 'root'}"
state = "{folder / 'state'}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = "{folder / 'containerd.sock'}"

[plugins."io.containerd.internal.v1.opt"]
  path = "{folder / 'opt'}"

[{cri}]
  sandbox_image = "{sandbox_image}"
  enable_cdi = true
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  netns_mounts_under_state_dir = true
  disable_apparmor = true
  # The pause container asks for oom_score_adj -998; lowering it needs CAP_SYS_RESOURCE, which
  # a test machine inside a container may lack. Restricted: never below containerd's own value.
  restrict_oom_score_adj = true
  enable_selinux = false

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  BinaryName = "{runc}"
  Root = "{folder / 'runc'}"
  SystemdCgroup = false

[{cri}.cni]
  bin_dir = "/opt/cni/bin"
  conf_dir = "/etc/cni/net.d"
  max_conf_num = 1
""")
    return path


def primary_conflist(subnet: str) -> dict:
    """The cluster's own CNI (what Calico or Flannel is on a real cluster): eth0 from a bridge with
    host-local IPv4. No gateway, no masquerade: pods reach each other on the node, nothing beyond."""
    return {"cniVersion": "1.0.0", "name": "local-pods", "plugins": [
        {"type": "bridge", "bridge": "rk8spods", "isGateway": False, "ipMasq": False,
         "ipam": {"type": "host-local", "ranges": [[{"subnet": subnet}]]}},
        {"type": "portmap", "capabilities": {"portMappings": True}}]}


def kubelet_config(folder: Path, containerd_socket: Path, node: str, node_ip: str, pki: pki_mod.Pki) -> Path:
    serving_cert, serving_key = pki.server(f"kubelet-serving-{node}", node, [node], [node_ip])
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "address": node_ip,
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(pki.ca_cert)}},
        "authorization": {"mode": "Webhook"},
        "tlsCertFile": str(serving_cert), "tlsPrivateKeyFile": str(serving_key),
        "containerRuntimeEndpoint": f"unix://{containerd_socket}",
        "cgroupDriver": "cgroupfs", "cgroupRoot": CGROUP_ROOT,
        # This machine runs cgroup v1 (kubelet refuses it unless told).
        "failCgroupV1": False,
        "failSwapOn": False,
        "readOnlyPort": 0, "healthzBindAddress": "127.0.0.1",
        "serializeImagePulls": False,
        # A test machine's disk is mostly full of other things: no evictions for disk.
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "resolvConf": "/etc/resolv.conf",
        "rotateCertificates": False,
    }
    path = folder / f"kubelet-{node}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def kubelet(bin_dir: Path, folder: Path, containerd_socket: Path, node: str, node_ip: str,
            pki: pki_mod.Pki) -> list[str]:
    """kubelet's command line; its config and kubeconfig are written to `folder`."""
    config = kubelet_config(folder, containerd_socket, node, node_ip, pki)
    kubeconfig_path = kubeconfig(folder / f"kubelet-{node}.kubeconfig", pki, pki_mod.node_identity(node))
    return [str(bin_dir / "kubelet"), "--config", str(config), "--kubeconfig", str(kubeconfig_path),
            "--hostname-override", node, "--node-ip", node_ip, "--root-dir", "/var/lib/kubelet"]


def write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")
