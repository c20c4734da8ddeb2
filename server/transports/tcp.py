"""The data connection's sending end: a stream from another host may carry its batches' bytes
on a TCP connection beside the gRPC stream (NOTE [ TCP data connection ] in
remote_loader.protos.tcp, which holds both ends' protocol); `DataListener` accepts them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator

from remote_loader.protos import tcp, wire
from remote_loader.server.errors import ClientSilent, DataConnectionLost
from remote_loader.server.lanes import Entry
from remote_loader.server.transports.base import DEFAULT_CLIENT_SILENCE, StreamStopped, payload

log = logging.getLogger(__name__)


class TcpSender:
    """Sends a stream's batches on its data connection; owns the socket until `close()`.

    A batch goes straight from its worker's slot into the socket (a broadcast entry, too, for
    every consumer: only the kernel's copy is paid per consumer)."""

    name = "tcp"

    def __init__(self, sock: socket.socket, client_silence: float = DEFAULT_CLIENT_SILENCE) -> None:
        self.sock = sock
        self.client_silence = client_silence
        self.batches = 0  # sent on the data connection

    def send(self, batch: int, entry: Entry, stopped: Callable[[], bool]) -> Iterator[bytes]:
        view = payload(entry)
        # The Frame announcing that batch `batch` follows on the data connection goes first:
        # the client reads the socket only once it has it, so the order keeps both from waiting.
        yield wire.handle_frame(batch, len(view), entry.delivery.header_nbytes, on_tcp=True)
        self._write(view, stopped)

    def finish(self, stopped: Callable[[], bool]) -> None:
        pass

    def _write(self, blob: memoryview, stopped: Callable[[], bool]) -> None:
        """Writes the batch its Frame announced.

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
