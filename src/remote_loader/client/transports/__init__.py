"""The receive side of the transports, one module per transport:

- base.py: the `End` seam, `InbandEnd` (Frames inside the gRPC stream: always works, and every
  other transport's fallback) and `TransportUnusable`, how any end says "go on without me";
- shm.py: the stream's ring in /dev/shm, for a client on the server's host (protos/shm.py);
- tcp.py: data connections beside the gRPC stream, for a client on another host (protos/tcp.py);
- node.py: batches fetched from the Ray node that made them (protos/node.py), beside any of the
  above, which carries the rest.

`Transports` is what a client offers each stream of an epoch, and remembers what it gave up on;
`StreamEnds` is one stream's ends, which pick the end that carries each batch Frame, so the
receiver reads Frames and knows none of them. The server's side is remote_loader.server.transports.
"""

from __future__ import annotations

import dataclasses
import logging
import ssl
from collections.abc import Callable, Iterator

from remote_loader.client.errors import ProtocolError, TransportError
from remote_loader.client.transports.base import BatchReused, End, InbandEnd, TransportUnusable
from remote_loader.client.transports.node import NodeEnd
from remote_loader.client.transports.shm import ShmEnd
from remote_loader.client.transports.tcp import TcpEnd
from remote_loader.protos import loader_pb2 as pb

# Aliased: importing this package's own `shm` submodule binds the name `shm` here to it.
from remote_loader.protos import shm as shm_protocol
from remote_loader.protos import shm_probe, wire
from remote_loader.protos import slots as slot_protocol

__all__ = [
    "BatchReused",
    "End",
    "InbandEnd",
    "NodeEnd",
    "ShmEnd",
    "StreamEnds",
    "TcpEnd",
    "TransportUnusable",
    "Transports",
]

log = logging.getLogger(__name__)


class Transports:
    """What this client offers the streams of one epoch, less what it has given up on.

    `use_shm`: offer shared memory (where this host has /dev/shm). `tcp_host`: ask for data
    connections to this host (the gRPC target's; None: never), `data_connections` of them (None:
    tcp.default_connections; NOTE [ TCP data connection ]). `slot_maps`: the workers' slots
    mapped so far (the loader's). `on_tcp_failed(again)` is called when one could not be made
    (`again`: only its handshake was too slow): the owner decides whether later epochs ask.
    `tcp_tls`, `tcp_server_name`: a TLS client's context for its data connections and the name
    its server's certificate carries; `tcp_required`: transport="tcp", which never goes on
    inside gRPC (TransportError instead).
    """

    def __init__(
        self,
        what: str,
        *,
        use_shm: bool,
        tcp_host: str | None,
        data_connections: int | None = None,
        on_tcp_failed: Callable[[bool], None] = lambda again: None,
        slot_maps: slot_protocol.SlotMaps | None = None,
        tcp_tls: ssl.SSLContext | None = None,
        tcp_server_name: str | None = None,
        tcp_required: bool = False,
    ) -> None:
        self._what = what
        self._use_shm = use_shm and shm_protocol.available()
        self._tcp_host = tcp_host
        self._data_connections = data_connections
        self._tcp_options = TcpOptions(tcp_tls, tcp_server_name, tcp_required)
        self._on_tcp_failed = on_tcp_failed
        # Workers' slots mapped by the streams (NOTE [ Zero-copy slots ]); the loader's, so that
        # every epoch reads the same pool's slots through the same maps.
        self._slot_maps = slot_maps if slot_maps is not None else slot_protocol.SlotMaps()

    def open(self, stopped: Callable[[], bool]) -> StreamEnds:
        """The ends of a new stream, with what its request offers; `stopped`: the receiver's."""
        return StreamEnds(
            self._what,
            self._probe(),
            self._tcp_host,
            stopped,
            self._slot_maps,
            self._data_connections,
            self._tcp_options,
        )

    def give_up(self, unusable: TransportUnusable) -> None:
        """Offers no more streams the transport `unusable` names."""
        if unusable.transport == ShmEnd.name:
            self._use_shm = False
        elif unusable.transport == TcpEnd.name:
            self._tcp_host = None
            self._on_tcp_failed(unusable.again)

    def _probe(self) -> shm_probe.Probe | None:
        if not self._use_shm:
            return None
        try:
            return shm_probe.Probe()
        except shm_protocol.ShmUnavailable as exc:
            log.info("%s: no shared memory here (%s); streaming over gRPC", self._what, exc)
            self._use_shm = False
            return None


