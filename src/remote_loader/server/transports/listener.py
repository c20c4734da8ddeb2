"""The data listener: accepts the data connections streams announce, each with its ticket, over
TLS when the server serves TLS, and holds each stream's connections after its end until the
client has read them (NOTE [ TCP data connection ] and NOTE [ TLS data connection ] in
remote_loader.protos.tcp, NOTE [ End of a stream ] in remote_loader.protos.tcp_closing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence

from remote_loader.protos import tcp, tcp_closing

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Handshake:
    """A connection that has not yet sent its whole HELLO (nor, with TLS, finished its TLS
    handshake)."""

    sock: socket.socket
    deadline: float
    received: bytearray = dataclasses.field(default_factory=bytearray)
    secured: bool = False  # the TLS handshake is done (always, without TLS)


@dataclasses.dataclass
class _Closing:
    """A data connection whose stream ended, until its client closes it."""

    sock: socket.socket
    silence: float  # how long the client may give no sign of life
    deadline: float  # when it is let go: moved on by each sign (a heartbeat, bytes acked)
    unsent: int | None  # what the kernel still held for the client at the last look


class _Waiting:
    """A stream's ticket, until its connection arrives or the stream stops waiting."""

    def __init__(self) -> None:
        self.arrived = threading.Event()
        self.sock: socket.socket | None = None


