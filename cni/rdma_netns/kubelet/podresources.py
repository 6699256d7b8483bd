"""The one client of kubelet's PodResources API: which device IDs of a resource a pod was granted.

kubelet allocates devices at pod admission, before RunPodSandbox, so when the CNI's ADD runs the
grant is already listed here. It sits below both packages: used by the device plugin's grants
broker and metrics (rdma_netns_dp.grant_rounds, rdma_netns_dp.metrics) and, when the broker is
absent, by the CNI itself (grants/client.py): importing this module is cheap (no grpc until the
first call) and starts nothing. Its generated stubs are in kubelet/api/podresources/v1/.

Kubelet facts (design.md): Get(pod_name, pod_namespace) first. kubelets older than 1.27 answer
UNIMPLEMENTED; 1.27-1.33 with the KubeletPodResourcesGet gate off answer UNKNOWN "PodResources API
Get method disabled": both mean List and match namespace + name. A Get for a pod kubelet does not
know answers UNKNOWN "pod <name> in namespace <ns> not found" (a plain Go error), which is an
answer (found False), not a failure. Every call may be refused RESOURCE_EXHAUSTED by kubelet's rate
limit (ratelimit.py): it is retried inside the caller's deadline, never taken for an answer.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rdma_netns.config.defaults import DEFAULT_POD_RESOURCES_SOCKET as DEFAULT_SOCKET  # noqa: F401
from rdma_netns.kubelet import ratelimit

# kubelet's server allows 16 MiB (podresources.DefaultMaxMsgSize); a busy node's List is large.
MAX_MESSAGE = 16 * 1024 * 1024

# (method, result) of every call made: result "ok", "rate_limited" (refused, retried), or the
# error kind. For the device plugin's metrics.
Observe = Callable[[str, str], None]


@dataclass(frozen=True)
class PodGrant:
    """kubelet's answer for one pod and resource. device_ids: de-duplicated, sorted."""
    found: bool
    device_ids: list[str] = field(default_factory=list)
    via: str = "Get"  # "Get" | "List": which kubelet method answered


class PodResourcesUnavailable(Exception):
    """kubelet could not say. kind: "unreachable" (no socket, refused), "timeout", "rate-limited"
    (refused by kubelet's rate limit until the deadline), "ambiguous" (List names the pod twice),
    "failed" (anything else)."""

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


class Client:
    """How a long-lived process asks kubelet: one channel per socket (ChannelPool), its own share
    of kubelet's bucket (a client-side TokenBucket: it waits for a token rather than be refused),
    and what it counts (`observe`). The device plugin holds one for its broker and its metrics."""

    def __init__(self, limiter: ratelimit.TokenBucket | None = None, observe: Observe | None = None) -> None:
        self.channels = ChannelPool()
        self.limiter = limiter
        self.observe = observe

    def close(self) -> None:
        self.channels.close()


