"""The receiver stage: a thread that turns one epoch's Frames into ready batches.

It copies each batch once, from the gRPC messages (or, on the same host, from the stream's
shared-memory ring: NOTE [ Shared-memory transport ] in remote_loader.protos.shm; or from the
stream's data connection: NOTE [ TCP data connection ] in remote_loader.protos.tcp) into (pinned)
host memory, starts the copy to the device on a side CUDA stream, and queues the batch for
`RemoteLoader.__next__`. When the
stream breaks (connection reset, server restart, UNAVAILABLE) it opens a new one from the next
batch it has not received, with bounded retries and backoff: batches are neither lost nor
repeated, and the training loop sees an error only when the retries run out.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np
import torch

from remote_loader.client.errors import (
    ConnectionLostError,
    DatasetError,
    ProtocolError,
    RemoteLoaderError,
    map_rpc_error,
)
from remote_loader.protos import codec, shm, tcp, wire
from remote_loader.protos import loader_pb2 as pb

log = logging.getLogger(__name__)

# How often a blocked put or get wakes up to check whether the other side is still there.
POLL_INTERVAL = 0.1
# Reconnecting: the first wait, and the most any one wait grows to (it doubles per attempt).
DEFAULT_BACKOFF = 0.5
MAX_BACKOFF = 8.0
# A broken stream is resumed on these codes (and when it ends without its end frame). ABORTED
# is a broadcast consumer detached for stalling: it rejoins at its position.
RETRYABLE = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED, grpc.StatusCode.CANCELLED}
)


@dataclasses.dataclass
class Ready:
    """A decoded batch; on CUDA, `event` marks the end of its copy to the device."""

    batch: Any
    device_payload: torch.Tensor | None = None
    event: Any = None  # torch.cuda.Event when the batch was copied on a side stream
    nbytes: int = 0  # the encoded batch's size (header and tensor data), for stats()
    transport: str = "grpc"  # how it arrived: "shm", "tcp" or "grpc"


@dataclasses.dataclass
class Failed:
    """An error to raise at this point of the stream; `final` ends the stream."""

    error: RemoteLoaderError
    final: bool


@dataclasses.dataclass
class Finished:
    """The stream ended normally after `batches` batches."""

    batches: int


Item = Ready | Failed | Finished


class _Assembly:
    """One batch being put together from its Frames."""

    def __init__(self, meta: Any, pin: bool) -> None:
        self.batch = meta.batch
        self.parts = meta.parts
        self.next_part = 0
        self.total = meta.total_bytes
        self.header_nbytes = meta.header_bytes
        self.payload_start = codec.payload_offset(self.header_nbytes)
        if (
            meta.parts < 1
            or self.header_nbytes > self.total
            or self.payload_start > max(self.total, self.header_nbytes)
        ):
            raise ProtocolError(f"batch {meta.batch}: inconsistent frame sizes")
        self.header = bytearray(self.header_nbytes)
        self.payload = torch.empty(
            self.total - self.payload_start, dtype=torch.uint8, pin_memory=pin
        )
        self._payload_np = self.payload.numpy()
        self.received = 0

    def add(self, meta: Any, data: memoryview) -> bool:
        """Copies one frame's data into place; True when the batch is complete."""
        if meta.batch != self.batch or meta.part != self.next_part:
            raise ProtocolError(
                f"expected part {self.next_part} of batch {self.batch}, "
                f"got part {meta.part} of batch {meta.batch}"
            )
        start, end = self.received, self.received + len(data)
        if end > self.total:
            raise ProtocolError(f"batch {self.batch}: more data than its {self.total} bytes")
        if start < self.header_nbytes:
            n = min(end, self.header_nbytes) - start
            self.header[start : start + n] = data[:n]
        lo = max(start, self.payload_start)
        if end > lo:
            self._payload_np[lo - self.payload_start : end - self.payload_start] = np.frombuffer(
                data[lo - start :], dtype=np.uint8
            )
        self.received = end
        self.next_part += 1
        return self._complete()

    def receive(self, read: Callable[[memoryview], bool]) -> bool:
        """Reads the whole batch with `read(view)` (which fills `view` from the data
        connection, False if stopped): header and padding, then the payload straight into
        place. True when complete, False if stopped."""
        if self.parts != 1 or self.next_part != 0:
            raise ProtocolError(f"batch {self.batch}: a data-connection batch is one part")
        head = bytearray(self.payload_start)
        if not read(memoryview(head)) or not read(self._payload_np.data):
            return False
        self.header[:] = head[: self.header_nbytes]
        self.received = self.total
        self.next_part = 1
        return self._complete()

    def _complete(self) -> bool:
        if self.next_part == self.parts:
            if self.received != self.total:
                raise ProtocolError(
                    f"batch {self.batch}: {self.received} of {self.total} bytes arrived"
                )
            return True
        return False


class _Broken(Exception):
    """The stream broke in a way a new stream from the next batch can repair."""

    def __init__(self, error: RemoteLoaderError) -> None:
        super().__init__(str(error))
        self.error = error


