"""The data connection's sending end: a stream from another host may carry its batches' bytes
on TCP connections beside the gRPC stream (NOTE [ TCP data connection ] in
remote_loader.protos.tcp, which holds both ends' protocol); `DataListener` accepts them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from remote_loader.protos import tcp, wire
from remote_loader.server.errors import ClientSilent, DataConnectionLost
from remote_loader.server.outgoing import Outgoing
from remote_loader.server.transports.base import DEFAULT_CLIENT_SILENCE, StreamStopped

log = logging.getLogger(__name__)

# The threads that write stripes 1.. of a stream's batches (tests count them).
STRIPE_THREAD_NAME = "rl-stripe-send"


class TcpSender:
    """Sends a stream's batches on its data connections; owns the sockets, and the threads that
    write all stripes but the first, until `close()`.

    A batch goes straight from its worker's slot into the sockets, stripe i on `socks[i]`
    (tcp.stripes), all at once (a broadcast entry, too, for every consumer: only the kernel's
    copy is paid per consumer)."""

    name = "tcp"

    def __init__(
        self, socks: Sequence[socket.socket], client_silence: float = DEFAULT_CLIENT_SILENCE
    ) -> None:
        if not 1 <= len(socks) <= tcp.MAX_DATA_CONNECTIONS:
            raise ValueError(
                f"a stream has 1 to {tcp.MAX_DATA_CONNECTIONS} data connections, got {len(socks)}"
            )
        self.socks = list(socks)
        self.client_silence = client_silence
        self.batches = 0  # sent on the data connections
        # Threads start on the first batch that needs them; close() joins them.
        self._pool = (
            ThreadPoolExecutor(len(socks) - 1, thread_name_prefix=STRIPE_THREAD_NAME)
            if len(socks) > 1
            else None
        )

    def send(self, batch: int, outgoing: Outgoing, stopped: Callable[[], bool]) -> Iterator[bytes]:
        view = tcp.as_bytes(outgoing.blob)
        # The Frame announcing that batch `batch` follows on the data connections goes first:
        # the client reads the sockets only once it has it, so the order keeps both from waiting.
        yield wire.handle_frame(batch, len(view), outgoing.header_nbytes, on_tcp=True)
        self._write(view, stopped)

    def finish(self, stopped: Callable[[], bool]) -> None:
        pass

    def _write(self, blob: memoryview, stopped: Callable[[], bool]) -> None:
        """Writes the batch its Frame announced, each stripe on its connection, and returns
        once all are written or all writers have stopped.

        Raises StreamStopped when `stopped()` turned true first, DataConnectionLost when the
        client has gone (any one connection broke), ClientSilent when it stopped reading and
        beating on one (NOTE [ TCP data connection ]).
        """
        failed = threading.Event()  # one stripe failed: the others stop

        def stop() -> bool:
            return failed.is_set() or stopped()

        # A small batch has fewer stripes than the stream has connections: the first ones.
        stripes = tcp.stripes(len(blob), len(self.socks))
        tasks = [
            functools.partial(tcp.send, sock, blob[lo:hi], stop, self.client_silence)
            for sock, (lo, hi) in zip(self.socks, stripes, strict=False)
        ]
        try:
            if not tcp.concurrently(self._pool, tasks, failed):
                raise StreamStopped()
        except tcp.SilentClientError as exc:
            raise ClientSilent(str(exc)) from exc
        except OSError as exc:
            raise DataConnectionLost(f"a data connection broke: {exc}") from exc
        self.batches += 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # idle: a batch's stripes all returned with it
        for sock in self.socks:
            sock.close()


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
        """A new ticket for a stream about to announce a data connection."""
        ticket = tcp.new_ticket()
        with self._lock:
            self._waiting[ticket] = _Waiting()
        return ticket

    def wait(
        self, tickets: Sequence[bytes], stopped: Callable[[], bool], timeout: float | None = None
    ) -> list[socket.socket | None]:
        """The connections that sent `tickets`, in their order; None for each that did not come
        within `timeout` s in all (default tcp.ACCEPT_TIMEOUT), or before `stopped()` turned
        true. The tickets are forgotten either way: none is handed over after this returns."""
        with self._lock:
            waiting = [self._waiting.get(ticket) for ticket in tickets]
        deadline = time.monotonic() + (tcp.ACCEPT_TIMEOUT if timeout is None else timeout)

        def all_arrived() -> bool:
            for each in waiting:
                while each is not None and not each.arrived.wait(tcp.POLL_INTERVAL):
                    if stopped() or time.monotonic() >= deadline:
                        return False
            return True

        try:
            all_arrived()
        finally:
            with self._lock:  # a handshake hands its socket over under this lock
                for ticket in tickets:
                    self._waiting.pop(ticket, None)
        return [
            each.sock if each is not None and each.arrived.is_set() else None for each in waiting
        ]

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
