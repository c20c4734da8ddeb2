"""Fetching a batch from the node that made it (NOTE [ Node data connection ] in
remote_loader.protos.node): the server names the node and the slot, this end reads the bytes
from the node's data server, stripe i on connection i, all at once.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from remote_loader.client.assembly import Assembly
from remote_loader.client.errors import ConnectionLostError, ProtocolError
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import node, striping, tcp

log = logging.getLogger(__name__)

# The threads that connect to nodes and read stripes 1.. (tests count them).
NODE_THREAD_NAME = "rl-node-recv"
# Nodes one stream connects to (a pool's actors of other hosts: each has a data server); past
# it, announcements are ignored and those nodes' batches keep coming through the server.
MAX_NODES = 256
# How long a node may send nothing of a batch this stream reads from it before it counts as
# silent (cut off from this trainer, or stopped): the stream breaks and is resumed from that
# batch, whose node's batches then come through the server if it still cannot be reached
# (NOTE [ Node data connection ] in protos/node.py). The node pushes a batch as soon as it is
# named, so a few seconds of nothing is no busy node; a data connection waits STALL_TIMEOUT.
# Counted per batch: a byte of any of its stripes is a sign of life (the node writes them one
# after another, so a stripe may wait for the others to leave).
NODE_SILENCE = 3.0
# A stripe is read in pieces of this size, each a sign of life of its node.
PROGRESS_STEP = 1 << 20

Address = tuple[str, int]


class NodeEnd:
    """Connects, in the background, to each node a stream announces (Frame.node_channel), and
    reads each batch whose Frame names a node (Frame.node) from it. A node it cannot reach is
    never told so to the server, which then goes on sending that node's batches itself.

    `stopped`: the receiver's; a read waiting on a socket gives up when it turns true."""

    name = "node"

    def __init__(self, what: str, stopped: Callable[[], bool]) -> None:
        self._what = what
        self._stopped = stopped
        self._nodes: dict[Address, Future[list[socket.socket]]] = {}
        # Connects to nodes, and reads stripes 1..; threads start when first needed.
        self._connector: ThreadPoolExecutor | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.fetched = 0  # bytes read from nodes, for the epoch's stats

    def connect(self, channel: pb.NodeChannel) -> None:
        """Starts connecting to the node `channel` announces (`channel.connections` times)."""
        address = (channel.host, channel.port)
        if address in self._nodes or len(self._nodes) >= MAX_NODES:
            return
        if not 1 <= channel.connections <= tcp.MAX_DATA_CONNECTIONS:
            raise ProtocolError(
                f"{self._what}: a node announced with {channel.connections} connections"
            )
        if self._connector is None:
            self._connector = ThreadPoolExecutor(4, thread_name_prefix=NODE_THREAD_NAME)
        if self._pool is None and channel.connections > 1:
            self._pool = ThreadPoolExecutor(
                tcp.MAX_DATA_CONNECTIONS - 1, thread_name_prefix=NODE_THREAD_NAME
            )
        self._nodes[address] = self._connector.submit(
            self._connect, address, channel.ticket, channel.connections
        )

    def _connect(self, address: Address, ticket: bytes, count: int) -> list[socket.socket]:
        made: list[socket.socket] = []
        try:
            for _ in range(count):
                made.append(tcp.connect(*address, ticket))
        except (tcp.DataConnectionError, ValueError) as exc:
            for sock in made:
                sock.close()
            log.info(
                "%s: the node %s:%d cannot be reached (%s); its batches come through the server",
                self._what,
                *address,
                exc,
            )
            raise
        return made

    def fill(self, meta: pb.Frame, data: memoryview, assembly: Assembly) -> bool:
        where = meta.node
        connecting = self._nodes.get((where.host, where.port))
        if connecting is None:
            raise ProtocolError(
                f"{self._what}: batch {assembly.batch} named on a node never announced "
                f"({where.host}:{where.port})"
            )
        try:
            # Made already, or nearly: the node told the server of them all.
            socks = connecting.result(timeout=tcp.CONNECT_TIMEOUT * tcp.MAX_DATA_CONNECTIONS)
        except Exception as exc:
            raise ConnectionLostError(
                f"{self._what}: batch {assembly.batch} is on {where.host}:{where.port}, which "
                f"this client could not connect to: {exc}"
            ) from exc
        stripes = striping.stripes(assembly.total, len(socks))
        answered = [False] * len(stripes)
        failed = threading.Event()  # one stripe failed: the others stop
        heard = [time.monotonic()]  # the last sign of life of the node, any stripe's
        silent = threading.Event()  # none for NODE_SILENCE: every stripe stops

        def stop() -> bool:
            if failed.is_set() or self._stopped():
                return True
            if time.monotonic() - heard[0] >= NODE_SILENCE:
                silent.set()
            return silent.is_set()

        def read(i: int, view: memoryview) -> bool:
            # The node pushes each stripe after a status byte, read into the assembly's views
            # in turn.
            if not answered[i]:
                answered[i] = True
                if not node.answer(socks[i], stop):
                    return False
                heard[0] = time.monotonic()
            view = tcp.as_bytes(view)
            for lo in range(0, len(view), PROGRESS_STEP):
                if not tcp.recv_into(socks[i], view[lo : lo + PROGRESS_STEP], stop):
                    return False
                heard[0] = time.monotonic()
            return True

        try:
            done = assembly.receive(
                read, stripes, lambda tasks: striping.concurrently(self._pool, tasks, failed)
            )
        except tcp.DataConnectionError as exc:
            # A stripe read half-way leaves the connection mid-answer: no use any more.
            self._drop((where.host, where.port))
            raise ConnectionLostError(
                f"{self._what}: batch {assembly.batch} from {where.host}:{where.port}: {exc}"
            ) from exc
        if done:
            self.fetched += assembly.total
            return True
        self._drop((where.host, where.port))
        if silent.is_set() and not self._stopped():
            # Cut off from this trainer (or stopped): a new stream has the batch, through the
            # server if the node still cannot be reached (NOTE [ Node data connection ]).
            raise ConnectionLostError(
                f"{self._what}: batch {assembly.batch} is on {where.host}:{where.port}, which "
                f"sent nothing of it for {NODE_SILENCE:g} s"
            )
        return False

    def _drop(self, address: Address) -> None:
        connecting = self._nodes.pop(address, None)
        if connecting is not None and connecting.done() and connecting.exception() is None:
            for sock in connecting.result():
                sock.close()

    def beat(self) -> None:
        for connecting in list(self._nodes.values()):
            if connecting.done() and connecting.exception() is None:
                for sock in connecting.result():
                    tcp.beat(sock)  # a node waiting for room reads them as a sign of life

    def close(self) -> None:
        for pool in (self._connector, self._pool):
            if pool is not None:  # a connect gives up within tcp.CONNECT_TIMEOUT
                pool.shutdown(wait=True, cancel_futures=True)
        self._connector = self._pool = None
        for connecting in self._nodes.values():
            if connecting.done() and connecting.exception() is None:
                for sock in connecting.result():
                    sock.close()
        self._nodes.clear()
