"""What kubelet does with a pod spec, through containerd's CRI: enough of it to run the DaemonSet's
pod and the training pod the way their manifests say.

Sandbox (hostNetwork -> the node's network namespace), volumes (hostPath with its `type`,
configMap, emptyDir), device admission through the stand-in kubelet (tests/kubelet_standin.py:
GetPreferredAllocation, Allocate, PodResources) and what the device plugin answered handed to the
runtime (env, mounts, device nodes, annotations, CDI devices as `cdi.k8s.io/` annotations, which
containerd 1.7 resolves with enable_cdi), init containers run to completion in order, then the
containers with their command, env (values and configMapKeyRef), mounts, capabilities, user,
read-only root and no_new_privs; exec probes through ExecSync; termination with the grace period.

Not kubelet: no API server (specs come from the manifests), no restarts of exited containers, no
image pulls (images are imported), emptyDir is a plain folder, and only the resources a registered
device plugin serves are admitted (others, e.g. nvidia.com/gpu, are left out by the caller).
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from integration.cri.api.runtime.v1 import api_pb2 as cri
from integration.cri.rig import ContainerdRig

EXTENDED = ("rdma/",)  # resources this kubelet admits through a device plugin


class PodError(AssertionError):
    pass


class HostPaths:
    """Where a manifest's hostPath lands on this machine: as written, unless a prefix is mapped to
    a folder of the rig (the longest mapped prefix wins)."""

    def __init__(self, mapping: dict[str, Path]) -> None:
        self.mapping = {k.rstrip("/"): Path(v) for k, v in mapping.items()}

    def resolve(self, path: str) -> Path:
        for prefix in sorted(self.mapping, key=len, reverse=True):
            if path == prefix or path.startswith(prefix + "/"):
                return self.mapping[prefix] / os.path.relpath(path, prefix)
        return Path(path)


@dataclass
class RunningPod:
    name: str
    namespace: str
    uid: str
    spec: dict
    sandbox_id: str = ""
    sandbox_config: cri.PodSandboxConfig | None = None
    containers: dict[str, str] = field(default_factory=dict)   # name -> container ID
    init_exit: dict[str, int] = field(default_factory=dict)    # init container -> exit code
    volumes: dict[str, tuple[Path, bool]] = field(default_factory=dict)  # name -> (host path, read-only)
    started: float = 0.0
    ready_after: float | None = None  # seconds from RunPodSandbox to every readiness probe passing
    sandbox_seconds: float = 0.0  # the RunPodSandbox call (the CNI ADDs run inside it)
    teardown_seconds: float = 0.0  # StopPodSandbox + RemovePodSandbox (the CNI DELs)


class MiniKubelet:
    def __init__(self, rig: ContainerdRig, work: Path, host_paths: HostPaths, configmaps: dict[str, dict[str, str]],
                 standin=None) -> None:
        self.rig, self.work, self.host_paths = rig, work, host_paths
        self.configmaps = configmaps  # name -> data
        self.standin = standin  # KubeletStandIn (device plugins, PodResources) or None

    # -- a pod's life --------------------------------------------------------------------------

    def run(self, spec: dict, name: str, namespace: str, *, wait_ready: bool = True,
            ready_timeout: float = 120.0) -> RunningPod:
        pod = RunningPod(name=name, namespace=namespace, uid=str(uuid.uuid4()), spec=spec)
        pod.started = time.monotonic()
        self._admit(pod)
        try:
            pod.volumes = self._volumes(pod)
            pod.sandbox_config = self._sandbox_config(pod)
            began = time.perf_counter()
            pod.sandbox_id = self.rig.cri.runtime.RunPodSandbox(
                cri.RunPodSandboxRequest(config=pod.sandbox_config), timeout=120).pod_sandbox_id
            pod.sandbox_seconds = time.perf_counter() - began
            self.rig.sandboxes.add(pod.sandbox_id)
            for container in spec.get("initContainers", []):
                cid = self._create(pod, container)
                self.rig.cri.runtime.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=60)
                code = self._wait_exit(cid, 300)
                pod.init_exit[container["name"]] = code
                if code != 0:
                    raise PodError(f"init container {container['name']} exited {code}:\n{self.logs(pod, container['name'])}")
            for container in spec["containers"]:
                cid = self._create(pod, container)
                self.rig.cri.runtime.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=60)
            if wait_ready:
                self.wait_ready(pod, ready_timeout)
        except BaseException:
            self.stop(pod, grace=2)
            raise
        return pod

    def wait_ready(self, pod: RunningPod, timeout: float) -> None:
        """Every container running and its readiness probe (if any) passing, as kubelet reports Ready."""
        deadline = time.monotonic() + timeout
        pending = {c["name"] for c in pod.spec["containers"]}
        while pending:
            for container in pod.spec["containers"]:
                if container["name"] in pending and self._running(pod, container["name"]) \
                        and self.probe(pod, container["name"], "readinessProbe"):
                    pending.discard(container["name"])
            if not pending:
                break
            if time.monotonic() > deadline:
                detail = {n: self.logs(pod, n)[-1500:] for n in pending}
                raise PodError(f"pod {pod.name}: {sorted(pending)} not ready after {timeout} s: {detail}")
            time.sleep(0.5)
        pod.ready_after = time.monotonic() - pod.started

    def stop(self, pod: RunningPod, grace: float | None = None) -> None:
        """Termination as kubelet does it: each container gets SIGTERM and the grace period, then
        the sandbox goes (its network teardown, CNI DEL), then the pod's devices are free."""
        grace = pod.spec.get("terminationGracePeriodSeconds", 30) if grace is None else grace
        for cid in pod.containers.values():
            try:
                self.rig.cri.runtime.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=int(grace)),
                                                   timeout=grace + 60)
                self.rig.cri.runtime.RemoveContainer(cri.RemoveContainerRequest(container_id=cid), timeout=60)
            except Exception:  # noqa: BLE001 - the sandbox's removal below takes what is left
                pass
        if pod.sandbox_id:
            pod.teardown_seconds = self.rig.cri.stop_pod(pod.sandbox_id) + self.rig.cri.remove_pod(pod.sandbox_id)
        if self.standin is not None:
            self.standin.forget_pod(pod.namespace, pod.name)

    # -- what a pod's containers see -------------------------------------------------------------

    def exec(self, pod: RunningPod, container: str, argv: list[str], timeout: int = 30) -> cri.ExecSyncResponse:
        return self.rig.cri.runtime.ExecSync(
            cri.ExecSyncRequest(container_id=pod.containers[container], cmd=argv, timeout=timeout),
            timeout=timeout + 30)

    def probe(self, pod: RunningPod, container: str, kind: str) -> bool:
        """The container's exec probe of that kind (readinessProbe, livenessProbe); no probe: True."""
        spec = next(c for c in pod.spec["containers"] if c["name"] == container)
        probe = spec.get(kind)
        if not probe:
            return True
        reply = self.exec(pod, container, probe["exec"]["command"], probe.get("timeoutSeconds", 1))
        return reply.exit_code == 0

    def logs(self, pod: RunningPod, container: str) -> str:
        path = self._log_dir(pod) / container / "0.log"
        try:
            return path.read_text(errors="replace")
        except OSError:
            return "(no log)"

    def netns(self, pod: RunningPod) -> str:
        return self.rig.netns_path(pod.sandbox_id)

    # -- the spec, turned into CRI requests ----------------------------------------------------------

    def _admit(self, pod: RunningPod) -> None:
        requests = {c["name"]: {r: int(n) for r, n in (c.get("resources", {}).get("limits") or {}).items()
                                if r.startswith(EXTENDED)}
                    for c in pod.spec["containers"]}
        init = {c["name"]: {r: int(n) for r, n in (c.get("resources", {}).get("limits") or {}).items()
                            if r.startswith(EXTENDED)}
                for c in pod.spec.get("initContainers", [])}
        if self.standin is not None:  # kubelet knows every pod it runs (PodResources lists it)
            self.standin.admit_pod(pod.namespace, pod.name, requests, init)
        elif any(requests.values()) or any(init.values()):
            raise PodError(f"pod {pod.name} asks for {requests} and this kubelet has no device plugins")

    def _log_dir(self, pod: RunningPod) -> Path:
        return self.work / "pods" / f"{pod.namespace}_{pod.name}_{pod.uid}"

    def _volumes(self, pod: RunningPod) -> dict[str, tuple[Path, bool]]:
        out: dict[str, tuple[Path, bool]] = {}
        base = self._log_dir(pod) / "volumes"
        for volume in pod.spec.get("volumes", []):
            name = volume["name"]
            if "hostPath" in volume:
                path = self.host_paths.resolve(volume["hostPath"]["path"])
                kind = volume["hostPath"].get("type", "")
                if kind == "DirectoryOrCreate":
                    path.mkdir(mode=0o755, parents=True, exist_ok=True)
                elif kind == "Directory" and not path.is_dir():
                    raise PodError(f"volume {name}: hostPath {path} is not a directory (type Directory)")
                out[name] = (path, False)
            elif "configMap" in volume:
                data = self.configmaps[volume["configMap"]["name"]]
                folder = base / "configmap" / name
                folder.mkdir(parents=True)
                for key, text in data.items():
                    (folder / key).write_text(text)
                    os.chmod(folder / key, 0o644)
                out[name] = (folder, True)
            elif "emptyDir" in volume:
                folder = base / "empty-dir" / name
                folder.mkdir(parents=True)
                os.chmod(folder, 0o777)
                out[name] = (folder, False)
            else:
                raise PodError(f"volume {name}: kind {sorted(volume)} is not handled by this kubelet")
        return out

    def _sandbox_config(self, pod: RunningPod) -> cri.PodSandboxConfig:
        host_network = bool(pod.spec.get("hostNetwork"))
        log_dir = self._log_dir(pod)
        log_dir.mkdir(parents=True, exist_ok=True)
        return cri.PodSandboxConfig(
            metadata=cri.PodSandboxMetadata(name=pod.name, namespace=pod.namespace, uid=pod.uid, attempt=0),
            hostname="" if host_network else pod.name[:63],
            log_directory=str(log_dir),
            labels={"io.kubernetes.pod.name": pod.name, "io.kubernetes.pod.namespace": pod.namespace,
                    "io.kubernetes.pod.uid": pod.uid},
            linux=cri.LinuxPodSandboxConfig(security_context=cri.LinuxSandboxSecurityContext(
                namespace_options=cri.NamespaceOption(network=cri.NODE if host_network else cri.POD,
                                                      pid=cri.NODE if pod.spec.get("hostPID") else cri.POD,
                                                      ipc=cri.POD))))

    def _env(self, container: dict) -> list[cri.KeyValue]:
        out = []
        for item in container.get("env", []):
            if "value" in item:
                value = str(item["value"])
            else:
                ref = item["valueFrom"]["configMapKeyRef"]
                value = self.configmaps[ref["name"]][ref["key"]]
            out.append(cri.KeyValue(key=item["name"], value=value))
        return out

    def _create(self, pod: RunningPod, container: dict) -> str:
        name = container["name"]
        mounts = []
        for vm in container.get("volumeMounts", []):
            host, forced_ro = pod.volumes[vm["name"]]
            mounts.append(cri.Mount(container_path=vm["mountPath"], host_path=str(host),
                                    readonly=bool(vm.get("readOnly")) or forced_ro))
        envs = self._env(container)
        devices, annotations = [], {}
        if self.standin is not None:
            for resource, answer in self.standin.allocations(pod.namespace, pod.name, name).items():
                envs += [cri.KeyValue(key=k, value=v) for k, v in answer.envs.items()]
                mounts += [cri.Mount(container_path=m.container_path, host_path=m.host_path, readonly=m.read_only)
                           for m in answer.mounts]
                devices += [cri.Device(container_path=d.container_path, host_path=d.host_path,
                                       permissions=d.permissions) for d in answer.devices]
                annotations.update(answer.annotations)
                if answer.cdi_devices:  # containerd 1.7 (enable_cdi) reads these annotations
                    key = f"cdi.k8s.io/{resource.replace('/', '_')}_{name}"
                    annotations[key] = ",".join(d.name for d in answer.cdi_devices)
        sc = container.get("securityContext", {})
        caps = sc.get("capabilities", {})
        security = cri.LinuxContainerSecurityContext(
            capabilities=cri.Capability(add_capabilities=caps.get("add", []), drop_capabilities=caps.get("drop", [])),
            privileged=bool(sc.get("privileged")),
            readonly_rootfs=bool(sc.get("readOnlyRootFilesystem")),
            no_new_privs=sc.get("allowPrivilegeEscalation") is False,
            namespace_options=pod.sandbox_config.linux.security_context.namespace_options)
        if "runAsUser" in sc:
            security.run_as_user.value = int(sc["runAsUser"])
        (self._log_dir(pod) / name).mkdir(parents=True, exist_ok=True)
        config = cri.ContainerConfig(
            metadata=cri.ContainerMetadata(name=name, attempt=0),
            image=cri.ImageSpec(image=container["image"]),
            command=container.get("command", []), args=container.get("args", []),
            envs=envs, mounts=mounts, devices=devices, annotations=annotations,
            labels={"io.kubernetes.container.name": name, "io.kubernetes.pod.name": pod.name,
                    "io.kubernetes.pod.namespace": pod.namespace, "io.kubernetes.pod.uid": pod.uid},
            log_path=f"{name}/0.log",
            linux=cri.LinuxContainerConfig(security_context=security))
        cid = self.rig.cri.runtime.CreateContainer(cri.CreateContainerRequest(
            pod_sandbox_id=pod.sandbox_id, config=config, sandbox_config=pod.sandbox_config),
            timeout=120).container_id
        pod.containers[name] = cid
        return cid

    def _status(self, cid: str) -> cri.ContainerStatus:
        return self.rig.cri.runtime.ContainerStatus(cri.ContainerStatusRequest(container_id=cid), timeout=30).status

    def _running(self, pod: RunningPod, container: str) -> bool:
        return self._status(pod.containers[container]).state == cri.CONTAINER_RUNNING

    def _wait_exit(self, cid: str, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            status = self._status(cid)
            if status.state == cri.CONTAINER_EXITED:
                return status.exit_code
            if time.monotonic() > deadline:
                raise PodError(f"container {cid} still {cri.ContainerState.Name(status.state)} after {timeout} s")
            time.sleep(0.2)
