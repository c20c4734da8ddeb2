"""The server as a whole: `Server(settings, loaders)` builds the loaders, binds the ports (port 0
for a free one), serves, drains and stops; `serve` runs one until SIGTERM (the CLI's `serve`).

    from remote_loader.server import Server, ServerSettings

    with Server(ServerSettings(address="127.0.0.1:0"), [spec]) as server:
        ...  # RemoteLoader(server.address, spec.name)

See NOTE [ Pool Shutdown ] in server/engine/pool.py for what stopping does to the workers.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.context
import signal
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent import futures
from types import TracebackType
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from remote_loader.protos import wire
from remote_loader.server.api.auth import TokenInterceptor
from remote_loader.server.api.listen import check_address_free
from remote_loader.server.api.methods import method_handlers
from remote_loader.server.api.page import status_pages
from remote_loader.server.api.report import Reports
from remote_loader.server.api.service import LoaderService
from remote_loader.server.api.settings import ServerSettings
from remote_loader.server.api.snapshot import Snapshots
from remote_loader.server.config.spec import ConfigError, LoaderSpec
from remote_loader.server.engine.forkserver import (
    imported_since,
    refuse_while_bootstrapping,
    start_fork_server,
)
from remote_loader.server.engine.kept import KeptPools
from remote_loader.server.engine.options import PoolOptions
from remote_loader.server.sharing.host import LoaderHost
from remote_loader.server.telemetry.exposition import MetricsServer
from remote_loader.server.transports import DataListener

log = logging.getLogger(__name__)

# Handler threads beyond max_streams, for unary calls (health, Describe) and for refusing the
# stream one over the limit: a full server still answers them at once.
UNARY_THREADS = 8
# Calls that may wait for a thread beyond those: past it gRPC answers RESOURCE_EXHAUSTED on its
# own (a flood, not the stream limit, which LoaderService.Stream enforces).
CALL_BACKLOG = 256


class Server:
    """Serves `loaders` (LoaderSpecs, or a mapping of name to spec) as `settings` say
    (ServerSettings(); every setting has a default).

    Made, it has built every loader (datasets, option checks, the fork server, persistent
    workers: all before any gRPC thread, see server/engine/forkserver.py) and bound its ports, so
    `port` is known; `start()` serves, `stop()` drains and stops. As a context manager it
    starts on entry and stops on exit.
    Health (`grpc.health.v1`, service "" and "remote_loader.v1.Loader") is SERVING once started
    and NOT_SERVING while draining.
    """

    def __init__(
        self,
        settings: ServerSettings | None,
        loaders: Iterable[LoaderSpec] | Mapping[str, LoaderSpec],
    ) -> None:
        refuse_while_bootstrapping()
        self.settings = settings if settings is not None else ServerSettings()
        specs = _by_name(loaders)
        # Before the loaders are built (datasets, persistent workers): a port in use is the
        # cheapest error to find. create_server checks again, right before gRPC binds.
        check_address_free(self.settings.address)
        self.hosts = build_hosts(
            specs,
            pool_options=self.settings.pool_options(),
            metrics_max_consumers=self.settings.metrics_max_consumers,
        )
        try:
            self._server = create_server(self.hosts, self.settings)
        except BaseException:
            for host in self.hosts.values():
                host.close()
            raise
        self._stopped = False

    @property
    def port(self) -> int:
        """The gRPC port (the one picked, for port 0)."""
        return self._server.port

    @property
    def address(self) -> str:
        """HOST:PORT of the gRPC port, the host as `settings.address` names it."""
        host, _, _ = self.settings.address.rpartition(":")
        return f"{host}:{self.port}"

    @property
    def metrics_port(self) -> int | None:
        """The Prometheus endpoint's port; None without `metrics_address`."""
        return self._server.metrics_port

    @property
    def data_port(self) -> int | None:
        """The data listener's port (NOTE [ TCP data connection ]); None when off."""
        return self._server.data_port

    @property
    def service(self) -> LoaderService:
        """The Loader service (its stream count, for tests and introspection)."""
        return self._server.service

    def start(self) -> None:
        self._server.start()

    def stop(self, grace: float | None = None) -> None:
        """Drains, then stops (idempotent): health turns NOT_SERVING and new streams are
        refused with UNAVAILABLE at once; running streams get `grace` seconds (default
        `settings.grace`) to finish, then are cancelled; then the loaders' workers stop."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self._server.stop(self.settings.grace if grace is None else grace)
        finally:
            for host in self.hosts.values():
                host.close()

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<Server {', '.join(sorted(self.hosts))} on port {self.port}>"


def _by_name(loaders: Iterable[LoaderSpec] | Mapping[str, LoaderSpec]) -> dict[str, LoaderSpec]:
    if isinstance(loaders, Mapping):
        specs = dict(loaders)
    else:
        specs = {}
        for spec in loaders:
            if spec.name in specs:
                raise ConfigError(f"two loaders are named {spec.name!r}: names must be unique")
            specs[spec.name] = spec
    if not specs:
        raise ConfigError("a server needs at least one loader")
    return specs


def serve(
    settings: ServerSettings,
    loaders: Iterable[LoaderSpec] | Mapping[str, LoaderSpec],
    *,
    ready: threading.Event | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Runs a server until SIGTERM / SIGINT (or `stop`); returns the process exit code."""
    stop = stop or threading.Event()
    with Server(settings, loaders) as server:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set())
        names = ", ".join(sorted(server.hosts))
        log.info(
            "serving %s on port %d (%s, %s)",
            names,
            server.port,
            _tls_mode(settings),
            "token required" if settings.token or settings.token_file else "no token",
        )
        print(f"remote-loader: serving {names} on port {server.port}", flush=True)
        if server.metrics_port is not None:
            log.info("metrics (Prometheus) on port %d", server.metrics_port)
        if server.data_port is not None:
            log.info("data connections (NOTE [ TCP data connection ]) on port %d", server.data_port)
        if ready is not None:
            ready.set()
        stop.wait()
        log.info("stopping: health NOT_SERVING, %.1f s for running streams", settings.grace)
    return 0


