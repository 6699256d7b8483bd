"""The one client of kubelet's PodResources API: which device IDs of a resource a pod was granted.

kubelet allocates devices at pod admission, before RunPodSandbox, so when the CNI's ADD runs the
grant is already listed here. It sits below both packages: used by the device plugin's grants
broker and metrics (rdma_netns_dp.pod_grants, rdma_netns_dp.metrics) and, when the broker is
absent, by the CNI itself (grants_client.py): importing this module is cheap (no grpc until the
first call) and starts nothing. Its generated stubs are in kubelet/api/podresources/v1/.

Kubelet facts (design.md): Get(pod_name, pod_namespace) first. kubelets older than 1.27 answer
UNIMPLEMENTED; 1.27-1.33 with the KubeletPodResourcesGet gate off answer UNKNOWN "PodResources API
Get method disabled": both mean List and match namespace + name. A Get for a pod kubelet does not
know answers UNKNOWN "pod <name> in namespace <ns> not found" (a plain Go error), which is an
answer (found False), not a failure.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

from rdma_netns.config.defaults import DEFAULT_POD_RESOURCES_SOCKET as DEFAULT_SOCKET  # noqa: F401

# kubelet's server allows 16 MiB (podresources.DefaultMaxMsgSize); a busy node's List is large.
MAX_MESSAGE = 16 * 1024 * 1024


@dataclass(frozen=True)
class PodGrant:
    """kubelet's answer for one pod and resource. device_ids: de-duplicated, sorted."""
    found: bool
    device_ids: list[str] = field(default_factory=list)
    via: str = "Get"  # "Get" | "List": which kubelet method answered


class PodResourcesUnavailable(Exception):
    """kubelet could not say. kind: "unreachable" (no socket, refused), "timeout", "failed"."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class ChannelPool:
    """One open channel per kubelet socket, for a long-lived caller (the grants broker): setting a
    channel up costs several milliseconds, more than the query itself. A channel that finds kubelet
    unreachable is dropped, so a restarted kubelet is dialled afresh instead of through gRPC's
    reconnect back-off."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._channels: dict[str, object] = {}

    def get(self, path: str):
        with self._lock:
            channel = self._channels.get(path)
            if channel is None:
                channel = self._channels[path] = _new_channel(path)
            return channel

    def drop(self, path: str, channel: object) -> None:
        with self._lock:
            if self._channels.get(path) is channel:
                del self._channels[path]
        channel.close()  # type: ignore[attr-defined]

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.close()  # type: ignore[attr-defined]


