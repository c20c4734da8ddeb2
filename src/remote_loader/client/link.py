"""How a RemoteLoader reaches its server: the channel and its stubs, unary calls tried again
after a refusal, and the receiver thread that reads one epoch's stream over the transports."""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

import grpc

from remote_loader.client import connect
from remote_loader.client.errors import LoaderNotFoundError
from remote_loader.client.items import Item
from remote_loader.client.options import LoaderOptions
from remote_loader.client.receiver import Receiver
from remote_loader.client.transports import StreamEnds, Transports
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import tcp
from remote_loader.protos.buffers import BufferPool
from remote_loader.protos.slots import SlotMaps


class ServerLink:
    """A RemoteLoader's connection to its server, made with the loader's `options` (where the
    server is, TLS and token, how calls are retried, how batches come: `transport`,
    `data_connections`, and where they go: `device`, pinned or not), batches for the CPU
    received into `buffers`. Opens the channel; `close()` closes it."""

    def __init__(self, options: LoaderOptions, buffers: BufferPool | None) -> None:
        self.options = options
        address, tls = options.address, options.tls
        self.address = address
        self.tls = tls
        self.buffers = buffers
        # The workers' slots this loader's streams have mapped (NOTE [ Zero-copy slots ] in
        # protos/slots.py): every epoch reads the same pool's, so each is mapped once.
        self.slot_maps = SlotMaps()
        # A data connection could not be made: later epochs do not try again (a firewall that
        # drops the connection would cost every epoch tcp.CONNECT_TIMEOUT), unless the port took
        # it and only the handshake was too slow (NOTE [ A slow handshake ] in protos/tcp.py).
        self._no_data_connection = False
        self._slow_handshakes = 0
        # The data connections' TLS: the channel's CA, certificate, key (NOTE [ TLS data
        # connection ] in protos/tcp.py); made once, here, so a bad file fails at once.
        self._data_tls = tls.data_context() if tls is not None else None
        if options.transport == "tcp" and tcp.target_host(address) is None:
            raise ValueError(
                f'transport="tcp" needs an address naming one TCP host (HOST:PORT), got '
                f"{address!r}: the data connections go to that host"
            )
        self._channel, stubs = connect.open_stubs(address, tls, options.token)
        self._describe, self._list, self._stream = stubs.describe, stubs.list, stubs.stream

    @property
    def channel(self) -> grpc.Channel:
        """The channel, token and all, for calls beside the loader's own (stall reports)."""
        return self._channel

    def describe(self, request: pb.DescribeRequest, what: str) -> pb.LoaderInfo:
        info: pb.LoaderInfo = self._call(self._describe, request, what)
        return info

    def only_loader(self) -> str:
        """The name of the server's only loader; LoaderNotFoundError if it has several."""
        names = list(self._call(self._list, pb.ListLoadersRequest(), "listing loaders").names)
        if len(names) != 1:
            raise LoaderNotFoundError(
                f"the server at {self.address} hosts {len(names)} loaders "
                f"({', '.join(names) or 'none'}); pass loader=NAME to pick one"
            )
        return str(names[0])

    def _call(self, method: Any, request: Any, what: str) -> Any:
        """A unary call, tried again after a refusal (NOTE [ Waiting for the server ])."""
        hint = (
            "(this client speaks TLS: does the server, with this CA, and does it want a client "
            "certificate?)"
            if self.tls is not None
            else "(this client speaks plaintext: a TLS server needs tls=...)"
        )
        return connect.first_call(
            lambda timeout: method(request, timeout=timeout, wait_for_ready=False),
            what=what,
            address=self.address,
            connect_timeout=self.options.connect_timeout,
            retries=self.options.retries,
            backoff=self.options.backoff,
            hint=hint,
        )

    def _wait_ready(self, timeout: float, stopped: Callable[[], bool]) -> bool:
        """Waits up to `timeout` s for the server to answer; False if it did not, or if
        `stopped()` turned true meanwhile."""
        return connect.wait_ready(
            lambda deadline: self._list.future(
                pb.ListLoadersRequest(), timeout=deadline, wait_for_ready=True
            ),
            timeout,
            stopped,
        )

    def _data_connection_failed(self, again: bool) -> None:
        self._slow_handshakes += again
        if not again or self._slow_handshakes >= tcp.SLOW_HANDSHAKES:
            self._no_data_connection = True

    def receiver(
        self, request: pb.StreamRequest, start: int, out: queue.Queue[Item], what: str
    ) -> Receiver:
        """The thread that reads `request`'s epoch from batch `start` into `out` (not started);
        `what` names the stream in its errors and logs."""

        def open_stream(first: int, ends: StreamEnds) -> Any:
            again = pb.StreamRequest()
            again.CopyFrom(request)
            again.start = first
            ends.offer(again)
            # Not wait_for_ready: the receiver has waited for the connection, with a deadline
            # (NOTE [ Waiting for the server ]); this call would wait for one without any.
            return self._stream(again, wait_for_ready=False)

        options = self.options
        transports = Transports(
            what,
            use_shm=options.transport == "auto",
            # A TLS client's data connections speak TLS (NOTE [ TLS data connection ]).
            tcp_host=(
                tcp.target_host(self.address)
                if options.transport != "grpc" and not self._no_data_connection
                else None
            ),
            data_connections=options.data_connections,
            on_tcp_failed=self._data_connection_failed,
            slot_maps=self.slot_maps,
            tcp_tls=self._data_tls,
            tcp_server_name=self.tls.server_name if self.tls is not None else None,
            tcp_required=options.transport == "tcp",
        )
        return Receiver(
            open_stream,
            out,
            transports=transports,
            device=options.device,
            pin=options.pin_memory,
            what=what,
            buffers=self.buffers,
            start=start,
            retries=options.retries,
            backoff=options.backoff,
            wait_ready=self._wait_ready,
            connect_timeout=options.connect_timeout,
        )

    def close(self) -> None:
        self.slot_maps.close()
        self._channel.close()