@dataclasses.dataclass(frozen=True)
class TcpOptions:
    """How a client makes its data connections, beyond where to (Transports' tcp_* args)."""

    tls: ssl.SSLContext | None = None
    server_name: str | None = None
    required: bool = False


class StreamEnds:
    """One stream's receiving ends: what its request offers, and which end carries each
    batch Frame. Owns what the ends open (a probe, a ring, sockets) until `close()`."""

    def __init__(
        self,
        what: str,
        probe: shm_probe.Probe | None,
        tcp_host: str | None,
        stopped: Callable[[], bool],
        slot_maps: slot_protocol.SlotMaps | None = None,
        data_connections: int | None = None,
        tcp_options: TcpOptions | None = None,
    ) -> None:
        self._what = what
        self._inband = InbandEnd()
        self._shm = ShmEnd(what, probe, slot_maps)
        options = tcp_options or TcpOptions()
        self._tcp = TcpEnd(
            what,
            tcp_host,
            stopped,
            data_connections,
            tls=options.tls,
            server_name=options.server_name,
            required=options.required and tcp_host is not None,
        )
        self._node = NodeEnd(what, stopped)
        self._carried = False  # a batch Frame arrived: too late to announce a data connection

    def offer(self, request: pb.StreamRequest) -> None:
        """Writes the offer into the stream's `request`: a shared-memory probe, data
        connections; the server picks at most one, and Frames are the rest."""
        offer = self._shm.offer()
        if offer is not None:
            request.shm.CopyFrom(offer)
        request.tcp = self._tcp.asked
        request.node_fetch = True  # NOTE [ Node data connection ]: the server decides per batch
        if self._tcp.asked:
            request.data_connections = self._tcp.connections

    def answered(self) -> None:
        """A Frame arrived: the server has read the offer."""
        self._shm.answered()

    def control(self, meta: pb.Frame) -> bool:
        """Handles `meta` if it is a Frame for the transports (the data connections'
        announcement, before any batch) rather than a batch: True if it was."""
        if meta.HasField("node_channel"):
            self._node.connect(meta.node_channel)
            return True
        if not meta.HasField("tcp_channel"):
            return False
        if self._carried:
            raise ProtocolError(f"{self._what}: a data connection announced mid-stream")
        self._tcp.connect(meta.tcp_channel)
        return True

    def frames(self, messages: Iterator[bytes]) -> Iterator[tuple[pb.Frame, memoryview]]:
        """The stream's gRPC `messages` as (Frame, data) pairs; each says the server has read
        the offer. Raises ProtocolError for a message that is not a Frame."""
        for message in messages:
            self.answered()
            try:
                yield wire.parse_frame(message)
            except wire.FrameError as exc:
                raise ProtocolError(f"{self._what}: {exc}") from exc

    def carrying(self, meta: pb.Frame) -> End:
        """The end that carries the batch Frame `meta`."""
        self._carried = True
        if meta.HasField("shm"):
            return self._shm
        if meta.on_tcp:
            return self._tcp
        if meta.HasField("node"):
            return self._node
        if self._tcp.required and not self._tcp.connected:
            raise TransportError(
                f'{self._what}: transport="tcp", but the server sends batch {meta.batch} inside '
                'the gRPC stream: it offers no data connection (its data_address is "off", '
                "or it is a version without them) or did not get them all in time; "
                'transport="auto" would go on inside gRPC'
            )
        return self._inband

    def server_closed(self) -> bool:
        """Whether the server has let go of the stream (its status follows the Frames it sent:
        reading on to it ends soon)."""
        return self._shm.server_closed()

    def beat(self) -> None:
        """The training loop is busy: tells the server, which may be waiting for room on the
        ring or the data connections, that this client is alive all the same."""
        self._shm.beat()
        self._tcp.beat()
        self._node.beat()

    def close(self) -> None:
        self._shm.close()
        self._tcp.close()
        self._node.close()