class _ShmFailed(Exception):
    """The server offered a ring this process cannot use: continue without shared memory."""


class _TcpFailed(Exception):
    """The server offered a data connection this process cannot make: continue without."""


class Receiver(threading.Thread):
    """Reads an epoch's Frames into `out_q`, a queue of `Item`s.

    `open_stream(start, offer, tcp)` starts a Stream call from batch `start`, offering shared
    memory when `offer` is not None (`use_shm`: try it) and a data connection when `tcp` is true
    (`tcp_host`: the host to connect to, None: never); a stream that cannot use one goes on
    without.
    Queue protocol: one Ready or Failed(final=False) per batch, in epoch order from `start`,
    then exactly one Finished or Failed(final=True), unless `stop()` was called. `out_q` is
    bounded by the caller (its maxsize is the prefetch depth); puts wait for room, checking
    `stop()`.

    `wait_ready(timeout)` waits for the connection before a new stream; a stream that breaks is
    replaced up to `retries` times in a row (a batch arriving resets the count) before the error
    reaches the training loop.
    """

    def __init__(
        self,
        open_stream: Callable[[int, pb.ShmOffer | None, bool], Any],
        out_q: queue.Queue[Item],
        *,
        device: torch.device,
        pin: bool,
        what: str,
        start: int = 0,
        retries: int = 0,
        backoff: float = DEFAULT_BACKOFF,
        wait_ready: Callable[[float], bool] = lambda timeout: True,
        connect_timeout: float = 10.0,
        use_shm: bool = False,
        tcp_host: str | None = None,
        on_tcp_failed: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(name="remote-loader-receiver", daemon=True)
        self._open_stream = open_stream
        self._out_q = out_q
        self._device = device
        self._pin = pin
        self._what = what
        self._expected = start  # the next batch to queue: a new stream starts from it
        self._retries = retries
        self._backoff = backoff
        self._wait_ready = wait_ready
        self._connect_timeout = connect_timeout
        self.reconnects = 0
        self._use_shm = use_shm and shm.available()
        self._tcp_host = tcp_host
        self._on_tcp_failed = on_tcp_failed  # the owner stops asking in later epochs
        # How the last batch arrived: "shm" (the shared-memory ring), "tcp" (the data
        # connection) or "grpc" (data Frames).
        self._ring: shm.RingReader | None = None
        self._data: socket.socket | None = None  # the current stream's data connection
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
                # The training loop is busy: tell the server, which may be waiting for room in
                # the ring or on the data connection, that this client is alive all the same
                # (NOTE [ Ring space ], NOTE [ TCP data connection ]).
                if self._ring is not None:
                    self._ring.beat()
                if self._data is not None:
                    tcp.beat(self._data)
        return False

    def run(self) -> None:
        failures = 0  # breaks in a row, with no batch delivered between them
        while True:
            probe = self._probe()
            with self._lock:
                if self._stopped.is_set():
                    if probe is not None:
                        probe.remove()
                    return
                offer = None if probe is None else pb.ShmOffer(probe=probe.name, nonce=probe.nonce)
                self._call = self._open_stream(self._expected, offer, self._tcp_host is not None)
            before = self._expected
            try:
                final = self._receive(iter(self._call), probe)
            except _ShmFailed as exc:
                log.warning(
                    "%s: %s; continuing over gRPC from batch %d", self._what, exc, self._expected
                )
                self._call.cancel()
                self._use_shm = False
                continue
            except _TcpFailed as exc:
                log.warning(
                    "%s: %s; continuing inside the gRPC stream from batch %d",
                    self._what,
                    exc,
                    self._expected,
                )
                self._call.cancel()
                self._tcp_host = None
                self._on_tcp_failed()
                continue
            except _Broken as exc:
                self._call.cancel()  # a broken data connection leaves the call running
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
                self._call.cancel()
                final = Failed(exc, final=True)
            except BaseException as exc:  # a bug here must reach the training loop, not vanish
                self._call.cancel()
                error = ProtocolError(
                    f"{self._what}: receiving failed: {type(exc).__name__}: {exc}"
                )
                error.__cause__ = exc
                final = Failed(error, final=True)
            self._put(final)
            return

    def _probe(self) -> shm.Probe | None:
        if not self._use_shm:
            return None
        try:
            return shm.Probe()
        except shm.ShmUnavailable as exc:
            log.info("%s: no shared memory here (%s); streaming over gRPC", self._what, exc)
            self._use_shm = False
            return None

    def _reconnect(self, error: RemoteLoaderError, failures: int) -> bool:
        """Waits out the backoff and for the connection; False if stopped meanwhile."""
        delay = min(self._backoff * 2 ** (failures - 1), MAX_BACKOFF)
        log.warning(
            "%s: stream broke (%s); resuming from batch %d in %.1f s (attempt %d of %d)",
            self._what,
            error,
            self._expected,
            delay,
            failures,
            self._retries,
        )
        if self._stopped.wait(delay):
            return False
        # Bounded: a server that does not come back costs connect_timeout per attempt.
        self._wait_ready(self._connect_timeout)
        self.reconnects += 1
        return not self._stopped.is_set()

    def _gave_up(self, error: RemoteLoaderError, failures: int) -> RemoteLoaderError:
        if self._retries == 0:
            return error
        gave_up = ConnectionLostError(
            f"{self._what}: the stream broke {failures} times in a row with no batch in between "
            f"(retries={self._retries}); batches before {self._expected} were received. "
            f"Last error: {error}"
        )
        gave_up.__cause__ = error
        return gave_up

    def _receive(self, frames: Iterator[bytes], probe: shm.Probe | None) -> Item:
        """Reads one stream; raises _Broken when a new stream could take over from here."""
        self._finished = None
        try:
            return self._read(frames, probe)
        except grpc.RpcError as exc:
            if self._finished is not None:
                return self._finished  # the end frame arrived: what breaks after it is moot
            code = exc.code() if isinstance(exc, grpc.Call) else None
            if code in RETRYABLE and not self._stopped.is_set():
                raise _Broken(map_rpc_error(exc, self._what)) from exc
            raise
        except ConnectionLostError as exc:
            raise _Broken(exc) from exc
        finally:
            if probe is not None:
                probe.remove()  # the server removes it when it reads it; this is in case not
            if self._ring is not None:  # each stream has its own ring
                self._ring.close()
                self._ring = None
            if self._data is not None:  # and its own data connection
                self._data.close()
                self._data = None

    def _read(self, frames: Iterator[bytes], probe: shm.Probe | None) -> Item:
        expected = self._expected
        assembly: _Assembly | None = None
        finished: Finished | None = None
        for message in frames:
            if probe is not None:
                probe.remove()  # the server has read it, or never will
                probe = None
            try:
                meta, data = wire.parse_frame(message)
            except wire.FrameError as exc:
                raise ProtocolError(f"{self._what}: {exc}") from exc
            if finished is not None:
                raise ProtocolError(f"{self._what}: a frame arrived after the end of the stream")
            if assembly is None:
                if meta.HasField("tcp_channel"):
                    self._connect(meta.tcp_channel, expected)
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
                    e = meta.error
                    error = DatasetError(meta.batch, e.where, e.type, e.message, e.traceback)
                    expected += 1
                    if not self._put(Failed(error, final=False)):
                        return Finished(expected)
                    self._expected = expected
                    continue
                assembly = _Assembly(meta, self._pin)
            if meta.HasField("shm"):
                ready = self._from_ring(meta, assembly)
            elif meta.on_tcp:
                received = self._from_socket(assembly)
                if received is None:
                    return Finished(expected)  # stopped
                ready = received
            elif assembly.add(meta, data):
                ready = self._decode(assembly, "grpc")
            else:
                continue  # more parts of this batch to come
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

    def _connect(self, channel: Any, expected: int) -> None:
        """Opens the data connection the stream's first Frame announced."""
        if self._data is not None or expected != self._expected:
            raise ProtocolError(f"{self._what}: a data connection announced mid-stream")
        if self._tcp_host is None:
            raise ProtocolError(f"{self._what}: a data connection this client did not ask for")
        try:
            self._data = tcp.connect(self._tcp_host, channel.port, channel.ticket)
        except (tcp.DataConnectionError, ValueError) as exc:
            raise _TcpFailed(str(exc)) from exc

    def _from_socket(self, assembly: _Assembly) -> Ready | None:
        """Reads a batch from the data connection into `assembly`; None if stopped."""
        sock = self._data
        if sock is None:
            raise ProtocolError(
                f"{self._what}: batch {assembly.batch} is on a data connection that was never made"
            )
        try:
            complete = assembly.receive(
                lambda view: tcp.recv_into(sock, view, self._stopped.is_set)
            )
        except tcp.DataConnectionError as exc:
            raise ConnectionLostError(f"{self._what}: batch {assembly.batch}: {exc}") from exc
        if not complete:
            return None
        return self._decode(assembly, "tcp")

    def _from_ring(self, meta: Any, assembly: _Assembly) -> Ready:
        """Copies a batch out of the stream's ring into `assembly`, hands its space back."""
        ref = meta.shm
        if self._ring is None or self._ring.name != ref.ring:
            if self._ring is not None:
                self._ring.close()  # the server moved to a larger ring: the old one is read
                self._ring = None
            try:
                self._ring = shm.RingReader(ref.ring, ref.ring_bytes)
            except shm.ShmUnavailable as exc:
                raise _ShmFailed(str(exc)) from exc
        try:
            view = self._ring.view(ref.offset, meta.total_bytes)
        except ValueError as exc:
            raise ProtocolError(f"{self._what}: batch {meta.batch}: {exc}") from exc
        assembly.add(meta, view.data)  # the one copy, out of shared memory
        del view
        self._ring.release(ref.release)
        return self._decode(assembly, "shm")

    def _decode(self, assembly: _Assembly, transport: str) -> Ready:
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
