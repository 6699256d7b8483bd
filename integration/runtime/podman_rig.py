"""A private Podman set-up whose CNI network is rdma-netns, on veth "RDMA NICs" in the root netns.

Nothing of the machine's own container or CNI configuration is read or written:

- Podman runs with `--root/--runroot` in a temporary folder, a private containers.conf
  (CONTAINERS_CONF: `network_backend = "cni"`, `cni_plugin_dirs` = [our plugin folder,
  /usr/lib/cni], `network_config_dir` = our conflist folder, file locks, file events) and a
  private storage.conf (CONTAINERS_STORAGE_CONF, vfs driver);
- the plugin folder holds the rdma-netns launcher (`rdma-netns install-launcher`) as
  `rdma-netns.real` behind `cni-record.sh` as `rdma-netns`, which records every call's CNI_*
  environment and stdin under `cni-calls/`;
- the rails are veth pairs with names unique to this rig, in the root netns (where Podman's CNI
  calls run), and the conflist puts the plugin's stateDir and host-local's dataDir in the rig.

The one thing outside the rig Podman 4.3 always uses is libcni's cache folder
/var/lib/cni/results (`<network>-<containerID>-<ifname>`, removed on DEL); close() removes any
entry of this rig's networks that a failed run left behind.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import tarfile
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
IMAGE = "localhost/rdma-netns-busybox:test"
LIBCNI_CACHE = Path("/var/lib/cni/results")
# The container's main process: exits at once on SIGTERM (a bare `sleep` as PID 1 ignores it and
# `podman stop` would wait its 10 s timeout before SIGKILL).
SLEEPER = ["sh", "-c", 'trap "exit 0" TERM; sleep 300 & wait']


def sh(*args: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} -> exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def static_busybox() -> str | None:
    """A statically linked busybox (Debian's busybox-static), or None."""
    for path in ("/bin/busybox", "/usr/bin/busybox"):
        if os.path.exists(path):
            out = subprocess.run(["ldd", path], capture_output=True, text=True)
            if "not a dynamic executable" in out.stdout + out.stderr:
                return path
    return None


@dataclass
class Call:
    """One call the runtime made to the plugin, as cni-record.sh saw it."""

    when_ns: int
    command: str
    env: dict[str, str]
    env_names: list[str]
    stdin: bytes

    @property
    def conf(self) -> dict:
        return json.loads(self.stdin)


class PodmanRig:
    def __init__(self, plugin_executable: str, rails: int = 2) -> None:
        self.tag = uuid.uuid4().hex[:4]
        self.work = Path(tempfile.mkdtemp(prefix=f"rdma-netns-podman-{self.tag}-"))
        self.cni_bin = self.work / "cni-bin"
        self.net_dir = self.work / "net.d"
        self.calls_dir = self.work / "cni-calls"
        self.state_dir = self.work / "state"
        self.ipam_dir = self.work / "ipam"
        self.rails = [f"rdpm{self.tag}{i}" for i in range(rails)]
        self.networks: list[str] = []
        self.sandboxes: set[str] = set()
        self.runtime = "runc" if shutil.which("runc") else "crun"
        for folder in (self.cni_bin, self.net_dir, self.calls_dir, self.state_dir, self.ipam_dir):
            folder.mkdir(parents=True)
        self.cni_path = f"{self.cni_bin}:/usr/lib/cni"
        try:
            self._rails_up()
            self._install_plugin(plugin_executable)
            self._write_podman_config()
        except BaseException:
            self.close()
            raise

    # -- set-up ---------------------------------------------------------------------------------

    def _rails_up(self) -> None:
        for rail in self.rails:
            sh("ip", "link", "add", rail, "type", "veth", "peer", "name", f"{rail}p")
            sh("ip", "link", "set", rail, "up")
            sh("ip", "link", "set", f"{rail}p", "up")

    def _install_plugin(self, plugin_executable: str) -> None:
        sh(plugin_executable, "install-launcher", str(self.cni_bin / "rdma-netns.real"))
        shutil.copy2(HERE / "cni-record.sh", self.cni_bin / "rdma-netns")
        os.chmod(self.cni_bin / "rdma-netns", 0o755)

    def _write_podman_config(self) -> None:
        # Podman (rootful) lowers its own RLIMIT_NPROC to 32768 and asks the OCI runtime for
        # nofile=1048576 in containers; without CAP_SYS_RESOURCE (some sandboxes/VMs) raising a
        # limit fails ("setrlimit RLIMIT_NOFILE: Operation not permitted"), so ask for what this
        # process already has.
        nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 1048576)
        nproc_hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
        nproc = 32768 if nproc_hard == resource.RLIM_INFINITY else min(nproc_hard, 32768)
        (self.work / "containers.conf").write_text(f"""\
[containers]
default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]

[engine]
runtime = "{self.runtime}"
cgroup_manager = "cgroupfs"
events_logger = "file"
lock_type = "file"
tmp_dir = "{self.work}/tmp"

[network]
network_backend = "cni"
cni_plugin_dirs = ["{self.cni_bin}", "/usr/lib/cni"]
network_config_dir = "{self.net_dir}"
""")
        (self.work / "storage.conf").write_text(f"""\
[storage]
driver = "vfs"
graphroot = "{self.work}/storage"
runroot = "{self.work}/runroot"
""")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("CNI_", "CONTAINERS_"))}
        self.env.update(CONTAINERS_CONF=str(self.work / "containers.conf"),
                        CONTAINERS_STORAGE_CONF=str(self.work / "storage.conf"))

    def import_image(self) -> str:
        """A one-binary image: busybox-static at /bin/busybox and a symlink per applet."""
        busybox = static_busybox()
        if busybox is None:
            raise FileNotFoundError("no static busybox (apt-get install busybox-static)")
        applets = sh(busybox, "--list").stdout.split()
        rootfs = self.work / "rootfs.tar"
        with tarfile.open(rootfs, mode="w") as tar:
            for folder in ("bin", "dev", "etc", "proc", "run", "sys", "tmp"):
                info = tarfile.TarInfo(folder)
                info.type, info.mode = tarfile.DIRTYPE, 0o1777 if folder == "tmp" else 0o755
                tar.addfile(info)
            tar.add(busybox, arcname="bin/busybox")
            for applet in applets:
                if applet != "busybox":
                    info = tarfile.TarInfo(f"bin/{applet}")
                    info.type, info.linkname = tarfile.SYMTYPE, "busybox"
                    tar.addfile(info)
        self.podman("import", "--change", "ENV PATH=/bin", "--change", 'CMD ["/bin/sh"]', str(rootfs), IMAGE)
        return IMAGE

    def add_network(self, name: str, subnets: list[str], version: str = "1.0.0",
                    capabilities: dict | None = None, rail_ifnames: bool = True) -> dict:
        """A conflist in the rig's network_config_dir: rdma-netns, shared mode, macvlan, one rail
        per subnet on the rig's veths, host-local IPv6 per rail, requireRdma false."""
        rails = []
        for i, subnet in enumerate(subnets):
            rail = {"netdev": self.rails[i],
                    "ipam": {"type": "host-local", "dataDir": str(self.ipam_dir), "ranges": [[{"subnet": subnet}]]}}
            if rail_ifnames:
                rail["ifname"] = f"rdma{i}"
            rails.append(rail)
        plugin = {"type": "rdma-netns", "mode": "shared", "link": "macvlan", "requireRdma": False, "pairing": False,
                  "stateDir": str(self.state_dir), "rails": rails,
                  # published pod info inside the rig, not in the machine's /run and /var/run/cdi
                  "podInfoDir": str(self.state_dir / "pods"), "cdiSpecDir": str(self.state_dir / "cdi")}
        if capabilities:
            plugin["capabilities"] = capabilities
        conflist = {"cniVersion": version, "name": name, "plugins": [plugin]}
        (self.net_dir / f"{name}.conflist").write_text(json.dumps(conflist, indent=2) + "\n")
        self.networks.append(name)
        return conflist

    # -- running podman -------------------------------------------------------------------------

    def podman(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        cmd = ["podman", "--root", f"{self.work}/storage", "--runroot", f"{self.work}/runroot",
               "--storage-driver", "vfs", *args]
        return sh(*cmd, check=check, timeout=timeout, env=self.env)

    def run(self, name: str, *options: str, command: list[str] = SLEEPER,
            check: bool = True) -> tuple[subprocess.CompletedProcess, float]:
        """`podman run -d`; returns the process and its wall time in seconds."""
        start = time.perf_counter()
        proc = self.podman("run", "-d", "--name", name, *options, IMAGE, *command, check=check)
        seconds = time.perf_counter() - start
        if proc.returncode == 0:
            self.sandboxes.add(self.inspect(name)["NetworkSettings"]["SandboxKey"])
        return proc, seconds

    def inspect(self, name: str) -> dict:
        return json.loads(self.podman("inspect", name).stdout)[0]

    def exec(self, name: str, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        return self.podman("exec", name, *command, check=check)

    # -- what happened --------------------------------------------------------------------------

    def calls(self) -> list[Call]:
        out = []
        for folder in sorted(self.calls_dir.iterdir(), key=lambda p: int(p.name.split("-")[0])):
            when, _pid, command = folder.name.split("-", 2)
            env = dict(line.split("=", 1) for line in (folder / "env").read_text().splitlines() if "=" in line)
            out.append(Call(int(when), command, env, (folder / "env-names").read_text().split(),
                            (folder / "stdin").read_bytes()))
        return out

    def state_files(self, network: str) -> list[str]:
        """Attachment records (not the released/ markers that make repeated DELs cheap)."""
        folder = self.state_dir / network
        return sorted(p.name for p in folder.iterdir() if p.name != "released") if folder.exists() else []

    def leases(self, network: str) -> list[str]:
        folder = self.ipam_dir / network
        if not folder.exists():
            return []
        return sorted(p.name for p in folder.iterdir()
                      if p.name != "lock" and not p.name.startswith("last_reserved_ip"))

    def libcni_cache(self, network: str) -> list[str]:
        if not LIBCNI_CACHE.exists():
            return []
        return sorted(p.name for p in LIBCNI_CACHE.iterdir() if p.name.startswith(f"{network}-"))

    # -- tear-down ------------------------------------------------------------------------------

    def close(self) -> None:
        """Remove everything, also after a failed test: containers (their DEL runs), the network
        namespaces Podman made for them, the rails, libcni cache entries, mounts, the folder."""
        if shutil.which("podman") and (self.work / "containers.conf").exists():
            self.podman("rm", "--force", "--all", "--time", "0", check=False)
        for sandbox in self.sandboxes:
            if sandbox and os.path.exists(sandbox):
                sh("ip", "netns", "del", os.path.basename(sandbox), check=False)
        for rail in self.rails:
            sh("ip", "link", "del", rail, check=False)
        for network in self.networks:
            for entry in self.libcni_cache(network):
                (LIBCNI_CACHE / entry).unlink(missing_ok=True)
        with open("/proc/self/mounts") as mounts:
            ours = [line.split()[1] for line in mounts if line.split()[1].startswith(str(self.work))]
        for mountpoint in sorted(ours, key=len, reverse=True):
            sh("umount", "-l", mountpoint, check=False)
        shutil.rmtree(self.work, ignore_errors=True)


def host_links() -> set[str]:
    return {link["ifname"] for link in json.loads(sh("ip", "-j", "link").stdout)}


def host_rules() -> list[str]:
    return sorted(sh("ip", "-6", "rule").stdout.splitlines() + sh("ip", "-4", "rule").stdout.splitlines())


def container_ipv6(rig: PodmanRig, name: str) -> dict[str, list[str]]:
    """`ip -6 addr` in the container (busybox): interface -> global addresses with prefix."""
    out = rig.exec(name, "ip", "-6", "addr").stdout
    found: dict[str, list[str]] = {}
    current = None
    for line in out.splitlines():
        head = re.match(r"^\d+: ([^:@]+)[@:]", line)
        if head:
            current = head.group(1)
            found.setdefault(current, [])
        addr = re.match(r"^\s+inet6 (\S+) scope global", line)
        if addr and current:
            found[current].append(addr.group(1))
    return found
