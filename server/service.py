"""The gRPC stage: the Loader service, `create_server` (binds, port 0 for tests) and `serve`.

See NOTE [ Pool Shutdown ] in server/pool.py for what stopping does to the workers.

Stream handlers forward the bytes workers encoded, cut into Frames (remote_loader.protos.wire),
and stop producing as soon as the client goes away.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import multiprocessing
import multiprocessing.context
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent import futures
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import shm, tcp, wire
from remote_loader.server.auth import ServerTLS, TokenInterceptor
from remote_loader.server.host import LoaderHost
from remote_loader.server.metrics import MetricsServer
from remote_loader.server.settings import DEFAULT_MAX_BATCH_BYTES, DEFAULT_MAX_REQUEST_BYTES
from remote_loader.server.sharing import (
    DEFAULT_JOB,
    ClosingError,
    DetachedError,
    Entry,
    LoaderBrokenError,
    Membership,
    SharingError,
)
from remote_loader.server.spec import LoaderSpec
from remote_loader.server.transport import (
    DEFAULT_CLIENT_SILENCE,
    ClientSilent,
    DataConnectionLost,
    DataListener,
    StreamStopped,
    TcpSender,
    accept_offer,
)

log = logging.getLogger(__name__)

# Streams served at once; one more is refused with RESOURCE_EXHAUSTED instead of queueing.
DEFAULT_MAX_STREAMS = 32
# Requests are a few plain fields: anything bigger is a mistake or an attack.
MAX_REQUEST_BYTES = DEFAULT_MAX_REQUEST_BYTES
# Handler threads beyond max_streams, for unary calls (health, Describe) and for refusing the
# stream one over the limit: a full server still answers them at once.
UNARY_THREADS = 8
# Calls that may wait for a thread beyond those: past it gRPC answers RESOURCE_EXHAUSTED on its
# own (a flood, not the stream limit, which LoaderService.Stream enforces).
CALL_BACKLOG = 256
# How long running streams may finish when the server is asked to stop.
DEFAULT_GRACE = 5.0
# Modules the fork server imports once, so each worker starts as a fork of a warm process.
FORKSERVER_PRELOAD = ["torch", "numpy", "remote_loader.server.worker"]


def worker_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context for workers: a fork server, started now.

    Forking a process that runs gRPC threads is unsafe (grpc/grpc#16001), and workers are
    started while the server runs (non-persistent pools, replacements). The fork server is a
    fresh interpreter started here, before any gRPC server, that forks the workers for us.
    """
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    from multiprocessing import forkserver

    forkserver.ensure_running()
    # The fork server imports the preload list (torch: about a second) before it forks anything;
    # start one process now so that cost is paid at start-up, not by the first stream.
    warmup = ctx.Process(target=_noop, name="remote-loader-warmup")
    warmup.start()
    warmup.join()
    return ctx


def _noop() -> None:
    pass


