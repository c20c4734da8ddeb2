"""The data connection's receiving end: batch bytes read from sockets beside the gRPC stream,
for a client that cannot share the server's /dev/shm (NOTE [ TCP data connection ] in
remote_loader.protos.tcp, which holds both ends' protocol).
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from remote_loader.client.assembly import Assembly
from remote_loader.client.errors import ConnectionLostError, ProtocolError, TransportError
from remote_loader.client.transports.base import TransportUnusable
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import striping, tcp

# The threads that read stripes 1.. of a stream's batches (tests count them).
STRIPE_THREAD_NAME = "rl-stripe-recv"


class TcpEnd:
    """Connects when the stream announces its data connections, then reads each batch whose
    Frame says `on_tcp` from them, stripe i from connection i (striping.stripes), all at once:
    header first, then the payload straight into place.

    `host`: the gRPC target's host, where the data connections go (None: this client did not
    ask for any). `connections`: how many it asks for (1 to tcp.MAX_DATA_CONNECTIONS; None:
    tcp.default_connections, fewer under TLS on a host of few CPUs). `stopped`: the
    receiver's; a read waiting on a socket gives up when it turns true. `tls`: the client's
    context for the data connections (a TLS client's: its gRPC channel's CA, certificate and
    key), `server_name` the name the server's certificate must carry (None: `host`).
    `required`: transport="tcp", where a data connection that cannot be made is an error
    (TransportError), not a fallback.
    """

    name = "tcp"

    def __init__(
        self,
        what: str,
        host: str | None,
        stopped: Callable[[], bool],
        connections: int | None = None,
        *,
        tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
        required: bool = False,
    ) -> None:
        if connections is None:
            connections = tcp.default_connections(tls=tls is not None)
        if not 1 <= connections <= tcp.MAX_DATA_CONNECTIONS:
            raise ValueError(
                f"data_connections must be between 1 and {tcp.MAX_DATA_CONNECTIONS}, "
                f"got {connections}"
            )
        self._what = what
        self._host = host
        self._stopped = stopped
        self.connections = connections
        self._tls = tls
        self._server_name = server_name
        self.required = required
        self._socks: list[socket.socket] = []
        # Reads stripes 1.. (and makes connections 1..); threads start when first needed.
        self._pool: ThreadPoolExecutor | None = None

    @property
    def connected(self) -> bool:
        """Whether the stream's data connections are made."""
        return bool(self._socks)

    @property
    def asked(self) -> bool:
        """Whether the stream's request asks for data connections."""
        return self._host is not None

    def connect(self, channel: pb.TcpChannel) -> None:
        """Opens all the data connections the stream's first Frame announced, at once (each
        within tcp.CONNECT_TIMEOUT); if any cannot be made, closes the others and raises
        TransportUnusable."""
        if self._socks:
            raise ProtocolError(f"{self._what}: a data connection announced mid-stream")
        host = self._host
        if host is None:
            raise ProtocolError(f"{self._what}: a data connection this client did not ask for")
        tickets = [channel.ticket, *channel.more_tickets]
        if len(tickets) > self.connections:
            raise ProtocolError(
                f"{self._what}: {len(tickets)} data connections announced, "
                f"{self.connections} asked for"
            )

        def attempt(ticket: bytes) -> socket.socket | Exception:
            try:
                return tcp.connect(
                    host, channel.port, ticket, tls=self._tls, server_name=self._server_name
                )
            except (tcp.DataConnectionError, ValueError) as exc:
                return exc

        more: list[Future[socket.socket | Exception]] = []
        if len(tickets) > 1:
            self._pool = ThreadPoolExecutor(len(tickets) - 1, thread_name_prefix=STRIPE_THREAD_NAME)
            more = [self._pool.submit(attempt, ticket) for ticket in tickets[1:]]
        outcomes: list[socket.socket | Exception] = []
        try:
            outcomes.append(attempt(tickets[0]))
        finally:
            outcomes += [future.result() for future in more]  # each within CONNECT_TIMEOUT
            made = [each for each in outcomes if isinstance(each, socket.socket)]
            errors = [each for each in outcomes if not isinstance(each, socket.socket)]
            if len(made) < len(tickets):
                for sock in made:
                    sock.close()
        if errors:
            reason = str(errors[0])
            if len(tickets) > 1:
                reason = f"{len(errors)} of {len(tickets)} data connections failed: {reason}"
            if self.required:
                raise TransportError(
                    f'{self._what}: transport="tcp", but {reason}; transport="auto" would go on '
                    "inside the gRPC stream instead"
                ) from errors[0]
            # Every one taken by the port but too slow to handshake: this process (or the
            # server) was busy, and a later epoch may well make them.
            again = all(isinstance(each, tcp.HandshakeTimeout) for each in errors)
            raise TransportUnusable(
                self.name, reason, "inside the gRPC stream", again=again
            ) from errors[0]
        self._socks = made

    def fill(self, meta: pb.Frame, data: memoryview, assembly: Assembly) -> bool:
        socks = self._socks
        if not socks:
            raise ProtocolError(
                f"{self._what}: batch {assembly.batch} is on a data connection that was never made"
            )
        failed = threading.Event()  # one stripe failed: the others stop

        def stop() -> bool:
            return failed.is_set() or self._stopped()

        def read(i: int, view: memoryview) -> bool:
            # Through the module: tests cut the connection under tcp.recv_into.
            return tcp.recv_into(socks[i], view, stop)

        try:
            return assembly.receive(
                read,
                striping.stripes(assembly.total, len(socks)),
                lambda tasks: striping.concurrently(self._pool, tasks, failed),
            )
        except tcp.DataConnectionError as exc:
            raise ConnectionLostError(f"{self._what}: batch {assembly.batch}: {exc}") from exc

    def beat(self) -> None:
        for sock in self._socks:
            tcp.beat(sock)

    def close(self) -> None:
        if self._pool is not None:  # idle: a batch's stripes all returned with it
            self._pool.shutdown(wait=True)
            self._pool = None
        for sock in self._socks:  # each stream has its own data connections
            sock.close()
        self._socks = []