def build_hosts(
    specs: Mapping[str, LoaderSpec],
    ctx: multiprocessing.context.BaseContext | None = None,
    *,
    pool_options: PoolOptions | None = None,
    metrics_max_consumers: int = ServerSettings.metrics_max_consumers,
) -> dict[str, LoaderHost]:
    """Builds and starts every loader (datasets, option checks, persistent workers), their pools
    made with `pool_options` (the server's settings, made once: ServerSettings.pool_options);
    without `ctx`, starts the fork server in between, once the datasets are built, preloading what
    they imported (NOTE [ Fork server preload ] in server/engine/forkserver.py)."""
    before = set(sys.modules)
    start = ctx is None
    ctx = ctx or multiprocessing.get_context("forkserver")
    hosts: dict[str, LoaderHost] = {}
    kept = KeptPools()  # idle pools, shared: one loader's make room for another's
    try:
        for name, spec in specs.items():
            hosts[name] = LoaderHost(
                spec,
                ctx,
                pool_options=pool_options,
                metrics_max_consumers=metrics_max_consumers,
                kept=kept,
            )
        if start:
            start_fork_server(ctx, imported_since(before, [h.dataset for h in hosts.values()]))
        for host in hosts.values():
            host.start()
    except BaseException:
        for host in hosts.values():
            host.close()
        raise
    return hosts


@dataclasses.dataclass
class LoaderServer:
    """A bound gRPC server for a set of hosted loaders (what `Server` runs).

    The data listener (`data_port`), when on, accepts from creation (a connection needs a
    ticket from a running stream) and closes with `stop()`.
    """

    grpc_server: grpc.Server
    port: int
    service: LoaderService
    health: health.HealthServicer
    # The Prometheus endpoint (metrics_address), bound; None when off.
    metrics: MetricsServer | None = None

    @property
    def metrics_port(self) -> int | None:
        return self.metrics.port if self.metrics is not None else None

    @property
    def data_port(self) -> int | None:
        """The port of the data listener (NOTE [ TCP data connection ]); None when off."""
        return self.service.listener.port if self.service.listener is not None else None

    def start(self) -> None:
        self.grpc_server.start()
        if self.metrics is not None:
            self.metrics.start()
        for name in ("", wire.SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace: float) -> None:
        """Drains, then stops: see Server.stop."""
        self.health.enter_graceful_shutdown()
        self.service.draining = True
        deadline = time.monotonic() + grace
        if not self.service.wait_streams(grace):
            log.warning("streams still running after %.1f s: cancelling them", grace)
        # A stream whose handler has returned still has its status to send: give calls the
        # rest of the grace (up to a second when none is left) rather than cancel them at once.
        self.grpc_server.stop(max(deadline - time.monotonic(), min(grace, 1.0))).wait()
        if self.service.listener is not None:
            self.service.listener.close()
        if self.metrics is not None:
            self.metrics.close()


