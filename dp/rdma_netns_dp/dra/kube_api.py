"""A small typed client for the Kubernetes API server, over the standard library only.

The DRA driver needs a handful of verbs on three resources (publish ResourceSlices, read and
watch ResourceClaims, write a claim's status). The official `kubernetes` package would bring
dozens of generated modules and several dependencies into a node image whose start-up time and
footprint matter, so this module speaks HTTPS + JSON itself (http.client, ssl, json).

What it copies from client-go, because the API server's behaviour depends on it:
- a projected service-account token rotates, so the token file is read again for every request;
- errors arrive as a `Status` object whose `reason` (NotFound, Conflict, AlreadyExists, Expired,
  Gone, ...) is what callers branch on; bodies that are not a Status get client-go's reason for
  the HTTP code (k8s.io/apimachinery/pkg/api/errors NewGenericServerResponse);
- a watch is a chunked stream of newline-separated JSON events, and a resourceVersion that is
  too old arrives as an `ERROR` event carrying a Status with code 410, raised here so that the
  caller lists again.

The bearer token never appears in a message, a repr or a log line of this module.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import json
import os
import shutil
import socket
import ssl
import tempfile
import threading
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote, urlencode, urlsplit

from rdma_netns_dp import __version__

# A larger answer is refused rather than buffered: nothing this driver reads comes close, and a
# broken proxy must not make the daemon allocate without bound. Read at call time (tests lower it).
MAX_RESPONSE_BYTES = 64 * 1024 * 1024
# Error text that is not a Status (a proxy's HTML page, say) is cut to this length.
MAX_ERROR_TEXT = 500
DEFAULT_USER_AGENT = f"rdma-netns-dp/{__version__}"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
RESOURCE_API = "/apis/resource.k8s.io/v1"

PatchType = Literal["merge", "strategic", "json", "apply"]
# k8s.io/apimachinery/pkg/types/patch.go. Server-side apply takes YAML, and JSON is YAML.
PATCH_CONTENT_TYPES: Mapping[str, str] = {
    "merge": "application/merge-patch+json",
    "strategic": "application/strategic-merge-patch+json",
    "json": "application/json-patch+json",
    "apply": "application/apply-patch+yaml",
}

# client-go's reason for an HTTP code when the body is not a Status (NewGenericServerResponse).
_REASON_FOR_CODE: Mapping[int, str] = {
    400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
    405: "MethodNotAllowed", 406: "NotAcceptable", 409: "Conflict", 410: "Gone",
    413: "RequestEntityTooLarge", 415: "UnsupportedMediaType", 422: "Invalid",
    429: "TooManyRequests", 503: "ServiceUnavailable", 504: "Timeout",
}
# A reused keep-alive connection that the server (or a load balancer) closed while idle fails
# like this before any answer arrives: one retry on a fresh connection, as Go's net/http does.
_DROPPED = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError,
            http.client.RemoteDisconnected, ssl.SSLEOFError, ssl.SSLZeroReturnError)
_READ_CHUNK = 1 << 20


class ApiError(Exception):
    """A request the API server refused: `status` is the HTTP code, `reason` the Status
    object's reason (what callers branch on), `message` its human text."""

    def __init__(self, status: int, reason: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(status, reason, message, retry_after)
        self.status = status
        self.reason = reason
        self.message = message
        # Seconds the server asked us to wait (Retry-After header or details.retryAfterSeconds).
        self.retry_after = retry_after

    def __str__(self) -> str:
        return f"{self.status} {self.reason}: {self.message}"


class ApiUnavailable(ApiError):
    """No answer at all: connection refused or dropped, TLS failure, timeout (status 0)."""

    def __init__(self, message: str) -> None:
        super().__init__(0, "Unavailable", message)

    def __reduce__(self):  # one-argument constructor: keep pickling (multiprocessing) working
        return (type(self), (self.message,))

    def __str__(self) -> str:
        return f"API server unavailable: {self.message}"


class CredentialsError(ValueError):
    """The credentials cannot be built or used (not in a pod, a bad kubeconfig, an unreadable
    token or certificate file). Messages name files, never their contents."""


@dataclass(frozen=True)
class Credentials:
    """Where the API server is and how we prove who we are: a bearer token read from
    `token_file` on every request, or a client certificate (`cert_file` + `key_file`)."""

    server: str
    ca_file: str | None = None  # None: the system's trust roots
    token_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.server)
        if parts.scheme != "https" or not parts.hostname:
            raise CredentialsError(f"the API server must be an https:// URL, not {self.server!r}")
        if (self.cert_file is None) != (self.key_file is None):
            raise CredentialsError("a client certificate needs both cert_file and key_file")
        if self.token_file is None and self.cert_file is None:
            raise CredentialsError("no client identity: give token_file or cert_file + key_file")

    @classmethod
    def in_cluster(cls, environ: Mapping[str, str] | None = None,
                   account_dir: str = SERVICE_ACCOUNT_DIR) -> Credentials:
        """The pod's own service account, as client-go's rest.InClusterConfig finds it."""
        env = os.environ if environ is None else environ
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise CredentialsError("not running in a pod: KUBERNETES_SERVICE_HOST and "
                                   "KUBERNETES_SERVICE_PORT must be defined")
        token, ca = Path(account_dir) / "token", Path(account_dir) / "ca.crt"
        for path in (token, ca):
            if not path.is_file():
                raise CredentialsError(f"{path} is missing: not in a pod, or the pod does not "
                                       "mount its service-account token (automountServiceAccountToken)")
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 address: https://[fd00::1]:443
        return cls(server=f"https://{host}:{port}", ca_file=str(ca), token_file=str(token))

    @classmethod
    def from_kubeconfig(cls, path: str | os.PathLike[str], context: str | None = None) -> Credentials:
        """The current context (or `context`) of a kubeconfig: for running the driver outside a
        pod. Relative file paths are resolved against the kubeconfig's folder (as client-go
        does); the `-data` variants and an inline `token` are written to a private temporary
        folder (0700, files 0600) that is removed when the Credentials are collected."""
        import yaml  # a dependency of the package; only this developer path pays its import

        path = Path(path)
        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as error:
            raise CredentialsError(f"cannot read kubeconfig {path}: {error}") from None
        if not isinstance(doc, dict):
            raise CredentialsError(f"{path} is not a kubeconfig")
        name = context or doc.get("current-context")
        if not name:
            raise CredentialsError(f"{path} has no current-context")
        ctx = _kubeconfig_entry(doc, "context", name, path)
        cluster = _kubeconfig_entry(doc, "cluster", ctx.get("cluster"), path)
        user = _kubeconfig_entry(doc, "user", ctx.get("user"), path)
        _refuse_unsupported(cluster, user, path)
        private = _PrivateFolder()
        try:
            base = path.resolve().parent
            token_file = None
            if user.get("token"):  # client-go: an inline token wins over tokenFile
                token_file = private.write("token", str(user["token"]).encode())
            elif user.get("tokenFile"):
                token_file = _resolve(user["tokenFile"], base)
            credentials = cls(
                server=str(cluster.get("server") or ""),
                ca_file=_file_or_data(cluster, "certificate-authority", base, private, "ca.crt"),
                token_file=token_file,
                cert_file=_file_or_data(user, "client-certificate", base, private, "client.crt"),
                key_file=_file_or_data(user, "client-key", base, private, "client.key"),
            )
        except BaseException:
            private.remove()
            raise
        if private.path is not None:
            weakref.finalize(credentials, shutil.rmtree, private.path, True)
        return credentials

    def bearer_token(self) -> str | None:
        """The token as of now: projected tokens are rotated by kubelet, so never cached."""
        if self.token_file is None:
            return None
        try:
            token = Path(self.token_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as error:
            raise CredentialsError(f"cannot read token file {self.token_file}: "
                                   f"{type(error).__name__}") from None
        if not token or any(not 0x21 <= ord(c) <= 0x7E for c in token):
            # http.client would quote the bad header value (the token) in its ValueError
            raise CredentialsError(f"token file {self.token_file} is empty or holds characters "
                                   "an HTTP header cannot carry")
        return token

    def ssl_context(self) -> ssl.SSLContext:
        """A verifying TLS context (TLS 1.2 at least) with our client certificate, if any."""
        try:
            context = ssl.create_default_context(cafile=self.ca_file)
            if self.cert_file is not None:
                context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as error:
            raise CredentialsError(f"cannot load the TLS files (ca {self.ca_file}, cert "
                                   f"{self.cert_file}, key {self.key_file}): {error}") from None
        return context


class _PrivateFolder:
    """A temporary folder made on first write, 0700, holding 0600 files."""

    def __init__(self) -> None:
        self.path: str | None = None

    def write(self, name: str, data: bytes) -> str:
        if self.path is None:
            self.path = tempfile.mkdtemp(prefix="rdma-netns-kube-")
            os.chmod(self.path, 0o700)
        target = os.path.join(self.path, name)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), 0o600)
            out.write(data)
        return target

    def remove(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)


