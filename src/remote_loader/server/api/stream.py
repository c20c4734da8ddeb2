"""One Stream call once LoaderService (server/api/service.py) has let it in: its transport
negotiated, its consumer attached, its epoch sent as Frames, and its end logged.

The handler forwards the bytes workers encoded, cut into Frames (remote_loader.protos.wire),
and stops producing as soon as the client goes away.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Generator, Iterator

import grpc

from remote_loader.protos import compression, stall, wire
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import tcp as tcp_protocol
from remote_loader.server.api.admission import StreamSlot
from remote_loader.server.api.status import abort_with
from remote_loader.server.errors import CallFailed, clip
from remote_loader.server.sharing.consumer import Consumer
from remote_loader.server.sharing.elastic import Reshard
from remote_loader.server.sharing.host import LoaderHost
from remote_loader.server.sharing.membership import Membership
from remote_loader.server.sharing.policies import policy_for
from remote_loader.server.telemetry.logfmt import logfmt
from remote_loader.server.transports import (
    DataListener,
    Sender,
    StreamStopped,
    connect,
    negotiate,
)
from remote_loader.server.transports.base import error_frame
from remote_loader.server.transports.node import NodeSender

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Sending:
    """How the server sends every stream's batches (LoaderService's settings)."""

    chunk_size: int
    # Each stream's shared-memory ring is at most this big (0: never use shared memory).
    max_ring_bytes: int
    # Same-host clients that can may read the workers' slots themselves (protos/slots.py).
    zero_copy: bool
    # A same-host client whose ring heartbeat stands still this long while the stream waits
    # for it is let go (NOTE [ Ring space ]).
    client_silence: float
    # Accepts streams' data connections (NOTE [ TCP data connection ]); None: off.
    listener: DataListener | None


@dataclasses.dataclass(frozen=True)
class AdmittedStream:
    """A Stream call let in: its place among the running streams, its loader, membership,
    seed and elastic origin, and the number that names it in its log lines."""

    request: pb.StreamRequest
    context: grpc.ServicerContext
    slot: StreamSlot
    host: LoaderHost
    membership: Membership
    seed: int
    reshard: Reshard | None
    number: int


def send_stream(stream: AdmittedStream, sending: Sending) -> Iterator[bytes]:
    """The Frames of an admitted stream, to its end frame; a failure after it started ends
    the call with its status (abort_with), and the stream's end line logs how it ended."""
    request, context, slot = stream.request, stream.context, stream.slot
    host, membership, seed, reshard = stream.host, stream.membership, stream.seed, stream.reshard
    start = request.start
    cancelled = threading.Event()
    # The client went away (cancel, break, crash, deadline): stop producing for it.
    context.add_callback(cancelled.set)
    started = time.monotonic()
    progress = _Progress(batches=start)
    who = logfmt(
        stream=stream.number,
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
        chunk_size=sending.chunk_size,
        shared=shared,
        max_ring_bytes=sending.max_ring_bytes,
        zero_copy=sending.zero_copy,
        client_silence=sending.client_silence,
        listener=sending.listener,
    )
    log.info("stream start %s %s", who, logfmt(transport=negotiated.described))
    sender: Sender = negotiated.sender
    consumer = None
    try:
        if negotiated.ticket is not None:
            assert sending.listener is not None
            connected = yield from connect(
                negotiated, sending.listener, cancelled.is_set, sending.client_silence, who
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
                f"loader {host.spec.name!r} failed outside the dataset: {type(exc).__name__}: {exc}"
            )
        # Here, not in statuses: the stream's end line below logs the status.
        abort_with(context, exc)
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
