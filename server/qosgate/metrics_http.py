"""The gateway's plaintext HTTP port (`metrics_listen`): Prometheus metrics, and the health
endpoints probes read where the gRPC listener speaks TLS (a kubelet's gRPC probe cannot).

- `/metrics`: the registry, in Prometheus' text format.
- `/healthz`: 200 while the process serves (liveness: a Triton outage does not fail it,
  so it never restarts a gateway that is only waiting for Triton).
- `/readyz`: 200 while the gateway takes calls (at least one upstream live, not shutting
  down), else 503: the same fact as gRPC health's SERVING.

Served from its own thread, as prometheus_client serves metrics: a scrape or a probe never
waits for the event loop, and reads only what the loop publishes.
"""

from __future__ import annotations

import socket
import socketserver
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        """Probes and scrapes every few seconds: not worth a log line each."""


class MetricsServer:
    """The running HTTP server on `metrics_listen` (port 0: any free port, see `.port`)."""

    def __init__(self, listen: str, registry: CollectorRegistry, ready: Callable[[], bool]) -> None:
        host, _, port = listen.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        metrics = make_wsgi_app(registry)

        def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
            path = environ.get("PATH_INFO", "")
            if path == "/healthz":
                return _text(start_response, "200 OK", "ok")
            if path == "/readyz":
                if ready():
                    return _text(start_response, "200 OK", "ready")
                return _text(start_response, "503 Service Unavailable", "not ready: no live upstream, or stopping")
            return metrics(environ, start_response)

        family = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0][0]
        server_class = type("Server", (_Server,), {"address_family": family})
        self._server: WSGIServer = make_server(host, int(port), app, server_class, handler_class=_QuietHandler)
        self.port: int = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def _text(start_response: StartResponse, status: str, body: str) -> list[bytes]:
    start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
    return [body.encode() + b"\n"]
