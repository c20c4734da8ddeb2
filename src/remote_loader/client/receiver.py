"""The receiver stage: a thread that turns one epoch's Frames into ready batches.

It reads a stream's Frames in order and has each batch copied once into (pinned) host memory by
the transport's end that carries it (client/transports/: the gRPC messages themselves, the
stream's shared-memory ring, or its data connection), starts the copy to the device on a side
CUDA stream, and queues the batch for `RemoteLoader.__next__`. When the stream breaks
(connection reset, server restart, UNAVAILABLE), or the server is full (RESOURCE_EXHAUSTED from
its max_streams), it opens a new one from the next batch it has not received, with bounded
retries and backoff: batches are neither lost nor repeated, and the training loop sees an error
only when the retries run out (NOTE [ Waiting for the server ] in client/connect.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import torch

from remote_loader.client.assembly import Assembly
from remote_loader.client.connect import DEFAULT_BACKOFF, delay
from remote_loader.client.errors import (
    ConnectionLostError,
    ProtocolError,
    RemoteLoaderError,
    ServerBusyError,
    dataset_error,
    map_rpc_error,
    server_busy,
)
from remote_loader.client.items import Failed, Finished, Item, Ready
from remote_loader.client.transports import (
    BatchReused,
    StreamEnds,
    Transports,
    TransportUnusable,
)
from remote_loader.protos import codec
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos.buffers import BufferPool

log = logging.getLogger(__name__)

# How often a blocked put or get wakes up to check whether the other side is still there.
POLL_INTERVAL = 0.1
# How long a stream whose batch was reused under the copy may take to end with its status (the
# server's reason: a broadcast consumer detached) before it is resumed as merely broken.
STATUS_WAIT = 1.0
# A broken stream is resumed on these codes (and when it ends without its end frame). ABORTED
# is a broadcast consumer detached for stalling: it rejoins at its position.
RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED}
)


def _retryable(exc: grpc.RpcError) -> bool:
    """Whether a new stream from the next batch may succeed where the call `exc` ended."""
    code = exc.code() if isinstance(exc, grpc.Call) else None
    return code in RETRYABLE or server_busy(exc)


class _Broken(Exception):
    """The stream broke in a way a new stream from the next batch can repair."""

    def __init__(self, error: RemoteLoaderError) -> None:
        super().__init__(str(error))
        self.error = error


class Receiver(threading.Thread):
    """Reads an epoch's Frames into `out_q`, a queue of `Item`s.

    `open_stream(start, ends)` starts a Stream call from batch `start` whose request carries
    the offer of `ends` (`StreamEnds.offer`), the new stream's ends from `transports`; a stream
    that cannot use a transport it was offered goes on without it (TransportUnusable).
    Queue protocol: one Ready or Failed(final=False) per batch, in epoch order from `start`,
    then exactly one Finished or Failed(final=True), unless `stop()` was called. `out_q` is
    bounded by the caller (its maxsize is the prefetch depth); puts wait for room, checking
    `stop()`.

    Batches for the CPU are received into `buffers` when given (NOTE [ Reused buffers ]).

    `wait_ready(timeout, stopped)` waits up to `timeout` for the connection before each stream
    (False: it did not come, or `stopped()`); no connection counts as a break. A stream that
    breaks is replaced up to `retries` times in a row (a batch arriving resets the count) before
    the error reaches the training loop (NOTE [ Waiting for the server ]).
    """

    def __init__(
        self,
        open_stream: Callable[[int, StreamEnds], Any],
        out_q: queue.Queue[Item],
        *,
        transports: Transports,
        device: torch.device,
        pin: bool,
        what: str,
        buffers: BufferPool | None = None,
        start: int = 0,
        retries: int = 0,
        backoff: float = DEFAULT_BACKOFF,
        wait_ready: Callable[[float, Callable[[], bool]], bool] = lambda timeout, stopped: True,
        connect_timeout: float = 10.0,
    ) -> None:
        super().__init__(name="remote-loader-receiver", daemon=True)
        self._open_stream = open_stream
        self._out_q = out_q
        self._transports = transports
        self._device = device
        self._pin = pin
        self._buffers = buffers
        self._what = what
        self._expected = start  # the next batch to queue: a new stream starts from it
        self._retries = retries
        self._backoff = backoff
        self._wait_ready = wait_ready
        self._connect_timeout = connect_timeout
        self.reconnects = 0
        self._ends: StreamEnds | None = None  # the current stream's, while it is read
        self._lock = threading.Lock()  # guards _call against stop() from another thread
        self._stopped = threading.Event()
        self._call: Any = None
        self._finished: Finished | None = None  # the current stream's end frame, once read
        self._copy_stream: Any = torch.cuda.Stream(device) if device.type == "cuda" else None

    def stop(self) -> None:
        """Cancels the stream (the server stops producing) and ends the thread."""
        self._stopped.set()
        with self._lock:
            if self._call is not None:
                self._call.cancel()

    def _put(self, item: Item) -> bool:
        while not self._stopped.is_set():
            try:
                self._out_q.put(item, timeout=POLL_INTERVAL)
                return True
            except queue.Full:
                # The training loop is busy: the server may be waiting on this client all the
                # same (NOTE [ Ring space ], NOTE [ TCP data connection ]).
                if self._ends is not None:
                    self._ends.beat()
        return False

    def run(self) -> None:
        failures = 0  # breaks in a row, with no batch delivered between them
        while True:
            before = self._expected
            try:
                final = self._stream()
                if final is None:
                    return  # stopped
            except TransportUnusable as exc:
                log.warning(
                    "%s: %s; continuing %s from batch %d",
                    self._what,
                    exc,
                    exc.instead,
                    self._expected,
                )
                self._transports.give_up(exc)
                continue
            except _Broken as exc:
                if self._stopped.is_set():
                    return
                # This break counts; batches since the last one reset the count.
                failures = 1 if self._expected > before else failures + 1
                if failures > self._retries:
                    final = Failed(self._gave_up(exc.error, failures), final=True)
                elif self._reconnect(exc.error, failures):
                    continue
                else:
                    return  # stopped while waiting
            except grpc.RpcError as exc:
                if self._stopped.is_set():
                    return
                final = Failed(map_rpc_error(exc, self._what), final=True)
            except RemoteLoaderError as exc:
                final = Failed(exc, final=True)
            except BaseException as exc:  # a bug here must reach the training loop, not vanish
                error = ProtocolError(
                    f"{self._what}: receiving failed: {type(exc).__name__}: {exc}"
                )
                error.__cause__ = exc
                final = Failed(error, final=True)
            self._put(final)
            return

    def _stream(self) -> Item | None:
        """Opens a stream from the next batch, once connected, and reads it; None if stopped.

        The call is made without wait_for_ready: waiting for the connection is wait_ready's,
        with its deadline, since the stream itself has none (it lasts an epoch)."""
        if not self._wait_ready(self._connect_timeout, self._stopped.is_set):
            if self._stopped.is_set():
                return None
            raise _Broken(
                ConnectionLostError(
                    f"{self._what}: the server did not answer within connect_timeout="
                    f"{self._connect_timeout:g} s"
                )
            )
        ends = self._transports.open(self._stopped.is_set)
        with self._lock:
            if self._stopped.is_set():
                ends.close()
                return None
            self._call = call = self._open_stream(self._expected, ends)
        try:
            return self._receive(call, ends)
        except grpc.RpcError:
            raise  # the call has ended with this status
        except BaseException:
            call.cancel()  # a broken data connection or ring leaves the call running
            raise

    def _reconnect(self, error: RemoteLoaderError, failures: int) -> bool:
        """Waits out the backoff; False if stopped meanwhile."""
        wait = delay(self._backoff, failures)
        log.warning(
            "%s: stream %s (%s); resuming from batch %d in %.1f s (attempt %d of %d)",
            self._what,
            "refused" if isinstance(error, ServerBusyError) else "broke",
            error,
            self._expected,
            wait,
            failures,
            self._retries,
        )
        if self._stopped.wait(wait):
            return False
        self.reconnects += 1
        return True

    def _gave_up(self, error: RemoteLoaderError, failures: int) -> RemoteLoaderError:
        if self._retries == 0:
            return error
        if isinstance(error, ServerBusyError):
            busy = ServerBusyError(
                f"{self._what}: the server stayed full through {failures} attempts in a row "
                f"(retries={self._retries}); batches before {self._expected} were received. "
                f"Last error: {error}"
            )
            busy.__cause__ = error
            return busy
        gave_up = ConnectionLostError(
            f"{self._what}: the stream broke {failures} times in a row with no batch in between "
            f"(retries={self._retries}); batches before {self._expected} were received. "
            f"Last error: {error}"
        )
        gave_up.__cause__ = error
        return gave_up

    def _receive(self, call: Any, ends: StreamEnds) -> Item:
        """Reads one stream (`call`: its gRPC call, an iterator of messages); raises _Broken
        when a new stream could take over from here."""
        self._finished = None
        self._ends = ends
        frames = ends.frames(iter(call))
        try:
            return self._read(frames, ends)
        except grpc.RpcError as exc:
            if self._finished is not None:
                return self._finished  # the end frame arrived: what breaks after it is moot
            if _retryable(exc) and not self._stopped.is_set():
                raise _Broken(map_rpc_error(exc, self._what)) from exc
            raise
        except ConnectionLostError as exc:
            # A slot reused (or gone) under this client: if the server let go of the stream (a
            # broadcast consumer detached), its status says why, not the torn read. The server
            # ends such a stream at its next look (a tick): wait that long for it. The status
            # comes after the Frames still queued, read through to it once the server has closed
            # its end (no more follow: at most gRPC's flow-control window of them).
            deadline = time.monotonic() + (STATUS_WAIT if isinstance(exc, BatchReused) else 0)
            while not (call.done() or ends.server_closed()) and time.monotonic() < deadline:
                if self._stopped.wait(0.01):
                    break
            if call.done() or ends.server_closed():
                self._raise_status(call)
            raise _Broken(exc) from exc
        finally:
            self._ends = None
            ends.close()  # each stream has its own probe, ring and data connection

    def _raise_status(self, call: Any) -> None:
        """Raises the status an ended `call` ended with (as _Broken when a new stream may take
        over); returns if it ended OK. Frames still queued are moot now."""
        try:
            for _ in call:
                pass
        except grpc.RpcError as status:
            if _retryable(status) and not self._stopped.is_set():
                raise _Broken(map_rpc_error(status, self._what)) from status
            raise

    def _read(self, frames: Iterator[tuple[pb.Frame, memoryview]], ends: StreamEnds) -> Item:
        expected = self._expected
        assembly: Assembly | None = None
        # The batch being assembled: when its first frame came, and its stream's wait for it.
        begun = workers_wait = 0.0
        finished: Finished | None = None
        for meta, data in frames:
            if finished is not None:
                raise ProtocolError(f"{self._what}: a frame arrived after the end of the stream")
            if assembly is None:
                if ends.control(meta):
                    continue
                if meta.HasField("end"):
                    if meta.end.batches != expected:
                        raise ProtocolError(
                            f"{self._what}: the server says the epoch ends at batch "
                            f"{meta.end.batches}, but batch {expected} is next here"
                        )
                    # Keep reading until the call completes with its status, so closing the
                    # loader afterwards does not cancel a stream that has in fact succeeded.
                    finished = self._finished = Finished(expected)
                    continue
                if meta.batch != expected:
                    raise ProtocolError(
                        f"{self._what}: expected batch {expected}, got batch {meta.batch}"
                    )
                if meta.HasField("error"):
                    error = dataset_error(meta.batch, meta.error)  # its own type too
                    expected += 1
                    if not self._put(Failed(error, final=False)):
                        return Finished(expected)
                    self._expected = expected
                    continue
                assembly = Assembly(meta, self._pin, self._buffers)
                begun, workers_wait = time.monotonic(), meta.waited_us / 1e6
            end = ends.carrying(meta)
            if not end.fill(meta, data, assembly):
                if self._stopped.is_set():
                    return Finished(expected)  # stopped while the end waited for the batch
                continue  # more parts of this batch to come
            ready = self._decode(assembly, end.name)
            ready.workers_wait = workers_wait
            ready.copy_seconds = time.monotonic() - begun
            assembly = None
            expected += 1
            if not self._put(ready):
                return Finished(expected)
            self._expected = expected
        if finished is not None or self._stopped.is_set():
            return finished or Finished(expected)
        raise ConnectionLostError(
            f"{self._what}: the stream ended after {expected} batches "
            "without the server's end-of-stream frame"
        )

    def _decode(self, assembly: Assembly, transport: str) -> Ready:
        header = memoryview(assembly.header)
        try:
            if self._copy_stream is None:
                batch = codec.decode(header, assembly.payload)
                return Ready(batch, nbytes=assembly.total, transport=transport)
            with torch.cuda.stream(self._copy_stream):
                device_payload = assembly.payload.to(self._device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._copy_stream)
            batch = codec.decode(header, assembly.payload, device_payload)
            return Ready(
                batch,
                device_payload=device_payload,
                event=event,
                nbytes=assembly.total,
                transport=transport,
            )
        except codec.DecodeError as exc:
            raise ProtocolError(f"{self._what}: batch {assembly.batch}: {exc}") from exc
