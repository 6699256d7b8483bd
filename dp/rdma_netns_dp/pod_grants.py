"""The grants broker: a unix socket on which the CNI asks which device IDs kubelet granted a pod.

Why: the CNI is a short-lived process per ADD; importing grpc there costs more than the whole
question. The long-running device-plugin daemon already has grpc loaded, so it asks kubelet's
PodResources API (rdma_netns.kubelet.podresources, the one client) on the CNI's behalf, in rounds
that answer many questions with one call (grant_rounds.py) inside kubelet's rate limit. One
request per connection, one JSON line each way (contract B):
  -> {"v": 1, "podResourcesSocket": "/abs", "namespace": "ns", "name": "pod", "uid": "",
      "resourceName": "rdma/hca", "timeoutMs": 500}
  <- {"v": 1, "found": true, "deviceIDs": [...], "via": "Get"|"List"} | {"v": 1, "found": false, "via": ...}
     | {"v": 1, "found": true, "deviceIDs": [CDI units], "rails": [RDMA devices], "via": "dra"}
     | {"v": 1, "error": "unreachable"|"timeout"|"rate-limited"|"ambiguous"|"failed"|"bad-request",
        "msg": "..."}
The socket is 0600 in a folder made 0700: only root on the node may ask.

On a DRA node (the daemon's DRA driver mode) the answer comes from the claims the driver
prepared for the pod, with no kubelet call: kubelet prepares a pod's claims before the runtime
creates its sandbox. `rails` names the RDMA devices the claims hold (the CNI attaches those and no
others) and `deviceIDs` the claims' CDI units; a pod without a claim of the driver holds nothing.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import stat
import threading
import time
from collections.abc import Callable

from rdma_netns.kubelet import podresources, ratelimit
from rdma_netns.util import fsutil
from rdma_netns_dp.grant_rounds import GrantRounds

log = logging.getLogger("rdma_netns_dp.pod_grants")

MAX_REQUEST = 64 * 1024
MAX_SOCKET_PATH = 107
MAX_TIMEOUT_MS = 10000
READ_TIMEOUT = 5.0  # a client that connects and says nothing does not keep a thread for long

Query = Callable[[str, str, str, str, float], podresources.PodGrant]
Observe = Callable[[str, float], None]  # (result, seconds) of each answer: the metrics
# DRA: (namespace, name, uid) -> (rails, CDI units) the pod's prepared claims hold, or None
DraLookup = Callable[[str, str, str], "tuple[list[str], list[str]] | None"]


class BadRequest(ValueError):
    pass


def parse_request(raw: bytes) -> dict:
    """The validated request, or BadRequest saying what is wrong."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise BadRequest("not a JSON object on one UTF-8 line") from None
    if not isinstance(data, dict):
        raise BadRequest("the request must be a JSON object")
    if data.get("v") != 1:
        raise BadRequest(f"unsupported request version {data.get('v')!r} (this broker speaks 1)")
    for key in ("podResourcesSocket", "namespace", "name", "resourceName"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise BadRequest(f"{key} must be a non-empty string")
    if not isinstance(data.get("uid", ""), str):
        raise BadRequest("uid must be a string")
    path = data["podResourcesSocket"]
    if not os.path.isabs(path) or len(path.encode()) > MAX_SOCKET_PATH or "\0" in path:
        raise BadRequest(f"podResourcesSocket must be an absolute path of at most {MAX_SOCKET_PATH} bytes")
    timeout = data.get("timeoutMs")
    if isinstance(timeout, bool) or not isinstance(timeout, int) or not 1 <= timeout <= MAX_TIMEOUT_MS:
        raise BadRequest(f"timeoutMs must be an integer 1..{MAX_TIMEOUT_MS}")
    return data


def answer(request: dict, query: Query) -> dict:
    """Ask kubelet (through `query`) and shape the answer; never raises."""
    try:
        grant = query(request["podResourcesSocket"], request["namespace"], request["name"],
                      request["resourceName"], request["timeoutMs"] / 1000)
    except podresources.PodResourcesUnavailable as exc:
        return {"v": 1, "error": exc.kind, "msg": exc.message}
    except Exception as exc:  # a bug must still get the CNI an answer (it then reports 107)
        log.exception("pod grant query failed")
        return {"v": 1, "error": "failed", "msg": f"{type(exc).__name__}: {exc}"}
    if not grant.found:
        return {"v": 1, "found": False, "via": grant.via}
    return {"v": 1, "found": True, "deviceIDs": list(grant.device_ids), "via": grant.via}


def dra_answer(request: dict, lookup: DraLookup) -> dict:
    """The pod's prepared claims as a grant; never raises."""
    try:
        found = lookup(request["namespace"], request["name"], request.get("uid", ""))
    except Exception as exc:
        log.exception("DRA grant lookup failed")
        return {"v": 1, "error": "failed", "msg": f"{type(exc).__name__}: {exc}"}
    rails, units = found or ([], [])
    return {"v": 1, "found": True, "deviceIDs": units, "rails": rails, "via": "dra"}


def _read_line(sock: socket.socket) -> bytes | None:
    """One request line (the "\\n" or the client's end of writing ends it); None when the client
    hung up without a byte (a probe); BadRequest if over MAX_REQUEST bytes."""
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            if not chunks:
                return None
            break
        newline = chunk.find(b"\n")
        if newline >= 0:
            chunk = chunk[:newline]
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_REQUEST:
            raise BadRequest(f"request over {MAX_REQUEST // 1024} KiB")
        if newline >= 0:
            break
    return b"".join(chunks)


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        started = time.monotonic()
        sock: socket.socket = self.request
        sock.settimeout(READ_TIMEOUT)
        request: dict = {}
        try:
            line = _read_line(sock)
            if line is None:
                return
            request = parse_request(line)
            if self.server.dra is not None:
                reply = dra_answer(request, self.server.dra)
            else:
                reply = answer(request, self.server.query)
        except BadRequest as exc:
            reply = {"v": 1, "error": "bad-request", "msg": str(exc)}
        except OSError as exc:  # the client went away or said nothing in time: nobody to answer
            log.warning("pod grant request not read", extra={"error": str(exc)})
            return
        try:
            sock.sendall(json.dumps(reply).encode() + b"\n")
        except OSError:
            pass  # the CNI gave up (its own timeout); the answer is logged anyway
        seconds = time.monotonic() - started
        if self.server.observe is not None:
            self.server.observe(reply.get("error") or ("found" if reply["found"] else "not_found"), seconds)
        ms = round(seconds * 1000, 1)
        pod = f"{request.get('namespace', '?')}/{request.get('name', '?')}"
        if "error" in reply:
            log.warning("pod grant", extra={"pod": pod, "error": reply["error"], "detail": reply["msg"], "ms": ms})
        else:
            log.info("pod grant", extra={"pod": pod, "uid": request.get("uid", ""),
                                         "resource": request["resourceName"], "found": reply["found"],
                                         "count": len(reply.get("deviceIDs", [])), "via": reply["via"],
                                         "ms": ms})


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    request_queue_size = 128  # a burst of pod starts is many ADDs at once
    query: Query
    observe: Observe | None = None
    dra: DraLookup | None = None


class PodGrantsServer:
    """The broker: start() binds and serves in a thread, stop() ends it and removes the socket."""

    def __init__(self, socket_path: str, query: Query | None = None, observe: Observe | None = None,
                 client: podresources.Client | None = None, dra: DraLookup | None = None) -> None:
        """`client`: the daemon's kubelet client (shared with its metrics, so that both stay inside
        one share of kubelet's rate limit); one of its own by default. `dra`: the DRA driver's
        lookup; answers come from it instead of kubelet."""
        self.socket_path = socket_path
        self.observe = observe
        self._own_client = client is None
        self.client = client or podresources.Client(ratelimit.TokenBucket())
        self.query = query or GrantRounds(self.client)
        self.dra = dra
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket we made

    def start(self) -> PodGrantsServer:
        """Bind under a temporary name, chmod 0600, then rename over the final path: a stale
        socket is replaced atomically and nobody sees the socket before its mode is set."""
        fsutil.make_daemon_folder(os.path.dirname(self.socket_path))  # 0700 whoever made it
        server = _Server(self.socket_path, _Handler, bind_and_activate=False)
        server.query = self.query
        server.observe = self.observe
        server.dra = self.dra
        tmp = f"{self.socket_path}.{os.getpid()}.tmp"
        try:
            fsutil.remove(tmp)
            server.socket.bind(tmp)
            os.chmod(tmp, 0o600)
            os.rename(tmp, self.socket_path)
            server.server_activate()
        except BaseException:
            server.server_close()
            fsutil.remove(tmp)
            raise
        st = os.stat(self.socket_path)
        self._identity = (st.st_dev, st.st_ino)
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="pod-grants", daemon=True)
        self._thread.start()
        log.info("pod grants broker serving", extra={"socket": self.socket_path})
        return self

    @property
    def serving(self) -> bool:
        return self._server is not None

    def stop(self) -> None:
        """Stop accepting and remove the socket file, unless another daemon has since put its
        own socket at that path."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._own_client:
            self.client.close()
        try:
            st = os.stat(self.socket_path)
            if stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == self._identity:
                os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
