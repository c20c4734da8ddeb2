"""The send stage: how one stream's batches leave the server.

Plain Frames (remote_loader.protos.wire) always work. A stream whose client offered shared
memory and proved it shares this host's /dev/shm sends its batches through a ring instead
(NOTE [ Shared-memory transport ] in remote_loader.protos.shm), batch by batch falling back to
Frames when the ring cannot take one. A stream from another host may carry its batches' bytes
on a data connection beside the gRPC stream (NOTE [ TCP data connection ] in
remote_loader.protos.tcp), which `DataListener` accepts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable

from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import shm, tcp, wire
from remote_loader.server.errors import ClientSilent, DataConnectionLost

log = logging.getLogger(__name__)


class StreamStopped(Exception):
    """The stream was cancelled, or its consumer detached, while waiting for the client."""


# How long a client may leave its ring's heartbeat still while the server waits on it, unless
# the server says otherwise (create_server: keepalive_time_ms + keepalive_timeout_ms).
DEFAULT_CLIENT_SILENCE = 30.0


def accept_offer(
    offer: pb.ShmOffer, max_ring_bytes: int, client_silence: float = DEFAULT_CLIENT_SILENCE
) -> ShmSender | None:
    """A sender for a stream whose request carries `offer`, or None to send plain Frames."""
    if not offer.probe or max_ring_bytes <= 0 or not shm.available():
        return None
    owner = shm.verify_probe(offer.probe, offer.nonce)
    if owner is None or not shm.can_share_with(owner):
        return None  # another host, or a user that could not open this server's rings
    return ShmSender(owner, max_ring_bytes, client_silence)


class ShmSender:
    """Copies a stream's batches into its ring; owns the ring until `close()`.

    The ring is made for the first batch's size (shm.RING_BATCHES of them) and made again,
    larger, when a batch outgrows it; a batch bigger than `max_ring_bytes`, or any batch after
    /dev/shm refused a ring, goes as plain Frames. Every wait for the client ends when its
    heartbeat stands still for `client_silence` seconds (ClientSilent).
    """

    def __init__(
        self,
        owner_uid: int,
        max_ring_bytes: int,
        client_silence: float = DEFAULT_CLIENT_SILENCE,
    ) -> None:
        self.owner_uid = owner_uid
        self.max_ring_bytes = max_ring_bytes
        self.client_silence = client_silence
        self.ring: shm.RingWriter | None = None
        # The ring before the last growth, kept mapped until the client opens the new one: a
        # client still reading its batches beats there (NOTE [ Ring space ]).
        self._previous: shm.RingWriter | None = None
        self._beats = 0  # the heartbeats seen last, and since when (monotonic)
        self._beat_at = 0.0
        self.disabled = False  # /dev/shm refused a ring: the rest of the stream goes as Frames
        self.batches = 0  # sent through shared memory

    def frame(
        self, batch: int, blob: memoryview, header_nbytes: int, stopped: Callable[[], bool]
    ) -> bytes | None:
        """The Frame that hands batch `batch` over through the ring; None: send it as Frames.

        Raises StreamStopped when `stopped()` turned true while waiting for room.
        """
        ring = self._ring_for(len(blob), stopped)
        if ring is None:
            return None
        waiting = self._waiting(stopped)
        placed = ring.place(blob, waiting)
        if placed is None:
            if waiting.silent:
                raise ClientSilent(
                    f"the client made no room in its shared-memory ring and gave no sign of life "
                    f"for {self.client_silence:g} s"
                )
            raise StreamStopped()
        offset, release = placed
        self.batches += 1
        return wire.handle_frame(
            batch,
            len(blob),
            header_nbytes,
            shm=pb.ShmBatch(
                ring=ring.name, ring_bytes=ring.capacity, offset=offset, release=release
            ),
        )

    def _waiting(self, stopped: Callable[[], bool]) -> _ClientWait:
        """A `stopped()` for one wait on the client that also turns true, marking itself
        `silent`, once the client's heartbeat has stood still for client_silence seconds."""
        self._beats, self._beat_at = self._heartbeats(), time.monotonic()
        return _ClientWait(stopped, self._silent)

    def _heartbeats(self) -> int:
        if self._previous is not None and self.ring is not None and self.ring.attached():
            self._previous.close()  # the client has moved on to the new ring
            self._previous = None
        return sum(r.heartbeat() for r in (self.ring, self._previous) if r is not None)

    def _silent(self) -> bool:
        beats, now = self._heartbeats(), time.monotonic()
        if beats != self._beats:
            self._beats, self._beat_at = beats, now
            return False
        return now - self._beat_at >= self.client_silence

    def _ring_for(self, nbytes: int, stopped: Callable[[], bool]) -> shm.RingWriter | None:
        if self.disabled:
            return None
        if self.ring is not None and nbytes <= self.ring.capacity:
            return self.ring
        capacity = shm.ring_bytes_for(nbytes, self.max_ring_bytes)
        if capacity is None:
            log.info(
                "a %d-byte batch is larger than max_ring_bytes (%d): sent as frames",
                nbytes,
                self.max_ring_bytes,
            )
            return None
        if self.ring is not None:
            # The client drops the old ring when it reads the first frame naming the new one,
            # having read the old one's batches by then; its name may go once it has opened it.
            self.finish(stopped)
            if self._previous is not None:
                self._previous.close()
            self._previous, self.ring = self.ring, None
        try:
            self.ring = shm.RingWriter(capacity, self.owner_uid)
        except shm.ShmUnavailable as exc:
            self.disabled = True
            log.warning("shared memory refused (%s): this stream continues over gRPC", exc)
            return None
        return self.ring

    def finish(self, stopped: Callable[[], bool]) -> None:
        """Before the stream ends or moves to a larger ring: waits until the client has opened
        the ring, which it does when it reads the first frame naming it (it may be a few
        batches behind). A client silent for client_silence seconds is not waited for: should
        it wake, it cannot open the ring and goes on over gRPC from the batch it needs.

        Raises StreamStopped when `stopped()` turned true first.
        """
        if self.ring is None:
            return
        waiting = self._waiting(stopped)
        if not self.ring.wait_attached(waiting) and not waiting.silent:
            raise StreamStopped()

    def close(self) -> None:
        """Unlinks the ring's name if the client has not, and drops this side's mappings."""
        for ring in (self.ring, self._previous):
            if ring is not None:
                ring.close()
        self.ring = self._previous = None


