"""Guest side of an RDMA node of the local cluster: run inside a real-kernel guest (by the
two-node rig's agent, integration/two_nodes/agent.py) with the config guest_node.py wrote.

It makes the guest a node as an admin's is: the node NIC on the cluster's network, one Soft-RoCE
device per rail NIC with the node's IPv6 address on the rail, containerd 1.7 with CDI on and the
cluster CNI (a bridge) in /etc/cni/net.d, the images imported, and kubelet started; then it returns
(containerd and kubelet keep running, detached, their logs in the shared folder)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from integration.cluster import components
from integration.cluster.namespaces import make_cgroups


def sh(*args: str, timeout: float = 120) -> str:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} -> {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def detach(argv: list[str], log: Path, env: dict[str, str]) -> int:
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                                start_new_session=True)
    return proc.pid


def main(config_path: str) -> int:
    config = json.loads(Path(config_path).read_text())
    shared = Path(config["shared"])
    began = time.monotonic()
    node_nic = config["node_nic"]
    sh("ip", "address", "add", config["node_cidr"], "dev", node_nic)
    sh("ip", "link", "set", node_nic, "up")
    # What rdma-core's udev rules and rdma-load-modules do on a node: rdma_rxe does not pull in
    # ib_uverbs, and without it no pod can open a device (the plugin's units are then Unhealthy).
    # rdma_ucm stays unloaded: the Job's verbs traffic needs no /dev/infiniband/rdma_cm, and a node
    # without it must still run pods (the plugin then leaves rdma_cm out of their devices).
    sh("modprobe", "rdma_rxe")
    sh("modprobe", "ib_uverbs")
    for rail, nic in sorted(config["rails"].items()):
        sh("ip", "link", "set", nic, "name", config["rail_names"][rail])
        nic = config["rail_names"][rail]
        sh("ip", "link", "set", nic, "up")
        sh("ip", "address", "add", config["rail_addresses"][rail], "dev", nic, "nodad")
        sh("rdma", "link", "add", f"rxe{rail}", "type", "rxe", "netdev", nic)
    Path("/etc/cni/net.d").mkdir(parents=True, exist_ok=True)
    Path("/opt/cni/bin").mkdir(parents=True, exist_ok=True)
    for plugin in Path(config["cni_plugins"]).iterdir():
        if plugin.is_file():
            shutil.copy2(plugin, Path("/opt/cni/bin") / plugin.name)
    components.write_json(Path("/etc/cni/net.d/10-local-pods.conflist"),
                          components.primary_conflist(config["pod_subnet"]))
    containerd_dir = Path(config["containerd_dir"])
    # The guest's root is an overlay (run-in-guest.sh's copy-on-write), on which containerd's
    # overlayfs snapshotter cannot make its own: its root goes on a tmpfs, as on a disk of a node.
    containerd_dir.mkdir(parents=True, exist_ok=True)
    sh("mount", "-t", "tmpfs", "-o", "mode=0711", "tmpfs", str(containerd_dir))
    conf = components.containerd_config(containerd_dir, config["sandbox_image"], shutil.which("runc") or "runc")
    env = {"PATH": f"{config['containerd_bin']}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
           "HOME": "/root"}
    detach([f"{config['containerd_bin']}/containerd", "--config", str(conf)], shared / "containerd.log", env)
    socket = containerd_dir / "containerd.sock"
    deadline = time.monotonic() + 120
    while not socket.exists():
        if time.monotonic() > deadline:
            raise RuntimeError("containerd's socket did not appear")
        time.sleep(0.2)
    for archive in config["images"]:
        sh(f"{config['containerd_bin']}/ctr", "-a", str(socket), "-n", "k8s.io", "images", "import",
           "--snapshotter", "overlayfs", archive, timeout=900)
    for name, pinned in config.get("tags", {}).items():
        sh(f"{config['containerd_bin']}/ctr", "-a", str(socket), "-n", "k8s.io", "images", "tag", name, pinned)
    make_cgroups(config["cgroup_root"])
    detach(config["kubelet_argv"], shared / "kubelet.log", env)
    print(json.dumps({"seconds": round(time.monotonic() - began, 1),
                      "cgroup2": os.path.exists("/sys/fs/cgroup/cgroup.controllers")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
