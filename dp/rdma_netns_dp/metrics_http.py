"""The /metrics HTTP server: cheap to scrape, and a flood of connections harms nothing else.

prometheus_client's own server gives every connection a thread with no timeout and renders the
registry for every request. Here: at most MAX_CONNECTIONS connections are served at once (more
are closed at once, and counted); a connection that says nothing for CONNECTION_TIMEOUT seconds is
closed; the exposition is rendered at most once per RENDER_INTERVAL and the same bytes served to
every scrape in between. The registry's collectors read memory only (metrics.py): nothing a
scrape does reaches kubelet or the disk.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, HTTPServer
from socketserver import TCPServer, ThreadingMixIn

MAX_CONNECTIONS = 16
CONNECTION_TIMEOUT = 5.0
RENDER_INTERVAL = 1.0  # Prometheus scrapes every 15-60 s; a second old is fresh


class Exposition:
    """The registry's text, rendered at most once per `interval` seconds."""

    def __init__(self, render: Callable[[], bytes], interval: float = RENDER_INTERVAL) -> None:
        self._render = render
        self._interval = interval
        self._lock = threading.Lock()
        self._body = b""
        self._at = float("-inf")
        self.renders = 0

    def body(self) -> bytes:
        with self._lock:
            now = time.monotonic()
            if now - self._at >= self._interval:
                self._body, self._at = self._render(), now
                self.renders += 1
            return self._body


class _Handler(BaseHTTPRequestHandler):
    server: MetricsServer
    timeout = CONNECTION_TIMEOUT  # socketserver sets it on the connection: reads and writes time out
    protocol_version = "HTTP/1.0"  # one request per connection

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.split("?", 1)[0] not in ("/", "/metrics"):
            self.send_error(404)
            return
        body = self.server.exposition.body()
        self.send_response(200)
        self.send_header("Content-Type", self.server.content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass  # a scrape is not news; a flood would fill the log


class MetricsServer(ThreadingMixIn, HTTPServer):
    """Serves one Exposition; start() runs it in a thread."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(self, address: str, port: int, exposition: Exposition, content_type: str,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.address_family = _family(address, port)
        self.exposition = exposition
        self.content_type = content_type
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0  # connections closed unserved because MAX_CONNECTIONS were open
        super().__init__((address, port), _Handler)
        self._thread: threading.Thread | None = None

    def server_bind(self) -> None:
        """HTTPServer's, without its reverse DNS lookup of the address (socket.getfqdn)."""
        TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), self.server_address[1]

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def start(self) -> MetricsServer:
        self._thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.5},
                                        name="metrics-http", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


def _family(address: str, port: int) -> int:
    """AF_INET6 for an IPv6 address ("::", "fd00::1"), AF_INET otherwise."""
    infos = socket.getaddrinfo(address or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    return infos[0][0] if infos else socket.AF_INET
