"""Naming a batch on the node that made it, for a stream that asked (`StreamRequest.direct`):
the trainer fetches the bytes from there (NOTE [ Node data connection ] in protos/node.py).

Wraps the sender the stream negotiated (data connections or Frames), which still carries every
batch made on this host, and every batch of a node the stream has not reached (yet, or at
all): the fallback, per batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import node, wire
from remote_loader.server.outgoing import Outgoing
from remote_loader.server.remote import Address, NodeDirectory, RemoteBatch
from remote_loader.server.transports.base import Sender

# How long the first batch of a node announced to a stream waits for the trainer to have
# connected to it (milliseconds on one network; a trainer that cannot reach the node fails to
# connect within tcp.CONNECT_TIMEOUT and is not waited for again).
REACH_WAIT = 1.0


class NodeSender:
    """`inner`'s batches, but those lying on a node this stream reached named there; the
    trainer makes `connections` connections to each node (1 to tcp.MAX_DATA_CONNECTIONS)."""

    name = "node"

    def __init__(self, inner: Sender, connections: int) -> None:
        self.inner = inner
        self.batches = 0  # named on their nodes
        self._nonce = node.new_nonce(connections, pushed=True)
        self._connections = connections
        # Per (directory, node) announced: until when a batch of it waits for the trainer to
        # reach it.
        self._deadlines: dict[tuple[int, Address], float] = {}
        self._directories: dict[int, NodeDirectory] = {}
        # The leases of batches named and not yet fetched whole (ended at close), and their
        # handles, which the node's SERVED finds only while someone holds them.
        self._held: dict[int, tuple[Callable[[], None], RemoteBatch]] = {}
        self._next_hold = 0

    def send(self, batch: int, outgoing: Outgoing, stopped: Callable[[], bool]) -> Iterator[bytes]:
        remote = outgoing.remote
        if remote is None:
            yield from self.inner.send(batch, outgoing, stopped)
            return
        directory = remote.directory
        if not remote.on_node or not directory.watched(remote.address):
            # Here already (or lost with its node: made again here), or its node's events
            # would not reach this server.
            yield from self.inner.send(batch, outgoing, stopped)
            return
        if id(directory) not in self._directories:
            # The pool's first batch for this stream: every node it knows is announced now, so
            # the trainer connects to all at once.
            self._directories[id(directory)] = directory
            for address in directory.nodes():
                yield self._announce(directory, address)
        if (id(directory), remote.address) not in self._deadlines:
            yield self._announce(directory, remote.address)
        # A node announced just now is waited for a little (the trainer connects meanwhile); a
        # trainer that cannot reach it costs that once, then its batches come from here.
        deadline = self._deadlines[(id(directory), remote.address)]
        if directory.wait_reached(self._nonce, remote.address, deadline, stopped):
            yield from self._name(batch, outgoing, stopped)
        else:
            yield from self.inner.send(batch, outgoing, stopped)

    def _announce(self, directory: NodeDirectory, address: Address) -> bytes:
        self._deadlines[(id(directory), address)] = time.monotonic() + REACH_WAIT
        host, port = address
        channel = pb.NodeChannel(
            host=host,
            port=port,
            ticket=directory.ticket(self._nonce),
            connections=self._connections,
        )
        return wire.control_frame(pb.Frame(node_channel=channel))

    def _name(self, batch: int, outgoing: Outgoing, stopped: Callable[[], bool]) -> Iterator[bytes]:
        remote = outgoing.remote
        assert remote is not None
        # The slot stays the batch's until the trainer has fetched it all (or this stream
        # ends): then the actor may make the next batch in it.
        hold = self._next_hold
        self._next_hold += 1
        release = outgoing.lease.hold()

        def done() -> None:
            self._held.pop(hold, None)
            release()

        self._held[hold] = (release, remote)
        remote.on_served(self._nonce, done)
        # Its node writes it to the trainer's connections now: it is there, or on its way,
        # when the trainer reads this Frame.
        if not remote.directory.push(remote, self._nonce):
            remote.abandon(self._nonce)
            done()
            yield from self.inner.send(batch, outgoing, stopped)
            return
        host, port = remote.address
        where = pb.NodeBatch(
            host=host,
            port=port,
            slot=remote.slot,
            generation=remote.generation,
            offset=remote.offset,
        )
        self.batches += 1
        yield wire.handle_frame(batch, remote.nbytes, outgoing.header_nbytes, node=where)

    def finish(self, stopped: Callable[[], bool]) -> None:
        self.inner.finish(stopped)

    def close(self) -> None:
        self.inner.close()
        for directory in self._directories.values():
            directory.forget(self._nonce)
        # A trainer that went without fetching them: the actors may reuse their slots (one
        # fetched late finds them STALE).
        for release, remote in list(self._held.values()):
            remote.abandon(self._nonce)
            release()
        self._held.clear()