def create_server(hosts: Mapping[str, LoaderHost], settings: ServerSettings) -> LoaderServer:
    """A gRPC server for `hosts`, bound as `settings` say but not started.

    With a token, every call but health checks must carry `authorization: Bearer <token>`
    (server/api/auth.py); with TLS, the port speaks TLS only (mTLS when it has a client CA).
    """
    tls = settings.server_tls()
    token = settings.auth_token()
    address = settings.address
    listen_data = resolve_data_address(settings.data_address, address)
    service = LoaderService(
        hosts,
        settings.chunk_size,
        settings.max_ring_bytes,
        zero_copy=settings.zero_copy,
        max_streams=settings.max_streams,
        idle_stream_timeout=settings.idle_stream_timeout,
        client_silence=(settings.keepalive_time_ms + settings.keepalive_timeout_ms) / 1000,
    )
    snapshots = Snapshots(hosts)
    reports = Reports(service.host, snapshots.tick)
    handlers = method_handlers(service, reports, snapshots)
    options: list[tuple[str, Any]] = [
        # Refuse to share a port with another server (a second server must fail, not split traffic).
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", settings.max_request_bytes),
        ("grpc.max_send_message_length", settings.chunk_size + wire.FRAME_OVERHEAD),
        # Pings of its own find clients that vanished; the clients' pings (every
        # wire.KEEPALIVE_TIME_MS) are accepted, never counted as strikes.
        ("grpc.keepalive_time_ms", settings.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", settings.keepalive_timeout_ms),
        # NOTE [ Ping timeout ] in protos/wire.py
        ("grpc.http2.ping_timeout_ms", settings.keepalive_timeout_ms),
        ("grpc.http2.min_ping_interval_without_data_ms", settings.min_ping_interval_ms),
        ("grpc.http2.max_ping_strikes", 0),
    ]
    max_streams = settings.max_streams
    server = grpc.server(
        # A thread per stream (LoaderService.Stream counts them against max_streams), plus
        # threads for unary calls and health checks beside them.
        futures.ThreadPoolExecutor(
            max_workers=max_streams + UNARY_THREADS, thread_name_prefix="rl-rpc"
        ),
        handlers=[grpc.method_handlers_generic_handler(wire.SERVICE_NAME, handlers)],
        interceptors=[TokenInterceptor(token)] if token is not None else None,
        maximum_concurrent_rpcs=max_streams + UNARY_THREADS + CALL_BACKLOG,
        options=options,
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if settings.reflection:
        from grpc_reflection.v1alpha import reflection as grpc_reflection

        grpc_reflection.enable_server_reflection(
            (wire.SERVICE_NAME, health.SERVICE_NAME, grpc_reflection.SERVICE_NAME), server
        )
    check_address_free(address)
    try:
        if tls is not None:
            port = server.add_secure_port(address, tls.credentials())
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as exc:
        # grpc says only "Failed to bind": with TLS, a bad certificate or key fails the same way.
        also = " Or are the TLS certificate and key not a matching PEM pair?" if tls else ""
        raise OSError(
            f"cannot listen on {address}: {exc} (is another server using it?{also})"
        ) from exc
    if port == 0:
        raise OSError(f"cannot listen on {address} (is another server using it?)")
    # Prometheus metrics on a port of their own (server/telemetry/metrics.py), bound now,
    # served once started and closed with the gRPC server.
    metrics = None
    if settings.metrics_address:
        metrics = MetricsServer(
            settings.metrics_address,
            [host.metrics for host in hosts.values()],
            pages=status_pages(snapshots.status),
        )
    if listen_data is not None:
        try:
            # With TLS, the data connections speak it too (NOTE [ TLS data connection ]).
            data_tls = None if tls is None else tls.data_context
            if tls is not None and data_tls is None:
                raise ValueError("TLS material without its data connections' ssl context")
            service.listener = DataListener(listen_data, data_tls)
        except OSError:
            if metrics is not None:
                metrics.close()
            raise
    return LoaderServer(server, port, service, health_servicer, metrics)


def resolve_data_address(data_address: str, address: str) -> str | None:
    """HOST:PORT for the data listener, or None for none: "auto" is `address`'s host on a free
    port, "off" (or "") none. On a TLS server the data connections speak TLS too."""
    if data_address in ("", "off"):
        return None
    if data_address == "auto":
        host, _, _ = address.rpartition(":")
        return f"{host}:0"
    return data_address


def _tls_mode(settings: ServerSettings) -> str:
    if settings.tls_cert is None:
        return "plaintext"
    return "mutual TLS" if settings.tls_client_ca is not None else "TLS"
