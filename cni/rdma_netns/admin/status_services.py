"""`status` checks of the running services: kubelet, the device plugin, the grants broker.

Each is asked, not guessed from files: the device plugin's socket must answer
GetDevicePluginOptions, kubelet's PodResources API must answer GetAllocatableResources (which
resources it holds devices of: the plugin registered), and the broker must answer a question
about a pod that does not exist. Every call is bounded by Options.timeout; grpc is imported here
only (this is the admin tool, not the CNI's hot path).
"""

from __future__ import annotations

import json
import os
import socket
import stat

from rdma_netns.admin.status_context import DEFAULT_RESOURCE, FAIL, OK, WARN, Check, Context
from rdma_netns.admin.status_conf import DS_POD
from rdma_netns.config.defaults import DEFAULT_POD_RESOURCES_SOCKET

PROBE_NAMESPACE, PROBE_NAME = "rdma-netns-status", "probe"
GET_DEVICE_PLUGIN_OPTIONS = "/v1beta1.DevicePlugin/GetDevicePluginOptions"  # package.Service/Method
# The DRA driver's (docs/dra.md): an unprepare of no claims changes nothing and proves it serves.
DRA_UNPREPARE = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources"
DRA_DRIVER = "rdma-netns.io"
DP_FIX = (f"check the rdma-netns-dp pod on this node: {DS_POD}, then `kubectl -n kube-system logs <pod> "
          "-c rdma-netns-dp`; it registers again by itself after a kubelet restart")


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def _plugin_options(path: str, timeout: float, method: str = GET_DEVICE_PLUGIN_OPTIONS) -> str | None:
    """None when the device plugin at `path` answers GetDevicePluginOptions (or the DRA driver
    `method`), else why not."""
    import grpc

    # Raw bytes, no generated stubs: those are the device plugin's (rdma_netns_dp.api), which the
    # CNI package never imports. The request is v1beta1.Empty (no bytes); the answer's content
    # does not matter, only that the plugin gives one.
    channel = grpc.insecure_channel(f"unix://{path}", options=[("grpc.enable_retries", 0)])
    try:
        channel.unary_unary(method)(b"", timeout=timeout)
        return None
    except grpc.RpcError as exc:
        return f"{exc.code().name}: {exc.details() or ''}".rstrip(": ")
    finally:
        channel.close()


def _allocatable(path: str, timeout: float) -> tuple[dict[str, int] | None, str | None]:
    """({resource: device count} kubelet holds, None) or (None, why it could not say)."""
    import grpc

    from rdma_netns.kubelet.api.podresources.v1 import api_pb2, api_pb2_grpc

    channel = grpc.insecure_channel(f"unix://{path}", options=[("grpc.enable_retries", 0)])
    try:
        answer = api_pb2_grpc.PodResourcesListerStub(channel).GetAllocatableResources(
            api_pb2.AllocatableResourcesRequest(), timeout=timeout)
    except grpc.RpcError as exc:
        return None, f"{exc.code().name}: {exc.details() or ''}".rstrip(": ")
    finally:
        channel.close()
    counts: dict[str, int] = {}
    for devices in answer.devices:
        counts[devices.resource_name] = counts.get(devices.resource_name, 0) + len(devices.device_ids)
    return counts, None


def _socket_resources(sockets: list[str]) -> list[str]:
    """The resources our sockets serve: rdma-netns-<slug>.sock, the slug the name with "/" as "_".
    A resource's domain is a DNS name (no "_"), so the first "_" is the "/"."""
    return [name[len("rdma-netns-"):-len(".sock")].replace("_", "/", 1) for name in sockets]


def dra_driver(ctx: Context, folder: str) -> list[Check]:
    """A DRA node: the driver's socket answers, kubelet's plugin watcher has its registration
    socket, and the claims its checkpoint holds."""
    g = "DRA driver"
    endpoint = os.path.join(folder, "dra.sock")
    registration = os.path.join(ctx.opts.kubelet_dir, "plugins_registry", f"{DRA_DRIVER}-reg.sock")
    problem = _plugin_options(endpoint, ctx.opts.timeout, DRA_UNPREPARE)
    out = [Check(g, f"driver {DRA_DRIVER}", OK, f"serving on {endpoint}", data={"socket": endpoint})
           if problem is None else
           Check(g, f"driver {DRA_DRIVER}", FAIL, f"not serving on {endpoint} ({problem}): kubelet cannot prepare "
                 "claims for new pods", DP_FIX, {"socket": endpoint, "error": problem})]
    if _is_socket(registration):
        out.append(Check(g, "registration", OK, f"{registration} is there for kubelet's plugin watcher"))
    else:
        out.append(Check(g, "registration", FAIL, f"no {registration}: kubelet does not know the driver", DP_FIX))
    try:
        with open(os.path.join(folder, "checkpoint.json")) as f:
            claims = json.load(f).get("claims") or {}
        out.append(Check(g, "prepared claims", OK, f"{len(claims)} claim(s) prepared on this node",
                         data={"claims": sorted(f"{c.get('namespace')}/{c.get('name')}" for c in claims.values())}))
    except (OSError, ValueError, AttributeError):
        out.append(Check(g, "prepared claims", OK, "none (no checkpoint yet)", data={"claims": []}))
    return out


