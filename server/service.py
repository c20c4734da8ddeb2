"""The gRPC stage: the Loader service (ListLoaders, Describe, Stream); server/server.py binds
and runs it.

Stream handlers forward the bytes workers encoded, cut into Frames (remote_loader.protos.wire),
and stop producing as soon as the client goes away.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import threading
import time
from collections.abc import Generator, Iterator, Mapping
from typing import NoReturn

import grpc

from remote_loader.protos import compression, shm, wire
from remote_loader.protos import loader_pb2 as pb
from remote_loader.server.elastic import Reshard, ReshardError
from remote_loader.server.errors import (
    ClosingError,
    LoaderNotFound,
    Overloaded,
    RequestInvalid,
    ServerError,
    SpecChanged,
)
from remote_loader.server.host import LoaderHost
from remote_loader.server.membership import DEFAULT_JOB, Membership
from remote_loader.server.policies import policy_for
from remote_loader.server.run import Consumer
from remote_loader.server.settings import ServerSettings
from remote_loader.server.transports import (
    DEFAULT_CLIENT_SILENCE,
    DataListener,
    Sender,
    StreamStopped,
    connect,
    negotiate,
)
from remote_loader.server.transports.base import error_frame

log = logging.getLogger(__name__)


class LoaderService:
    """The `remote_loader.v1.Loader` service over a set of hosted loaders."""

    def __init__(
        self,
        hosts: Mapping[str, LoaderHost],
        chunk_size: int,
        max_ring_bytes: int = shm.DEFAULT_MAX_RING_BYTES,
        zero_copy: bool = True,
        max_streams: int = ServerSettings.max_streams,
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
        # Same-host clients that can may read the workers' slots themselves (protos/slots.py).
        self.zero_copy = zero_copy
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

    def _refuse_when_draining(self) -> None:
        if self.draining:
            raise ClosingError("the server is shutting down (draining its running streams)")

    def _host(self, name: str) -> LoaderHost:
        if not name:
            if len(self.hosts) == 1:
                return next(iter(self.hosts.values()))
            raise RequestInvalid(
                f"this server hosts several loaders ({', '.join(sorted(self.hosts))}); name one"
            )
        host = self.hosts.get(name)
        if host is None:
            raise LoaderNotFound(
                f"no loader named {name!r}; this server hosts: {', '.join(sorted(self.hosts))}"
            )
        return host

    def _membership(self, host: LoaderHost, consumer: pb.Consumer) -> Membership:
        membership = Membership(
            sharing=consumer.sharing or "partition",
            job=consumer.job or DEFAULT_JOB,
            rank=consumer.rank,
            world_size=consumer.world_size if consumer.HasField("world_size") else 1,
        )
        host.check(membership)  # SharingError
        return membership

    def ListLoaders(
        self, request: pb.ListLoadersRequest, context: grpc.ServicerContext
    ) -> pb.ListLoadersResponse:
        return pb.ListLoadersResponse(names=sorted(self.hosts))

    def Describe(self, request: pb.DescribeRequest, context: grpc.ServicerContext) -> pb.LoaderInfo:
        with _statuses(context):
            return self._describe(request)

    def _describe(self, request: pb.DescribeRequest) -> pb.LoaderInfo:
        self._refuse_when_draining()
        host = self._host(request.loader)
        spec = host.spec
        info = pb.LoaderInfo(
            name=spec.name,
            dataset_kind=host.dataset_kind,
            options=spec.options_text(),
            seed=spec.seed,
            fingerprint=spec.fingerprint(),
        )
        membership = self._membership(host, request.consumer)
        info.sharing.extend(spec.sharing)
        with contextlib.suppress(TypeError):  # unknown for an unsized IterableDataset
            info.epoch_length = len(host)
        seed = request.seed if request.HasField("seed") else spec.seed
        try:
            reshard = Reshard.of(request.reshard)
            if reshard is not None and membership.sharing != "partition":
                raise ReshardError("only partition sharing resumes on another world size")
            info.length = host.length(membership, reshard, seed, request.epoch)
            info.has_length = True
        except TypeError:
            pass  # unsized IterableDataset, or dynamic sharing: the length is unknown
        except ReshardError as exc:
            raise RequestInvalid(
                f"cannot resume epoch {request.epoch} on world_size {membership.world_size}: {exc}"
            ) from exc
        if spec.batch_size is not None and spec.batch_sampler is None:
            info.batch_size = spec.batch_size
        with contextlib.suppress(TypeError):
            info.dataset_length = len(host.dataset)
        if spec.num_workers > 0:
            started = host.pool_info
            info.pool.backend = spec.pool
            info.pool.nodes = int(started.get("nodes", 0))
            info.pool.workers = int(started.get("workers", spec.num_workers))
        return info

    def Stream(self, request: pb.StreamRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        with _statuses(context):
            yield from self._counted_stream(request, context)

    def _counted_stream(
        self, request: pb.StreamRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        self._refuse_when_draining()
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
            raise Overloaded(
                f"this server already runs its max_streams={self.max_streams} streams; retry "
                "when one ends, or raise the server's max_streams setting (--max-streams, "
                "REMOTE_LOADER_MAX_STREAMS)"
            )
        try:
            yield from self._stream(request, context)
        finally:
            with self._streams_changed:
                self._streams -= 1
                self._streams_changed.notify_all()

    def _admit(
        self, request: pb.StreamRequest
    ) -> tuple[LoaderHost, Membership, int, Reshard | None]:
        """The stream's loader, membership, seed and elastic origin; a ServerError for a
        request refused before anything reads the dataset."""
        host = self._host(request.loader)
        membership = self._membership(host, request.consumer)
        if request.fingerprint and request.fingerprint != host.spec.fingerprint():
            raise SpecChanged(
                f"loader {host.spec.name!r} has changed: its spec's fingerprint is now "
                f"{host.spec.fingerprint()}, the consumer's state was saved with "
                f"{request.fingerprint}; resuming would not line the batches up. Start the "
                "epoch afresh, or serve the old spec"
            )
        seed = request.seed if request.HasField("seed") else host.spec.seed
        try:
            reshard = Reshard.of(request.reshard)
            if reshard is not None and membership.sharing != "partition":
                raise ReshardError(
                    "only partition sharing resumes on another world size (a broadcast or "
                    "dynamic consumer's position does not depend on the world size)"
                )
            problem = check_positions(host, membership, request.epoch, request.start, seed, reshard)
        except ReshardError as exc:
            problem = f"cannot resume this epoch on world_size {membership.world_size}: {exc}"
        if problem is None:
            try:
                compression.check(request.compression)
            except ValueError as exc:
                problem = str(exc)
        if problem is not None:
            raise RequestInvalid(problem)
        return host, membership, seed, reshard

    def _stream(self, request: pb.StreamRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        host, membership, seed, reshard = self._admit(request)
        start = request.start
        cancelled = threading.Event()
        # The client went away (cancel, break, crash, deadline): stop producing for it.
        context.add_callback(cancelled.set)
        started = time.monotonic()
        progress = _Progress(batches=start)
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
            compression=request.compression or "none",
        )
        shared = policy_for(membership.sharing).shares_entries
        negotiated = negotiate(
            request,
            chunk_size=self.chunk_size,
            shared=shared,
            max_ring_bytes=self.max_ring_bytes,
            zero_copy=self.zero_copy,
            client_silence=self.client_silence,
            listener=self.listener,
        )
        log.info("stream start %s %s", who, logfmt(transport=negotiated.described))
        sender: Sender = negotiated.sender
        consumer = None
        try:
            if negotiated.ticket is not None:
                assert self.listener is not None
                connected = yield from connect(
                    negotiated, self.listener, cancelled.is_set, self.client_silence, who
                )
                if connected is None:
                    return
                sender = connected
            consumer = host.attach(
                membership, seed, request.epoch, start, reshard, _compression(request)
            )
            # Detach at once when the client goes, even if this thread is stuck sending; the
            # callback only queues it: it runs on gRPC's thread (NOTE [ Sharing ]).
            context.add_callback(consumer.let_go)
            ended = yield from _send_epoch(consumer, sender, cancelled, progress)
            if not ended:
                return  # cancelled mid-batch; the finally below closes the consumer
            # Detach before the end frame: the last consumer out gives the workers back first,
            # so this trainer's next epoch finds them free (NOTE [ Sharing ]).
            consumer.close()
            # A ring's name must outlive the client's opening it (it may be behind).
            with contextlib.suppress(StreamStopped):
                sender.finish(cancelled.is_set)
            if not cancelled.is_set():
                yield wire.control_frame(pb.Frame(end=pb.StreamEnd(batches=progress.batches)))
                progress.completed = True
        except Exception as exc:
            if cancelled.is_set():
                return  # nobody is left to tell; the log line says "cancelled"
            if not isinstance(exc, ServerError):
                log.exception("stream of loader %r failed", host.spec.name)
                exc = ServerError(
                    f"loader {host.spec.name!r} failed outside the dataset: "
                    f"{type(exc).__name__}: {exc}"
                )
            # Here, not in _statuses: the stream's end line below logs the status.
            _abort_with(context, exc)
        finally:
            if consumer is not None:
                consumer.close()
            sender.close()
            done = progress.completed
            outcome = _outcome(context, cancelled.is_set() and not done, done)
            log.log(
                logging.WARNING if "status" in outcome else logging.INFO,
                "stream end %s %s",
                who,
                logfmt(
                    batches=progress.batches - start,
                    bytes=progress.nbytes,
                    **{f"{sender.name}_batches": sender.batches},
                    seconds=f"{time.monotonic() - started:.3f}",
                    **outcome,
                ),
            )


@dataclasses.dataclass
class _Progress:
    """How far a stream has got."""

    batches: int  # the position of the next batch in this consumer's epoch
    nbytes: int = 0  # encoded bytes sent
    completed: bool = False  # the end frame went out: callbacks after it are not a cancellation


def _send_epoch(
    consumer: Consumer, sender: Sender, cancelled: threading.Event, progress: _Progress
) -> Generator[bytes, None, bool]:
    """Sends the consumer's entries in order, counting them in `progress`: True when its
    epoch ended, False when the client went away mid-batch."""

    def stopped() -> bool:
        return cancelled.is_set() or consumer.detached is not None

    while (entry := consumer.next(cancelled)) is not None:
        try:
            if entry.error is not None:
                yield error_frame(progress.batches, entry.error)
            else:
                yield from sender.send(progress.batches, entry.outgoing, stopped)
                progress.nbytes += entry.nbytes
        except StreamStopped:
            if cancelled.is_set():
                return False
            continue  # detached: next() says why
        finally:
            consumer.done(entry)
        consumer.sent(entry)  # metrics: batches, bytes or errors served
        progress.batches += 1
    return True


def _compression(request: pb.StreamRequest) -> str:
    """The codec the stream's workers use (NOTE [ Compression ]): the one asked for, or none
    when this server lacks its package (the client decodes whatever each batch says)."""
    name = compression.check(request.compression)
    if name and not compression.available(name):
        log.warning(
            "a stream asked for %s compression, which this server cannot do (%s): sending "
            "its batches uncompressed",
            name,
            compression.install_hint(name),
        )
        return ""
    return name


# torch.Generator.manual_seed takes [-2**63, 2**64 - 1]; an epoch's generator is seeded
# seed + epoch (server/sampling.py), and a DistributedSampler-style sampler seeds its own
# generator with its seed + epoch. Seeds are int64 (request and spec), so an epoch of at most
# 2**63 - 1 keeps every such sum in range whatever the seed.
MAX_EPOCH = 2**63 - 1
# A stream's positions travel as uint64 (Frame.batch, StreamEnd.batches) and are counted on from
# `start`: a start past this could not be numbered to the end of any epoch.
MAX_START = 2**63 - 1


def check_positions(
    host: LoaderHost,
    membership: Membership,
    epoch: int,
    start: int,
    seed: int = 0,
    reshard: Reshard | None = None,
) -> str | None:
    """What is wrong with a stream's epoch and start, or None: checked before any read.
    Raises ReshardError for an elastic resume that cannot be honoured."""
    if epoch > MAX_EPOCH:
        return (
            f"epoch must be between 0 and {MAX_EPOCH} (the epoch's generators are seeded with "
            f"seed + epoch, as DistributedSampler does), got {epoch}"
        )
    try:
        length = host.length(membership, reshard, seed, epoch)
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


@contextlib.contextmanager
def _statuses(context: grpc.ServicerContext) -> Iterator[None]:
    """The one mapping of errors to statuses (server/errors.py): a ServerError ends the call
    with its status and message. (A stream maps its own errors once it has started, so that
    its end line can log the status; anything else there is reported as a ServerError.)"""
    try:
        yield
    except ServerError as exc:
        _abort_with(context, exc)


def _abort_with(context: grpc.ServicerContext, error: ServerError) -> NoReturn:
    context.abort(grpc.StatusCode[error.status], str(error))
    raise AssertionError("unreachable: context.abort raises")