class _ClientWait:
    """`stopped` for one wait on the client, which also ends once `silent()` says so."""

    def __init__(self, stopped: Callable[[], bool], silent: Callable[[], bool]) -> None:
        self._stopped, self._silent = stopped, silent
        self.silent = False

    def __call__(self) -> bool:
        if self._stopped():
            return True
        self.silent = self._silent()
        return self.silent


class TcpSender:
    """Sends a stream's batches on its data connection; owns the socket until `close()`."""

    def __init__(self, sock: socket.socket, client_silence: float = DEFAULT_CLIENT_SILENCE) -> None:
        self.sock = sock
        self.client_silence = client_silence
        self.batches = 0  # sent on the data connection

    @staticmethod
    def frame(batch: int, blob: memoryview, header_nbytes: int) -> bytes:
        """The Frame announcing that batch `batch` follows on the data connection."""
        return wire.handle_frame(batch, len(blob), header_nbytes, on_tcp=True)

    def send(self, blob: memoryview, stopped: Callable[[], bool]) -> None:
        """Writes the batch the last `frame()` announced (after that Frame went out: the client
        reads the socket only once it has it, so the order is what keeps both from waiting).

        Raises StreamStopped when `stopped()` turned true first, DataConnectionLost when the
        client has gone, ClientSilent when it stopped reading and beating (NOTE [ TCP data
        connection ]).
        """
        try:
            if not tcp.send(self.sock, blob, stopped, self.client_silence):
                raise StreamStopped()
        except tcp.SilentClientError as exc:
            raise ClientSilent(str(exc)) from exc
        except OSError as exc:
            raise DataConnectionLost(f"the data connection broke: {exc}") from exc
        self.batches += 1

    def close(self) -> None:
        self.sock.close()


@dataclasses.dataclass
class _Handshake:
    """A connection that has not yet sent its whole HELLO."""

    sock: socket.socket
    deadline: float
    received: bytearray = dataclasses.field(default_factory=bytearray)


class _Waiting:
    """A stream's ticket, until its connection arrives or the stream stops waiting."""

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self.sock: socket.socket | None = None


