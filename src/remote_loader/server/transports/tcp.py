"""The data connection's sending end: a stream from another host may carry its batches' bytes
on TCP connections beside the gRPC stream (NOTE [ TCP data connection ] in
remote_loader.protos.tcp, which holds both ends' protocol); `DataListener` (listener.py)
accepts them.
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from remote_loader.protos import striping, tcp, tcp_closing, wire
from remote_loader.server.batch.outgoing import Outgoing
from remote_loader.server.errors import ClientSilent, DataConnectionLost
from remote_loader.server.transports.base import DEFAULT_CLIENT_SILENCE, StreamStopped
from remote_loader.server.transports.listener import DataListener

__all__ = ["DataListener", "TcpSender"]

log = logging.getLogger(__name__)

# The threads that write stripes 1.. of a stream's batches (tests count them).
STRIPE_THREAD_NAME = "rl-stripe-send"


class TcpSender:
    """Sends a stream's batches on its data connections; owns the sockets, and the threads that
    write all stripes but the first, until `close()`.

    A batch goes straight from its worker's slot into the sockets, stripe i on `socks[i]`
    (striping.stripes), all at once (a broadcast entry, too, for every consumer: only the kernel's
    copy is paid per consumer)."""

    name = "tcp"

    def __init__(
        self,
        socks: Sequence[socket.socket],
        client_silence: float = DEFAULT_CLIENT_SILENCE,
        retire: Callable[[Sequence[socket.socket], float], None] | None = None,
    ) -> None:
        if not 1 <= len(socks) <= tcp.MAX_DATA_CONNECTIONS:
            raise ValueError(
                f"a stream has 1 to {tcp.MAX_DATA_CONNECTIONS} data connections, got {len(socks)}"
            )
        self.socks = list(socks)
        self.client_silence = client_silence
        self.batches = 0  # sent on the data connections
        # Takes the sockets once the stream has ended, until the client has read everything
        # (DataListener.retire; NOTE [ End of a stream ]); None: closed at once.
        self._retire = retire
        self._ended = False
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
        # The last batch may still be in the kernel's buffers, unread: a FIN after it, never a
        # close (NOTE [ End of a stream ]).
        for sock in self.socks:
            tcp_closing.end_of_stream(sock)
        self._ended = True

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
        stripes = striping.stripes(len(blob), len(self.socks))
        tasks = [
            functools.partial(tcp.send, sock, blob[lo:hi], stop, self.client_silence)
            for sock, (lo, hi) in zip(self.socks, stripes, strict=False)
        ]
        try:
            if not striping.concurrently(self._pool, tasks, failed):
                raise StreamStopped()
        except tcp.SilentClientError as exc:
            raise ClientSilent(str(exc)) from exc
        except OSError as exc:
            raise DataConnectionLost(f"a data connection broke: {exc}") from exc
        self.batches += 1

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)  # idle: a batch's stripes all returned with it
        if self._ended and self._retire is not None:
            self._retire(self.socks, self.client_silence)
        else:  # broken or cancelled: nothing the client still needs
            for sock in self.socks:
                sock.close()
        self.socks = []