def _kubeconfig_entry(doc: Mapping[str, Any], kind: str, name: Any, path: Path) -> dict[str, Any]:
    """The `kind` (context, cluster, user) called `name` in the kubeconfig's named lists."""
    for entry in doc.get(kind + "s") or []:
        if isinstance(entry, dict) and entry.get("name") == name:
            return entry.get(kind) or {}
    raise CredentialsError(f"{path}: no {kind} named {name!r}")


def _refuse_unsupported(cluster: Mapping[str, Any], user: Mapping[str, Any], path: Path) -> None:
    """Say so instead of silently connecting another way than the kubeconfig asks."""
    if cluster.get("insecure-skip-tls-verify"):
        raise CredentialsError(f"{path}: insecure-skip-tls-verify is not supported")
    for key in ("tls-server-name", "proxy-url"):
        if cluster.get(key):
            raise CredentialsError(f"{path}: cluster {key} is not supported")
    for key in ("exec", "auth-provider", "username", "password", "as"):
        if user.get(key):
            raise CredentialsError(f"{path}: user {key} is not supported; use a token, a "
                                   "tokenFile or a client certificate")


def _resolve(value: Any, base: Path) -> str:
    return str(base / str(value))  # an absolute value stays as it is


def _file_or_data(entry: Mapping[str, Any], key: str, base: Path, private: _PrivateFolder,
                  name: str) -> str | None:
    """`key-data` (base64, wins as in client-go) written to the private folder, else `key`."""
    data = entry.get(key + "-data")
    if data:
        try:
            raw = base64.b64decode("".join(str(data).split()), validate=True)
        except (binascii.Error, ValueError):
            raise CredentialsError(f"{key}-data is not base64") from None
        return private.write(name, raw)
    if entry.get(key):
        return _resolve(entry[key], base)
    return None