def _new_channel(path: str):
    import grpc

    return grpc.insecure_channel(f"unix://{path}", options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.enable_retries", 0)])


class GetUnsupported(Exception):
    """This kubelet has no usable Get (older than 1.27, or the gate off): ask List."""


def socket_path(socket: str) -> str:
    """The absolute socket path; PodResourcesUnavailable("unreachable") when there is no socket
    (the cheap, common case of "no kubelet here": no grpc import)."""
    path = os.path.abspath(socket)
    if not os.path.exists(path):
        raise PodResourcesUnavailable("unreachable", f"no kubelet PodResources socket at {path}")
    return path


def on_channel(path: str, client: Client | None, deadline: float, ask: Callable[[object], object]):
    """ask(channel), on the client's open channel (dialled again once if kubelet restarted) or on
    a channel of its own that is closed afterwards."""
    if client is None:
        channel = _new_channel(path)
        try:
            return ask(channel)
        finally:
            channel.close()
    channel = client.channels.get(path)
    try:
        return ask(channel)
    except PodResourcesUnavailable as exc:
        if exc.kind in ("unreachable", "timeout"):
            client.channels.drop(path, channel)
        if exc.kind != "unreachable" or deadline - time.monotonic() <= 0:
            raise
    return ask(client.channels.get(path))


def pod_device_ids(socket: str, namespace: str, name: str, resource: str,
                   timeout: float, client: Client | None = None) -> PodGrant:
    """The device IDs of `resource` granted to pod namespace/name, from every container (init
    containers too); `timeout` (seconds) bounds the whole exchange, List fallback and retries
    after kubelet's rate limit included. Without a `client`, one channel just for this question."""
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    path = socket_path(socket)
    # The timeout is kubelet's to keep, so it starts after our own imports (a CNI process asking
    # kubelet directly imports grpc here: 0.1-0.4 s on a busy node).
    from rdma_netns.kubelet.api.podresources.v1 import api_pb2_grpc  # noqa: F401 (loads grpc too)

    deadline = time.monotonic() + timeout

    def ask(channel) -> PodGrant:
        try:
            return get_pod(channel, path, namespace, name, resource, deadline, client)
        except GetUnsupported:
            return grant_from_listing(list_pods(channel, path, deadline, client), namespace, name, resource)

    return on_channel(path, client, deadline, ask)


def get_pod(channel, path: str, namespace: str, name: str, resource: str, deadline: float,
            client: Client | None = None) -> PodGrant:
    """kubelet's Get for one pod; GetUnsupported on kubelets without it."""
    import grpc

    from rdma_netns.kubelet.api.podresources.v1 import api_pb2, api_pb2_grpc

    stub = api_pb2_grpc.PodResourcesListerStub(channel)
    request = api_pb2.GetPodResourcesRequest(pod_name=name, pod_namespace=namespace)
    try:
        answer = call(lambda t: stub.Get(request, timeout=t), path, "Get", deadline, client)
    except grpc.RpcError as exc:
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.NOT_FOUND or (code == grpc.StatusCode.UNKNOWN and "not found" in details):
            return PodGrant(False, [], "Get")
        if code == grpc.StatusCode.UNIMPLEMENTED or (code == grpc.StatusCode.UNKNOWN and "disabled" in details):
            raise GetUnsupported() from None
        raise unavailable(exc, path, "Get") from None
    return PodGrant(True, _device_ids([answer.pod_resources], resource), "Get")


def list_pods(channel, path: str, deadline: float, client: Client | None = None):
    """kubelet's List: every pod on the node (a ListPodResourcesResponse)."""
    import grpc

    from rdma_netns.kubelet.api.podresources.v1 import api_pb2, api_pb2_grpc

    stub = api_pb2_grpc.PodResourcesListerStub(channel)
    try:
        return call(lambda t: stub.List(api_pb2.ListPodResourcesRequest(), timeout=t), path, "List",
                    deadline, client)
    except grpc.RpcError as exc:
        raise unavailable(exc, path, "List") from None


def grant_from_listing(listing, namespace: str, name: str, resource: str) -> PodGrant:
    """The pod's grant in a List answer. PodResources entries carry no UID, so two entries of one
    namespace/name (a pod being replaced by one of the same name) cannot be told apart: that is
    refused ("ambiguous"), never merged, and the runtime's retry asks again once one is gone."""
    pods = [p for p in listing.pod_resources if p.namespace == namespace and p.name == name]
    if len(pods) > 1:
        raise PodResourcesUnavailable("ambiguous", f"kubelet's PodResources List names pod {namespace}/{name} "
                                      f"{len(pods)} times (a pod being replaced by one of the same name?); "
                                      "its grant cannot be told apart")
    return PodGrant(bool(pods), _device_ids(pods, resource), "List")


def call(rpc: Callable[[float], object], path: str, method: str, deadline: float, client: Client | None = None):
    """rpc(timeout) inside kubelet's rate limit: a client's token taken first (waiting for it),
    RESOURCE_EXHAUSTED retried after ratelimit.backoff() until `deadline`, then
    PodResourcesUnavailable("rate-limited"). Other gRPC errors propagate as they are. A retry
    takes no second token: the client's bucket bounds the calls kubelet answers, and a refused
    call took nothing from kubelet's."""
    import grpc

    limiter = client.limiter if client is not None else None
    observe = client.observe if client is not None else None
    attempt = 0
    while True:
        if limiter is not None and attempt == 0 and not limiter.take(deadline):
            raise PodResourcesUnavailable("timeout", f"kubelet PodResources {method} at {path}: no answer in time "
                                          "(waited for the device plugin's share of kubelet's rate limit)")
        try:
            answer = rpc(_remaining(deadline))
        except grpc.RpcError as exc:
            refused = exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            if observe is not None:
                answered = exc.code() == grpc.StatusCode.UNKNOWN and "not found" in (exc.details() or "")
                observe(method, "rate_limited" if refused else "ok" if answered else _kind(exc))
            if not refused:
                raise
            pause = ratelimit.backoff(attempt)
            attempt += 1
            if time.monotonic() + pause >= deadline:
                raise PodResourcesUnavailable(
                    "rate-limited", f"kubelet PodResources {method} at {path}: refused {attempt} times by "
                    f"kubelet's rate limit ({exc.details() or 'RESOURCE_EXHAUSTED'}) until the deadline") from None
            time.sleep(pause)
            continue
        if observe is not None:
            observe(method, "ok")
        return answer


def allocated_counts(socket: str, resources: list[str], timeout: float,
                     client: Client | None = None) -> dict[str, int]:
    """Device IDs of each of `resources` that kubelet has allocated to pods now (one List)."""
    path = socket_path(socket)
    deadline = time.monotonic() + timeout
    listing = on_channel(path, client, deadline, lambda channel: list_pods(channel, path, deadline, client))
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


def _kind(exc) -> str:
    import grpc

    code = exc.code()
    return ("timeout" if code == grpc.StatusCode.DEADLINE_EXCEEDED
            else "unreachable" if code == grpc.StatusCode.UNAVAILABLE else "failed")


def unavailable(exc, path: str, method: str) -> PodResourcesUnavailable:
    """A gRPC error as PodResourcesUnavailable of its kind."""
    kind = _kind(exc)
    details = exc.details() or ""
    if kind == "timeout":
        return PodResourcesUnavailable("timeout", f"kubelet PodResources {method} at {path}: no answer in time")
    if kind == "unreachable":
        return PodResourcesUnavailable("unreachable", f"kubelet PodResources at {path}: {details}")
    return PodResourcesUnavailable("failed", f"kubelet PodResources {method} at {path}: {exc.code().name}: {details}")