class LoaderService:
    """The `remote_loader.v1.Loader` service over a set of hosted loaders."""

    def __init__(
        self,
        hosts: Mapping[str, LoaderHost],
        chunk_size: int,
        max_ring_bytes: int = shm.DEFAULT_MAX_RING_BYTES,
        max_streams: int = DEFAULT_MAX_STREAMS,
        client_silence: float = DEFAULT_CLIENT_SILENCE,
    ) -> None:
        if not hosts:
            raise ValueError("a server needs at least one loader")
        if not 0 < chunk_size <= wire.MAX_CHUNK_SIZE:
            raise ValueError(
                f"chunk_size must be between 1 and {wire.MAX_CHUNK_SIZE} bytes, got {chunk_size}"
            )
        self.hosts = dict(hosts)
        self.chunk_size = chunk_size
        # Each stream's shared-memory ring is at most this big (0: never use shared memory).
        self.max_ring_bytes = max_ring_bytes
        # A same-host client whose ring heartbeat stands still this long while the stream waits
        # for it is let go (NOTE [ Ring space ]): keepalive_time_ms + keepalive_timeout_ms.
        self.client_silence = client_silence
        # Accepts streams' data connections (NOTE [ TCP data connection ]); None: off. Set by
        # create_server once the gRPC port is bound, so a port clash fails before it listens.
        self.listener: DataListener | None = None
        # Draining (SIGTERM): new streams are refused with UNAVAILABLE; running ones go on.
        self.draining = False
        # Stream number max_streams + 1 is refused with RESOURCE_EXHAUSTED (health and
        # Describe are not counted: a full server still answers probes).
        self.max_streams = max_streams
        self._streams = 0  # always the Stream calls between their count and their finally
        self._streams_changed = threading.Condition()
        self._stream_ids = itertools.count(1)  # names a stream in its log lines

    def wait_streams(self, timeout: float) -> bool:
        """Waits up to `timeout` s for the running streams to end; True if none is left."""
        with self._streams_changed:
            return self._streams_changed.wait_for(lambda: self._streams == 0, timeout)

    def _refuse_when_draining(self, context: grpc.ServicerContext) -> None:
        if self.draining:
            _abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                "the server is shutting down (draining its running streams)",
            )

    def _host(self, name: str, context: grpc.ServicerContext) -> LoaderHost:
        if not name:
            if len(self.hosts) == 1:
                return next(iter(self.hosts.values()))
            _abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"this server hosts several loaders ({', '.join(sorted(self.hosts))}); name one",
            )
        host = self.hosts.get(name)
        if host is None:
            _abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"no loader named {name!r}; this server hosts: {', '.join(sorted(self.hosts))}",
            )
        return host

    def _membership(
        self, host: LoaderHost, consumer: pb.Consumer, context: grpc.ServicerContext
    ) -> Membership:
        membership = Membership(
            sharing=consumer.sharing or "partition",
            job=consumer.job or DEFAULT_JOB,
            rank=consumer.rank,
            world_size=consumer.world_size if consumer.HasField("world_size") else 1,
        )
        try:
            host.check(membership)
        except SharingError as exc:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return membership

    def ListLoaders(
        self, request: pb.ListLoadersRequest, context: grpc.ServicerContext
    ) -> pb.ListLoadersResponse:
        return pb.ListLoadersResponse(names=sorted(self.hosts))

    def Describe(self, request: pb.DescribeRequest, context: grpc.ServicerContext) -> pb.LoaderInfo:
        self._refuse_when_draining(context)
        host = self._host(request.loader, context)
        spec = host.spec
        info = pb.LoaderInfo(
            name=spec.name,
            dataset_kind=host.dataset_kind,
            options=spec.options_text(),
            seed=spec.seed,
            fingerprint=spec.fingerprint(),
        )
        membership = self._membership(host, request.consumer, context)
        info.sharing.extend(spec.sharing)
        with contextlib.suppress(TypeError):  # unknown for an unsized IterableDataset
            info.epoch_length = len(host)
        try:
            info.length = host.length(membership)
            info.has_length = True
        except TypeError:
            pass  # unsized IterableDataset, or dynamic sharing: the length is unknown
        if spec.batch_size is not None and spec.batch_sampler is None:
            info.batch_size = spec.batch_size
        with contextlib.suppress(TypeError):
            info.dataset_length = len(host.dataset)
        return info

    def Stream(self, request: pb.StreamRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        self._refuse_when_draining(context)
        with self._streams_changed:
            full = self._streams >= self.max_streams
            if not full:
                self._streams += 1
        if full:
            log.warning(
                "stream refused %s",
                logfmt(
                    peer=context.peer(),
                    loader=request.loader,
                    status="RESOURCE_EXHAUSTED",
                    error=f"max_streams={self.max_streams} streams are running",
                ),
            )
            _abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this server already runs its max_streams={self.max_streams} streams; retry "
                "when one ends, or raise the server's max_streams setting (--max-streams, "
                "REMOTE_LOADER_MAX_STREAMS)",
            )
        try:
            yield from self._stream(request, context)
        finally:
            with self._streams_changed:
                self._streams -= 1
                self._streams_changed.notify_all()

    def _stream(self, request: pb.StreamRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        host = self._host(request.loader, context)
        membership = self._membership(host, request.consumer, context)
        if request.fingerprint and request.fingerprint != host.spec.fingerprint():
            _abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"loader {host.spec.name!r} has changed: its spec's fingerprint is now "
                f"{host.spec.fingerprint()}, the consumer's state was saved with "
                f"{request.fingerprint}; resuming would not line the batches up. Start the "
                "epoch afresh, or serve the old spec",
            )
        seed = request.seed if request.HasField("seed") else host.spec.seed
        start = request.start
        problem = check_positions(host, membership, request.epoch, start)
        if problem is not None:  # before anything reads the dataset
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, problem)
        cancelled = threading.Event()
        # The client went away (cancel, break, crash, deadline): stop producing for it.
        context.add_callback(cancelled.set)
        started = time.monotonic()
        batches = start  # the position of the next batch in this consumer's epoch
        nbytes = 0
        completed = False  # the end frame went out: callbacks after it are not a cancellation
        who = logfmt(
            stream=next(self._stream_ids),
            peer=context.peer(),
            loader=host.spec.name,
            epoch=request.epoch,
            seed=seed,
            sharing=membership.sharing,
            job=membership.job,
            rank=f"{membership.rank}/{membership.world_size}",
            start=start,
        )
        # Same host? Read the client's probe now (it is removed either way).
        sender = (
            accept_offer(request.shm, self.max_ring_bytes, self.client_silence)
            if request.HasField("shm")
            else None
        )
        transport = "shm" if sender is not None else "grpc"
        if request.HasField("shm") and sender is None:
            transport += " (shm offered, declined)"
        ticket = None
        if sender is None and request.tcp and self.listener is not None:
            ticket = self.listener.expect()
            transport = "tcp"
        log.info("stream start %s %s", who, logfmt(transport=transport))
        consumer = None
        tcp_sender: TcpSender | None = None
        try:
            if ticket is not None:
                assert self.listener is not None
                yield wire.control_frame(
                    pb.Frame(tcp_channel=pb.TcpChannel(port=self.listener.port, ticket=ticket))
                )
                sock = self.listener.wait(ticket, cancelled.is_set)
                if cancelled.is_set():
                    if sock is not None:
                        sock.close()
                    return  # the client went, or cancelled to go on without a data connection
                if sock is None:
                    log.warning(
                        "no data connection within %g s, sending Frames: %s",
                        tcp.ACCEPT_TIMEOUT,
                        who,
                    )
                else:
                    tcp_sender = TcpSender(sock, self.client_silence)
            consumer = host.attach(membership, seed, request.epoch, start)
            # Detach at once when the client goes, even if this thread is stuck sending; only
            # marking: the callback runs on gRPC's thread (NOTE [ Sharing ]).
            context.add_callback(consumer.let_go)
            shared_frames = membership.sharing == "broadcast"

            def stopped() -> bool:
                assert consumer is not None
                return cancelled.is_set() or consumer.detached is not None

            while (entry := consumer.next(cancelled)) is not None:
                try:
                    if entry.error is not None:
                        e = entry.error
                        yield wire.control_frame(
                            pb.Frame(
                                batch=batches,
                                error=pb.RemoteError(
                                    where=e.where,
                                    type=e.type,
                                    message=e.message,
                                    traceback=e.traceback,
                                ),
                            )
                        )
                    elif sender is not None and (
                        frame := sender.frame(
                            batches,
                            entry.blob() if shared_frames else _blob(entry),
                            entry.delivery.header_nbytes,
                            stopped,
                        )
                    ):
                        yield frame
                        nbytes += entry.nbytes
                    elif tcp_sender is not None:
                        view = entry.blob() if shared_frames else _blob(entry)
                        yield tcp_sender.frame(batches, view, entry.delivery.header_nbytes)
                        tcp_sender.send(view, stopped)
                        nbytes += entry.nbytes
                    elif shared_frames:
                        frames = entry.frames(batches, self.chunk_size)
                        yield from frames
                        nbytes += entry.nbytes
                    else:
                        blob = entry.delivery.blob
                        assert blob is not None
                        yield from wire.batch_frames(
                            batches, blob, entry.delivery.header_nbytes, self.chunk_size
                        )
                        nbytes += len(blob)
                except StreamStopped:
                    if cancelled.is_set():
                        return  # the finally below closes the consumer; nothing more to send
                    continue  # detached: next() says why
                finally:
                    consumer.done(entry)
                consumer.sent(entry)  # metrics: batches, bytes or errors served
                batches += 1
            # Detach before the end frame: the last consumer out gives the workers back first,
            # so this trainer's next epoch finds them free (NOTE [ Sharing ]).
            consumer.close()
            if sender is not None:
                # The ring's name must outlive the client's opening it (it may be behind).
                with contextlib.suppress(StreamStopped):
                    sender.finish(cancelled.is_set)
            if not cancelled.is_set():
                yield wire.control_frame(pb.Frame(end=pb.StreamEnd(batches=batches)))
                completed = True
        except LoaderBrokenError as exc:
            _abort(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"loader {host.spec.name!r} cannot make batches: {exc}",
            )
        except ClosingError as exc:
            _abort(context, grpc.StatusCode.UNAVAILABLE, str(exc))
        except DetachedError as exc:
            _abort(context, grpc.StatusCode.ABORTED, str(exc))
        except ClientSilent as exc:
            if cancelled.is_set():
                return
            # A frozen client cannot read this; the log line and the freed ring are the point.
            _abort(context, grpc.StatusCode.UNAVAILABLE, str(exc))
        except DataConnectionLost as exc:
            if cancelled.is_set():
                return
            # The client resumes from the batch it did not get whole (client/receiver.py).
            _abort(context, grpc.StatusCode.UNAVAILABLE, f"the data connection broke: {exc}")
        except Exception as exc:
            if cancelled.is_set():
                return
            log.exception("stream of loader %r failed", host.spec.name)
            _abort(
                context,
                grpc.StatusCode.INTERNAL,
                f"loader {host.spec.name!r} failed outside the dataset: "
                f"{type(exc).__name__}: {exc}",
            )
        finally:
            if consumer is not None:
                consumer.close()
            if sender is not None:
                sender.close()
            if tcp_sender is not None:
                tcp_sender.close()
            outcome = _outcome(context, cancelled.is_set() and not completed, completed)
            log.log(
                logging.WARNING if "status" in outcome else logging.INFO,
                "stream end %s %s",
                who,
                logfmt(
                    batches=batches - start,
                    bytes=nbytes,
                    shm_batches=sender.batches if sender is not None else 0,
                    tcp_batches=tcp_sender.batches if tcp_sender is not None else 0,
                    seconds=f"{time.monotonic() - started:.3f}",
                    **outcome,
                ),
            )