class DataListener:
    """Accepts the data connections that streams announce (NOTE [ TCP data connection ]).

    One thread runs the accept loop, every handshake (TLS's and HELLO, non-blocking, selectors)
    and every ended stream's connections until their client closes them, so a client that
    connects and says nothing costs a socket for HANDSHAKE_TIMEOUT, not a thread; at most
    tcp.MAX_HANDSHAKES such connections are held (a new one evicts the oldest), and at most
    tcp_closing.MAX_CLOSING ended ones (likewise).

    `tls`: a server-side SSLContext (the gRPC port's certificate, key and client CA); every
    connection must speak TLS first (NOTE [ TLS data connection ]). None: plaintext.
    """

    def __init__(self, address: str, tls: ssl.SSLContext | None = None) -> None:
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
        self.tls = tls
        self._waiting: dict[bytes, _Waiting] = {}
        self._lock = threading.Lock()
        # Ended streams' connections, handed over by retire() to the listener's thread.
        self._retired: list[_Closing] = []
        self._done = False  # the thread has let go of everything: retire() closes at once
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

    def retire(self, socks: Sequence[socket.socket], silence: float) -> None:
        """Takes an ended stream's connections (each half-closed after its last batch) and
        closes each once its client has closed it, or has given no sign of life for `silence`
        seconds (NOTE [ End of a stream ])."""
        now = time.monotonic()
        closing = [
            _Closing(sock, silence, now + silence, tcp_closing.unsent(sock)) for sock in socks
        ]
        with self._lock:
            if not self._done:
                self._retired += closing
                return
        for each in closing:  # the listener is closed: nobody is left to wait for the client
            each.sock.close()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        with self._lock:
            for waiting in self._waiting.values():
                if waiting.sock is not None:  # arrived, but its stream never took it
                    waiting.sock.close()
                    waiting.sock = None
                waiting.arrived.set()  # with no socket: the stream goes on as Frames
            self._waiting.clear()

    def _run(self) -> None:
        handshakes: dict[socket.socket, _Handshake] = {}
        closing: dict[socket.socket, _Closing] = {}
        try:
            while not self._closed.is_set():
                self._take_retired(closing)
                for key, _ in self._selector.select(timeout=tcp.POLL_INTERVAL):
                    if key.data is None:
                        self._accept(handshakes)
                    elif isinstance(key.data, _Closing):
                        self._read_closing(key.data, closing)
                    else:
                        self._advance(key.data, handshakes)
                now = time.monotonic()
                for hs in [hs for hs in handshakes.values() if hs.deadline <= now]:
                    self._drop(hs.sock, handshakes)  # said nothing (enough) in time
                for each in list(closing.values()):
                    self._look_at(each, closing, now)
        except Exception:  # a bug here must not pass silently: streams fall back to Frames
            log.exception("the data listener failed; streams continue over gRPC")
        finally:
            with self._lock:
                self._done = True
            self._take_retired(closing)
            for sock in [*handshakes, *closing]:
                self._drop(sock, handshakes, closing)
            self._selector.close()
            self._listener.close()

    # --- connections arriving --------------------------------------------------------------------

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
            self._drop(min(handshakes.values(), key=lambda hs: hs.deadline).sock, handshakes)
        sock.setblocking(False)
        secured = self.tls is None
        if self.tls is not None:
            try:
                sock = self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            except (ssl.SSLError, OSError) as exc:
                log.info("data listener: cannot start TLS: %s", exc)
                sock.close()
                return
        hs = _Handshake(sock, time.monotonic() + tcp.HANDSHAKE_TIMEOUT, secured=secured)
        handshakes[sock] = hs  # the deadline is read now: tests patch HANDSHAKE_TIMEOUT
        self._selector.register(sock, selectors.EVENT_READ, hs)

    def _advance(self, hs: _Handshake, handshakes: dict[socket.socket, _Handshake]) -> None:
        """Takes a handshake as far as what has arrived allows: TLS's, then HELLO."""
        if not hs.secured:
            try:
                hs.sock.do_handshake()  # type: ignore[attr-defined]
            except ssl.SSLWantReadError:
                self._selector.modify(hs.sock, selectors.EVENT_READ, hs)
                return
            except ssl.SSLWantWriteError:
                self._selector.modify(hs.sock, selectors.EVENT_WRITE, hs)
                return
            except (ssl.SSLError, OSError) as exc:
                # Worth a line: a client with the wrong CA or no certificate (mTLS) lands here.
                log.info("data listener: TLS handshake failed: %s", exc)
                self._drop(hs.sock, handshakes)
                return
            hs.secured = True
            self._selector.modify(hs.sock, selectors.EVENT_READ, hs)
        # TLS may hold decrypted bytes the selector cannot see: read until it would block.
        while len(hs.received) < tcp.HELLO_BYTES:
            try:
                chunk = hs.sock.recv(tcp.HELLO_BYTES - len(hs.received))
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return
            except OSError:
                chunk = b""
            if not chunk:
                self._drop(hs.sock, handshakes)
                return
            hs.received += chunk
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

    # --- connections of ended streams ------------------------------------------------------------

    def _take_retired(self, closing: dict[socket.socket, _Closing]) -> None:
        with self._lock:
            retired, self._retired = self._retired, []
        for each in retired:
            if len(closing) >= tcp_closing.MAX_CLOSING:
                oldest = min(closing.values(), key=lambda c: c.deadline)
                self._drop(oldest.sock, closing=closing)
            try:
                self._selector.register(each.sock, selectors.EVENT_READ, each)
            except (OSError, ValueError):  # closed meanwhile
                each.sock.close()
                continue
            closing[each.sock] = each

    def _read_closing(self, each: _Closing, closing: dict[socket.socket, _Closing]) -> None:
        got = tcp.drain(each.sock)
        if got is None:  # the client closed its end: it read all it wanted
            self._drop(each.sock, closing=closing)
        elif got:
            each.deadline = time.monotonic() + each.silence  # a heartbeat

    def _look_at(self, each: _Closing, closing: dict[socket.socket, _Closing], now: float) -> None:
        unsent = tcp_closing.unsent(each.sock)
        if unsent != each.unsent:  # the client is reading
            each.unsent = unsent
            each.deadline = now + each.silence
        elif each.deadline <= now:
            log.info(
                "data listener: a client gave no sign of life for %g s after its stream "
                "ended (%s bytes unread): closing its connection",
                each.silence,
                "?" if unsent is None else unsent,
            )
            self._drop(each.sock, closing=closing)

    def _drop(
        self,
        sock: socket.socket,
        handshakes: dict[socket.socket, _Handshake] | None = None,
        closing: dict[socket.socket, _Closing] | None = None,
    ) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
        if handshakes is not None:
            handshakes.pop(sock, None)
        if closing is not None:
            closing.pop(sock, None)
        sock.close()
