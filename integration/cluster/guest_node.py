"""Host side of an RDMA node of the local cluster: a real-kernel guest (run-in-guest.sh, Soft-RoCE)
that joins the API server as a kubelet over the cluster's network.

The guest's node NIC is a tap device on the cluster's bridge (QEMU runs inside the cluster's
network namespace, so the tap lives there and nothing touches this machine's own network); its
rails are two virtio NICs joined by a QEMU hub (pods of the node reach each other through them).
The guest runs the two-node rig's agent; guest_setup.py, run through it, makes it a node.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from integration.cluster import components, host_rdma
from integration.cluster.layout import BRIDGE, CGROUP_ROOT, NETNS, NODE_PREFIX_LEN
from integration.cluster.namespaces import run
from integration.cluster.pki import Pki
from integration.cri import pause_image
from integration.cri.rig import CNI_PLUGINS, CONTAINERD17_DIR
from integration.two_nodes.rig import RAILS, Node, NodeError, rail_mac

REPO = Path(__file__).resolve().parents[2]
GUEST_CONTAINERD = Path("/var/lib/rk8s/containerd")  # inside the guest (its own copy-on-write root)


def node_mac(index: int) -> str:
    return f"52:54:00:c{index}:00:01"


def stage(path: Path, folder: Path) -> Path:
    """`path` in `folder`: a hard link, or a copy across file systems."""
    target = folder / path.name
    if not target.exists():
        try:
            os.link(path, target)
        except OSError:
            shutil.copy2(path, target)
    return target


class GuestNode:
    def __init__(self, cluster, name: str, index: int, memory: str = "3G", cpus: int = 2) -> None:
        self.cluster, self.name, self.index = cluster, name, index
        self.ip = f"10.251.0.{10 + index}"
        self.pod_subnet = f"10.252.{1 + index}.0/24"
        self.shared = cluster.layout.root / "guests" / name
        self.tap = f"rk8stap{index}"
        self.memory, self.cpus = memory, cpus
        self.agent: Node | None = None
        self.booted_s = self.setup_s = 0.0

    def rail_address(self, rail: int) -> str:
        return f"fd00:1{rail}::{10 + self.index}:1/64"

    def _qemu_opts(self) -> list[str]:
        opts = ["-device", "virtio-rng-pci",
                "-netdev", f"tap,id=node,ifname={self.tap},script=no,downscript=no",
                "-device", f"virtio-net-pci,netdev=node,mac={node_mac(self.index)}"]
        for rail in range(RAILS):
            opts += ["-netdev", f"hubport,id=rail{rail},hubid={self.index}",
                     "-device", f"virtio-net-pci,netdev=rail{rail},mac={rail_mac(self.index, rail)}"]
        return opts

    def boot(self, timeout: float = 900) -> None:
        """Start the guest with its agent and wait until it answers (boot under emulation)."""
        self.shared.mkdir(parents=True, exist_ok=True)
        run("ip", "-n", NETNS, "tuntap", "add", "dev", self.tap, "mode", "tap")
        run("ip", "-n", NETNS, "link", "set", self.tap, "master", BRIDGE, "up")
        agent = Node(self.index, self.shared, self.shared)
        agent.qemu_opts = self._qemu_opts()
        agent.boot(cpus=self.cpus, memory=self.memory, timeout_s=7200, name=self.name,
                   wrap=("nsenter", f"--net=/run/netns/{NETNS}", "--"))
        self.agent = agent
        agent.wait_ready(time.monotonic() + timeout)
        self.booted_s = agent.booted_s

    def join(self, pki: Pki, bin_dir: Path, images: list[Path], tags: dict[str, str], timeout: float = 900) -> None:
        """Make the guest a node (guest_setup.py) and wait until the API server has it Ready."""
        assert self.agent is not None
        facts = json.loads((self.agent.channel / "ready.json").read_text())
        by_mac = {nic["mac"]: nic["name"] for nic in facts["nics"]}
        if node_mac(self.index) not in by_mac:
            raise NodeError(f"{self.name}: no node NIC with MAC {node_mac(self.index)}: {facts}")
        # Certificates and kubelet's files in the shared folder (the guest sees this machine's
        # files read-only, but not necessarily its /tmp).
        guest_pki = self.shared / "pki"
        guest_pki.mkdir(exist_ok=True)
        argv = components.kubelet(bin_dir, self.shared, GUEST_CONTAINERD / "containerd.sock", self.name, self.ip, pki)
        for item in pki.folder.iterdir():
            if item.suffix in (".crt", ".key") and (item.name.startswith(("ca.", f"kubelet-{self.name}",
                                                                           f"kubelet-serving-{self.name}"))):
                shutil.copy2(item, guest_pki / item.name)
        for written in (self.shared / f"kubelet-{self.name}.yaml", self.shared / f"kubelet-{self.name}.kubeconfig"):
            written.write_text(written.read_text().replace(str(pki.folder), str(guest_pki)))
        # The guest does not see this machine's /var/cache: kubelet and the images go through the
        # shared folder (hard links where the file system allows).
        sandbox = pause_image.build()
        staged = [str(stage(path, self.shared)) for path in (sandbox.tarball, *images)]
        argv[0] = str(stage(Path(argv[0]), self.shared))
        config = {
            "shared": str(self.shared), "node_nic": by_mac[node_mac(self.index)],
            "node_cidr": f"{self.ip}/{NODE_PREFIX_LEN}",
            "rails": {str(rail): self.agent.nics[rail] for rail in range(RAILS)},
            "rail_addresses": {str(rail): self.rail_address(rail) for rail in range(RAILS)},
            # One ConfigMap for every node names the rails: the guest's NICs get the host node's names
            # (what a udev rule does on real nodes).
            "rail_names": {str(rail): host_rdma.rail_netdev(rail) for rail in range(RAILS)},
            "cni_plugins": str(CNI_PLUGINS), "pod_subnet": self.pod_subnet,
            "containerd_dir": str(GUEST_CONTAINERD), "containerd_bin": str(CONTAINERD17_DIR / "bin"),
            "sandbox_image": sandbox.name, "images": staged, "tags": tags,
            "cgroup_root": CGROUP_ROOT, "kubelet_argv": argv,
        }
        (self.shared / "node.json").write_text(json.dumps(config, indent=2))
        began = time.monotonic()
        reply = self.agent.run(str(REPO / ".venv" / "bin" / "python"), "-m", "integration.cluster.guest_setup",
                               str(self.shared / "node.json"), timeout=timeout, env={"PYTHONPATH": str(REPO)})
        self.setup_facts = json.loads(reply.stdout.strip().splitlines()[-1])
        self.cluster.wait_for(f"node {self.name} Ready", lambda: self.cluster.node_ready(self.name), timeout=timeout)
        self.setup_s = time.monotonic() - began

    def stop(self) -> None:
        if self.agent is not None:
            self.agent.stop()
        run("ip", "-n", NETNS, "link", "delete", self.tap, check=False)

