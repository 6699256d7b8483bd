"""One node, as the DaemonSet of conf/k8s/rdma-netns-dp-daemonset.yaml finds it, driven the way
kubelet drives it (integration/deploy/kubelet.py) through containerd 1.7's CRI with CDI on.

What is as written and what the rig maps (docs/testing.md, "Proven: the DaemonSet as an admin
installs it" lists the same):

| manifest | here |
| --- | --- |
| image `registry.example.com/...` | the image scripts/build-image.sh built, imported with `ctr images import`, its digest checked and named (`ctr images tag`), and pinned by digest (`...@sha256:`) in the DaemonSets |
| hostPath /etc/cni/net.d, /opt/cni/bin | the rig containerd's CNI conf and bin folders (its own, so the machine's are never touched) |
| hostPath /sys | a fake sysfs tree with two Soft-RoCE-shaped devices on the rig's rails (this kernel has no RDMA) |
| dp.yaml `devRoot` | that tree's /dev (char nodes 1:3); the CNI is told the same with RDMA_NETNS_SYSFS_ROOT / RDMA_NETNS_DEV_ROOT in containerd's environment |
| training pod | its image ours (a shell), sleeping instead of torchrun, no GPUs, emptyDir for the PVC, capabilities this machine's bounding set lacks (SYS_RESOURCE here) left out |
| chained entry `rails` | the rig's two veth rails (an admin edits the netdev names too), `requireRdma: false` (no GIDs without RDMA; the guest suites prove them) |
| every other hostPath (/opt/rdma-netns-ds, /var/lib/kubelet/..., /var/lib/cni/rdma-netns, /var/lib/rdma-netns, /run/rdma-netns, /var/run/cdi) | as written, on this machine (the launcher's absolute paths and the CNI's fallback to kubelet's socket depend on them); the fixture refuses to start while any is in use, sets aside what earlier runs left there and puts it back after, and removes what it made |

The node's rails get node addresses fd00:1<r>::7:1/64, from which the shipped entry's
rangeFromNodeAddress gives pods fd00:1<r>::7:2 and up; the fake tables hold the GIDs of the first
PREFILLED of those (a fake tree cannot watch addresses appear; the guest suites prove the kernel's). The cluster CNI is a bridge plugin with
host-local IPv4 (the pod's eth0).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import yaml

from integration.cri.rig import CONTAINERD_17, ContainerdRig, sh
from integration.deploy.kubelet import HostPaths, MiniKubelet, RunningPod
from tests.fake_rdma_sysfs import FakeRdmaSysfs
from rdma_netns.kernel.inet import Prefix
from tests.kubelet_standin import KubeletStandIn, PodResourcesStandIn

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "conf" / "k8s"
NODE_INDEX = 7
PREFILLED = 200
# Host paths the DaemonSet uses as written: none may be in use by anything else when the suite starts.
AS_WRITTEN = ["/opt/rdma-netns-ds", "/var/lib/kubelet/device-plugins", "/var/lib/kubelet/pod-resources",
              "/var/lib/kubelet/plugins_registry", "/var/lib/cni/rdma-netns", "/var/lib/rdma-netns",
              "/run/rdma-netns"]
CDI_DIR = Path("/var/run/cdi")


def documents(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def one(name: str, kind: str) -> dict:
    (doc,) = [d for d in documents(name) if d.get("kind") == kind]
    return doc


CAPABILITY_BITS = {"IPC_LOCK": 14, "SYS_RESOURCE": 24}


def has_capability(name: str) -> bool:
    """Is the capability in this machine's bounding set (runc cannot give a container more)?"""
    with open("/proc/self/status") as status:
        bounding = int(next(line for line in status if line.startswith("CapBnd:")).split()[1], 16)
    return bool(bounding >> CAPABILITY_BITS[name] & 1)


def node_address(rail: int) -> str:
    return f"fd00:1{rail}::{NODE_INDEX}:1/64"


