"""A stand-in kubelet device manager for device-plugin tests, the guest suite and benchmarks.

It serves the real `v1beta1.Registration` gRPC service on <device-plugins>/kubelet.sock and does
what kubelet does after a Register: dial the plugin's endpoint, ask for its options, keep a
ListAndWatch stream open and remember every device list it sends. It can also restart like
kubelet (every socket in the folder wiped, kubelet.sock re-created) and drive the plugin-watcher
registration (<kubelet dir>/plugins_registry/<sock>).

With a PodResourcesStandIn it also does kubelet's pod admission (admit_pod: pick free healthy IDs,
Allocate on the plugin) and publishes each grant through the real `v1.PodResourcesLister` service
on <kubelet dir>/pod-resources/kubelet.sock, as kubelet does, behind kubelet's rate limit: one
token bucket for every client, 100 QPS with a burst of 10, a call without a token answered
RESOURCE_EXHAUSTED "rejected by rate limit" (pkg/kubelet/apis/grpc/ratelimit.go and
pkg/kubelet/apis/podresources DefaultQPS/DefaultBurstTokens; rdma_netns.kubelet.ratelimit).

No pytest imports: usable from plain scripts.
"""

from __future__ import annotations

import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

try:
    from rdma_netns_dp.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
    from rdma_netns_dp.api.pluginregistration.v1 import api_pb2 as reg_pb2
    from rdma_netns_dp.api.pluginregistration.v1 import api_pb2_grpc as reg_pb2_grpc
    from rdma_netns.kubelet.api.podresources.v1 import api_pb2 as pr_pb2
    from rdma_netns.kubelet.api.podresources.v1 import api_pb2_grpc as pr_pb2_grpc
except ImportError:  # source tree, package not installed
    sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "dp"), str(Path(__file__).resolve().parent.parent / "cni")]
    from rdma_netns_dp.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
    from rdma_netns_dp.api.pluginregistration.v1 import api_pb2 as reg_pb2
    from rdma_netns_dp.api.pluginregistration.v1 import api_pb2_grpc as reg_pb2_grpc
    from rdma_netns.kubelet.api.podresources.v1 import api_pb2 as pr_pb2
    from rdma_netns.kubelet.api.podresources.v1 import api_pb2_grpc as pr_pb2_grpc

KUBELET_SOCKET = "kubelet.sock"
# kubelet's PodResources rate limit, copied from its source (not from the product's client, so that
# the two are checked against each other): pkg/kubelet/apis/podresources/constants.go DefaultQPS,
# DefaultBurstTokens; pkg/kubelet/apis/grpc/ratelimit.go ErrorLimitExceeded.
KUBELET_QPS = 100
KUBELET_BURST = 10
KUBELET_REFUSAL = "rejected by rate limit"


class KubeletBucket:
    """golang.org/x/time/rate.Limiter's Allow(), as kubelet's interceptor uses it: full at first
    (`burst` tokens), `qps` tokens a second, one taken per call or the call is refused."""

    def __init__(self, qps: float, burst: int) -> None:
        self.qps, self.burst = qps, burst
        self._tokens, self._last = float(burst), time.monotonic()
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.qps)
            self._last = now
            if self._tokens >= 1:
                self._tokens -= 1
                return True
            return False
POD_RESOURCES_DIR = "pod-resources"  # under the kubelet dir, holding kubelet.sock
SUPPORTED_VERSIONS = ("v1beta1",)
RPC_TIMEOUT = 5.0