# torch.Generator.manual_seed takes [-2**63, 2**64 - 1]; an epoch's generator is seeded
# seed + epoch (server/sampling.py), and a DistributedSampler-style sampler seeds its own
# generator with its seed + epoch. Seeds are int64 (request and spec), so an epoch of at most
# 2**63 - 1 keeps every such sum in range whatever the seed.
MAX_EPOCH = 2**63 - 1
# A stream's positions travel as uint64 (Frame.batch, StreamEnd.batches) and are counted on from
# `start`: a start past this could not be numbered to the end of any epoch.
MAX_START = 2**63 - 1


def check_positions(host: LoaderHost, membership: Membership, epoch: int, start: int) -> str | None:
    """What is wrong with a stream's epoch and start, or None: checked before any read."""
    if epoch > MAX_EPOCH:
        return (
            f"epoch must be between 0 and {MAX_EPOCH} (the epoch's generators are seeded with "
            f"seed + epoch, as DistributedSampler does), got {epoch}"
        )
    try:
        length = host.length(membership)
    except TypeError:  # unsized IterableDataset, or dynamic sharing: no end known in advance
        if start > MAX_START:
            return f"start must be between 0 and {MAX_START}, got {start}"
        return None
    if start > length:
        return (
            f"start must be between 0 and {length} (this consumer's batches in an epoch of "
            f"loader {host.spec.name!r}), got {start}"
        )
    return None


