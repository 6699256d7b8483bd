"""A private containerd (Debian 12's 1.6.20) whose CRI is driven the way kubelet drives it, with
rdma-netns in its CNI bin folder behind a recording wrapper.

Nothing of the machine's own containerd is used or touched: the rig starts its own `containerd
--config <work>/config.toml` with root, state, gRPC socket, CNI bin and conf folders, runc root and
/opt path all inside one temp folder (/tmp/rcri-<tag>-*), network namespaces under its state
(netns_mounts_under_state_dir), snapshotter overlayfs, and a pause image built locally from
busybox-static (pause_image.py). The rails are veth pairs in the root netns named rcr<tag><i>;
each network gets its own Linux bridge (no address, no gateway, no masquerade) as the primary
plugin, so nothing outside the rig sees any of it.

What containerd 1.6 always puts outside its root/state, and close() cleans for this rig only:
libcni's result cache /var/lib/cni/results/<network>-<sandbox>-<ifname> and the runc shims'
sockets /run/containerd/s/<sha256(grpc address/namespace/id)>.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc

from integration.cri import pause_image
from integration.cri.cri_client import CriClient, Pod

HERE = Path(__file__).resolve().parent
LIBCNI_CACHE = Path("/var/lib/cni/results")
SHIM_SOCKETS = Path("/run/containerd/s")
CNI_PLUGINS = Path(os.environ.get("RDMA_NETNS_CNI_PATH", "/usr/lib/cni"))
NAMESPACE = "k8s.io"
CONFLIST_NAME = "10-rcri.conflist"


def sh(*args: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(args)} -> exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def missing_tools(containerd: "Containerd | None" = None) -> list[str]:
    """What this machine lacks for the suite (empty: all there)."""
    missing = [tool for tool in ("runc", "nsenter") if shutil.which(tool) is None]
    missing += (containerd or CONTAINERD_16).missing()
    missing += [f"{CNI_PLUGINS}/{p}" for p in ("bridge", "host-local", "loopback") if not (CNI_PLUGINS / p).exists()]
    if pause_image.static_busybox() is None:
        missing.append("busybox-static")
    return missing


@dataclass
class Call:
    """One call containerd made to rdma-netns, as cni-record.sh saw it."""

    start_ns: int
    end_ns: int | None
    command: str
    env: dict[str, str]
    env_names: list[str]
    stdin: bytes
    rc: int | None
    stdout: str
    cpu_seconds: float | None = None  # the plugin's user + system CPU time


    @property
    def conf(self) -> dict:
        return json.loads(self.stdin)

    @property
    def seconds(self) -> float | None:
        return None if self.end_ns is None else (self.end_ns - self.start_ns) / 1e9

    def cni_args(self) -> dict[str, str]:
        raw = self.env.get("CNI_ARGS", "")
        return dict(kv.split("=", 1) for kv in raw.split(";") if "=" in kv)


@dataclass
class Network:
    """One conflist the rig wrote: its name, bridge, IPv4 subnet and rail subnets."""

    name: str
    bridge: str | None
    subnet4: str | None
    rail_subnets: list[str]
    conflist: dict


CONTAINERD17_DIR = Path(os.environ.get("RDMA_NETNS_CONTAINERD17_DIR", "/opt/rdma-netns-test/containerd-1.7"))


@dataclass(frozen=True)
class Containerd:
    """Which containerd a rig runs: Debian 12's 1.6 from PATH, or 1.7 (fetch-containerd.sh) from
    its own folder, whose shim and ctr then come first on PATH."""

    label: str
    bin_dir: Path | None  # None: the machine's PATH

    def tool(self, name: str) -> str:
        return str(self.bin_dir / name) if self.bin_dir else (shutil.which(name) or name)

    @property
    def cdi(self) -> bool:
        """containerd 1.7 can inject CDI devices (enable_cdi); 1.6 cannot."""
        return self.label == "1.7"

    def missing(self) -> list[str]:
        tools = ("containerd", "ctr", "containerd-shim-runc-v2")
        if self.bin_dir is None:
            return [t for t in tools if shutil.which(t) is None]
        if any(not (self.bin_dir / t).exists() for t in tools):
            return [f"containerd 1.7 in {self.bin_dir} (integration/cri/fetch-containerd.sh)"]
        return []


CONTAINERD_16 = Containerd("1.6", None)
CONTAINERD_17 = Containerd("1.7", CONTAINERD17_DIR / "bin")


class ContainerdRig:
    def __init__(self, plugin_executable: str | None, rails: int = 2, containerd: Containerd = CONTAINERD_16,
                 cdi_dirs: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        """plugin_executable: installed behind the recorder as the CNI bin folder's rdma-netns
        (None: the folder gets only Debian's plugins, and whoever installs rdma-netns writes it);
        cdi_dirs: containerd 1.7's cdi_spec_dirs (default: the rig's own); env: added to
        containerd's environment, which libcni passes on to the plugins."""
        self.containerd = containerd
        self.extra_env = dict(env or {})
        self.tag = uuid.uuid4().hex[:6]
        self.work = Path(tempfile.mkdtemp(prefix=f"rcri-{self.tag}-", dir="/tmp"))
        self.root, self.state = self.work / "root", self.work / "state"
        self.cni_bin, self.net_dir = self.work / "cni-bin", self.work / "net.d"
        self.calls_dir = self.work / "cni-calls"
        self.rdma_state = self.work / "rdma-state"
        self.cdi_dir = self.work / "cdi"
        self.cdi_dirs = cdi_dirs or [str(self.cdi_dir)]  # containerd 1.7's cdi_spec_dirs
        self.ipam4, self.ipam6 = self.work / "ipam4", self.work / "ipam6"
        self.socket = str(self.work / "containerd.sock")
        self.log_path = self.work / "containerd.log"
        self.rails = [f"rcr{self.tag}{i}" for i in range(rails)]
        self.networks: list[Network] = []
        self.sandboxes: set[str] = set()
        self.proc: subprocess.Popen | None = None
        self.client: CriClient | None = None
        self.image: pause_image.PauseImage | None = None
        self.starts: list[float] = []
        # Folders containerd/libcni create outside the rig: removed again (if empty) only when
        # they were not there before.
        self._run_dirs_existed = {p: p.exists() for p in (SHIM_SOCKETS, SHIM_SOCKETS.parent, LIBCNI_CACHE,
                                                          LIBCNI_CACHE.parent, *_namespace_cgroups())}
        for folder in (self.root, self.state, self.cni_bin, self.net_dir, self.calls_dir, self.rdma_state,
                       self.ipam4, self.ipam6, self.work / "runc", self.work / "opt", self.cdi_dir):
            folder.mkdir(parents=True)
        try:
            self._install_plugins(plugin_executable)
            self._rails_up()
            self.image = pause_image.build()
            self._write_config()
        except BaseException:
            self.close()
            raise

    # -- set-up ---------------------------------------------------------------------------------

    def _install_plugins(self, plugin_executable: str | None) -> None:
        """Debian's reference plugins plus the rdma-netns launcher behind the recorder."""
        for plugin in CNI_PLUGINS.iterdir():
            if plugin.is_file():
                os.symlink(plugin, self.cni_bin / plugin.name)
        if plugin_executable is None:
            return
        sh(plugin_executable, "install-launcher", str(self.cni_bin / "rdma-netns.real"))
        shutil.copy2(HERE / "cni-record.sh", self.cni_bin / "rdma-netns")
        os.chmod(self.cni_bin / "rdma-netns", 0o755)

    def _rails_up(self) -> None:
        for rail in self.rails:
            sh("ip", "link", "add", rail, "type", "veth", "peer", "name", f"{rail}p")
            sh("ip", "link", "set", rail, "up")
            sh("ip", "link", "set", f"{rail}p", "up")

    def _write_config(self) -> None:
        runc = shutil.which("runc") or "runc"
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        (self.work / "config.toml").write_text(f"""\
version = 2
root = "{self.root}"
state = "{self.state}"
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing",
]

[grpc]
  address = "{self.socket}"

[debug]
  level = "info"

[plugins."io.containerd.internal.v1.opt"]
  path = "{self.work}/opt"

[{cri}]
  sandbox_image = "{self.image.name}"
  netns_mounts_under_state_dir = true
  disable_apparmor = true
  # The pause container asks for oom_score_adj -998; lowering it needs CAP_SYS_RESOURCE, which
  # a test machine inside a container may lack (runc then fails "can't get final child's PID").
  # Restricted: never below containerd's own value.
  restrict_oom_score_adj = true
  enable_selinux = false
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

[{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[{cri}.containerd.runtimes.runc.options]
  BinaryName = "{runc}"
  Root = "{self.work}/runc"
  SystemdCgroup = false

[{cri}.cni]
  bin_dir = "{self.cni_bin}"
  conf_dir = "{self.net_dir}"
  max_conf_num = 1
""")
        if self.containerd.cdi:  # containerd 1.7: CDI devices named by device plugins / annotations
            text = (self.work / "config.toml").read_text()
            dirs = ", ".join(json.dumps(d) for d in self.cdi_dirs)
            text = text.replace(f"[{cri}]\n", f"[{cri}]\n  enable_cdi = true\n  cdi_spec_dirs = [{dirs}]\n", 1)
            (self.work / "config.toml").write_text(text)

    # -- containerd's life ----------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> float:
        """Start containerd and wait until its CRI answers with the runtime ready; returns seconds."""
        assert self.proc is None or self.proc.poll() is not None, "containerd already running"
        began = time.perf_counter()
        log = open(self.log_path, "ab")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CNI_", "CONTAINERD_"))}
        env.update(self.extra_env)
        if self.containerd.bin_dir is not None:  # its own shim first
            env["PATH"] = f"{self.containerd.bin_dir}:{env.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
        self.proc = subprocess.Popen([self.containerd.tool("containerd"), "--config", str(self.work / "config.toml")],
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                     start_new_session=True)
        log.close()
        if self.client is not None:  # a fresh channel: the old one would sit in reconnect back-off
            self.client.close()
        self.client = CriClient(self.socket)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"containerd exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if os.path.exists(self.socket):
                    conditions = {c.type: c.status for c in self.client.status(timeout=2).status.conditions}
                    if conditions.get("RuntimeReady"):
                        break
            except grpc.RpcError:
                pass
            if "failed to load plugin io.containerd.grpc.v1.cri" in self.log_path.read_text(errors="replace"):
                raise AssertionError(f"containerd started without its CRI plugin:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"containerd's CRI not ready after {timeout} s:\n{self.log_tail()}")
            time.sleep(0.05)
        if not self._image_imported():
            self.import_image(self.image.tarball)
            if not self._image_imported():
                raise AssertionError(f"{self.image.name} not listed after import")
        seconds = time.perf_counter() - began
        self.starts.append(seconds)
        return seconds

    def import_image(self, tarball: Path) -> None:
        """`ctr images import` of an OCI archive into the CRI's namespace."""
        sh(self.containerd.tool("ctr"), "-a", self.socket, "-n", NAMESPACE, "images", "import",
           "--snapshotter", "overlayfs", str(tarball), timeout=300)

    def images(self) -> list[str]:
        return sh(self.containerd.tool("ctr"), "-a", self.socket, "-n", NAMESPACE, "images", "ls", "-q").stdout.split()

    def _image_imported(self) -> bool:
        return self.image.name in self.images()

    def kill(self) -> None:
        """SIGKILL containerd (a crash); its shims and pods keep running."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def restart(self) -> float:
        self.kill()
        return self.start()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def cri(self) -> CriClient:
        assert self.client is not None, "containerd not started"
        return self.client

    # -- networks -------------------------------------------------------------------------------

    def _next_index(self) -> int:
        return len(self.networks) + 1

    def bridge_plugin(self, index: int) -> tuple[dict, str, str]:
        """The primary plugin: a bridge unique to this network, host-local IPv4, no gateway
        address on the host, no masquerade, no routes: nothing reaches beyond the bridge."""
        bridge, subnet = f"rcb{self.tag}{index}", f"10.231.{index}.0/24"
        plugin = {"type": "bridge", "bridge": bridge, "isGateway": False, "ipMasq": False,
                  "ipam": {"type": "host-local", "dataDir": str(self.ipam4), "ranges": [[{"subnet": subnet}]]}}
        return plugin, bridge, subnet

    def rdma_plugin(self, index: int, rails: int = 1, ifnames: bool = True, **extra: object) -> tuple[dict, list[str]]:
        """rdma-netns, shared mode, macvlan on the rig's veth rails, host-local IPv6 per rail."""
        subnets = [f"fd00:cc{index:02x}:{i}::/64" for i in range(rails)]
        entries = []
        for i in range(rails):
            entry = {"netdev": self.rails[i],
                     "ipam": {"type": "host-local", "dataDir": str(self.ipam6), "ranges": [[{"subnet": subnets[i]}]]}}
            if ifnames:
                entry["ifname"] = f"rdma{i}"
            entries.append(entry)
        plugin = {"type": "rdma-netns", "mode": "shared", "link": "macvlan", "requireRdma": False,
                  "stateDir": str(self.rdma_state), "rails": entries,
                  # published pod info inside the rig, not in the machine's /run and /var/run/cdi
                  "podInfoDir": str(self.rdma_state / "pods"), "cdiSpecDir": str(self.rdma_state / "cdi"), **extra}
        if "resourceName" not in extra:
            plugin["pairing"] = False  # every sandbox gets rails, on purpose (a config must say so)
        return plugin, subnets

    def use_network(self, kind: str, rails: int = 1, version: str = "1.0.0", **rdma_extra: object) -> Network:
        """Write the one conflist of the CNI conf folder and wait until containerd loaded it.
        kind: "primary" (bridge only), "chained" (bridge + rdma-netns), "standalone" (rdma-netns only)."""
        index = self._next_index()
        name = f"rcri-{self.tag}-{index}"
        plugins, bridge, subnet4, subnets = [], None, None, []
        if kind in ("primary", "chained"):
            plugin, bridge, subnet4 = self.bridge_plugin(index)
            plugins.append(plugin)
        if kind in ("chained", "standalone"):
            plugin, subnets = self.rdma_plugin(index, rails, ifnames=(kind == "chained"), **rdma_extra)
            plugins.append(plugin)
        assert plugins, f"unknown network kind {kind!r}"
        conflist = {"cniVersion": version, "name": name, "plugins": plugins}
        network = Network(name, bridge, subnet4, subnets, conflist)
        self.networks.append(network)
        # containerd 1.6's conf syncer ignores fsnotify Create events and reloads on Write, Rename
        # and Remove: a file renamed in from elsewhere is never seen. A temp file inside the
        # folder (an extension libcni does not load) renamed over the conflist gives a Rename.
        tmp = self.net_dir / f".{CONFLIST_NAME}.tmp"
        tmp.write_text(json.dumps(conflist, indent=2) + "\n")
        os.replace(tmp, self.net_dir / CONFLIST_NAME)
        self.wait_network_loaded(name)
        return network

    def loaded_networks(self) -> list[str]:
        """Network names in containerd's loaded CNI config (CRI Status, verbose)."""
        info = self.cri.status(verbose=True).info
        config = json.loads(info.get("cniconfig", "{}"))
        return [n.get("Config", {}).get("Name", "") for n in config.get("Networks") or []]

    def wait_network_loaded(self, name: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while name not in self.loaded_networks():
            if time.monotonic() > deadline:
                raise AssertionError(f"containerd did not load network {name}: {self.loaded_networks()}")
            time.sleep(0.05)

    # -- pods -----------------------------------------------------------------------------------

    def new_pod(self, label: str = "p", namespace: str | None = None) -> Pod:
        return Pod(name=f"{label}-{uuid.uuid4().hex[:6]}", namespace=namespace or f"rcri-{self.tag}",
                   uid=str(uuid.uuid4()))

    def run_pod(self, pod: Pod) -> tuple[str, float]:
        sandbox_id, seconds = self.cri.run_pod(pod)
        self.sandboxes.add(sandbox_id)
        return sandbox_id, seconds

    def stop_remove(self, sandbox_id: str) -> tuple[float, float]:
        return self.cri.stop_pod(sandbox_id), self.cri.remove_pod(sandbox_id)

    def netns_path(self, sandbox_id: str) -> str:
        """The pod's network namespace: containerd's runtime spec, else the pause process's."""
        info = self.cri.pod_info(sandbox_id)
        for ns in info.get("runtimeSpec", {}).get("linux", {}).get("namespaces", []):
            if ns.get("type") == "network" and ns.get("path"):
                return ns["path"]
        pid = info.get("pid")
        assert pid, f"no netns path and no pid for sandbox {sandbox_id}: {sorted(info)}"
        return f"/proc/{pid}/ns/net"

    def pod_addresses(self, sandbox_id: str) -> dict[str, dict[str, list[str]]]:
        """Interfaces in the pod (not lo): name -> {"inet": [...], "inet6": [...]} (global scope,
        address/prefix)."""
        out = sh("nsenter", f"--net={self.netns_path(sandbox_id)}", "ip", "-j", "addr", "show").stdout
        found: dict[str, dict[str, list[str]]] = {}
        for link in json.loads(out):
            if link["ifname"] == "lo":
                continue
            found[link["ifname"]] = {"inet": [], "inet6": []}
            for addr in link.get("addr_info", []):
                if addr.get("scope") == "global":
                    found[link["ifname"]][addr["family"]].append(f"{addr['local']}/{addr['prefixlen']}")
        return found

    # -- what happened --------------------------------------------------------------------------

    def calls(self) -> list[Call]:
        out = []
        for folder in sorted(self.calls_dir.iterdir(), key=lambda p: int(p.name.split("-")[0])):
            _when, _pid, command = folder.name.split("-", 2)

            def read(name: str) -> str | None:
                path = folder / name
                return path.read_text() if path.exists() else None

            env = dict(line.split("=", 1) for line in (read("env") or "").splitlines() if "=" in line)
            start, end, rc = read("start"), read("end"), read("rc")
            out.append(Call(int(start) if start else int(_when), int(end) if end else None, command, env,
                            (read("env-names") or "").split(), (folder / "stdin").read_bytes(),
                            int(rc) if rc else None, read("stdout") or "", _children_cpu(read("times"))))
        return out

    def calls_for(self, sandbox_id: str) -> list[Call]:
        return [c for c in self.calls() if c.env.get("CNI_CONTAINERID") == sandbox_id]

    def leftovers(self, network: Network, sandbox_ids: list[str]) -> dict[str, list[str]]:
        """Everything the network's pods could have left behind; all lists empty when clean."""
        found: dict[str, list[str]] = {}
        for family, folder in (("ipv4 leases", self.ipam4), ("ipv6 leases", self.ipam6)):
            found[family] = _leases(folder / network.name)
        state = self.rdma_state / network.name
        found["rdma-netns state"] = sorted(
            str(p.relative_to(state)) for p in state.rglob("*")
            if p.is_file() and "released" not in p.relative_to(state).parts and not p.name.endswith(".lock")
        ) if state.exists() else []
        found["libcni cache"] = sorted(p.name for p in LIBCNI_CACHE.glob(f"{network.name}-*")
                                       if any(sid in p.name for sid in sandbox_ids)) if LIBCNI_CACHE.exists() else []
        found["rail macvlans"] = self.rail_children()
        found["sandboxes listed"] = [s.id for s in self.cri.list_pods() if s.id in sandbox_ids]
        netns_dir = self.state / "io.containerd.grpc.v1.cri" / "netns"
        found["netns files"] = sorted(p.name for p in netns_dir.iterdir()) if netns_dir.exists() else []
        found["pod veths on bridge"] = self.bridge_ports(network.bridge) if network.bridge else []
        return found

    def rail_children(self) -> list[str]:
        """Links in the root netns whose lower device is one of the rails (other than the veth peer)."""
        links = json.loads(sh("ip", "-j", "-d", "link", "show").stdout)
        return sorted(link["ifname"] for link in links
                      if link.get("link") in self.rails
                      and link.get("linkinfo", {}).get("info_kind") != "veth")

    def bridge_ports(self, bridge: str) -> list[str]:
        if not os.path.exists(f"/sys/class/net/{bridge}"):
            return []
        return sorted(os.listdir(f"/sys/class/net/{bridge}/brif"))

    # -- tear-down ------------------------------------------------------------------------------

    def _shim_socket(self, sandbox_id: str) -> Path:
        digest = hashlib.sha256(os.path.join(self.socket, NAMESPACE, sandbox_id).encode()).hexdigest()
        return SHIM_SOCKETS / digest

    def _our_pids(self, needle: str) -> list[int]:
        """Processes whose command line mentions this rig's folder or socket (its shims)."""
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if needle in cmdline:
                pids.append(int(entry))
        return pids

    def close(self) -> None:
        """Remove everything, also after a failed test: pods (their DELs run), containerd, its
        shims and containers, mounts under the rig, libcni cache and shim sockets of this rig,
        rails, bridges, the folder."""
        if self.proc is not None and self.proc.poll() is None and self.client is not None:
            try:
                for sandbox in self.client.list_pods():
                    try:
                        self.client.stop_pod(sandbox.id, timeout=30)
                        self.client.remove_pod(sandbox.id, timeout=30)
                    except grpc.RpcError:
                        pass
            except grpc.RpcError:
                pass
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.client is not None:
            self.client.close()
        runc_root = self.work / "runc" / NAMESPACE
        if runc_root.exists():
            for container in os.listdir(runc_root):
                sh("runc", "--root", str(runc_root), "delete", "--force", container, check=False)
        for pid in self._our_pids(f"-address {self.socket}"):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for sandbox_id in self.sandboxes:
            self._shim_socket(sandbox_id).unlink(missing_ok=True)
        for network in self.networks:
            if LIBCNI_CACHE.exists():
                for entry in LIBCNI_CACHE.glob(f"{network.name}-*"):
                    entry.unlink(missing_ok=True)
        for path in (SHIM_SOCKETS, SHIM_SOCKETS.parent, LIBCNI_CACHE, LIBCNI_CACHE.parent, *_namespace_cgroups()):
            if not self._run_dirs_existed.get(path, False):
                try:
                    path.rmdir()
                except OSError:
                    pass
        for network in self.networks:
            if network.bridge:
                sh("ip", "link", "del", network.bridge, check=False)
        for rail in self.rails:
            sh("ip", "link", "del", rail, check=False)
        for mountpoint in sorted(self.mounts(), key=len, reverse=True):
            sh("umount", "-l", mountpoint, check=False)
        shutil.rmtree(self.work, ignore_errors=True)

    def remnants(self) -> list[str]:
        """What close() should have removed and is still there (empty after a clean close)."""
        found = [f"mount {m}" for m in self.mounts()]
        found += [f"folder {self.work}"] if self.work.exists() else []
        found += [f"process {pid}" for pid in self._our_pids(str(self.work))]
        found += [f"link {name}" for name in [*self.rails, *(n.bridge for n in self.networks if n.bridge)]
                  if os.path.exists(f"/sys/class/net/{name}")]
        found += [f"shim socket {self._shim_socket(sid)}" for sid in self.sandboxes if self._shim_socket(sid).exists()]
        if LIBCNI_CACHE.exists():
            found += [f"libcni cache {p}" for n in self.networks for p in LIBCNI_CACHE.glob(f"{n.name}-*")]
        # Another rig may be using the k8s.io parent right now: only this rig's pods count.
        found += [f"cgroup {p / sid}" for p in _namespace_cgroups() for sid in self.sandboxes if (p / sid).exists()]
        return found

    def mounts(self) -> list[str]:
        with open("/proc/self/mounts") as mounts:
            return [line.split()[1] for line in mounts if line.split()[1].startswith(str(self.work))]


def _namespace_cgroups() -> list[Path]:
    """The cgroup folders runc makes for containerd's default cgroupsPath /k8s.io/<id> (one per
    v1 controller, or one on a v2-only machine); a pod's own folder goes with the pod, the parent
    stays, so close() removes it (rmdir: only when empty) if the rig made it."""
    root = Path("/sys/fs/cgroup")
    return [root / NAMESPACE, *(p / NAMESPACE for p in sorted(root.iterdir()) if p.is_dir())] if root.exists() else []


def _children_cpu(times: str | None) -> float | None:
    """Seconds of CPU from the second line of sh's `times` ("0m0.12s 0m0.03s": user, system)."""
    lines = (times or "").splitlines()
    if len(lines) < 2:
        return None
    total = 0.0
    for part in lines[1].split():
        minutes, _, seconds = part.rstrip("s").partition("m")
        total += float(minutes) * 60 + float(seconds)
    return total


def _leases(folder: Path) -> list[str]:
    if not folder.exists():
        return []
    return sorted(p.name for p in folder.iterdir() if p.name != "lock" and not p.name.startswith("last_reserved_ip"))


def in_subnet(address: str, subnet: str) -> bool:
    return ipaddress.ip_interface(address).ip in ipaddress.ip_network(subnet)
