"""The metrics port: the loaders' metrics over HTTP in the Prometheus text format
(`MetricsServer`, setting `metrics_address`), and whatever else the server hands it to serve.
"""

from __future__ import annotations

import socket
import threading
import wsgiref.simple_server
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import CollectorRegistry

from remote_loader.server.telemetry.metrics import LoaderMetrics

# How long stopping the metrics server waits for its thread.
STOP_TIMEOUT = 5.0


class _Merged:
    """Several loaders' metrics as one set of families (a family per name, all hosts' samples)."""

    def __init__(self, loaders: Sequence[LoaderMetrics]) -> None:
        self._loaders = list(loaders)

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for loader in self._loaders:
            for family in loader.collect():
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                into.samples.extend(family.samples)
        yield from merged.values()


class _QuietHandler(wsgiref.simple_server.WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape on stderr is noise


# A WSGI application, and what wraps one (MetricsServer's `pages`).
WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class MetricsServer:
    """The loaders' metrics over HTTP (any path), in the Prometheus text format; `pages`, when
    given, wraps that application to serve some paths of its own (the status page).

    Bound when made (port 0: a free one, then in `port`), serving after `start()`, stopped by
    `close()`. Each server has its own: several can run in one process (tests).
    """

    def __init__(
        self,
        address: str,
        loaders: Sequence[LoaderMetrics],
        pages: Callable[[WSGIApp], WSGIApp] | None = None,
    ) -> None:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ValueError(
                f"metrics address must be HOST:PORT (port 0 picks a free one), got {address!r}"
            )
        self.registry = CollectorRegistry()
        self.registry.register(_Merged(loaders))
        app: WSGIApp = make_wsgi_app(self.registry)
        if pages is not None:
            app = pages(app)
        host = host.strip("[]")  # [::1]:9090
        try:
            family = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0][0]
            server_class = type(
                "MetricsHTTPServer", (ThreadingWSGIServer,), {"address_family": family}
            )
            self._httpd: ThreadingWSGIServer = wsgiref.simple_server.make_server(
                host,
                int(port),
                app,
                server_class,
                handler_class=_QuietHandler,
            )
        except OSError as exc:
            raise OSError(
                f"cannot serve metrics on {address}: {exc} (is another server using it?)"
            ) from exc
        self.port: int = self._httpd.server_port
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="rl-metrics", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stops serving and closes the port. Idempotent."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._httpd.shutdown()  # waits for serve_forever to return: only once it ran
            thread.join(STOP_TIMEOUT)
        self._httpd.server_close()