def _segment(value: str, what: str) -> str:
    """One URL path segment: a name or namespace, quoted."""
    if not value or value in (".", ".."):
        raise ValueError(f"invalid {what} {value!r}")
    return quote(value, safe="")


def resource_slices_path(name: str | None = None) -> str:
    """`/apis/resource.k8s.io/v1/resourceslices[/name]` (cluster-scoped)."""
    path = f"{RESOURCE_API}/resourceslices"
    return path if name is None else f"{path}/{_segment(name, 'name')}"


def resource_claims_path(namespace: str | None = None, name: str | None = None,
                         status: bool = False) -> str:
    """ResourceClaims of every namespace, of one, one claim, or its `status` subresource."""
    if name is not None and namespace is None:
        raise ValueError("a ResourceClaim's name needs its namespace")
    if status and name is None:
        raise ValueError("the status subresource needs a ResourceClaim's name")
    path = RESOURCE_API
    if namespace is not None:
        path += f"/namespaces/{_segment(namespace, 'namespace')}"
    path += "/resourceclaims"
    if name is not None:
        path += f"/{_segment(name, 'name')}"
    return path + "/status" if status else path


def device_classes_path(name: str | None = None) -> str:
    """`/apis/resource.k8s.io/v1/deviceclasses[/name]` (cluster-scoped)."""
    path = f"{RESOURCE_API}/deviceclasses"
    return path if name is None else f"{path}/{_segment(name, 'name')}"


def _query(params: Mapping[str, str | int | None]) -> dict[str, str]:
    return {key: str(value) for key, value in params.items() if value is not None}