def _blob(entry: Entry) -> memoryview:
    blob = entry.delivery.blob
    assert blob is not None, "an entry without an error has a blob"
    return blob


def logfmt(**fields: object) -> str:
    """`key=value` pairs for a log line; values with spaces, quotes or `=` are quoted (JSON)."""
    parts = []
    for key, value in fields.items():
        text = str(value)
        if not text or any(c in text for c in ' "=\\') or not text.isprintable():
            text = json.dumps(text)
        parts.append(f"{key}={text}")
    return " ".join(parts)


def _outcome(context: grpc.ServicerContext, cancelled: bool, completed: bool) -> dict[str, str]:
    """How a stream ended, for its log line: with the status code and message of an error."""
    # code() and details() are grpc's (experimental) ServicerContext API, not in grpc-stubs.
    code = getattr(context, "code", lambda: None)()
    if isinstance(code, grpc.StatusCode) and code != grpc.StatusCode.OK:
        details = getattr(context, "details", lambda: b"")()
        if isinstance(details, bytes):
            details = details.decode("utf-8", "replace")
        return {"outcome": "error", "status": code.name, "error": str(details or "")}
    if cancelled:
        return {"outcome": "cancelled"}  # by the client: it broke off, closed or died
    return {"outcome": "completed" if completed else "ended"}