class DataListener:
    """Accepts the data connections that streams announce (NOTE [ TCP data connection ]).

    One thread runs the accept loop and every handshake (non-blocking, selectors), so a client
    that connects and says nothing costs a socket for HANDSHAKE_TIMEOUT, not a thread; at most
    tcp.MAX_HANDSHAKES such connections are held, and a new one evicts the oldest.
    """

    def __init__(self, address: str) -> None:
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        try:
            if ":" in host:  # IPv6; "::" also takes IPv4, as gRPC's "[::]" does
                self._listener = socket.create_server(
                    (host, int(port)),
                    family=socket.AF_INET6,
                    dualstack_ipv6=host == "::" and socket.has_dualstack_ipv6(),
                    backlog=tcp.MAX_HANDSHAKES,
                )
            else:
                self._listener = socket.create_server((host, int(port)), backlog=tcp.MAX_HANDSHAKES)
        except (OSError, ValueError) as exc:
            raise OSError(
                f"cannot listen for data connections on {address}: {exc} (is another server "
                'using it? Set data_address to another HOST:PORT, or "off")'
            ) from exc
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._waiting: dict[bytes, _Waiting] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="rl-data-listener", daemon=True)
        self._thread.start()

    def expect(self) -> bytes:
        """A new ticket for a stream about to announce its data connection."""
        ticket = tcp.new_ticket()
        with self._lock:
            self._waiting[ticket] = _Waiting()
        return ticket

    def wait(
        self, ticket: bytes, stopped: Callable[[], bool], timeout: float | None = None
    ) -> socket.socket | None:
        """The connection that sent `ticket`; None if none came within `timeout` s (default
        tcp.ACCEPT_TIMEOUT) or `stopped()` turned true. The ticket is forgotten either way."""
        with self._lock:
            waiting = self._waiting.get(ticket)
        deadline = time.monotonic() + (tcp.ACCEPT_TIMEOUT if timeout is None else timeout)
        try:
            while waiting is not None and not waiting.arrived.wait(tcp.POLL_INTERVAL):
                if stopped() or time.monotonic() >= deadline:
                    break
        finally:
            with self._lock:
                self._waiting.pop(ticket, None)
        if waiting is None or not waiting.arrived.is_set():
            return None
        return waiting.sock

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        with self._lock:
            for waiting in self._waiting.values():
                waiting.arrived.set()  # with no socket: the stream goes on as Frames
            self._waiting.clear()

    def _run(self) -> None:
        handshakes: dict[socket.socket, _Handshake] = {}
        try:
            while not self._closed.is_set():
                for key, _ in self._selector.select(timeout=tcp.POLL_INTERVAL):
                    if key.data is None:
                        self._accept(handshakes)
                    else:
                        self._read_hello(key.data, handshakes)
                now = time.monotonic()
                for hs in [hs for hs in handshakes.values() if hs.deadline <= now]:
                    self._drop(hs, handshakes)  # said nothing (enough) in time
        except Exception:  # a bug here must not pass silently: streams fall back to Frames
            log.exception("the data listener failed; streams continue over gRPC")
        finally:
            for hs in list(handshakes.values()):
                self._drop(hs, handshakes)
            self._selector.close()
            self._listener.close()

    def _accept(self, handshakes: dict[socket.socket, _Handshake]) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # EMFILE and the like: the client will fall back
            log.warning("data listener: accept failed: %s", exc)
            return
        if len(handshakes) >= tcp.MAX_HANDSHAKES:
            # Evict the oldest, not the newest: a real client says HELLO at once, so connections
            # that sit silent cannot crowd it out (it would only fall back to gRPC, but slower).
            self._drop(min(handshakes.values(), key=lambda hs: hs.deadline), handshakes)
        sock.setblocking(False)
        hs = _Handshake(sock, time.monotonic() + tcp.HANDSHAKE_TIMEOUT)  # read now: tests patch it
        handshakes[sock] = hs
        self._selector.register(sock, selectors.EVENT_READ, hs)

    def _read_hello(self, hs: _Handshake, handshakes: dict[socket.socket, _Handshake]) -> None:
        try:
            chunk = hs.sock.recv(tcp.HELLO_BYTES - len(hs.received))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(hs, handshakes)
            return
        hs.received += chunk
        if len(hs.received) < tcp.HELLO_BYTES:
            return
        self._selector.unregister(hs.sock)
        del handshakes[hs.sock]
        magic, ticket = bytes(hs.received[: len(tcp.MAGIC)]), bytes(hs.received[len(tcp.MAGIC) :])
        with self._lock:
            waiting = self._waiting.get(ticket) if magic == tcp.MAGIC else None
            if waiting is not None and not waiting.arrived.is_set():
                try:
                    hs.sock.setblocking(True)
                    tcp.tune(hs.sock)
                    hs.sock.sendall(tcp.ACK)
                    hs.sock.settimeout(tcp.POLL_INTERVAL)
                except OSError:
                    hs.sock.close()
                    return
                waiting.sock = hs.sock
                waiting.arrived.set()
                return
        hs.sock.close()  # a wrong, stale or reused ticket: no answer

    def _drop(self, hs: _Handshake, handshakes: dict[socket.socket, _Handshake]) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(hs.sock)
        handshakes.pop(hs.sock, None)
        hs.sock.close()
