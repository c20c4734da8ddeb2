"""Naming a batch on the node that made it, for a stream that asked (`StreamRequest.node_fetch`):
the trainer fetches the bytes from there (NOTE [ Node data connection ] in protos/node.py).

Wraps the sender the stream negotiated (data connections or Frames), which still carries every
batch made on this host, and every batch of a node the stream has not reached (yet, or at
all): the fallback, per batch.

Bound: a batch named on its node holds its slot there until the node has written it all to
the trainer's connections (SERVED). Naming is only a Frame, so nothing else would stop the
server from naming a whole epoch ahead of a slow trainer, every batch in a slot of its actor's
(measured: all 300 batches of an epoch named 2.4 s into its 15.8 s, 444 MB of actor memory).
So a stream names at most NAMED_AHEAD batches per node that the node has not yet written to
it, as a zero-copy stream leases at most slots.SLOT_LEASES slots (server/transports/shm.py),
and waits for the node's SERVED before naming another there: an actor's kept batches are its
tasks in flight, the batches made and not yet sent, NAMED_AHEAD per stream it serves, and the
slots released since its last task (a release rides on the next task). Measured with a free
dataset and a slow trainer, two actors: 13-14 slots at most, where the epoch was named ahead
(64 of its 80 batches kept at once), tests/integration/test_ray_faults.py; four actors on
two nodes across namespaces, 35 of the bound's 36 slots (benchmarks/ray_hosts.py --faults).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import node, wire
from remote_loader.server.batch.node_batch import Address, Directory, NodeBatch
from remote_loader.server.batch.outgoing import Outgoing
from remote_loader.server.transports.base import Sender, StreamStopped

# How long the first batch of a node announced to a stream waits for the trainer to have
# connected to it (milliseconds on one network; a trainer that cannot reach the node fails to
# connect within tcp.CONNECT_TIMEOUT and is not waited for again).
REACH_WAIT = 1.0
# A stream's batches named on one node and not yet written whole to its trainer (module doc).
NAMED_AHEAD = 4
# How often a stream waiting to name another batch looks whether it was stopped.
NAMED_CHECK = 0.05


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
        self._directories: dict[int, Directory] = {}
        # The leases of batches named and not yet fetched whole (ended at close), and their
        # handles, which the node's SERVED finds only while someone holds them.
        self._held: dict[int, tuple[Callable[[], None], NodeBatch]] = {}
        self._next_hold = 0
        # Per (directory, node): the batches named there and not yet SERVED (at most
        # NAMED_AHEAD), counted down by the watchers' thread.
        self._named: dict[tuple[int, Address], int] = {}
        self._served = threading.Condition()

    def send(self, batch: int, outgoing: Outgoing, stopped: Callable[[], bool]) -> Iterator[bytes]:
        kept = outgoing.node_batch
        if kept is None:
            yield from self.inner.send(batch, outgoing, stopped)
            return
        directory = kept.directory
        if not kept.on_node or not directory.watched(kept.address):
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
        if (id(directory), kept.address) not in self._deadlines:
            yield self._announce(directory, kept.address)
        # A node announced just now is waited for a little (the trainer connects meanwhile); a
        # trainer that cannot reach it costs that once, then its batches come from here.
        deadline = self._deadlines[(id(directory), kept.address)]
        if directory.wait_reached(self._nonce, kept.address, deadline, stopped):
            yield from self._name(batch, outgoing, stopped)
        else:
            yield from self.inner.send(batch, outgoing, stopped)

    def _announce(self, directory: Directory, address: Address) -> bytes:
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
        kept = outgoing.node_batch
        assert kept is not None
        where = (id(kept.directory), kept.address)
        self._wait_named(where, stopped)
        # The slot stays the batch's until the trainer has fetched it all (or this stream
        # ends): then the actor may make the next batch in it.
        hold = self._next_hold
        self._next_hold += 1
        release = outgoing.lease.hold()

        def done() -> None:
            if self._held.pop(hold, None) is None:
                return  # once (or the stream closed, which let go of it)
            with self._served:
                self._named[where] -= 1
                self._served.notify_all()
            release()

        self._held[hold] = (release, kept)
        kept.on_served(self._nonce, done)
        # Its node writes it to the trainer's connections now: it is there, or on its way,
        # when the trainer reads this Frame.
        if not kept.directory.push(kept, self._nonce):
            kept.abandon(self._nonce)
            done()
            yield from self.inner.send(batch, outgoing, stopped)
            return
        host, port = kept.address
        named = pb.NodeBatch(
            host=host,
            port=port,
            slot=kept.slot,
            generation=kept.generation,
            offset=kept.offset,
        )
        self.batches += 1
        yield wire.handle_frame(batch, kept.nbytes, outgoing.header_nbytes, node=named)

    def _wait_named(self, where: tuple[int, Address], stopped: Callable[[], bool]) -> None:
        """Waits until fewer than NAMED_AHEAD of this stream's batches named on the node
        `where` are unserved, and counts the next one; StreamStopped when `stopped()` turned
        true first (the trainer went, or resumed elsewhere: a node it cannot read from costs it
        client/transports/node.py's NODE_SILENCE, then a new stream)."""
        with self._served:
            while self._named.get(where, 0) >= NAMED_AHEAD:
                if stopped():
                    raise StreamStopped()
                self._served.wait(NAMED_CHECK)
            self._named[where] = self._named.get(where, 0) + 1

    def finish(self, stopped: Callable[[], bool]) -> None:
        self.inner.finish(stopped)

    def close(self) -> None:
        self.inner.close()
        for directory in self._directories.values():
            directory.forget(self._nonce)
        # A trainer that went without fetching them: the actors may reuse their slots (one
        # fetched late finds them STALE).
        for release, kept in list(self._held.values()):
            kept.abandon(self._nonce)
            release()
        self._held.clear()