def _tls_mode(tls: ServerTLS | None) -> str:
    if tls is None:
        return "plaintext"
    return "mutual TLS" if tls.client_ca is not None else "TLS"


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    context.abort(code, details)
    raise AssertionError("unreachable: context.abort raises")


@dataclasses.dataclass
class LoaderServer:
    """A bound gRPC server for a set of loaders, with the standard health service.

    Health (`grpc.health.v1`, service "" and "remote_loader.v1.Loader") is SERVING once
    started and NOT_SERVING while draining. The data listener (`data_port`), when on, accepts
    from creation (a connection needs a ticket from a running stream) and closes with `stop()`.
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

    def stop(self, grace: float = DEFAULT_GRACE) -> None:
        """Drains, then stops: health turns NOT_SERVING and new streams are refused with
        UNAVAILABLE at once; running streams get up to `grace` seconds to finish, then are
        cancelled."""
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


def create_server(
    hosts: Mapping[str, LoaderHost],
    address: str = "127.0.0.1:0",
    *,
    max_streams: int = DEFAULT_MAX_STREAMS,
    chunk_size: int = wire.DEFAULT_CHUNK_SIZE,
    max_ring_bytes: int = shm.DEFAULT_MAX_RING_BYTES,
    max_request_bytes: int = MAX_REQUEST_BYTES,
    keepalive_time_ms: int = wire.KEEPALIVE_TIME_MS,
    keepalive_timeout_ms: int = wire.KEEPALIVE_TIMEOUT_MS,
    min_ping_interval_ms: int = wire.KEEPALIVE_TIME_MS // 2,
    token: str | None = None,
    tls: ServerTLS | None = None,
    reflection: bool = False,
    metrics_address: str | None = None,
    data_address: str = "auto",
) -> LoaderServer:
    """A server for `hosts`, bound to `address` (port 0: a free one) but not started.

    With `token`, every call but health checks must carry `authorization: Bearer <token>`
    (server/auth.py); with `tls`, the port speaks TLS only (mTLS when it has a client CA).
    `data_address` is where clients on other hosts open their data connections (NOTE [ TCP
    data connection ]): "auto" is `address`'s host on a free port, "off" (or "") none; a server
    with `tls` has none unless told otherwise, which is an error (the connection is plaintext).
    The keyword arguments are the [server] settings of the same names (server/settings.py).
    """
    listen_data = resolve_data_address(data_address, address, tls is not None)
    service = LoaderService(
        hosts,
        chunk_size,
        max_ring_bytes,
        max_streams=max_streams,
        client_silence=(keepalive_time_ms + keepalive_timeout_ms) / 1000,
    )
    handlers = {
        "ListLoaders": grpc.unary_unary_rpc_method_handler(
            service.ListLoaders,
            request_deserializer=pb.ListLoadersRequest.FromString,
            response_serializer=pb.ListLoadersResponse.SerializeToString,
        ),
        "Describe": grpc.unary_unary_rpc_method_handler(
            service.Describe,
            request_deserializer=pb.DescribeRequest.FromString,
            response_serializer=pb.LoaderInfo.SerializeToString,
        ),
        # No response serializer: the handler yields Frames it serialized itself (see wire.py).
        "Stream": grpc.unary_stream_rpc_method_handler(
            service.Stream, request_deserializer=pb.StreamRequest.FromString
        ),
    }
    options: list[tuple[str, Any]] = [
        # Refuse to share a port with another server (a second server must fail, not split traffic).
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", max_request_bytes),
        ("grpc.max_send_message_length", chunk_size + wire.FRAME_OVERHEAD),
        # Pings of its own find clients that vanished; the clients' pings (every
        # wire.KEEPALIVE_TIME_MS) are accepted, never counted as strikes.
        ("grpc.keepalive_time_ms", keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive_timeout_ms),
        ("grpc.http2.ping_timeout_ms", keepalive_timeout_ms),  # NOTE [ Ping timeout ], wire.py
        ("grpc.http2.min_ping_interval_without_data_ms", min_ping_interval_ms),
        ("grpc.http2.max_ping_strikes", 0),
    ]
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
    if reflection:
        from grpc_reflection.v1alpha import reflection as grpc_reflection

        grpc_reflection.enable_server_reflection(
            (wire.SERVICE_NAME, health.SERVICE_NAME, grpc_reflection.SERVICE_NAME), server
        )
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
    # Prometheus metrics on a port of their own (server/metrics.py), bound now, served once
    # started and closed with the gRPC server.
    metrics = None
    if metrics_address:
        metrics = MetricsServer(metrics_address, [host.metrics for host in hosts.values()])
    if listen_data is not None:
        try:
            service.listener = DataListener(listen_data)
        except OSError:
            if metrics is not None:
                metrics.close()
            raise
    return LoaderServer(server, port, service, health_servicer, metrics)


def resolve_data_address(data_address: str, address: str, tls: bool) -> str | None:
    """HOST:PORT for the data listener, or None for none (see create_server)."""
    if data_address in ("", "off"):
        return None
    if data_address == "auto":
        if tls:
            return None  # the batches stay inside TLS, over gRPC
        host, _, _ = address.rpartition(":")
        return f"{host}:0"
    if tls:
        raise ValueError(
            f"data_address {data_address} is plaintext, and this server serves TLS: leave "
            'data_address "auto" (no data connections with TLS) or set it "off"'
        )
    return data_address


def build_hosts(
    specs: Mapping[str, LoaderSpec],
    ctx: multiprocessing.context.BaseContext | None = None,
    *,
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
) -> dict[str, LoaderHost]:
    """Builds and starts every loader (datasets, option checks, persistent workers)."""
    ctx = ctx or worker_context()
    hosts: dict[str, LoaderHost] = {}
    try:
        for name, spec in specs.items():
            hosts[name] = LoaderHost(spec, ctx, max_batch_bytes=max_batch_bytes)
            hosts[name].start()
    except BaseException:
        for host in hosts.values():
            host.close()
        raise
    return hosts


def serve(
    specs: Mapping[str, LoaderSpec],
    address: str,
    *,
    max_streams: int = DEFAULT_MAX_STREAMS,
    chunk_size: int = wire.DEFAULT_CHUNK_SIZE,
    grace: float = DEFAULT_GRACE,
    ready: threading.Event | None = None,
    stop: threading.Event | None = None,
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES,
    **options: Any,
) -> int:
    """Runs a server until SIGTERM / SIGINT (or `stop`); returns the process exit code.

    `options` are create_server's other keyword arguments (max_request_bytes, the keepalive
    settings, token, tls, reflection, metrics_address, ...).
    """
    # Workers and the fork server start before any gRPC thread.
    hosts = build_hosts(specs, max_batch_bytes=max_batch_bytes)
    stop = stop or threading.Event()
    try:
        server = create_server(
            hosts, address, max_streams=max_streams, chunk_size=chunk_size, **options
        )
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set())
        server.start()
        names = ", ".join(sorted(hosts))
        log.info(
            "serving %s on port %d (%s, %s)",
            names,
            server.port,
            _tls_mode(options.get("tls")),
            "token required" if options.get("token") is not None else "no token",
        )
        print(f"remote-loader: serving {names} on port {server.port}", flush=True)
        if server.metrics is not None:
            log.info("metrics (Prometheus) on port %d", server.metrics.port)
        if server.data_port is not None:
            log.info("data connections (NOTE [ TCP data connection ]) on port %d", server.data_port)
        if ready is not None:
            ready.set()
        stop.wait()
        log.info("stopping: health NOT_SERVING, %.1f s for running streams", grace)
        server.stop(grace)
    finally:
        for host in hosts.values():
            host.close()
    return 0
