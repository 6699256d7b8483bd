"""Ask what kubelet granted a pod: through the device-plugin daemon's broker, or kubelet itself.

kubelet's PodResources API is gRPC, and `import grpc` costs tens of milliseconds of every pod
event. The rdma-netns-dp daemon already runs grpc on every node, so it answers this question on a
local unix socket in one JSON line each way (its side: rdma_netns_dp.pod_grants). When the daemon
is not there (not deployed, or restarting) the plugin asks kubelet directly with the same client
code the daemon uses (rdma_netns.kubelet.podresources, below both packages): slower, never wrong.
"""

from __future__ import annotations

import errno
from _socket import socket

from rdma_netns import events
from rdma_netns.config.netconf import NetConfig
from rdma_netns.grants.early import Early, ForeignBroker, connect_and_send, request
from rdma_netns.spec.errors import PAIRING_UNAVAILABLE, CniError
from rdma_netns.util import jsonio

MAX_ANSWER = 1 << 20
# Connection errors that mean "no broker here (any more)", as opposed to a broker that failed to
# answer: never there, or the daemon going away while it was asked (a rolling update terminates it:
# its socket file may still be there, refusing, or close the connection mid-request). Then kubelet
# is asked directly, which is slower and never wrong.
NO_BROKER = (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTDIR, errno.ENOTSOCK, errno.EACCES, errno.ECONNRESET,
             errno.EPIPE)


class BrokerGone(OSError):
    """The broker closed the connection without an answer (its daemon is stopping)."""

    def __init__(self) -> None:
        super().__init__(errno.ECONNRESET, "the grants broker closed the connection without an answer")


class Grant:
    """What kubelet says about one pod and one resource. `rails`: the RDMA devices the pod's DRA
    claims hold (the rails to attach, and no others); None from the device plugin's units, which
    name NICs only in exclusive mode."""

    __slots__ = ("found", "device_ids", "via", "rails")

    def __init__(self, found: bool, device_ids: list[str], via: str, rails: list[str] | None = None) -> None:
        self.found, self.device_ids, self.via, self.rails = found, device_ids, via, rails


def query(net: NetConfig, namespace: str, name: str, uid: str, early: Early | None = None) -> Grant:
    """The pod's device IDs of net.resource_name; CniError(PAIRING_UNAVAILABLE) when unknowable.
    `early`: the question early.send asked before the config was validated; its answer is
    read when it is this very question, else it is dropped and the question asked now."""
    timeout = net.pod_resources_timeout_ms / 1000
    broker = net.pod_grants_socket
    if broker:
        question = request(net.pod_resources_socket, namespace, name, uid, net.resource_name or "",
                           net.pod_resources_timeout_ms)
        events.note("pairing", "broker")
        try:
            sock = early.take(broker, question) if early is not None else None
            # The broker's own kubelet deadline comes first; allow it time to say so.
            if sock is None:
                sock = connect_and_send(broker, question, timeout + 0.25)
            return _from_answer(_receive(sock, broker, timeout + 0.25), net)
        except TimeoutError:
            raise CniError(PAIRING_UNAVAILABLE, f"the grants broker {broker} did not answer in {timeout + 0.25:.2f} s",
                           "kubelet's PodResources API may be slow; raise podResourcesTimeoutMs") from None
        except ForeignBroker as exc:
            raise CniError(PAIRING_UNAVAILABLE, str(exc), "podGrantsSocket names rdma-netns-dp's socket "
                           "(root's); \"\" asks kubelet directly") from None
        except OSError as exc:
            if exc.errno not in NO_BROKER:
                raise CniError(PAIRING_UNAVAILABLE, f"the device plugin's grants broker {broker} failed: "
                               f"{exc.strerror or exc}") from None
    elif early is not None:
        early.close()
    events.note("pairing", "kubelet")
    return _ask_kubelet(net, namespace, name, timeout)


def _receive(sock: socket, path: str, timeout: float) -> dict:
    """The broker's one-line answer on `sock` (closed afterwards)."""
    data = b""
    try:
        sock.settimeout(timeout)
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
            if len(data) > MAX_ANSWER:
                raise CniError(PAIRING_UNAVAILABLE, f"the grants broker {path} sent an oversized answer")
    except TimeoutError:
        raise CniError(PAIRING_UNAVAILABLE, f"the grants broker {path} did not answer in {timeout:.2f} s",
                       "kubelet's PodResources API may be slow; raise podResourcesTimeoutMs") from None
    finally:
        sock.close()
    if not data:
        raise BrokerGone()
    try:
        answer = jsonio.loads(data)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise CniError(PAIRING_UNAVAILABLE, f"the grants broker {path} sent no JSON answer")
    return answer


def _from_answer(answer: dict, net: NetConfig) -> Grant:
    if "error" in answer:
        raise CniError(PAIRING_UNAVAILABLE, f"kubelet's PodResources API ({net.pod_resources_socket}): "
                       f"{answer.get('error')}: {answer.get('msg', '')}".rstrip(": "))
    ids = answer.get("deviceIDs") or []
    rails = answer.get("rails")
    if not _strings(ids) or (rails is not None and not _strings(rails)):
        raise CniError(PAIRING_UNAVAILABLE, "the grants broker sent a malformed device list")
    return Grant(bool(answer.get("found")), ids, str(answer.get("via", "")), rails)


def _strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(i, str) for i in value)


def _ask_kubelet(net: NetConfig, namespace: str, name: str, timeout: float) -> Grant:
    # Imported only now: the module is cheap, and grpc comes only once kubelet is really asked
    # (podresources.pod_device_ids finds the socket first).
    from rdma_netns.kubelet import podresources

    try:
        grant = podresources.pod_device_ids(net.pod_resources_socket, namespace, name, net.resource_name,
                                            timeout)
    except ImportError as exc:  # grpc or protobuf missing from this install
        raise CniError(PAIRING_UNAVAILABLE, "the device plugin's grants broker is not running and this "
                       f"install cannot ask kubelet itself ({exc})") from None
    except podresources.PodResourcesUnavailable as exc:
        raise CniError(PAIRING_UNAVAILABLE, f"kubelet's PodResources API ({net.pod_resources_socket}): "
                       f"{exc.kind}: {exc}") from None
    return Grant(grant.found, list(grant.device_ids), grant.via)
