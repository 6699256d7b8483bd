"""rdma_netns_dp.dra.kube_api against a stand-in kube-apiserver served over real TLS on
127.0.0.1 (a throwaway CA, server and client certificates made with openssl).

The stand-in copies what the client relies on, as read in the Kubernetes v1.37.2 sources:
- error bodies are `Status` objects (apimachinery pkg/api/errors/errors.go: NewNotFound,
  NewAlreadyExists, NewConflict, NewResourceExpired, NewUnauthorized), the conflict message with
  apiserver pkg/registry/generic/registry/store.go's OptimisticLockErrorMsg, and a failed uid
  precondition as a Conflict (apiserver pkg/storage/interfaces.go, pkg/storage/errors/storage.go);
- paging with `limit` / `metadata.continue` (a base64url JSON token {"v","rv","start"},
  apiserver pkg/storage/continue.go) and 410 Expired for a continue token that is too old
  (apiserver pkg/storage/etcd3/errors.go);
- watches as chunked, newline-separated JSON events (apiserver pkg/endpoints/handlers/watch.go:
  Transfer-Encoding: chunked, one flush per event; apimachinery's JSON framer writes objects
  as json.Encoder does, each followed by "\\n"), a BOOKMARK event whose object is an empty
  object of the kind with only metadata.resourceVersion (apiserver pkg/storage/cacher/cacher.go),
  and a too old resourceVersion as an ERROR event carrying a Status with code 410 on an HTTP 200
  stream (cacher.go newErrWatcher, watch_cache_history.go "too old resource version: %d (%d)").
"""

from __future__ import annotations

import base64
import gc
import json
import os
import pickle
import socket
import ssl
import stat
import subprocess
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from rdma_netns_dp.dra import kube_api
from rdma_netns_dp.dra.kube_api import (
    ApiError,
    ApiUnavailable,
    Credentials,
    CredentialsError,
    KubeApi,
    device_classes_path,
    resource_claims_path,
    resource_slices_path,
)

GROUP = "resource.k8s.io"
TOKEN = "sa-token-1.secret-part"


# -- certificates -----------------------------------------------------------------------------

def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _leaf(folder: Path, name: str, subject: str, extensions: str) -> None:
    _openssl("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=folder)
    (folder / f"{name}.ext").write_text(extensions + "\nauthorityKeyIdentifier=keyid\n"
                                        "subjectKeyIdentifier=hash\nbasicConstraints=CA:FALSE\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-set_serial", str(abs(hash(name)) % 10**9 + 2), "-days", "2", "-out", f"{name}.crt",
             "-extfile", f"{name}.ext", cwd=folder)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("pki")
    (folder / "ca.cnf").write_text(
        "[req]\ndistinguished_name=dn\nx509_extensions=v3_ca\n[dn]\n"
        "[v3_ca]\nbasicConstraints=critical,CA:TRUE\nkeyUsage=critical,keyCertSign,cRLSign\n"
        "subjectKeyIdentifier=hash\n")
    _openssl("req", "-x509", "-config", "ca.cnf", "-newkey", "ec", "-pkeyopt",
             "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
             "-days", "2", "-subj", "/CN=test-kubernetes-ca", cwd=folder)
    _leaf(folder, "server", "/CN=kube-apiserver",
          "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1")
    _leaf(folder, "client", "/O=system:nodes/CN=system:node:node-1",
          "keyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth")
    return folder


# -- the stand-in kube-apiserver --------------------------------------------------------------

def status(code: int, reason: str, message: str, details: dict | None = None) -> dict:
    """metav1.Status as kube-apiserver encodes it (ListMeta `metadata` is always there)."""
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}
    if details is not None:
        body["details"] = details
    return body


def not_found(resource: str, name: str) -> dict:
    return status(404, "NotFound", f'{resource}.{GROUP} "{name}" not found',
                  {"name": name, "group": GROUP, "kind": resource})


def conflict(resource: str, name: str, why: str) -> dict:
    return status(409, "Conflict", f'Operation cannot be fulfilled on {resource}.{GROUP} "{name}": {why}',
                  {"name": name, "group": GROUP, "kind": resource})


OPTIMISTIC_LOCK = ("the object has been modified; please apply your changes to the latest version "
                   "and try again")
CONTINUE_EXPIRED = ("The provided continue parameter is too old to display a consistent list result. "
                    "You can start a new list without the continue parameter.")
LIST_KINDS = {"resourceslices": "ResourceSliceList", "resourceclaims": "ResourceClaimList",
              "deviceclasses": "DeviceClassList"}