class DeployNode:
    """containerd 1.7 + stand-in kubelet + fake RDMA NICs: a node to install the DaemonSet on."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.made: list[Path] = []  # host paths as written that this rig created (removed by close())
        self.saved: list[Path] = []  # ones that were there: set aside, put back by close()
        busy = [str(p) for p in Path("/var/lib/cni/rdma-netns").glob("*/*:*.json")]
        busy += [p for p in ("/var/lib/kubelet/device-plugins/kubelet.sock", "/var/lib/kubelet/pod-resources/kubelet.sock")
                 if Path(p).exists()]
        if busy:
            raise AssertionError(f"the deploy suite uses the DaemonSet's host paths as written; in use: {busy}")
        for path in map(Path, AS_WRITTEN):  # leftovers of earlier runs or suites: aside, and back after
            if path.exists():
                path.rename(path.with_name(path.name + ".rdeploy-saved"))
                self.saved.append(path)
        for path in [*AS_WRITTEN, "/var/lib/kubelet", str(CDI_DIR)]:
            if not Path(path).exists():
                self.made.append(Path(path))
        self.cdi_before = sorted(p.name for p in CDI_DIR.iterdir()) if CDI_DIR.exists() else []
        self.rig = ContainerdRig(None, rails=2, containerd=CONTAINERD_17, cdi_dirs=[str(CDI_DIR)])
        try:
            self.fake = FakeRdmaSysfs(work / "fake")
            for i, rail in enumerate(self.rig.rails):
                self.fake.add_soft_device(f"rxe{i}", rail)
                # The device plugin counts free entries: twice Soft-RoCE's 1024, so that at two
                # addresses per pod (the default addressesPerPod) all 1000 units stay Healthy.
                self.fake.soft_gid_table(f"rxe{i}", table=2048)
                # The kernel's part, done ahead: a fake tree cannot see addresses appear, so the
                # RoCE v2 GIDs of the first PREFILLED addresses of the node's range are there already
                # (ndev: the pod interface's name), and ADD's GID wait finds its pod's.
                for n in range(2, 2 + PREFILLED):
                    self.fake.add_gid(f"rxe{i}", Prefix.parse(f"fd00:1{i}::{NODE_INDEX}:{n:x}").exploded(), f"rdma{i}")
            for node in (self.fake.dev / "infiniband").iterdir():  # runc wants real char nodes
                node.unlink()
                os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            self.rig.extra_env.update(RDMA_NETNS_SYSFS_ROOT=str(self.fake.sys), RDMA_NETNS_DEV_ROOT=str(self.fake.dev))
            for i, rail in enumerate(self.rig.rails):
                sh("ip", "address", "add", node_address(i), "dev", rail, "nodad")
            self.rig.start()
            self.primary = self.rig.use_network("primary")  # the cluster CNI's conflist, first in the folder
            self.primary_path = self.rig.net_dir / "10-rcri.conflist"
            self.primary_bytes = self.primary_path.read_bytes()
            self.cni_bin_before = sorted(os.listdir(self.rig.cni_bin))
            self.pod_resources = PodResourcesStandIn("/var/lib/kubelet/pod-resources/kubelet.sock")
            self.kubelet = KubeletStandIn("/var/lib/kubelet/device-plugins", pod_resources=self.pod_resources).start()
            self.host_paths = HostPaths({"/etc/cni/net.d": self.rig.net_dir, "/opt/cni/bin": self.rig.cni_bin,
                                         "/sys": self.fake.sys})
            self.configmaps = {"rdma-netns-dp-config": self.configmap_data()}
            self.kubelet_driver = MiniKubelet(self.rig, work / "kubelet", self.host_paths, self.configmaps,
                                              self.kubelet)
        except BaseException:
            self.close()
            raise

    # -- the manifests, as an admin edits them for this node ---------------------------------------

    def configmap_data(self) -> dict[str, str]:
        data = dict(one("rdma-netns-dp-daemonset.yaml", "ConfigMap")["data"])
        entry = json.loads(data["rdma-netns-chained-entry.json"])
        entry["rails"] = [{"netdev": rail, "ifname": f"rdma{i}"} for i, rail in enumerate(self.rig.rails)]
        entry["requireRdma"] = False
        data["rdma-netns-chained-entry.json"] = json.dumps(entry, indent=2) + "\n"
        dp = yaml.safe_load(data["dp.yaml"])
        dp["devRoot"] = str(self.fake.dev)
        data["dp.yaml"] = yaml.safe_dump(dp)
        return data

    def daemonset_spec(self, image: str, manifest: str = "rdma-netns-dp-daemonset.yaml") -> dict:
        spec = copy.deepcopy(one(manifest, "DaemonSet")["spec"]["template"]["spec"])
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            container["image"] = image
        return spec

    def training_spec(self, image: str, host_network: bool = False) -> dict:
        """conf/k8s/training-job.yaml's pod: the image a shell one, sleeping instead of torchrun; no GPUs
        (no GPU plugin here), the data volume an emptyDir (no PVCs); hostNetwork for the seed's Job."""
        spec = copy.deepcopy(one("training-job.yaml", "Job")["spec"]["template"]["spec"])
        (train,) = spec["containers"]
        train["image"] = image
        train["command"] = ["/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"]
        train.pop("args", None)
        for what in ("limits", "requests"):
            train["resources"][what] = {k: v for k, v in train["resources"][what].items()
                                        if k.startswith("rdma/")}
        spec["volumes"] = [v if "persistentVolumeClaim" not in v else {"name": v["name"], "emptyDir": {}}
                           for v in spec["volumes"]]
        caps = train["securityContext"]["capabilities"]
        caps["add"] = [c for c in caps["add"] if has_capability(c)]  # this VM lacks SYS_RESOURCE
        if host_network:
            spec["hostNetwork"] = True
        return spec

    def plain_spec(self, image: str) -> dict:
        """A pod without rdma/hca."""
        return {"containers": [{"name": "app", "image": image,
                                "command": ["/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 3600 & wait $!; done"]}]}

    def pin(self, name: str, digest: str, pinned: str) -> None:
        """docs/install.md's steps after `ctr images import`: the digest containerd recorded must be
        the one the build printed; then the image is named by it, so that a pod spec that pins the
        digest finds it (containerd's CRI resolves only names it holds, and takes any digest name
        `ctr images tag` gives it: the check first is what makes the pin mean something)."""
        ctr = [self.rig.containerd.tool("ctr"), "-a", self.rig.socket, "-n", "k8s.io"]
        listed = {line.split()[0]: line.split()[2] for line in sh(*ctr, "images", "ls").stdout.splitlines()[1:]}
        assert listed.get(name) == digest, f"containerd holds {name} as {listed.get(name)}, the build made {digest}"
        sh(*ctr, "images", "tag", name, pinned)

    # -- what the node shows -------------------------------------------------------------------------

    def launcher_release(self) -> str | None:
        try:
            first = (self.rig.cni_bin / "rdma-netns").read_text().splitlines()[0]
        except OSError:
            return None
        return first.split("/opt/rdma-netns-ds/", 1)[1].split("/", 1)[0] if "/opt/rdma-netns-ds/" in first else None

    def chained(self) -> bool:
        try:
            return json.loads(self.primary_path.read_text())["plugins"][-1]["type"] == "rdma-netns"
        except (OSError, ValueError, KeyError, IndexError):
            return False

    def wait_for(self, what: str, predicate, timeout: float = 60.0) -> float:
        start = time.monotonic()
        while not predicate():
            if time.monotonic() - start > timeout:
                raise AssertionError(f"{what} not within {timeout} s")
            time.sleep(0.1)
        return time.monotonic() - start

    def interfaces(self, pod: RunningPod) -> dict[str, dict[str, list[str]]]:
        return self.rig.pod_addresses(pod.sandbox_id)

    def leftovers(self) -> list[str]:
        """Anything of rdma-netns on this node (after an uninstall: nothing)."""
        found = [p for p in ("/opt/rdma-netns-ds", "/var/lib/cni/rdma-netns", "/var/lib/rdma-netns", "/run/rdma-netns")
                 if Path(p).exists()]
        found += [f"{CDI_DIR}/{n}" for n in (sorted(os.listdir(CDI_DIR)) if CDI_DIR.exists() else [])
                  if n.startswith("rdma-netns")]
        for folder in ("/var/lib/kubelet/device-plugins", "/var/lib/kubelet/plugins_registry"):
            found += [f"{folder}/{n}" for n in (os.listdir(folder) if os.path.isdir(folder) else []) if "rdma-netns" in n]
        found += [f"cni bin {n}" for n in sorted(os.listdir(self.rig.cni_bin)) if n not in self.cni_bin_before]
        if self.primary_path.read_bytes() != self.primary_bytes:
            found.append(f"{self.primary_path.name} differs from the cluster CNI's bytes")
        found += [f"net.d {n}" for n in os.listdir(self.rig.net_dir) if n != self.primary_path.name]
        return found

    def close(self) -> None:
        for stop in (getattr(self, "kubelet", None), getattr(self, "pod_resources", None)):
            if stop is not None:
                stop.close()
        self.rig.close()
        if CDI_DIR.exists():
            for name in os.listdir(CDI_DIR):
                if name.startswith("rdma-netns") and name not in self.cdi_before:
                    (CDI_DIR / name).unlink()
        for path in [Path(p) for p in AS_WRITTEN] + self.made:
            if path in self.made or path.name in ("rdma-netns-ds", "rdma-netns"):
                shutil.rmtree(path, ignore_errors=True)
            elif path.is_dir():
                for child in path.iterdir():
                    if "rdma-netns" in child.name:
                        (shutil.rmtree if child.is_dir() else os.unlink)(child)
        for path in self.saved:
            shutil.rmtree(path, ignore_errors=True)
            path.with_name(path.name + ".rdeploy-saved").rename(path)


def bare_root_call(root: Path, command: str, conf: dict, netns: str, container_id: str, ifname: str,
                   env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the launcher in `root` (chroot in a mount namespace of its own, with only /proc, /sys and
    the pod's netns bound in: a kernel's file systems, nothing of the host's userland)."""
    inner = "/var/run/netns/pod"
    script = ('set -e; mount --bind /proc "$1/proc"; mount --bind /sys "$1/sys"; '
              'mount --bind "$2" "$1/var/run/netns/pod"; exec chroot "$1" /opt/cni/bin/rdma-netns')
    call_env = {"CNI_COMMAND": command, "CNI_CONTAINERID": container_id, "CNI_NETNS": inner if netns else "",
                "CNI_IFNAME": ifname, "CNI_PATH": "/opt/cni/bin", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", **(env or {})}
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", str(root),
                           netns or "/proc/self/ns/net"],
                          input=json.dumps(conf).encode(), env=call_env, capture_output=True, timeout=120)
