"""Ask the grants broker before the config is validated, and take its answer afterwards.

An ADD with pairing spends ~1.5 ms waiting for the broker (and kubelet behind it), and ~1.5 ms
importing and loading its own code. They need not come one after the other: as soon as the raw
config is read, send() asks the broker what a validated config would ask (the same defaults), and
the rest of start-up runs while the broker works. client.query takes the answer only when
the validated config asks the very same question of the very same broker; otherwise, or when
anything here fails, it asks again the ordinary way. So this can cost a wasted question, never a
wrong answer.

Standard library only, and nothing heavier than the JSON codec: everything imported before the
question leaves is start-up the broker cannot overlap.
"""

from __future__ import annotations

import posix
import sys
from _socket import AF_UNIX, SO_PEERCRED, SOCK_CLOEXEC, SOCK_STREAM, SOL_SOCKET, socket

from rdma_netns.config.defaults import (
    DEFAULT_POD_GRANTS_SOCKET,
    DEFAULT_POD_RESOURCES_SOCKET,
    DEFAULT_POD_RESOURCES_TIMEOUT_MS,
    MAX_POD_RESOURCES_TIMEOUT_MS,
)
from rdma_netns.util import jsonio

MAX_SOCKET_PATH = 107  # sun_path


def request(pod_resources_socket: str, namespace: str, name: str, uid: str, resource: str,
            timeout_ms: int) -> dict:
    """The broker's question (contract B in rdma_netns_dp.pod_grants), built one way for both paths."""
    return {"v": 1, "podResourcesSocket": pod_resources_socket, "namespace": namespace, "name": name,
            "uid": uid, "resourceName": resource, "timeoutMs": timeout_ms}


class ForeignBroker(PermissionError):
    """The socket's server is not root: it gets no question and its answer is never read (a
    config's podGrantsSocket could name anybody's socket; the broker meant is rdma-netns-dp's)."""


def require_root_peer(sock: socket, path: str) -> None:
    """SO_PEERCRED: the uid that bound the listening socket (struct ucred: pid, uid, gid)."""
    cred = sock.getsockopt(SOL_SOCKET, SO_PEERCRED, 12)
    pid, uid = int.from_bytes(cred[0:4], sys.byteorder), int.from_bytes(cred[4:8], sys.byteorder)
    if uid != 0 and uid != posix.geteuid():
        raise ForeignBroker(f"the grants broker socket {path} is served by uid {uid} (pid {pid}), not root: "
                            "its answer is not trusted")


def connect_and_send(path: str, question: dict, timeout: float) -> socket:
    """A connected socket that has sent `question` to a broker root serves; OSError as the
    connection fails, ForeignBroker when somebody else serves it."""
    sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC)  # _socket: the socket module's enum import costs
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        require_root_peer(sock, path)
        sock.sendall(jsonio.dumps(question).encode() + b"\n")
    except BaseException:
        sock.close()
        raise
    return sock


class Early:
    """A question on its way: the broker it went to, what it asked, and the socket to read."""

    __slots__ = ("path", "question", "sock")

    def __init__(self, path: str, question: dict, sock: socket) -> None:
        self.path, self.question, self.sock = path, question, sock

    def take(self, path: str, question: dict) -> socket | None:
        """The socket to read the answer from, when this is the question the validated config
        asks; else None (and the early question is dropped). Taken at most once."""
        sock, self.sock = self.sock, None
        if sock is not None and path == self.path and question == self.question:
            return sock
        if sock is not None:
            sock.close()
        return None

    def close(self) -> None:
        """Drop an answer nobody took (the call failed or did not pair); the broker sees a hang-up."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def send(raw: dict, args: dict[str, str]) -> Early | None:
    """Send the pod's grants question if the raw config pairs through a broker; None when it does
    not, when a value is not what validation would accept as is, or when the broker is not
    reachable (the ordinary query then finds out and reports it)."""
    resource = raw.get("resourceName")
    path = raw.get("podGrantsSocket", DEFAULT_POD_GRANTS_SOCKET)
    resources_socket = raw.get("podResourcesSocket", DEFAULT_POD_RESOURCES_SOCKET)
    timeout_ms = raw.get("podResourcesTimeoutMs", DEFAULT_POD_RESOURCES_TIMEOUT_MS)
    namespace, name = args.get("K8S_POD_NAMESPACE", ""), args.get("K8S_POD_NAME", "")
    if not (isinstance(resource, str) and resource and namespace and name):
        return None
    if not (isinstance(path, str) and path.startswith("/") and len(path.encode()) <= MAX_SOCKET_PATH
            and "\0" not in path and isinstance(resources_socket, str)):
        return None
    if type(timeout_ms) is not int or not 1 <= timeout_ms <= MAX_POD_RESOURCES_TIMEOUT_MS:
        return None
    question = request(resources_socket, namespace, name, args.get("K8S_POD_UID", ""), resource, timeout_ms)
    try:
        # The same limit as the ordinary query: the broker's own kubelet deadline comes first.
        sock = connect_and_send(path, question, timeout_ms / 1000 + 0.25)
    except (OSError, ValueError):
        return None
    return Early(path, question, sock)