def merge_patch(target, patch):
    """RFC 7386, as kube-apiserver applies application/merge-patch+json."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class Recorded:
    def __init__(self, handler: BaseHTTPRequestHandler, body: bytes):
        parts = urlsplit(handler.path)
        self.method = handler.command
        self.path = parts.path
        self.query = {k: v[0] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        self.raw_query = parts.query
        self.headers = dict(handler.headers.items())
        self.body = json.loads(body) if body else None
        self.client_port = handler.client_address[1]
        cert = handler.connection.getpeercert()
        self.client_cn = dict(x[0] for x in cert["subject"]).get("commonName") if cert else None


class StandIn(ThreadingHTTPServer):
    """kube-apiserver's resource.k8s.io/v1 API, enough of it: objects, paging, watches."""

    daemon_threads = True

    def __init__(self, certs: Path):
        super().__init__(("127.0.0.1", 0), Handler)
        self.tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.tls.load_cert_chain(certs / "server.crt", certs / "server.key")
        self.tls.load_verify_locations(certs / "ca.crt")
        self.tls.verify_mode = ssl.CERT_OPTIONAL  # a token or a client certificate, as the real one
        self.url = f"https://127.0.0.1:{self.server_address[1]}"
        self.tokens = {TOKEN}
        self.requests: list[Recorded] = []
        self.objects: dict[tuple[str, str, str], dict] = {}
        self.rv = 100
        self.compacted_rv = 0  # continue tokens older than this are expired
        self.watch_script: list = []  # dicts (events), bytes (raw chunks), "hold", "truncate"
        self.watch_release = threading.Event()
        self.raw_error: tuple[int, str, dict] | None = None  # (code, body text, headers)
        self.drop_reused = 0  # close a reused connection instead of answering, this many times
        self.drop_all = False  # close every connection instead of answering
        self.chunked = False  # answer with chunked bodies instead of Content-Length
        self.echo_authorization = False

    def finish_request(self, request, client_address):
        """TLS per connection in the connection's own thread (a slow handshake blocks nobody)."""
        try:
            tls = self.tls.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError):
            return
        try:
            super().finish_request(tls, client_address)
        finally:
            tls.close()

    def next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    def __enter__(self):
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.watch_release.set()
        self.shutdown()
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and chunked transfer, as kube-apiserver (Go net/http)
    server: StandIn
    timeout = 5
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall

    def log_message(self, *args):
        pass

    # one entry point for every verb
    def do_GET(self):
        self.dispatch()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

    def handle(self):
        self.served = 0
        super().handle()

    def dispatch(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        stand_in = self.server
        if stand_in.drop_all or (stand_in.drop_reused and self.served):
            stand_in.drop_reused = max(0, stand_in.drop_reused - 1)
            stand_in.requests.append(Recorded(self, raw))
            self.close_connection = True
            return  # no answer at all: an idle keep-alive connection the server closed
        self.served += 1
        request = Recorded(self, raw)
        stand_in.requests.append(request)
        auth = self.headers.get("Authorization")
        if not (auth and auth.removeprefix("Bearer ") in stand_in.tokens) and request.client_cn is None:
            message = "Unauthorized" + (f" ({auth})" if stand_in.echo_authorization else "")
            return self.send_json(401, status(401, "Unauthorized", message))
        if stand_in.echo_authorization:
            return self.send_json(403, status(403, "Forbidden", f"forbidden for {auth}"))
        if stand_in.raw_error:
            code, text, headers = stand_in.raw_error
            return self.send_raw(code, text.encode(), "text/plain; charset=utf-8", headers)
        self.route(request)

    def route(self, request: Recorded):
        prefix = "/apis/resource.k8s.io/v1/"
        if not request.path.startswith(prefix):
            return self.send_json(404, status(404, "NotFound", "the server could not find the requested resource"))
        parts = request.path[len(prefix):].split("/")
        namespace = ""
        if parts[0] == "namespaces":
            namespace, parts = parts[1], parts[2:]
        resource, name = parts[0], (parts[1] if len(parts) > 1 else None)
        subresource = parts[2] if len(parts) > 2 else None
        key = (resource, namespace, name)
        if name is None and request.method == "GET":
            if request.query.get("watch") in ("1", "true"):
                return self.watch()
            return self.list(resource, namespace, request)
        if request.method == "POST":
            return self.create(resource, namespace, request.body)
        current = self.server.objects.get(key)
        if current is None:
            return self.send_json(404, not_found(resource, name))
        if request.method == "GET":
            return self.send_json(200, current)
        if request.method == "PUT":
            return self.update(key, current, request.body, subresource)
        if request.method == "PATCH":
            return self.patch(key, current, request)
        if request.method == "DELETE":
            uid = ((request.body or {}).get("preconditions") or {}).get("uid")
            if uid is not None and uid != current["metadata"]["uid"]:
                why = (f"Precondition failed: UID in precondition: {uid}, "
                       f"UID in object meta: {current['metadata']['uid']}")
                return self.send_json(409, conflict(resource, name, why))
            del self.server.objects[key]
            return self.send_json(200, current)

    def create(self, resource, namespace, body):
        name = body["metadata"]["name"]
        key = (resource, namespace, name)
        if key in self.server.objects:
            return self.send_json(409, status(409, "AlreadyExists", f'{resource}.{GROUP} "{name}" already exists',
                                              {"name": name, "group": GROUP, "kind": resource}))
        meta = {**body["metadata"], "uid": f"uid-{name}", "resourceVersion": self.server.next_rv()}
        if namespace:
            meta["namespace"] = namespace
        self.server.objects[key] = obj = {**body, "metadata": meta}
        self.send_json(201, obj)

    def update(self, key, current, body, subresource):
        sent_rv = body["metadata"].get("resourceVersion")
        if sent_rv and sent_rv != current["metadata"]["resourceVersion"]:
            return self.send_json(409, conflict(key[0], key[2], OPTIMISTIC_LOCK))
        new = {**body} if subresource is None else {**current, "status": body.get("status")}
        new["metadata"] = {**current["metadata"], **({} if subresource else body["metadata"]),
                           "resourceVersion": self.server.next_rv()}
        self.server.objects[key] = new
        self.send_json(200, new)

    def patch(self, key, current, request):
        content_type = request.headers.get("Content-Type")
        if content_type == "application/merge-patch+json":
            new = merge_patch(current, request.body)
        elif content_type in ("application/apply-patch+yaml", "application/json-patch+json",
                              "application/strategic-merge-patch+json"):
            new = current  # recorded; the client's part is the content type and the query
        else:
            return self.send_json(415, status(415, "UnsupportedMediaType", f"the body of the request was in an "
                                              f"unknown format - accepted media types include: ..."))
        new = {**new, "metadata": {**new["metadata"], "resourceVersion": self.server.next_rv()}}
        self.server.objects[key] = new
        self.send_json(200, new)

    def list(self, resource, namespace, request):
        stand_in = self.server
        keys = sorted(k for k in stand_in.objects if k[0] == resource and (not namespace or k[1] == namespace))
        selector = request.query.get("labelSelector")
        if selector:
            want = dict(term.split("=") for term in selector.split(","))
            keys = [k for k in keys if all(stand_in.objects[k]["metadata"].get("labels", {}).get(a) == b
                                           for a, b in want.items())]
        rv = stand_in.rv
        token = request.query.get("continue")
        if token:
            decoded = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
            if decoded["rv"] < stand_in.compacted_rv:
                return self.send_json(410, status(410, "Expired", CONTINUE_EXPIRED))
            rv = decoded["rv"]
            keys = [k for k in keys if f"{k[1]}/{k[2]}" >= decoded["start"]]
        limit = int(request.query.get("limit") or 0)
        metadata = {"resourceVersion": str(rv)}
        if limit and len(keys) > limit:
            rest = keys[limit]
            keys, remaining = keys[:limit], len(keys) - limit
            raw = json.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": f"{rest[1]}/{rest[2]}"},
                             separators=(",", ":")).encode()
            metadata["continue"] = base64.urlsafe_b64encode(raw).decode().rstrip("=")
            metadata["remainingItemCount"] = remaining
        items = []
        for k in keys:  # items of a typed list carry no kind/apiVersion
            item = dict(stand_in.objects[k])
            item.pop("kind", None)
            item.pop("apiVersion", None)
            items.append(item)
        self.send_json(200, {"kind": LIST_KINDS[resource], "apiVersion": f"{GROUP}/v1",
                             "metadata": metadata, "items": items})

    def watch(self):
        """Headers first, then one chunk per event (json.Encoder's output: object + "\\n")."""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()
        for step in self.server.watch_script:
            if step == "hold":
                self.server.watch_release.wait(5)
                continue
            if step == "truncate":
                self.wfile.write(b"40\r\n{\"type\":\"ADDED\"")  # a chunk cut short, then the TCP close
                self.wfile.flush()
                self.close_connection = True
                return
            if step == "close":  # the connection closed between two events, no last chunk
                self.close_connection = True
                return
            data = step if isinstance(step, bytes) else (json.dumps(step) + "\n").encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def send_json(self, code: int, body: dict):
        self.send_raw(code, json.dumps(body).encode(), "application/json", {})

    def send_raw(self, code: int, data: bytes, content_type: str, headers: dict):
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        for name, value in headers.items():
            self.send_header(name, value)
        if self.server.chunked:
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            half = len(data) // 2
            for part in (data[:half], data[half:]):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)