def device_plugin(ctx: Context) -> list[Check]:
    g = "Device plugin"
    opts = ctx.opts
    dra_folder = os.path.join(opts.kubelet_dir, "plugins", DRA_DRIVER)
    if _is_socket(os.path.join(dra_folder, "dra.sock")):
        return dra_driver(ctx, dra_folder)
    plugins_dir = os.path.join(opts.kubelet_dir, "device-plugins")
    try:
        ours = sorted(n for n in os.listdir(plugins_dir) if n.startswith("rdma-netns-") and n.endswith(".sock"))
    except OSError:
        ours = []
    if not (ctx.setting("resourceName") or opts.resources or ours):
        return [Check(g, "device plugin", OK, f"not deployed: the config names no resourceName and {plugins_dir} "
                      "has no rdma-netns socket")]
    pr = ctx.pod_resources_socket
    counts, error = (None, "no socket") if not _is_socket(pr) else _allocatable(pr, opts.timeout)
    resources = ctx.resources or _socket_resources(ours) or [DEFAULT_RESOURCE]
    out = []
    kubelet_sock = os.path.join(plugins_dir, "kubelet.sock")
    if _is_socket(kubelet_sock):
        out.append(Check(g, "kubelet", OK, f"{kubelet_sock} is there"))
    else:
        out.append(Check(g, "kubelet", FAIL, f"no {kubelet_sock}: kubelet is not running here (or --kubelet-dir "
                         "is not its folder)", "`systemctl status kubelet`; `journalctl -u kubelet`"))
    for resource in resources:
        path = os.path.join(plugins_dir, f"rdma-netns-{resource.replace('/', '_')}.sock")
        problem = "no socket" if not _is_socket(path) else _plugin_options(path, opts.timeout)
        if problem is None:
            out.append(Check(g, f"plugin {resource}", OK, f"serving on {path}", data={"socket": path}))
        else:
            out.append(Check(g, f"plugin {resource}", FAIL, f"not serving on {path} ({problem}): kubelet cannot "
                             f"allocate {resource} for new pods", DP_FIX, {"socket": path, "error": problem}))
    if counts is None:
        unimplemented = error is not None and error.startswith("UNIMPLEMENTED")
        out.append(Check(g, "kubelet PodResources", WARN if unimplemented else FAIL,
                         f"{pr} does not answer GetAllocatableResources ({error})" + (
                             ": this kubelet is too old to say what is registered" if unimplemented else
                             ": pairing cannot learn pods' grants and registration cannot be confirmed"),
                         "" if unimplemented else "kubelet serves it at <kubelet dir>/pod-resources/kubelet.sock: "
                         "`systemctl status kubelet`", {"socket": pr, "error": error}))
        return out
    out.append(Check(g, "kubelet PodResources", OK, f"{pr} answers", data={"socket": pr}))
    for resource in resources:
        n = counts.get(resource, 0)
        if n:
            out.append(Check(g, f"registered {resource}", OK, f"kubelet holds {n} {resource} device(s)",
                             data={"devices": n}))
        else:
            out.append(Check(g, f"registered {resource}", FAIL, f"kubelet holds no {resource} device: the plugin "
                             "is not registered (or offers no device)", DP_FIX + "; its units go Unhealthy while "
                             "the rails' GID tables are full or the kernel's mode is wrong (see Rails, Kernel)",
                             {"devices": 0, "registered": sorted(counts)}))
    return out


def _ask_broker(path: str, request: dict, timeout: float) -> dict:
    """One JSON line each way (rdma_netns_dp.pod_grants); OSError, TimeoutError or ValueError."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(json.dumps(request).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n") and len(data) < 1 << 20:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    answer = json.loads(data)
    if not isinstance(answer, dict):
        raise ValueError("not a JSON object")
    return answer


def pairing(ctx: Context) -> list[Check]:
    """The grants broker the CNI asks which units kubelet granted a pod."""
    g, name = "Pairing", "grants broker"
    resource = ctx.setting("resourceName")
    broker = ctx.pod_grants_socket
    if not resource:
        return [Check(g, name, OK, "not used: the config names no resourceName (pods are not paired with grants)")]
    if not broker:
        return [Check(g, name, OK, "not used: podGrantsSocket is \"\" (the CNI asks kubelet itself)")]
    kubelet = ctx.setting("podResourcesSocket", DEFAULT_POD_RESOURCES_SOCKET)
    request = {"v": 1, "podResourcesSocket": kubelet, "namespace": PROBE_NAMESPACE, "name": PROBE_NAME, "uid": "",
               "resourceName": resource, "timeoutMs": max(1, int(ctx.opts.timeout * 1000 * 2 / 3))}
    data = {"socket": broker, "podResourcesSocket": kubelet}
    try:
        answer = _ask_broker(broker, request, ctx.opts.timeout)
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        return [Check(g, name, WARN, f"no broker at {broker} ({exc.strerror}): each ADD asks kubelet itself "
                      "(slower, never wrong)", DP_FIX + " (its daemon serves the broker)", data)]
    except TimeoutError:
        return [Check(g, name, FAIL, f"{broker} did not answer in {ctx.opts.timeout:g} s: ADDs wait for it",
                      DP_FIX, data)]
    except (OSError, ValueError) as exc:
        return [Check(g, name, FAIL, f"{broker} gave no answer: {exc}", DP_FIX, data)]
    data["answer"] = answer
    if "found" in answer:
        return [Check(g, name, OK, f"{broker} answers (asked about a pod that does not exist: found "
                      f"{str(answer['found']).lower()}, via {answer.get('via', '?')})", data=data)]
    error, msg = answer.get("error", "?"), answer.get("msg", "")
    if error == "bad-request":
        return [Check(g, name, FAIL, f"{broker} refused the question: {msg}", "the daemon and this tool are "
                      "different versions: finish the rollout of the DaemonSet", data)]
    return [Check(g, name, FAIL, f"{broker} answers, but kubelet's PodResources at {kubelet} did not ({error}: "
                  f"{msg}): ADDs of paired pods fail", "check kubelet (`systemctl status kubelet`); "
                  f"podResourcesSocket in {ctx.config_source} must be kubelet's socket", data)]