def wait_for_path(path: str | os.PathLike, timeout: float, *, socket_only: bool = True) -> bool:
    """Poll until `path` exists (as a socket when `socket_only`); False on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            mode = os.stat(path).st_mode
            if not socket_only or stat.S_ISSOCK(mode):
                return True
        except FileNotFoundError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def unix_channel(path: str | os.PathLike, timeout: float = RPC_TIMEOUT) -> grpc.Channel:
    """A channel to a unix socket, connected (raises grpc.FutureTimeoutError if it is not)."""
    channel = grpc.insecure_channel(f"unix://{os.path.abspath(path)}")
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
    except BaseException:
        channel.close()
        raise
    return channel


@dataclass
class DeviceListUpdate:
    """One ListAndWatch message as received."""
    time: float  # time.monotonic() at reception
    devices: list  # list[api_pb2.Device]

    def ids(self) -> list[str]:
        return [d.ID for d in self.devices]

    def health(self) -> dict[str, str]:
        return {d.ID: d.health for d in self.devices}

    def numa(self) -> dict[str, list[int]]:
        return {d.ID: [n.ID for n in d.topology.nodes] for d in self.devices}


class PluginConnection:
    """Kubelet's side of one plugin endpoint: options, a ListAndWatch stream, Allocate & co."""

    def __init__(self, socket_path: str | os.PathLike, resource_name: str = "",
                 timeout: float = RPC_TIMEOUT) -> None:
        self.socket_path = str(socket_path)
        self.resource_name = resource_name
        self.connected_at = time.monotonic()
        self.channel = unix_channel(self.socket_path, timeout)
        self.stub = api_pb2_grpc.DevicePluginStub(self.channel)
        self.options: api_pb2.DevicePluginOptions = self.stub.GetDevicePluginOptions(
            api_pb2.Empty(), timeout=timeout)
        self.history: list[DeviceListUpdate] = []
        self.stream_error: grpc.RpcError | None = None
        self.stream_ended = False
        self._cond = threading.Condition()
        self._closed = False
        self._call = self.stub.ListAndWatch(api_pb2.Empty())
        self._thread = threading.Thread(target=self._watch, name=f"listandwatch:{resource_name}",
                                        daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        try:
            for response in self._call:
                update = DeviceListUpdate(time.monotonic(), list(response.devices))
                with self._cond:
                    self.history.append(update)
                    self._cond.notify_all()
        except grpc.RpcError as exc:
            if not self._closed:
                self.stream_error = exc
        finally:
            with self._cond:
                self.stream_ended = True
                self._cond.notify_all()

    # --- device lists -------------------------------------------------------------------
    @property
    def latest(self) -> DeviceListUpdate | None:
        with self._cond:
            return self.history[-1] if self.history else None

    def wait_for(self, predicate: Callable[[DeviceListUpdate], bool], timeout: float,
                 what: str = "condition") -> DeviceListUpdate:
        """Wait until the latest list satisfies `predicate`; AssertionError on timeout or if the
        stream ends first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self.history and predicate(self.history[-1]):
                    return self.history[-1]
                if self.stream_ended:
                    raise AssertionError(f"ListAndWatch ended ({self.stream_error!r}) before {what}; "
                                         f"last list: {self._describe_last()}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise AssertionError(f"timed out after {timeout:.1f} s waiting for {what}; "
                                         f"{len(self.history)} lists, last: {self._describe_last()}")
                self._cond.wait(remaining)

    def wait_first(self, timeout: float = RPC_TIMEOUT) -> DeviceListUpdate:
        """The first list (waiting for it)."""
        self.wait_for(lambda _: True, timeout, "a first device list")
        return self.history[0]

    def wait_stream_end(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.stream_ended, timeout)

    def _describe_last(self) -> str:
        if not self.history:
            return "none"
        health = self.history[-1].health()
        if len(health) > 12:
            counts: dict[str, int] = {}
            for value in health.values():
                counts[value] = counts.get(value, 0) + 1
            return f"{len(health)} devices {counts}"
        return str(health)

    # --- RPCs (grpc.RpcError propagates as is) -----------------------------------------------
    def allocate(self, ids: Sequence[str], *more: Sequence[str],
                 timeout: float = RPC_TIMEOUT) -> api_pb2.AllocateResponse:
        """Allocate with one container request per argument."""
        request = api_pb2.AllocateRequest(container_requests=[
            api_pb2.ContainerAllocateRequest(devices_ids=list(c)) for c in (ids, *more)])
        return self.stub.Allocate(request, timeout=timeout)

    def preferred(self, available: Sequence[str], must_include: Sequence[str] = (), size: int = 1,
                  timeout: float = RPC_TIMEOUT) -> api_pb2.PreferredAllocationResponse:
        request = api_pb2.PreferredAllocationRequest(container_requests=[
            api_pb2.ContainerPreferredAllocationRequest(
                available_deviceIDs=list(available), must_include_deviceIDs=list(must_include),
                allocation_size=size)])
        return self.stub.GetPreferredAllocation(request, timeout=timeout)

    def prestart(self, ids: Sequence[str], timeout: float = RPC_TIMEOUT) -> api_pb2.PreStartContainerResponse:
        return self.stub.PreStartContainer(api_pb2.PreStartContainerRequest(devices_ids=list(ids)),
                                           timeout=timeout)

    def close(self) -> None:
        self._closed = True
        self._call.cancel()
        self.channel.close()
        self._thread.join(timeout=2)


@dataclass
class Registration:
    """One RegisterRequest as received by the stand-in."""
    time: float
    request: api_pb2.RegisterRequest
    accepted: bool = True
    endpoint_existed: bool = False  # the plugin's socket existed when Register arrived


@dataclass
class _State:
    registrations: list[Registration] = field(default_factory=list)
    plugins: dict[str, PluginConnection] = field(default_factory=dict)
    connect_errors: list[tuple[str, BaseException]] = field(default_factory=list)


class _RegistrationService(api_pb2_grpc.RegistrationServicer):
    def __init__(self, kubelet: KubeletStandIn) -> None:
        self.kubelet = kubelet

    def Register(self, request, context):  # noqa: N802 (gRPC name)
        return self.kubelet._on_register(request, context)


ContainerGrants = dict[str, dict[str, list[str]]]  # container name -> resource name -> device IDs


class _PodResourcesService(pr_pb2_grpc.PodResourcesListerServicer):
    def __init__(self, owner: PodResourcesStandIn) -> None:
        self.owner = owner

    def List(self, request, context):  # noqa: N802 (gRPC name)
        self.owner._admit(context, "List")
        self.owner._record("List", "", "")
        with self.owner._lock:
            pods = [self.owner._message(ns, name) for ns, name in sorted(self.owner._pods)]
        return pr_pb2.ListPodResourcesResponse(pod_resources=pods)

    def Get(self, request, context):  # noqa: N802
        self.owner._admit(context, "Get")
        self.owner._record("Get", request.pod_namespace, request.pod_name)
        mode = self.owner.get_mode
        if mode == "unimplemented":  # kubelet < 1.27: no Get method (grpc-go's wording)
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "unknown method Get for service v1.PodResourcesLister")
        if mode == "disabled":  # kubelet 1.27-1.33, KubeletPodResourcesGet gate off: a plain Go error
            context.abort(grpc.StatusCode.UNKNOWN, "PodResources API Get method disabled")
        with self.owner._lock:
            known = (request.pod_namespace, request.pod_name) in self.owner._pods
            message = self.owner._message(request.pod_namespace, request.pod_name) if known else None
        if message is None:
            context.abort(grpc.StatusCode.UNKNOWN,
                          f"pod {request.pod_name} in namespace {request.pod_namespace} not found")
        return pr_pb2.GetPodResourcesResponse(pod_resources=message)

    def GetAllocatableResources(self, request, context):  # noqa: N802
        self.owner._admit(context, "GetAllocatableResources")
        self.owner._record("GetAllocatableResources", "", "")
        source = self.owner.allocatable
        devices = source() if source is not None else {}
        return pr_pb2.AllocatableResourcesResponse(devices=[
            pr_pb2.ContainerDevices(resource_name=resource, device_ids=ids)
            for resource, ids in sorted(devices.items())])


class PodResourcesStandIn:
    """kubelet's PodResources API (v1.PodResourcesLister) on a unix socket, for the pods a test
    sets. get_mode imitates kubelet generations: "enabled" (Get answers), "disabled" (1.27-1.33
    with the gate off: UNKNOWN "...Get method disabled"), "unimplemented" (< 1.27). `delay` makes
    every RPC sleep first (a slow kubelet). Both can be changed while serving.
    `rate_limit`: kubelet's bucket (qps, burst), on by default as on every kubelet; None turns it
    off, for a test that measures something else and says why. `rejected` lists the refusals."""

    def __init__(self, socket_path: str | os.PathLike, *, get_mode: str = "enabled",
                 delay: float = 0.0, rate_limit: tuple[float, int] | None = (KUBELET_QPS, KUBELET_BURST)) -> None:
        if get_mode not in ("enabled", "disabled", "unimplemented"):
            raise ValueError(f"get_mode {get_mode!r}")
        self.socket = Path(socket_path)
        self.get_mode = get_mode
        self.delay = delay
        self.allocatable: Callable[[], dict[str, list[str]]] | None = None
        self._lock = threading.Lock()
        self._pods: dict[tuple[str, str], tuple[ContainerGrants, ContainerGrants]] = {}
        self._calls: list[tuple[str, str, str]] = []
        self._rejected: list[str] = []
        self.bucket = KubeletBucket(*rate_limit) if rate_limit is not None else None
        self._server: grpc.Server | None = None
        self._stopping = threading.Event()

    def start(self) -> PodResourcesStandIn:
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        self._stopping.clear()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
        pr_pb2_grpc.add_PodResourcesListerServicer_to_server(_PodResourcesService(self), server)
        if server.add_insecure_port(f"unix://{self.socket}") == 0:
            raise RuntimeError(f"cannot bind {self.socket}")
        server.start()
        self._server = server
        return self

    @property
    def serving(self) -> bool:
        return self._server is not None

    def stop(self) -> None:
        """Stop serving (the pods are kept, like kubelet's checkpoint; the socket file may stay)."""
        self._stopping.set()  # cut sleeping RPCs short
        if self._server is not None:
            self._server.stop(grace=None).wait(5)
            self._server = None

    def close(self) -> None:
        self.stop()
        try:
            os.unlink(self.socket)
        except FileNotFoundError:
            pass

    def __enter__(self) -> PodResourcesStandIn:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_pod(self, namespace: str, name: str, containers: ContainerGrants,
                init_containers: ContainerGrants | None = None) -> None:
        """Publish (or replace) a pod's grants: container name -> resource name -> device IDs."""
        copy = lambda grants: {c: {r: list(ids) for r, ids in res.items()} for c, res in grants.items()}  # noqa: E731
        with self._lock:
            self._pods[(namespace, name)] = (copy(containers), copy(init_containers or {}))

    def remove_pod(self, namespace: str, name: str) -> None:
        with self._lock:
            self._pods.pop((namespace, name), None)

    @property
    def calls(self) -> list[tuple[str, str, str]]:
        """(method, namespace, name) per RPC received; List has ("List", "", "")."""
        with self._lock:
            return list(self._calls)

    @property
    def rejected(self) -> list[str]:
        """The method of each call refused by the rate limit (it never reached `calls`)."""
        with self._lock:
            return list(self._rejected)

    def _admit(self, context, method: str) -> None:
        """kubelet's LimiterUnaryServerInterceptor: no token, no call."""
        if self.bucket is not None and not self.bucket.allow():
            with self._lock:
                self._rejected.append(method)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, KUBELET_REFUSAL)

    def _record(self, method: str, namespace: str, name: str) -> None:
        with self._lock:
            self._calls.append((method, namespace, name))
        if self.delay > 0:
            self._stopping.wait(self.delay)

    def _message(self, namespace: str, name: str):
        """The PodResources message (caller holds the lock). Init containers come first, listed
        as containers, as newer kubelets list them."""
        containers, init_containers = self._pods[(namespace, name)]
        return pr_pb2.PodResources(name=name, namespace=namespace, containers=[
            pr_pb2.ContainerResources(name=cname, devices=[
                pr_pb2.ContainerDevices(resource_name=resource, device_ids=ids)
                for resource, ids in sorted(resources.items())])
            for cname, resources in [*init_containers.items(), *containers.items()]])


class AdmissionError(RuntimeError):
    """kubelet would refuse the pod (UnexpectedAdmissionError): not enough devices, no plugin,
    Allocate failed."""


class KubeletStandIn:
    """A kubelet device manager: Registration server on <device_plugins_dir>/kubelet.sock, and
    with `pod_resources` pod admission published through kubelet's PodResources API."""

    def __init__(self, device_plugins_dir: str | os.PathLike, *, connect: bool = True,
                 pod_resources: PodResourcesStandIn | None = None) -> None:
        self.dir = Path(device_plugins_dir)
        self.kubelet_dir = self.dir.parent
        self.socket = self.dir / KUBELET_SOCKET
        self.connect = connect  # dial plugins after Register, as kubelet does
        self.pod_resources = pod_resources
        if pod_resources is not None and pod_resources.allocatable is None:
            pod_resources.allocatable = self._allocatable
        self._admit_lock = threading.Lock()  # kubelet admits pods one at a time
        self._grants: dict[tuple[str, str], ContainerGrants] = {}  # (ns, name) -> init + app containers
        # (ns, name) -> container -> resource -> the plugin's ContainerAllocateResponse (what kubelet
        # hands the runtime: env, mounts, device nodes, annotations, CDI devices)
        self._allocations: dict[tuple[str, str], dict[str, dict[str, object]]] = {}
        self.reject_registrations = 0  # answer the next N Register calls with UNAVAILABLE
        self._cond = threading.Condition()
        self._state = _State()
        self._server: grpc.Server | None = None
        self.starts = 0
        self.started_at = 0.0  # time.monotonic() of the last start

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> KubeletStandIn:
        """Create kubelet.sock and serve Register."""
        self.dir.mkdir(parents=True, exist_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        api_pb2_grpc.add_RegistrationServicer_to_server(_RegistrationService(self), server)
        if server.add_insecure_port(f"unix://{self.socket}") == 0:
            raise RuntimeError(f"cannot bind {self.socket}")
        server.start()
        self._server = server
        if self.pod_resources is not None and not self.pod_resources.serving:
            self.pod_resources.start()
        self.starts += 1
        self.started_at = time.monotonic()
        return self

    def stop(self) -> None:
        """Stop serving and drop every plugin connection (kubelet.sock may remain as a file)."""
        if self._server is not None:
            self._server.stop(grace=None).wait(5)
            self._server = None
        if self.pod_resources is not None:
            self.pod_resources.stop()
        with self._cond:
            plugins = list(self._state.plugins.values())
            self._state.plugins.clear()
        for plugin in plugins:
            plugin.close()

    def wipe_sockets(self) -> list[str]:
        """Delete every socket file in the device-plugins folder, as kubelet does at start."""
        removed = []
        for entry in os.scandir(self.dir):
            try:
                if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                    os.unlink(entry.path)
                    removed.append(entry.name)
            except FileNotFoundError:
                pass
        return sorted(removed)

    def restart(self, downtime: float = 0.0) -> list[str]:
        """A kubelet restart: stop, wipe every socket (the plugins' too), start again (a new
        kubelet.sock inode). Returns the socket names wiped."""
        self.stop()
        removed = self.wipe_sockets()
        if downtime:
            time.sleep(downtime)
        self.start()
        return removed

    def close(self) -> None:
        self.stop()
        if self.pod_resources is not None:
            self.pod_resources.close()
        try:
            os.unlink(self.socket)
        except FileNotFoundError:
            pass

    def __enter__(self) -> KubeletStandIn:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- Register -------------------------------------------------------------------------------
    def _on_register(self, request: api_pb2.RegisterRequest, context: grpc.ServicerContext) -> api_pb2.Empty:
        copy = api_pb2.RegisterRequest()
        copy.CopyFrom(request)
        record = Registration(time.monotonic(), copy,
                              endpoint_existed=bool(request.endpoint) and wait_for_path(
                                  self.dir / os.path.basename(request.endpoint), 0))
        with self._cond:
            if self.reject_registrations > 0:
                self.reject_registrations -= 1
                record.accepted = False
        if record.accepted and request.version not in SUPPORTED_VERSIONS:
            record.accepted = False
        with self._cond:
            self._state.registrations.append(record)
            self._cond.notify_all()
        if not record.accepted:
            if request.version not in SUPPORTED_VERSIONS:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"unsupported API version {request.version!r}")
            context.abort(grpc.StatusCode.UNAVAILABLE, "registration rejected by the test")
        if self.connect:
            threading.Thread(target=self._connect_registered, args=(copy,), daemon=True).start()
        return api_pb2.Empty()

    def _connect_registered(self, request: api_pb2.RegisterRequest) -> None:
        try:
            plugin = PluginConnection(self.dir / request.endpoint, request.resource_name)
        except BaseException as exc:  # recorded for the test to see
            with self._cond:
                self._state.connect_errors.append((request.resource_name, exc))
                self._cond.notify_all()
            return
        self._install(request.resource_name, plugin)

    def _install(self, resource: str, plugin: PluginConnection) -> None:
        with self._cond:
            old = self._state.plugins.get(resource)
            self._state.plugins[resource] = plugin
            self._cond.notify_all()
        if old is not None:
            old.close()

    # --- what tests look at ---------------------------------------------------------------------
    @property
    def registrations(self) -> list[Registration]:
        with self._cond:
            return list(self._state.registrations)

    @property
    def connect_errors(self) -> list[tuple[str, BaseException]]:
        with self._cond:
            return list(self._state.connect_errors)

    def wait_registrations(self, count: int, timeout: float) -> list[Registration]:
        """Wait until at least `count` Register calls arrived."""
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._state.registrations) >= count, timeout):
                raise AssertionError(f"{len(self._state.registrations)} registrations after "
                                     f"{timeout:.1f} s, expected {count}")
            return list(self._state.registrations)

    def plugin(self, resource: str, timeout: float = RPC_TIMEOUT,
               newer_than: PluginConnection | None = None, since: float = 0.0) -> PluginConnection:
        """The current connection to the plugin of `resource` (waiting for one, for one other
        than `newer_than`, and for one made at or after monotonic time `since`)."""
        def ready() -> bool:
            current = self._state.plugins.get(resource)
            return current is not None and current is not newer_than and current.connected_at >= since
        with self._cond:
            if not self._cond.wait_for(ready, timeout):
                raise AssertionError(f"no plugin connection for {resource!r} after {timeout:.1f} s; "
                                     f"connect errors: {self._state.connect_errors!r}")
            return self._state.plugins[resource]

    # --- pod admission (kubelet's device manager) + PodResources -----------------------------
    @property
    def pod_resources_socket(self) -> Path:
        """Where a kubelet serves PodResources: <kubelet dir>/pod-resources/kubelet.sock."""
        return self.kubelet_dir / POD_RESOURCES_DIR / KUBELET_SOCKET

    def admit_pod(self, namespace: str, name: str, requests: dict[str, dict[str, int]],
                  init_requests: dict[str, dict[str, int]] | None = None) -> ContainerGrants:
        """kubelet's admission of a pod: for each container (init containers first) and resource,
        free healthy IDs from the plugin's latest list (its GetPreferredAllocation when offered),
        Allocate on the plugin, the grant remembered and published through PodResources.
        An init container's IDs may be reused by the pod's later containers, as kubelet does.
        Returns container -> resource -> IDs (init containers included); AdmissionError when
        kubelet would refuse the pod (nothing is kept then)."""
        init_requests = init_requests or {}
        with self._admit_lock:
            if (namespace, name) in self._grants:
                raise AdmissionError(f"pod {namespace}/{name} is already admitted")
            in_use = {i for grants in self._grants.values() for res in grants.values()
                      for ids in res.values() for i in ids}
            reusable: dict[str, list[str]] = {}
            granted: ContainerGrants = {}
            answers: dict[str, dict[str, object]] = {}
            for cname, wants, is_init in [*((c, r, True) for c, r in init_requests.items()),
                                          *((c, r, False) for c, r in requests.items())]:
                granted[cname] = {}
                for resource, count in wants.items():
                    if count <= 0:
                        continue
                    ids = self._pick(resource, count, in_use, reusable.get(resource, []))
                    try:
                        reply = self.plugin(resource, timeout=0.5).allocate(ids)
                        answers.setdefault(cname, {})[resource] = reply.container_responses[0]
                    except grpc.RpcError as exc:
                        raise AdmissionError(f"Allocate of {resource} {ids} for {cname}: "
                                             f"{exc.code().name}: {exc.details()}") from None
                    granted[cname][resource] = ids
                    in_use.update(ids)
                    if is_init:
                        reusable[resource] = sorted(set(reusable.get(resource, [])) | set(ids))
                    else:
                        reusable[resource] = [i for i in reusable.get(resource, []) if i not in ids]
            self._grants[(namespace, name)] = granted
            self._allocations[(namespace, name)] = answers
            if self.pod_resources is not None:
                self.pod_resources.set_pod(namespace, name,
                                           {c: granted[c] for c in requests},
                                           {c: granted[c] for c in init_requests})
            return {c: {r: list(ids) for r, ids in res.items()} for c, res in granted.items()}

    def _pick(self, resource: str, count: int, in_use: set[str], reusable: list[str]) -> list[str]:
        try:
            plugin = self.plugin(resource, timeout=0.5)
        except AssertionError:
            raise AdmissionError(f"resource {resource} has no registered device plugin") from None
        latest = plugin.latest
        healthy = [d.ID for d in (latest.devices if latest else []) if d.health == "Healthy"]
        must = [i for i in reusable if i in healthy][:count]
        available = [i for i in healthy if i not in in_use or i in must]
        if len(available) < count:
            raise AdmissionError(f"requested {count} of {resource}, available {len(available)}")
        if plugin.options.get_preferred_allocation_available:
            try:
                answer = plugin.preferred(available, must, count).container_responses[0].deviceIDs
                picked = list(dict.fromkeys(answer))
                if len(picked) == count and set(picked) <= set(available) and set(must) <= set(picked):
                    return picked
            except (grpc.RpcError, IndexError):
                pass  # kubelet, too, falls back to its own choice
        rest = [i for i in sorted(available) if i not in must]
        return must + rest[:count - len(must)]

    def forget_pod(self, namespace: str, name: str) -> None:
        """The pod was deleted: its IDs are free again and it leaves PodResources."""
        with self._admit_lock:
            self._grants.pop((namespace, name), None)
            self._allocations.pop((namespace, name), None)
            if self.pod_resources is not None:
                self.pod_resources.remove_pod(namespace, name)

    def allocations(self, namespace: str, name: str, container: str) -> dict[str, object]:
        """resource -> ContainerAllocateResponse the plugin gave the admitted pod's container."""
        with self._admit_lock:
            return dict(self._allocations.get((namespace, name), {}).get(container, {}))

    def pod_grants(self, namespace: str, name: str) -> ContainerGrants | None:
        with self._admit_lock:
            grants = self._grants.get((namespace, name))
            return None if grants is None else {c: {r: list(i) for r, i in res.items()}
                                                for c, res in grants.items()}

    def _allocatable(self) -> dict[str, list[str]]:
        """Healthy IDs per registered resource (PodResources GetAllocatableResources)."""
        with self._cond:
            plugins = dict(self._state.plugins)
        out = {}
        for resource, plugin in plugins.items():
            latest = plugin.latest
            out[resource] = sorted(d.ID for d in (latest.devices if latest else []) if d.health == "Healthy")
        return out

    # --- plugin-watcher mode --------------------------------------------------------------------
    def connect_via_watcher(self, socket_name: str, timeout: float = RPC_TIMEOUT,
                            notify: bool = True) -> tuple[reg_pb2.PluginInfo, PluginConnection]:
        """What kubelet's plugin watcher does for <kubelet dir>/plugins_registry/<socket_name>:
        GetInfo, dial the endpoint it names, options + ListAndWatch, NotifyRegistrationStatus."""
        registry = self.kubelet_dir / "plugins_registry" / socket_name
        channel = unix_channel(registry, timeout)
        try:
            stub = reg_pb2_grpc.RegistrationStub(channel)
            info = stub.GetInfo(reg_pb2.InfoRequest(), timeout=timeout)
            endpoint = info.endpoint if os.path.isabs(info.endpoint) else str(self.dir / info.endpoint)
            try:
                plugin = PluginConnection(endpoint, info.name, timeout)
            except BaseException as exc:
                if notify:
                    stub.NotifyRegistrationStatus(reg_pb2.RegistrationStatus(
                        plugin_registered=False, error=f"cannot dial {endpoint}: {exc}"), timeout=timeout)
                raise
            if notify:
                stub.NotifyRegistrationStatus(reg_pb2.RegistrationStatus(plugin_registered=True),
                                              timeout=timeout)
        finally:
            channel.close()
        self._install(info.name, plugin)
        return info, plugin