class KubeApi:
    """JSON verbs on API paths. Each thread keeps one keep-alive HTTPS connection; a watch gets
    a connection of its own (it blocks it). `close()` also ends watches blocked in another
    thread. Nothing is connected before the first request."""

    def __init__(self, credentials: Credentials, timeout: float = 10.0,
                 user_agent: str = DEFAULT_USER_AGENT) -> None:
        self.credentials = credentials
        self.timeout = timeout
        self.user_agent = user_agent
        parts = urlsplit(credentials.server)
        self._host = parts.hostname or ""
        self._port = parts.port or 443
        self._prefix = parts.path.rstrip("/")  # a server behind a path (a proxy's /k8s/clusters/x)
        self._ssl = credentials.ssl_context()  # a bad cert or key fails here, not on first use
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: weakref.WeakSet[http.client.HTTPSConnection] = weakref.WeakSet()
        self._closed = False

    def __repr__(self) -> str:
        return f"KubeApi({self.credentials.server!r})"

    def __enter__(self) -> KubeApi:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every connection, watches in other threads included (they end quietly)."""
        self._closed = True
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            sock = conn.sock
            if sock is not None:
                try:  # the plain socket's shutdown: wakes a reader blocked in another thread
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)
                except OSError:
                    pass

    # -- verbs -------------------------------------------------------------------------------

    def get(self, path: str) -> dict[str, Any]:
        """One object (or any GET answer)."""
        return self._request("GET", path)

    def list(self, path: str, label_selector: str | None = None, field_selector: str | None = None,
             limit: int | None = None, continue_: str | None = None) -> dict[str, Any]:
        """Every page of a collection as one list: `items` holds them all and
        `metadata.resourceVersion` is the list's version, to start a watch from. A continue
        token that expired meanwhile raises ApiError 410 Expired: list again from scratch."""
        selectors = {"labelSelector": label_selector, "fieldSelector": field_selector, "limit": limit}
        page = self._request("GET", path, _query({**selectors, "continue": continue_}))
        first, items, seen = page, list(page.get("items") or []), set()
        while token := (page.get("metadata") or {}).get("continue"):
            if token in seen:
                raise ApiError(200, "InvalidResponse", f"GET {path}: the server repeated a continue token")
            seen.add(token)
            page = self._request("GET", path, _query({**selectors, "continue": token}))
            items.extend(page.get("items") or [])
        metadata = {k: v for k, v in (first.get("metadata") or {}).items()
                    if k not in ("continue", "remainingItemCount")}
        last_version = (page.get("metadata") or {}).get("resourceVersion")
        if last_version:
            metadata["resourceVersion"] = last_version
        return {**first, "metadata": metadata, "items": items}

    def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST to a collection; an existing name raises ApiError 409 AlreadyExists."""
        return self._request("POST", path, body=body)

    def replace(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """PUT an object. Its metadata.resourceVersion makes the write conditional: a stale one
        raises ApiError 409 Conflict (read again, reapply, retry)."""
        return self._request("PUT", path, body=body)

    def patch(self, path: str, body: Any, patch_type: PatchType = "merge",
              field_manager: str | None = None, force: bool | None = None) -> dict[str, Any]:
        """PATCH an object; `body` is a list for a JSON patch. Server-side apply ("apply")
        needs a field manager, and `force` exists for apply only (the server answers 422
        otherwise, so it is refused here first)."""
        content_type = PATCH_CONTENT_TYPES.get(patch_type)
        if content_type is None:
            raise ValueError(f"unknown patch type {patch_type!r}; one of {sorted(PATCH_CONTENT_TYPES)}")
        if patch_type == "apply" and not field_manager:
            raise ValueError("a server-side apply needs a field_manager")
        if force is not None and patch_type != "apply":
            raise ValueError("force applies to server-side apply only")
        query = _query({"fieldManager": field_manager,
                        "force": None if force is None else str(bool(force)).lower()})
        return self._request("PATCH", path, query, body=body, content_type=content_type)

    def delete(self, path: str, preconditions_uid: str | None = None) -> None:
        """DELETE an object; one already gone counts as deleted. With `preconditions_uid` the
        server deletes only that incarnation of the name (else ApiError 409 Conflict)."""
        body = None
        if preconditions_uid is not None:
            body = {"apiVersion": "v1", "kind": "DeleteOptions",
                    "preconditions": {"uid": preconditions_uid}}
        try:
            self._request("DELETE", path, body=body)
        except ApiError as error:
            if error.status != 404:
                raise

    def watch(self, path: str, resource_version: str, field_selector: str | None = None,
              label_selector: str | None = None, timeout_seconds: int = 300,
              allow_bookmarks: bool = True) -> Iterator[dict[str, Any]]:
        """The events after `resource_version`, as {"type": ADDED|MODIFIED|DELETED|BOOKMARK,
        "object": ...}. The server ends the stream after `timeout_seconds` (the iterator just
        ends: watch again from the last version seen). A version too old for the server raises
        ApiError 410 (Expired or Gone): list again. A dropped stream raises ApiUnavailable.
        Nothing is sent before the first next()."""
        query = _query({"watch": "1", "resourceVersion": resource_version,
                        "allowWatchBookmarks": "true" if allow_bookmarks else None,
                        "timeoutSeconds": timeout_seconds,
                        "fieldSelector": field_selector, "labelSelector": label_selector})
        # The server is silent for up to timeout_seconds between events: the socket waits longer.
        return self._watch(path, query, timeout_seconds + self.timeout)

    # -- plumbing ----------------------------------------------------------------------------

    def _url(self, path: str, query: Mapping[str, str] | None) -> str:
        if not path.startswith("/"):
            raise ValueError(f"an API path starts with '/': {path!r}")
        return self._prefix + path + (f"?{urlencode(query)}" if query else "")

    def _headers(self, token: str | None, content_type: str | None) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": self.user_agent}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        if content_type is not None:
            headers["Content-Type"] = content_type
        return headers

    def _new_connection(self, timeout: float) -> http.client.HTTPSConnection:
        conn = http.client.HTTPSConnection(self._host, self._port, timeout=timeout, context=self._ssl)
        with self._lock:
            self._connections.add(conn)
        return conn

    def _thread_connection(self) -> http.client.HTTPSConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._new_connection(self.timeout)
        return conn

    def _unavailable(self, method: str, path: str, error: BaseException) -> ApiUnavailable:
        return ApiUnavailable(f"{method} {self.credentials.server}{path}: {type(error).__name__}: {error}")

    def _request(self, method: str, path: str, query: Mapping[str, str] | None = None,
                 body: Any = None, content_type: str = "application/json") -> dict[str, Any]:
        """One request on this thread's connection, retried once on a fresh connection when a
        reused one turns out dropped before any answer (a create retried after all reached
        the server comes back 409 AlreadyExists, which callers already handle)."""
        if self._closed:
            raise ApiUnavailable("the client is closed")
        url = self._url(path, query)
        payload = None if body is None else json.dumps(body, separators=(",", ":")).encode()
        token = self.credentials.bearer_token()
        headers = self._headers(token, content_type if payload is not None else None)
        conn = self._thread_connection()
        for attempt in (1, 2):
            reused = conn.sock is not None
            try:
                conn.request(method, url, body=payload, headers=headers)
                response = conn.getresponse()
                break
            except _DROPPED as error:
                conn.close()
                if not reused or attempt == 2:
                    raise self._unavailable(method, path, error) from error
            except (OSError, http.client.HTTPException) as error:  # refused, timeout, TLS
                conn.close()
                raise self._unavailable(method, path, error) from error
        try:
            data = _read_body(response, f"{method} {path}")
        except (OSError, http.client.HTTPException) as error:
            conn.close()
            raise self._unavailable(method, path, error) from error
        except ApiError:
            conn.close()  # the unread rest of the body makes the connection unusable
            raise
        if not 200 <= response.status < 300:
            raise _error_from(response.status, data, response.getheader("Retry-After"), method, token)
        return _decode(data, response.status, f"{method} {path}", token)

    def _watch(self, path: str, query: Mapping[str, str], socket_timeout: float) -> Iterator[dict[str, Any]]:
        if self._closed:
            raise ApiUnavailable("the client is closed")
        url = self._url(path, query)
        token = self.credentials.bearer_token()
        conn = self._new_connection(socket_timeout)
        try:
            try:
                conn.request("GET", url, headers=self._headers(token, None))
                response = conn.getresponse()
            except (OSError, http.client.HTTPException) as error:
                raise self._unavailable("WATCH", path, error) from error
            if response.status != 200:
                try:
                    data = _read_body(response, f"WATCH {path}")
                except (OSError, http.client.HTTPException) as error:
                    raise self._unavailable("WATCH", path, error) from error
                raise _error_from(response.status, data, response.getheader("Retry-After"), "GET", token)
            for line in self._lines(response, path):
                if not line.strip():
                    continue
                event = _decode(line, 200, f"WATCH {path}", token)
                if event.get("type") == "ERROR":
                    raise _watch_error(event.get("object"), token)
                yield event
        finally:
            conn.close()
            with self._lock:
                self._connections.discard(conn)

    def _lines(self, response: http.client.HTTPResponse, path: str) -> Iterator[bytes]:
        """The stream's newline-separated events, whatever the chunking. read1() rather than
        readline(): on a chunked body readline() goes through peek(), which turns a connection
        dropped between two chunks into a quiet end of stream; read1() raises IncompleteRead."""
        buffer = bytearray()
        while True:
            newline = buffer.find(b"\n")
            if newline >= 0:
                yield bytes(buffer[:newline])
                del buffer[:newline + 1]
                continue
            if len(buffer) > MAX_RESPONSE_BYTES:
                raise ApiError(200, "ResponseTooLarge", f"WATCH {path}: an event over {MAX_RESPONSE_BYTES} bytes")
            try:
                data = response.read1(_READ_CHUNK)
            except (OSError, ValueError, http.client.HTTPException) as error:
                if self._closed:
                    return  # close() shut the socket under us
                raise self._unavailable("WATCH", path, error) from error
            if not data:  # the last chunk: the server ended the watch (timeoutSeconds)
                if buffer.strip():
                    yield bytes(buffer)
                return
            buffer += data


def _read_body(response: http.client.HTTPResponse, what: str) -> bytes:
    """The whole body, refused past MAX_RESPONSE_BYTES (declared or actual)."""
    limit = MAX_RESPONSE_BYTES
    declared = response.getheader("Content-Length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise ApiError(response.status, "ResponseTooLarge",
                       f"{what}: a {declared}-byte answer is over the {limit}-byte limit")
    parts, total = [], 0
    while chunk := response.read(min(_READ_CHUNK, limit + 1 - total)):
        parts.append(chunk)
        total += len(chunk)
        if total > limit:
            raise ApiError(response.status, "ResponseTooLarge", f"{what}: an answer over {limit} bytes")
    return b"".join(parts)


def _redact(text: str, token: str | None) -> str:
    """Whatever the server (or a proxy) echoes, the token does not leave this module."""
    return text.replace(token, "<redacted>") if token else text


def _decode(data: bytes, status: int, what: str, token: str | None) -> dict[str, Any]:
    if not data.strip():
        return {}
    try:
        doc = json.loads(data)
    except ValueError:
        text = _redact(data[:MAX_ERROR_TEXT].decode("utf-8", "replace"), token)
        raise ApiError(status, "InvalidResponse", f"{what}: not JSON: {text}") from None
    if not isinstance(doc, dict):
        raise ApiError(status, "InvalidResponse", f"{what}: a JSON {type(doc).__name__}, not an object")
    return doc


def _retry_after(header: str | None, status: Mapping[str, Any] | None) -> float | None:
    if header:
        try:
            return float(header)
        except ValueError:
            pass  # an HTTP date: kube-apiserver sends seconds only
    details = (status or {}).get("details") or {}
    seconds = details.get("retryAfterSeconds") if isinstance(details, dict) else None
    return float(seconds) if isinstance(seconds, (int, float)) and seconds > 0 else None


def _error_from(status: int, data: bytes, retry_after: str | None, method: str,
                token: str | None) -> ApiError:
    """A non-2xx answer as ApiError: the Status body's reason and message, else client-go's
    reason for the code and the raw text (cut to MAX_ERROR_TEXT)."""
    text = data.decode("utf-8", "replace")
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and doc.get("kind") == "Status":
        reason = str(doc.get("reason") or _reason_for(status, method))
        message = str(doc.get("message") or "")[:MAX_ERROR_TEXT * 4]
        return ApiError(status, reason, _redact(message, token), _retry_after(retry_after, doc))
    message = text.strip()[:MAX_ERROR_TEXT] or (
        f"the server responded with the status code {status} but did not return more information")
    return ApiError(status, _reason_for(status, method), _redact(message, token),
                    _retry_after(retry_after, None))


def _reason_for(status: int, method: str) -> str:
    if status == 409 and method == "POST":
        return "AlreadyExists"
    return _REASON_FOR_CODE.get(status) or ("InternalError" if status >= 500 else "Unknown")


def _watch_error(status: Any, token: str | None) -> ApiError:
    """A watch's ERROR event (its object a Status) as ApiError; 410 means list again."""
    if not isinstance(status, dict):
        return ApiError(500, "InternalError", "a watch ERROR event without a Status")
    code = status.get("code")
    code = code if isinstance(code, int) and code > 0 else 500
    reason = str(status.get("reason") or ("Expired" if code == 410 else _reason_for(code, "GET")))
    message = _redact(str(status.get("message") or ""), token)
    return ApiError(code, reason, message, _retry_after(None, status))
