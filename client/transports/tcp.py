"""The data connection's receiving end: batch bytes read from a socket beside the gRPC stream,
for a client that cannot share the server's /dev/shm (NOTE [ TCP data connection ] in
remote_loader.protos.tcp, which holds both ends' protocol).
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from remote_loader.client.assembly import Assembly
from remote_loader.client.errors import ConnectionLostError, ProtocolError
from remote_loader.client.transports.base import TransportUnusable
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import tcp


class TcpEnd:
    """Connects when the stream announces its data connection, then reads each batch whose
    Frame says `on_tcp` from it, header first, then the payload straight into place.

    `host`: the gRPC target's host, where the data connection goes (None: this client did not
    ask for one). `stopped`: the receiver's; a read waiting on the socket gives up when it
    turns true.
    """

    name = "tcp"

    def __init__(self, what: str, host: str | None, stopped: Callable[[], bool]) -> None:
        self._what = what
        self._host = host
        self._stopped = stopped
        self._sock: socket.socket | None = None

    @property
    def asked(self) -> bool:
        """Whether the stream's request asks for a data connection."""
        return self._host is not None

    def connect(self, channel: pb.TcpChannel) -> None:
        """Opens the data connection the stream's first Frame announced."""
        if self._sock is not None:
            raise ProtocolError(f"{self._what}: a data connection announced mid-stream")
        if self._host is None:
            raise ProtocolError(f"{self._what}: a data connection this client did not ask for")
        try:
            self._sock = tcp.connect(self._host, channel.port, channel.ticket)
        except (tcp.DataConnectionError, ValueError) as exc:
            raise TransportUnusable(self.name, str(exc), "inside the gRPC stream") from exc

    def fill(self, meta: pb.Frame, data: memoryview, assembly: Assembly) -> bool:
        sock = self._sock
        if sock is None:
            raise ProtocolError(
                f"{self._what}: batch {assembly.batch} is on a data connection that was never made"
            )
        try:
            # Through the module: tests cut the connection under tcp.recv_into.
            return assembly.receive(lambda view: tcp.recv_into(sock, view, self._stopped))
        except tcp.DataConnectionError as exc:
            raise ConnectionLostError(f"{self._what}: batch {assembly.batch}: {exc}") from exc

    def beat(self) -> None:
        if self._sock is not None:
            tcp.beat(self._sock)

    def close(self) -> None:
        if self._sock is not None:  # each stream has its own data connection
            self._sock.close()
            self._sock = None