def summarize(updates: Iterable[DeviceListUpdate], since: float = 0.0) -> list[tuple[float, dict[str, str]]]:
    """(seconds since `since`, {id: health}) per update: for benchmark output and failure messages."""
    return [(u.time - since, u.health()) for u in updates]


def main(argv: Sequence[str] | None = None) -> int:
    """`python tests/kubelet_standin.py DEVICE_PLUGINS_DIR`: serve until Ctrl-C, printing each
    registration and device list as JSON lines (for manual runs in the guest)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description="stand-in kubelet device manager")
    parser.add_argument("device_plugins_dir")
    args = parser.parse_args(argv)
    kubelet = KubeletStandIn(args.device_plugins_dir).start()
    t0 = time.monotonic()
    registrations_seen = 0
    updates_seen: dict[int, int] = {}  # id(connection) -> lists printed
    try:
        while True:
            time.sleep(0.1)
            registrations = kubelet.registrations
            for reg in registrations[registrations_seen:]:
                print(json.dumps({"t": round(reg.time - t0, 3), "register": reg.request.resource_name,
                                  "endpoint": reg.request.endpoint, "accepted": reg.accepted}), flush=True)
            registrations_seen = len(registrations)
            with kubelet._cond:
                plugins = dict(kubelet._state.plugins)
            for name, plugin in plugins.items():
                history = list(plugin.history)
                for update in history[updates_seen.get(id(plugin), 0):]:
                    health = update.health()
                    print(json.dumps({"t": round(update.time - t0, 3), "resource": name, "devices": len(health),
                                      "healthy": sum(v == "Healthy" for v in health.values())}), flush=True)
                updates_seen[id(plugin)] = len(history)
    except KeyboardInterrupt:
        return 0
    finally:
        kubelet.close()


if __name__ == "__main__":
    sys.exit(main())