def _new_channel(path: str):
    import grpc

    return grpc.insecure_channel(f"unix://{path}", options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.enable_retries", 0)])


def pod_device_ids(socket_path: str, namespace: str, name: str, resource: str,
                   timeout: float, pool: ChannelPool | None = None) -> PodGrant:
    """The device IDs of `resource` granted to pod namespace/name, from every container (init
    containers too); `timeout` (seconds) bounds the whole exchange, List fallback included.
    With a `pool`, its open channel is used (and dialled again once if kubelet restarted)."""
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    path = os.path.abspath(socket_path)
    if not os.path.exists(path):  # the cheap, common case of "no kubelet here": no grpc import
        raise PodResourcesUnavailable("unreachable", f"no kubelet PodResources socket at {path}")
    # The timeout is kubelet's to keep, so it starts after our own imports (a CNI process asking
    # kubelet directly imports grpc here: 0.1-0.4 s on a busy node).
    from rdma_netns.kubelet.api.podresources.v1 import api_pb2_grpc  # noqa: F401 (loads grpc too)

    deadline = time.monotonic() + timeout
    if pool is None:
        channel = _new_channel(path)
        try:
            return _ask(channel, path, namespace, name, resource, deadline)
        finally:
            channel.close()
    channel = pool.get(path)
    try:
        return _ask(channel, path, namespace, name, resource, deadline)
    except PodResourcesUnavailable as exc:
        pool.drop(path, channel)
        if exc.kind != "unreachable" or deadline - time.monotonic() <= 0:
            raise
    return _ask(pool.get(path), path, namespace, name, resource, deadline)


def _ask(channel, path: str, namespace: str, name: str, resource: str, deadline: float) -> PodGrant:
    """Get, or List on kubelets without Get (older than 1.27, or the gate off)."""
    import grpc

    from rdma_netns.kubelet.api.podresources.v1 import api_pb2, api_pb2_grpc

    stub = api_pb2_grpc.PodResourcesListerStub(channel)
    try:
        answer = stub.Get(api_pb2.GetPodResourcesRequest(pod_name=name, pod_namespace=namespace),
                          timeout=_remaining(deadline))
        return PodGrant(True, _device_ids([answer.pod_resources], resource), "Get")
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.NOT_FOUND or (
                code == grpc.StatusCode.UNKNOWN and "not found" in details):
            return PodGrant(False, [], "Get")
        if not (code == grpc.StatusCode.UNIMPLEMENTED or (
                code == grpc.StatusCode.UNKNOWN and "disabled" in details)):
            raise _unavailable(exc, path, "Get") from None
    try:
        listing = stub.List(api_pb2.ListPodResourcesRequest(), timeout=_remaining(deadline))
    except grpc.RpcError as exc:
        raise _unavailable(exc, path, "List") from None
    pods = [p for p in listing.pod_resources if p.namespace == namespace and p.name == name]
    # Without a UID in the API, two entries of one name (a pod being replaced) are merged.
    return PodGrant(bool(pods), _device_ids(pods, resource), "List")


def allocated_counts(socket_path: str, resources: list[str], timeout: float,
                     pool: ChannelPool | None = None) -> dict[str, int]:
    """Device IDs of each of `resources` that kubelet has allocated to pods now (one List)."""
    import grpc

    from rdma_netns.kubelet.api.podresources.v1 import api_pb2, api_pb2_grpc

    path = os.path.abspath(socket_path)
    if not os.path.exists(path):
        raise PodResourcesUnavailable("unreachable", f"no kubelet PodResources socket at {path}")
    channel = pool.get(path) if pool is not None else _new_channel(path)
    try:
        listing = api_pb2_grpc.PodResourcesListerStub(channel).List(api_pb2.ListPodResourcesRequest(),
                                                                     timeout=timeout)
    except grpc.RpcError as exc:
        if pool is not None:
            pool.drop(path, channel)
        raise _unavailable(exc, path, "List") from None
    finally:
        if pool is None:
            channel.close()
    ids: dict[str, set[str]] = {name: set() for name in resources}
    for pod in listing.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                if devices.resource_name in ids:
                    ids[devices.resource_name].update(devices.device_ids)
    return {name: len(found) for name, found in ids.items()}


def _remaining(deadline: float) -> float:
    """Seconds left; a tiny positive value once spent, so gRPC reports DEADLINE_EXCEEDED."""
    return max(0.001, deadline - time.monotonic())


def _device_ids(pods, resource: str) -> list[str]:
    ids: set[str] = set()
    for pod in pods:
        for container in pod.containers:
            for devices in container.devices:
                if devices.resource_name == resource:
                    ids.update(devices.device_ids)
    return sorted(ids)


def _unavailable(exc, path: str, method: str) -> PodResourcesUnavailable:
    import grpc

    code = exc.code()
    details = exc.details() or ""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return PodResourcesUnavailable("timeout", f"kubelet PodResources {method} at {path}: no answer in time")
    if code == grpc.StatusCode.UNAVAILABLE:
        return PodResourcesUnavailable("unreachable", f"kubelet PodResources at {path}: {details}")
    return PodResourcesUnavailable("failed", f"kubelet PodResources {method} at {path}: {code.name}: {details}")
