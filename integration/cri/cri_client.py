"""A small CRI v1 client (the RuntimeService calls kubelet makes for pods), over containerd's
unix socket, on the generated code in integration/cri/api/runtime/v1/."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import grpc

from integration.cri.api.runtime.v1 import api_pb2 as cri
from integration.cri.api.runtime.v1 import api_pb2_grpc as cri_grpc

# kubelet's default --runtime-request-timeout is 2 minutes; a pod start here takes well under 5 s.
RPC_TIMEOUT = 60.0


@dataclass(frozen=True)
class Pod:
    """What kubelet puts into PodSandboxMetadata."""

    name: str
    namespace: str
    uid: str
    attempt: int = 0


class CriClient:
    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.channel = grpc.insecure_channel(f"unix://{socket_path}")
        self.runtime = cri_grpc.RuntimeServiceStub(self.channel)
        self.images = cri_grpc.ImageServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    # -- runtime --------------------------------------------------------------------------------

    def version(self, timeout: float = 5.0) -> cri.VersionResponse:
        return self.runtime.Version(cri.VersionRequest(version="v1"), timeout=timeout)

    def status(self, verbose: bool = False, timeout: float = 5.0) -> cri.StatusResponse:
        return self.runtime.Status(cri.StatusRequest(verbose=verbose), timeout=timeout)

    def sandbox_config(self, pod: Pod, log_dir: str = "") -> cri.PodSandboxConfig:
        """A pod as kubelet describes it: metadata, hostname, network namespace mode POD (not
        hostNetwork), pid/ipc per pod."""
        return cri.PodSandboxConfig(
            metadata=cri.PodSandboxMetadata(name=pod.name, namespace=pod.namespace, uid=pod.uid,
                                            attempt=pod.attempt),
            hostname=pod.name[:63],
            log_directory=log_dir,
            labels={"io.kubernetes.pod.name": pod.name, "io.kubernetes.pod.namespace": pod.namespace,
                    "io.kubernetes.pod.uid": pod.uid},
            linux=cri.LinuxPodSandboxConfig(
                security_context=cri.LinuxSandboxSecurityContext(
                    namespace_options=cri.NamespaceOption(network=cri.POD, pid=cri.POD, ipc=cri.POD))),
        )

    def run_pod(self, pod: Pod, timeout: float = RPC_TIMEOUT) -> tuple[str, float]:
        """RunPodSandbox; returns the sandbox ID and the call's wall time in seconds."""
        start = time.perf_counter()
        reply = self.runtime.RunPodSandbox(cri.RunPodSandboxRequest(config=self.sandbox_config(pod)),
                                           timeout=timeout)
        return reply.pod_sandbox_id, time.perf_counter() - start

    def stop_pod(self, sandbox_id: str, timeout: float = RPC_TIMEOUT) -> float:
        start = time.perf_counter()
        self.runtime.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=timeout)
        return time.perf_counter() - start

    def remove_pod(self, sandbox_id: str, timeout: float = RPC_TIMEOUT) -> float:
        start = time.perf_counter()
        self.runtime.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=timeout)
        return time.perf_counter() - start

    def pod_status(self, sandbox_id: str, verbose: bool = False,
                   timeout: float = 10.0) -> cri.PodSandboxStatusResponse:
        return self.runtime.PodSandboxStatus(
            cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=verbose), timeout=timeout)

    def pod_info(self, sandbox_id: str) -> dict:
        """containerd's verbose sandbox info (its "info" JSON: pid, runtimeSpec, cniResult...)."""
        info = self.pod_status(sandbox_id, verbose=True).info
        return json.loads(info["info"]) if "info" in info else {}

    def list_pods(self, ready_only: bool = False, timeout: float = 10.0) -> list[cri.PodSandbox]:
        flt = None
        if ready_only:
            flt = cri.PodSandboxFilter(state=cri.PodSandboxStateValue(state=cri.SANDBOX_READY))
        return list(self.runtime.ListPodSandbox(cri.ListPodSandboxRequest(filter=flt), timeout=timeout).items)

    # -- containers (to run a command in a pod) -------------------------------------------------

    def exec_in_pod(self, sandbox_id: str, pod: Pod, image: str, command: list[str],
                    timeout: float = RPC_TIMEOUT) -> cri.ExecSyncResponse:
        """CreateContainer + StartContainer in the sandbox (the pause image as a busybox), then
        ExecSync; the container is removed again."""
        config = cri.ContainerConfig(metadata=cri.ContainerMetadata(name="probe"),
                                     image=cri.ImageSpec(image=image),
                                     command=["/bin/sh", "-c", "trap 'exit 0' TERM; sleep 600 & wait"])
        cid = self.runtime.CreateContainer(cri.CreateContainerRequest(
            pod_sandbox_id=sandbox_id, config=config, sandbox_config=self.sandbox_config(pod)),
            timeout=timeout).container_id
        try:
            self.runtime.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=timeout)
            return self.runtime.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=command, timeout=30),
                                         timeout=timeout)
        finally:
            self.runtime.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=0), timeout=timeout)
            self.runtime.RemoveContainer(cri.RemoveContainerRequest(container_id=cid), timeout=timeout)