# -- fixtures ---------------------------------------------------------------------------------

@pytest.fixture
def server(certs):
    with StandIn(certs) as stand_in:
        yield stand_in


@pytest.fixture
def token_file(tmp_path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")  # kubelet's projected token files end without one; tolerate it
    return path


@pytest.fixture
def api(server, certs, token_file):
    client = KubeApi(Credentials(server.url, ca_file=str(certs / "ca.crt"), token_file=str(token_file)),
                     timeout=3.0)
    yield client
    client.close()


def claim(name: str, namespace: str = "ns", **extra) -> dict:
    return {"apiVersion": f"{GROUP}/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace, **extra}, "spec": {"devices": {}}}


def slice_(name: str, node: str = "node-1") -> dict:
    return {"apiVersion": f"{GROUP}/v1", "kind": "ResourceSlice",
            "metadata": {"name": name, "labels": {"node": node}},
            "spec": {"driver": "rdma.example.com", "nodeName": node, "pool": {"name": node}}}


# -- paths ------------------------------------------------------------------------------------

def test_paths():
    assert resource_slices_path() == "/apis/resource.k8s.io/v1/resourceslices"
    assert resource_slices_path("node-1-rdma") == "/apis/resource.k8s.io/v1/resourceslices/node-1-rdma"
    assert device_classes_path("rdma") == "/apis/resource.k8s.io/v1/deviceclasses/rdma"
    assert device_classes_path() == "/apis/resource.k8s.io/v1/deviceclasses"
    assert resource_claims_path() == "/apis/resource.k8s.io/v1/resourceclaims"
    assert resource_claims_path("ns") == "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims"
    assert resource_claims_path("ns", "c", status=True) == \
        "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/c/status"
    assert resource_claims_path("ns", "a/b?c") == "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims/a%2Fb%3Fc"
    for bad in (lambda: resource_claims_path(name="c"), lambda: resource_claims_path("ns", status=True),
                lambda: resource_slices_path(".."), lambda: resource_claims_path("")):
        with pytest.raises(ValueError):
            bad()


# -- verbs, auth, keep-alive ------------------------------------------------------------------

def test_crud_on_one_keepalive_connection_with_the_token_read_again_per_request(api, server, token_file):
    created = api.create(resource_claims_path("ns"), claim("c1"))
    assert created["metadata"]["uid"] == "uid-c1"
    token_file.write_text("sa-token-2.rotated")  # kubelet rotated the projected token
    server.tokens.add("sa-token-2.rotated")
    got = api.get(resource_claims_path("ns", "c1"))
    assert got == created
    auth = [r.headers["Authorization"] for r in server.requests]
    assert auth == [f"Bearer {TOKEN}", "Bearer sa-token-2.rotated"]
    assert len({r.client_port for r in server.requests}) == 1  # one keep-alive connection
    first = server.requests[0]
    assert first.method == "POST" and first.path == "/apis/resource.k8s.io/v1/namespaces/ns/resourceclaims"
    assert first.headers["Content-Type"] == "application/json"
    assert first.headers["User-Agent"] == f"rdma-netns-dp/{kube_api.__version__}"
    assert first.headers["Accept"] == "application/json"


def test_replace_is_conditional_on_the_resource_version(api, server):
    created = api.create(resource_claims_path("ns"), claim("c1"))
    updated = api.replace(resource_claims_path("ns", "c1", status=True),
                          {**created, "status": {"allocation": {"devices": {"results": []}}}})
    assert updated["status"] == {"allocation": {"devices": {"results": []}}}
    assert updated["metadata"]["resourceVersion"] != created["metadata"]["resourceVersion"]
    with pytest.raises(ApiError) as stale:
        api.replace(resource_claims_path("ns", "c1", status=True), {**created, "status": {}})
    assert (stale.value.status, stale.value.reason) == (409, "Conflict")
    assert stale.value.message == (f'Operation cannot be fulfilled on resourceclaims.{GROUP} "c1": '
                                   f"{OPTIMISTIC_LOCK}")
    assert server.requests[-1].method == "PUT"


def test_patch_types_and_their_query(api, server):
    api.create(resource_claims_path("ns"), claim("c1"))
    merged = api.patch(resource_claims_path("ns", "c1"), {"metadata": {"labels": {"a": "b"}}})
    assert merged["metadata"]["labels"] == {"a": "b"}
    api.patch(resource_claims_path("ns", "c1"), [{"op": "add", "path": "/x", "value": 1}], patch_type="json")
    api.patch(resource_claims_path("ns", "c1"), {"spec": {}}, patch_type="strategic")
    api.patch(resource_claims_path("ns", "c1", status=True), {"status": {}}, patch_type="apply",
              field_manager="rdma.example.com", force=True)
    sent = [(r.headers["Content-Type"], r.query) for r in server.requests[1:]]
    assert sent == [("application/merge-patch+json", {}), ("application/json-patch+json", {}),
                    ("application/strategic-merge-patch+json", {}),
                    ("application/apply-patch+yaml", {"fieldManager": "rdma.example.com", "force": "true"})]
    assert server.requests[2].body == [{"op": "add", "path": "/x", "value": 1}]
    with pytest.raises(ValueError, match="field_manager"):
        api.patch(resource_claims_path("ns", "c1"), {}, patch_type="apply")
    with pytest.raises(ValueError, match="force"):
        api.patch(resource_claims_path("ns", "c1"), {}, force=True)
    with pytest.raises(ValueError, match="unknown patch type"):
        api.patch(resource_claims_path("ns", "c1"), {}, patch_type="yaml")  # type: ignore[arg-type]


def test_delete_404_is_success_and_the_uid_precondition(api, server):
    assert api.delete(resource_slices_path("never-there")) is None
    api.create(resource_slices_path(), slice_("s1"))
    with pytest.raises(ApiError) as other:
        api.delete(resource_slices_path("s1"), preconditions_uid="uid-of-an-older-s1")
    assert (other.value.status, other.value.reason) == (409, "Conflict")
    assert "Precondition failed: UID in precondition: uid-of-an-older-s1" in other.value.message
    assert server.requests[-1].body == {"apiVersion": "v1", "kind": "DeleteOptions",
                                        "preconditions": {"uid": "uid-of-an-older-s1"}}
    api.delete(resource_slices_path("s1"), preconditions_uid="uid-s1")
    assert ("resourceslices", "", "s1") not in server.objects
    assert server.requests[0].body is None  # no DeleteOptions without a precondition


def test_client_certificate_authentication(server, certs):
    credentials = Credentials(server.url, ca_file=str(certs / "ca.crt"),
                              cert_file=str(certs / "client.crt"), key_file=str(certs / "client.key"))
    with KubeApi(credentials) as api:
        api.create(resource_slices_path(), slice_("s1"))
    assert server.requests[0].client_cn == "system:node:node-1"
    assert "Authorization" not in server.requests[0].headers
    with pytest.raises(CredentialsError, match="cannot load the TLS files"):
        Credentials(server.url, cert_file=str(certs / "client.crt"), key_file=str(certs / "server.key")).ssl_context()
    with pytest.raises(CredentialsError, match="both"):
        Credentials(server.url, cert_file=str(certs / "client.crt"))


def test_credentials_are_checked(certs, tmp_path):
    with pytest.raises(CredentialsError, match="https"):
        Credentials("http://127.0.0.1:8080", token_file="/x")
    with pytest.raises(CredentialsError, match="no client identity"):
        Credentials("https://127.0.0.1:6443")


def test_a_server_certificate_we_do_not_trust_is_unavailable(server, token_file):
    with KubeApi(Credentials(server.url, token_file=str(token_file)), timeout=3) as api:  # system roots
        with pytest.raises(ApiUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            api.get(resource_slices_path())


# -- paging -----------------------------------------------------------------------------------

def test_list_follows_every_page_into_one_list(api, server):
    for i in range(5):
        api.create(resource_slices_path(), slice_(f"s{i}"))
    api.create(resource_slices_path(), slice_("other", node="node-2"))
    server.requests.clear()
    result = api.list(resource_slices_path(), label_selector="node=node-1", limit=2)
    assert [item["metadata"]["name"] for item in result["items"]] == ["s0", "s1", "s2", "s3", "s4"]
    assert result["kind"] == "ResourceSliceList"
    assert result["metadata"] == {"resourceVersion": str(server.rv)}  # no continue, no remainingItemCount
    queries = [r.query for r in server.requests]
    assert len(queries) == 3 and all(q["labelSelector"] == "node=node-1" and q["limit"] == "2" for q in queries)
    assert "continue" not in queries[0] and queries[1]["continue"] and queries[2]["continue"]


def test_query_strings_are_url_encoded(api, server):
    api.list(resource_claims_path(), field_selector="spec.nodeName=n 1,metadata.name!=a&b", limit=10)
    request = server.requests[-1]
    assert request.query == {"fieldSelector": "spec.nodeName=n 1,metadata.name!=a&b", "limit": "10"}
    assert "&b" not in request.raw_query


def test_an_expired_continue_token_is_410_expired(api, server):
    for i in range(3):
        api.create(resource_slices_path(), slice_(f"s{i}"))
    first = api._request("GET", resource_slices_path(), {"limit": "1"})
    server.compacted_rv = server.rv + 1
    with pytest.raises(ApiError) as expired:
        api.list(resource_slices_path(), continue_=first["metadata"]["continue"])
    assert (expired.value.status, expired.value.reason, expired.value.message) == (410, "Expired", CONTINUE_EXPIRED)


# -- errors -----------------------------------------------------------------------------------

def test_not_found_and_already_exists(api):
    with pytest.raises(ApiError) as missing:
        api.get(resource_claims_path("ns", "ghost"))
    assert (missing.value.status, missing.value.reason) == (404, "NotFound")
    assert missing.value.message == f'resourceclaims.{GROUP} "ghost" not found'
    assert str(missing.value) == f'404 NotFound: resourceclaims.{GROUP} "ghost" not found'
    api.create(resource_claims_path("ns"), claim("c1"))
    with pytest.raises(ApiError) as exists:
        api.create(resource_claims_path("ns"), claim("c1"))
    assert (exists.value.status, exists.value.reason) == (409, "AlreadyExists")
    assert pickle.loads(pickle.dumps(exists.value)).reason == "AlreadyExists"


def test_a_body_that_is_not_a_status_gets_client_gos_reason_and_is_cut(api, server):
    server.raw_error = (503, "upstream connect error " + "x" * 2000, {"Retry-After": "2"})
    with pytest.raises(ApiError) as unavailable:
        api.get(resource_slices_path())
    error = unavailable.value
    assert (error.status, error.reason, error.retry_after) == (503, "ServiceUnavailable", 2.0)
    assert error.message.startswith("upstream connect error") and len(error.message) == 500
    server.raw_error = (409, "", {})
    with pytest.raises(ApiError) as empty:
        api.create(resource_slices_path(), slice_("s"))
    assert empty.value.reason == "AlreadyExists"  # client-go: a bare 409 on POST
    assert "did not return more information" in empty.value.message


def test_the_token_never_appears_in_error_text(api, server, token_file):
    server.tokens.clear()
    with pytest.raises(ApiError) as refused:
        api.get(resource_slices_path())
    assert (refused.value.status, refused.value.reason) == (401, "Unauthorized")
    server.tokens.add(TOKEN)
    server.echo_authorization = True  # a (broken) proxy that quotes the request's header back
    with pytest.raises(ApiError) as echoed:
        api.get(resource_slices_path())
    assert echoed.value.reason == "Forbidden" and "<redacted>" in echoed.value.message
    token_file.write_text("bad\ntoken-" + TOKEN)  # http.client would quote the header in its ValueError
    with pytest.raises(CredentialsError) as bad:
        api.get(resource_slices_path())
    for error in (refused.value, echoed.value, bad.value):
        assert TOKEN not in str(error) and TOKEN not in repr(error) and TOKEN not in str(error.args)
    assert TOKEN not in repr(api) and TOKEN not in repr(api.credentials)


def test_a_refused_connection_is_unavailable(certs, token_file):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with KubeApi(Credentials(f"https://127.0.0.1:{port}", ca_file=str(certs / "ca.crt"),
                             token_file=str(token_file))) as api:
        with pytest.raises(ApiUnavailable) as refused:
            api.get(resource_slices_path())
    assert refused.value.status == 0 and "ConnectionRefusedError" in refused.value.message
    assert isinstance(refused.value, ApiError)
    assert pickle.loads(pickle.dumps(refused.value)).message == refused.value.message


def test_a_server_that_never_answers_times_out(certs, token_file):
    with socket.socket() as silent:  # listens (the kernel completes the TCP handshake), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        credentials = Credentials(f"https://127.0.0.1:{silent.getsockname()[1]}",
                                  ca_file=str(certs / "ca.crt"), token_file=str(token_file))
        started = time.monotonic()
        with KubeApi(credentials, timeout=0.3) as api, pytest.raises(ApiUnavailable, match="timed out"):
            api.get(resource_slices_path())
        assert time.monotonic() - started < 2


def test_a_dropped_keepalive_connection_is_retried_once(api, server):
    api.create(resource_slices_path(), slice_("s1"))
    server.drop_reused = 1  # the server closed the idle connection: the next request gets no answer
    assert api.get(resource_slices_path("s1"))["metadata"]["name"] == "s1"
    assert [r.method for r in server.requests] == ["POST", "GET", "GET"]
    assert len({r.client_port for r in server.requests}) == 2  # the retry on a new connection


def test_a_fresh_connection_that_drops_is_not_retried_again(api, server):
    api.create(resource_slices_path(), slice_("s1"))
    server.drop_all = True  # every request dropped, on fresh connections too
    with pytest.raises(ApiUnavailable, match="RemoteDisconnected"):
        api.get(resource_slices_path("s1"))
    assert [r.method for r in server.requests] == ["POST", "GET", "GET"]  # one retry, then give up


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_answer_over_the_limit_is_refused(api, server, monkeypatch, chunked):
    api.create(resource_slices_path(), {**slice_("big"), "spec": {"devices": ["x" * 3000]}})
    monkeypatch.setattr(kube_api, "MAX_RESPONSE_BYTES", 2048)
    server.chunked = chunked
    with pytest.raises(ApiError) as large:
        api.get(resource_slices_path("big"))
    assert large.value.reason == "ResponseTooLarge"
    api.create(resource_slices_path(), slice_("small"))  # the connection was dropped, not poisoned
    assert api.get(resource_slices_path("small"))["metadata"]["name"] == "small"


# -- watch ------------------------------------------------------------------------------------

def _event(kind: str, name: str, rv: int) -> dict:
    return {"type": kind, "object": {"kind": "ResourceClaim", "apiVersion": f"{GROUP}/v1",
                                     "metadata": {"name": name, "namespace": "ns", "resourceVersion": str(rv)}}}


BOOKMARK = {"type": "BOOKMARK", "object": {"kind": "ResourceClaim", "apiVersion": f"{GROUP}/v1",
                                           "metadata": {"resourceVersion": "120", "creationTimestamp": None},
                                           "spec": {"devices": {}}}}
TOO_OLD = {"type": "ERROR", "object": status(410, "Expired", "too old resource version: 5 (101)")}


def test_watch_yields_events_and_bookmarks_until_the_server_ends_it(api, server):
    split = (json.dumps(_event("MODIFIED", "c1", 111)) + "\n").encode()
    server.watch_script = [_event("ADDED", "c1", 110), split[:17], split[17:], BOOKMARK,
                           _event("DELETED", "c1", 121)]
    events = list(api.watch(resource_claims_path(), "100", field_selector="spec.nodeName=node-1",
                            timeout_seconds=30))
    assert events == [_event("ADDED", "c1", 110), _event("MODIFIED", "c1", 111), BOOKMARK,
                      _event("DELETED", "c1", 121)]
    request = server.requests[-1]
    assert request.query == {"watch": "1", "resourceVersion": "100", "allowWatchBookmarks": "true",
                             "timeoutSeconds": "30", "fieldSelector": "spec.nodeName=node-1"}
    assert request.headers["Authorization"] == f"Bearer {TOKEN}"


def test_a_too_old_resource_version_raises_410_after_the_events_before_it(api, server):
    server.watch_script = [_event("ADDED", "c1", 110), TOO_OLD]
    seen = []
    with pytest.raises(ApiError) as gone:
        for event in api.watch(resource_claims_path("ns"), "5", allow_bookmarks=False):
            seen.append(event["type"])
    assert seen == ["ADDED"]
    assert (gone.value.status, gone.value.reason) == (410, "Expired")
    assert gone.value.message == "too old resource version: 5 (101)"
    assert "allowWatchBookmarks" not in server.requests[-1].query


def test_a_watch_refused_up_front_is_an_api_error(api, server):
    server.tokens.clear()
    with pytest.raises(ApiError) as refused:
        next(api.watch(resource_claims_path(), "1"))
    assert refused.value.status == 401


@pytest.mark.parametrize("cut", ["truncate", "close"], ids=["mid-event", "between-events"])
def test_a_dropped_stream_is_unavailable_not_a_normal_end(api, server, cut):
    server.watch_script = [_event("ADDED", "c1", 110), cut]
    stream = api.watch(resource_claims_path(), "100")
    assert next(stream)["type"] == "ADDED"
    with pytest.raises(ApiUnavailable):
        next(stream)


def test_a_watch_has_its_own_connection_and_close_ends_it_from_another_thread(api, server):
    api.create(resource_claims_path("ns"), claim("c1"))
    server.watch_script = [_event("ADDED", "c1", 110), b'{"type":"MODIFIED",', "hold"]
    stream = api.watch(resource_claims_path(), "100")
    assert next(stream)["type"] == "ADDED"
    assert api.get(resource_claims_path("ns", "c1"))["metadata"]["name"] == "c1"  # while the watch is open
    ports = [r.client_port for r in server.requests]
    assert ports[0] == ports[2] != ports[1]  # requests share one connection, the watch has its own
    threading.Timer(0.1, api.close).start()
    started = time.monotonic()
    assert list(stream) == []  # ends quietly
    assert time.monotonic() - started < 3
    with pytest.raises(ApiUnavailable, match="closed"):
        api.get(resource_claims_path("ns", "c1"))


# -- in-cluster and kubeconfig ----------------------------------------------------------------

def test_in_cluster(tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    (tmp_path / "ca.crt").write_text("x")
    env = {"KUBERNETES_SERVICE_HOST": "fd00:10:96::1", "KUBERNETES_SERVICE_PORT": "443"}
    credentials = Credentials.in_cluster(env, str(tmp_path))
    assert credentials == Credentials("https://[fd00:10:96::1]:443", ca_file=str(tmp_path / "ca.crt"),
                                      token_file=str(tmp_path / "token"))
    assert credentials.bearer_token() == TOKEN
    env4 = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    assert Credentials.in_cluster(env4, str(tmp_path)).server == "https://10.96.0.1:443"
    with pytest.raises(CredentialsError, match="KUBERNETES_SERVICE_HOST"):
        Credentials.in_cluster({}, str(tmp_path))
    with pytest.raises(CredentialsError, match="token is missing"):
        Credentials.in_cluster(env, str(tmp_path / "nowhere"))


def _kubeconfig(path: Path, cluster: dict, user: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "dev",
        "clusters": [{"name": "other", "cluster": {"server": "https://192.0.2.1"}},
                     {"name": "test", "cluster": cluster}],
        "users": [{"name": "me", "user": user}],
        "contexts": [{"name": "dev", "context": {"cluster": "test", "user": "me"}}],
    }))
    return path


def _private(path: str) -> Path:
    """The private folder holding `path`, checked: a 0700 folder of 0600 files."""
    folder = Path(path).parent
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for file in folder.iterdir():
        assert stat.S_IMODE(file.stat().st_mode) == 0o600
    return folder


def test_kubeconfig_with_file_paths_and_a_token_file(server, certs, tmp_path, token_file):
    os.symlink(certs / "ca.crt", tmp_path / "ca.crt")
    config = _kubeconfig(tmp_path / "config", {"server": server.url, "certificate-authority": "ca.crt"},
                         {"tokenFile": "token"})  # relative: against the kubeconfig's folder
    credentials = Credentials.from_kubeconfig(config)
    here = tmp_path.resolve()
    assert credentials == Credentials(server.url, ca_file=str(here / "ca.crt"), token_file=str(here / "token"))
    with KubeApi(credentials) as api:
        api.list(resource_slices_path())
    assert server.requests[-1].headers["Authorization"] == f"Bearer {TOKEN}"


def test_kubeconfig_with_data_variants_and_client_cert(server, certs, tmp_path):
    b64 = lambda name: base64.b64encode((certs / name).read_bytes()).decode()  # noqa: E731
    config = _kubeconfig(tmp_path / "config", {"server": server.url, "certificate-authority-data": b64("ca.crt")},
                         {"client-certificate-data": b64("client.crt"), "client-key-data": b64("client.key")})
    credentials = Credentials.from_kubeconfig(str(config))
    folder = _private(credentials.cert_file)
    assert {p.name for p in folder.iterdir()} == {"ca.crt", "client.crt", "client.key"}
    assert Path(credentials.key_file).read_bytes() == (certs / "client.key").read_bytes()
    assert Path(credentials.ca_file).parent == folder and credentials.token_file is None
    with KubeApi(credentials) as api:
        api.create(resource_slices_path(), slice_("s1"))
    assert server.requests[-1].client_cn == "system:node:node-1"
    del api, credentials
    gc.collect()
    assert not folder.exists()  # removed with the Credentials


def test_kubeconfig_inline_token_goes_to_a_private_file(server, certs, tmp_path):
    config = _kubeconfig(tmp_path / "config", {"server": server.url, "certificate-authority": str(certs / "ca.crt")},
                         {"token": TOKEN, "tokenFile": "/ignored"})
    credentials = Credentials.from_kubeconfig(config)
    assert Path(credentials.token_file).read_text() == TOKEN
    _private(credentials.token_file)
    assert TOKEN not in repr(credentials)
    with KubeApi(credentials) as api:
        api.list(resource_slices_path())
    assert server.requests[-1].headers["Authorization"] == f"Bearer {TOKEN}"


@pytest.mark.parametrize("cluster, user, message", [
    ({"server": "https://h", "insecure-skip-tls-verify": True}, {"token": "t"}, "insecure-skip-tls-verify"),
    ({"server": "https://h"}, {"exec": {"command": "aws"}}, "user exec is not supported"),
    ({"server": "http://h:8080"}, {"token": "t"}, "https"),
    ({"server": "https://h", "certificate-authority-data": "not base64!"}, {"token": "t"}, "not base64"),
])
def test_kubeconfig_refusals(tmp_path, cluster, user, message):
    before = set(Path(tempfile.gettempdir()).glob("rdma-netns-kube-*"))
    with pytest.raises(CredentialsError, match=message):
        Credentials.from_kubeconfig(_kubeconfig(tmp_path / "config", cluster, user))
    assert set(Path(tempfile.gettempdir()).glob("rdma-netns-kube-*")) == before  # nothing written is left behind


def test_kubeconfig_context_lookup(tmp_path):
    config = _kubeconfig(tmp_path / "config", {"server": "https://h"}, {"tokenFile": "/t"})
    with pytest.raises(CredentialsError, match="no context named 'prod'"):
        Credentials.from_kubeconfig(config, context="prod")
    (tmp_path / "empty").write_text("apiVersion: v1\nkind: Config\n")
    with pytest.raises(CredentialsError, match="no current-context"):
        Credentials.from_kubeconfig(tmp_path / "empty")
