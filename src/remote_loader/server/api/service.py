"""The gRPC stage: the Loader service (ListLoaders, Describe, Stream); server/api/server.py binds
and runs it.

Stream handlers forward the bytes workers encoded, cut into Frames (remote_loader.protos.wire),
and stop producing as soon as the client goes away.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Generator, Iterator, Mapping
from typing import NoReturn

import grpc

from remote_loader.protos import compression, shm, stall, wire
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import tcp as tcp_protocol
from remote_loader.server.api.admission import Admission, StreamSlot
from remote_loader.server.api.settings import ServerSettings
from remote_loader.server.api.status import trailer
from remote_loader.server.api.validation import (
    Undecodable,
    check_epoch,
    check_start,
    decoded,
)
from remote_loader.server.errors import (
    CallFailed,
    Closing,
    InvalidRequest,
    LoaderNotFound,
    LoaderNotNamed,
    ServerBusy,
    SpecChanged,
    clip,
)
from remote_loader.server.sharing.consumer import Consumer
from remote_loader.server.sharing.elastic import Reshard
from remote_loader.server.sharing.host import LoaderHost
from remote_loader.server.sharing.membership import DEFAULT_JOB, Membership
from remote_loader.server.sharing.policies import policy_for
from remote_loader.server.telemetry.logfmt import logfmt
from remote_loader.server.transports import (
    DEFAULT_CLIENT_SILENCE,
    DataListener,
    Sender,
    StreamStopped,
    connect,
    negotiate,
)
from remote_loader.server.transports.base import error_frame
from remote_loader.server.transports.node import NodeSender

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
        idle_stream_timeout: float = ServerSettings.idle_stream_timeout,
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
        # Stream number max_streams + 1 is refused with RESOURCE_EXHAUSTED, or takes the place
        # of a stream idle for idle_stream_timeout (NOTE [ Idle streams ]); health and Describe
        # are not counted: a full server still answers probes.
        self.admission = Admission(max_streams, idle_stream_timeout)
        self._stream_ids = itertools.count(1)  # names a stream in its log lines

    def wait_streams(self, timeout: float) -> bool:
        """Waits up to `timeout` s for the running streams to end; True if none is left."""
        return self.admission.wait_idle(timeout)

    def _refuse_when_draining(self) -> None:
        if self.draining:
            raise Closing("the server is shutting down (draining its running streams)")

    def host(self, name: str) -> LoaderHost:
        """The loader named `name` (empty: the only one); LoaderNotFound otherwise."""
        if not name:
            if len(self.hosts) == 1:
                return next(iter(self.hosts.values()))
            raise LoaderNotNamed(
                f"this server hosts several loaders ({', '.join(sorted(self.hosts))}); name one"
            )
        host = self.hosts.get(name)
        if host is None:
            raise LoaderNotFound(
                f"no loader named {clip(name)!r}; this server hosts: "
                f"{', '.join(sorted(self.hosts))}"
            )
        return host

    def _membership(self, host: LoaderHost, consumer: pb.Consumer) -> Membership:
        membership = Membership(
            sharing=consumer.sharing or "partition",
            job=consumer.job or DEFAULT_JOB,
            rank=consumer.rank,
            world_size=consumer.world_size if consumer.HasField("world_size") else 1,
        )
        host.check(membership)  # SharingRefused
        return membership

    def ListLoaders(
        self, request: pb.ListLoadersRequest | Undecodable, context: grpc.ServicerContext
    ) -> pb.ListLoadersResponse:
        decoded("ListLoaders", request, context)
        return pb.ListLoadersResponse(names=sorted(self.hosts))

    def Describe(
        self, request: pb.DescribeRequest | Undecodable, context: grpc.ServicerContext
    ) -> pb.LoaderInfo:
        described = decoded("Describe", request, context)
        with statuses(context):
            return self._describe(described)

    def _describe(self, request: pb.DescribeRequest) -> pb.LoaderInfo:
        self._refuse_when_draining()
        host = self.host(request.loader)
        spec = host.spec
        info = pb.LoaderInfo(
            name=spec.name,
            dataset_kind=host.dataset_kind,
            options=spec.options_text(),
            seed=spec.seed,
            fingerprint=spec.fingerprint(),
        )
        membership = self._membership(host, request.consumer)
        info.sharing.extend(spec.parts.sharing.modes)
        with contextlib.suppress(TypeError):  # unknown for an unsized IterableDataset
            info.epoch_length = len(host)
        seed = request.seed if request.HasField("seed") else spec.seed
        _, length = check_epoch(host, membership, request.epoch, seed, request.reshard)
        if length is not None:  # else unsized IterableDataset, or dynamic sharing
            info.length = length
            info.has_length = True
        if spec.batch_size is not None and spec.batch_sampler is None:
            info.batch_size = spec.batch_size
        with contextlib.suppress(TypeError):
            info.dataset_length = len(host.dataset)
        pool = spec.parts.pool
        if pool.num_workers > 0:
            started = host.pool_info
            info.pool.backend = pool.backend
            info.pool.nodes = int(started.get("nodes", 0))
            info.pool.workers = int(started.get("workers", pool.num_workers))
        # What a local DataLoader would have warned the trainer about (server/config/sampling.py).
        info.warnings.extend(
            pb.LoaderWarning(category=w.category, message=w.message) for w in host.warnings
        )
        return info

    def Stream(
        self, request: pb.StreamRequest | Undecodable, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        streamed = decoded("Stream", request, context)  # before it counts as a stream
        with statuses(context):
            yield from self._counted_stream(streamed, context)

    def _counted_stream(
        self, request: pb.StreamRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        self._refuse_when_draining()
        slot = self.admission.admit(context)
        if slot is None:
            max_streams = self.admission.max_streams
            log.warning(
                "stream refused %s",
                logfmt(
                    peer=context.peer(),
                    loader=clip(request.loader),
                    status="RESOURCE_EXHAUSTED",
                    error=f"max_streams={max_streams} streams are running",
                ),
            )
            idle = self.admission.idle_stream_timeout
            raise ServerBusy(
                f"this server already runs its max_streams={max_streams} streams"
                + (f" (none has gone idle_stream_timeout={idle:g} s unread)" if idle else "")
                + "; retry when one ends, or raise the server's max_streams setting "
                "(--max-streams, REMOTE_LOADER_MAX_STREAMS)"
            )
        try:
            yield from self._stream(request, context, slot)
        finally:
            self.admission.release(slot)

    def _admit(
        self, request: pb.StreamRequest
    ) -> tuple[LoaderHost, Membership, int, Reshard | None]:
        """The stream's loader, membership, seed and elastic origin; a CallFailed error for a
        request refused before anything reads the dataset."""
        host = self.host(request.loader)
        membership = self._membership(host, request.consumer)
        if request.fingerprint and request.fingerprint != host.spec.fingerprint():
            raise SpecChanged(
                f"loader {host.spec.name!r} has changed: its spec's fingerprint is now "
                f"{host.spec.fingerprint()}, the consumer's state was saved with "
                f"{clip(request.fingerprint)}; resuming would not line the batches up. Start the "
                "epoch afresh, or serve the old spec"
            )
        seed = request.seed if request.HasField("seed") else host.spec.seed
        reshard, length = check_epoch(host, membership, request.epoch, seed, request.reshard)
        problem = check_start(host, request.start, length)
        if problem is None:
            try:
                compression.check(clip(request.compression))  # clip: the error echoes it
            except ValueError as exc:
                problem = str(exc)
        if problem is not None:
            raise InvalidRequest(problem)
        return host, membership, seed, reshard

    def _stream(
        self, request: pb.StreamRequest, context: grpc.ServicerContext, slot: StreamSlot
    ) -> Iterator[bytes]:
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
            job=clip(membership.job),
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
            if request.node_fetch and not shared:
                # NOTE [ Node data connection ]: a batch made on another host is named there
                # once this trainer has reached that node.
                sender = NodeSender(sender, _node_connections(request))
            consumer = host.attach(
                membership, seed, request.epoch, start, reshard, _compression(request)
            )
            # Detach at once when the client goes, even if this thread is stuck sending; the
            # callback only queues it: it runs on gRPC's thread (NOTE [ Sharing ]).
            context.add_callback(consumer.let_go)
            ended = yield from _send_epoch(consumer, sender, cancelled, progress, slot)
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
            if not isinstance(exc, CallFailed):
                log.exception("stream of loader %r failed", host.spec.name)
                exc = CallFailed(
                    f"loader {host.spec.name!r} failed outside the dataset: "
                    f"{type(exc).__name__}: {exc}"
                )
            # Here, not in statuses: the stream's end line below logs the status.
            _abort_with(context, exc)
        finally:
            if consumer is not None:
                consumer.close()
            sender.close()
            done = progress.completed
            outcome = _outcome(context, cancelled.is_set() and not done, done)
            if slot.evicted is not None and not done:  # NOTE [ Idle streams ]
                outcome = {"outcome": "error", "status": "ABORTED", "error": slot.evicted}
            log.log(
                logging.WARNING if "status" in outcome else logging.INFO,
                "stream end %s %s",
                who,
                logfmt(
                    batches=progress.batches - start,
                    bytes=progress.nbytes,
                    **{f"{sender.name}_batches": sender.batches},
                    errors=consumer.errors if consumer is not None else 0,
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


def _node_connections(request: pb.StreamRequest) -> int:
    """How many connections the stream makes to each node: as many as it asked for data
    connections (none: the default), at most the cap."""
    asked = request.data_connections or tcp_protocol.DEFAULT_DATA_CONNECTIONS
    return min(asked, tcp_protocol.MAX_DATA_CONNECTIONS)


def _send_epoch(
    consumer: Consumer,
    sender: Sender,
    cancelled: threading.Event,
    progress: _Progress,
    slot: StreamSlot,
) -> Generator[bytes, None, bool]:
    """Sends the consumer's entries in order, counting them in `progress`: True when its
    epoch ended, False when the client went away mid-batch. `slot` is told when the stream
    waits on its client (NOTE [ Idle streams ])."""

    def stopped() -> bool:
        return cancelled.is_set() or consumer.detached is not None

    while (entry := consumer.next(cancelled)) is not None:
        slot.handing()
        try:
            if entry.error is not None:
                yield error_frame(progress.batches, entry.error)
            else:
                # NOTE [ Stall stages ]: part 0 says how long the stream waited for the batch.
                waited: float | None = consumer.waited
                # gRPC resumes this generator once it has written the Frame: the client took
                # it, and the wait for it to take the next one starts.
                for frame in sender.send(progress.batches, entry.outgoing, stopped):
                    if waited is not None and (first := stall.stamped(frame, waited)):
                        frame, waited = first, None
                    yield frame
                    slot.handing()
                progress.nbytes += entry.nbytes
        except StreamStopped:
            if cancelled.is_set():
                return False
            continue  # detached: next() says why
        finally:
            slot.between()
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
def statuses(context: grpc.ServicerContext) -> Iterator[None]:
    """The one mapping of errors to statuses (server/errors.py): a CallFailed ends the call
    with its status and message. (A stream maps its own errors once it has started, so that
    its end line can log the status; anything else there is reported as a CallFailed.)"""
    try:
        yield
    except CallFailed as exc:
        _abort_with(context, exc)


def _abort_with(context: grpc.ServicerContext, error: CallFailed) -> NoReturn:
    """Ends the call with `error`'s status and message, and its reason (and a broken loader's
    exception) in the trailing metadata (NOTE [ Error reasons ], server/api/status.py): abort
    sends what set_trailing_metadata set."""
    details, metadata = trailer(error)
    context.set_trailing_metadata(metadata)
    context.abort(grpc.StatusCode[error.status], details)
    raise AssertionError("unreachable: context.abort raises")
