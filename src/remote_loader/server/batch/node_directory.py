"""The nodes of a Ray pool whose actors keep batches (NOTE [ Node data connection ] in
protos/node.py): the pool's `NodeDirectory` (tickets, which streams reached which node, the
server's own fetches, and the batches kept on each node, server/batch/node_batch.py's
NodeBatch), and what happens to those batches when a node is lost.

A leaf between the Ray pool and the send stage, as node_batch.py is.

NOTE [ Node lost ]

A batch kept on a node lives in its actor's memory until it leaves it, and the pool counted its
task done when the Result came. So the directory watches every node (a connection to each data
server, its events read by a thread of its own), and when a node's watcher closes (its actor's
process ended: killed, out of memory, its node lost) or cannot be made, each of that node's
batches that no stream has fetched whole (ORPHANED) is sent, with the task that made it, to
another live actor on a KEEP lane (a Remake down its lane), which makes it again outside its
slots and tells its own watcher REMADE; the directory fetches it into the server's room for
the batch, where it stays (HERE): senders send it from there, as through a COPY lane.

    sender (a stream's)                 directory (its thread)            other actor
    -------------------                 ----------------------            -----------
    batch KEPT: named on its node,      watcher of node A closes:
    or fetched from it                  A's unfetched batches ORPHANED,
                                        each to a live actor B:  ------>  Remake (lane):
    ORPHANED: waits (REMAKE_WAIT)                                          make_batch, kept
                                        REMADE (B's watcher): fetch  <--  until fetched
                                        into the room: HERE
    HERE: sends it from the room

Nothing is lost or repeated: a batch is made again only if no trainer has it, and it goes to
its place in the same Run. The cost: a batch the server had already named on the lost node
breaks its stream, which the client resumes from that batch like any data connection break (a
resumed stream makes it again). Bounds: a batch is made again at most MAX_REMAKES times (its
stream then breaks until the client's retries give up, as for a poison sample); the batches
held for remakes are those the pool holds anyway. A remade batch must have the size the lost
one had (a dataset deterministic for a task's indices and seed, as torch's re-issued tasks
assume); one that differs is lost, with that said.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import select
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from remote_loader.protos import node, tcp
from remote_loader.server.batch.node_batch import ORPHANED, Address, NodeBatch

log = logging.getLogger(__name__)

# How often a batch is made again before it counts as lost (each time an actor died holding it).
MAX_REMAKES = 3


class NodeDirectory:
    """One pool's nodes: tickets for its streams, the nodes each stream has reached, its
    batches kept on them, and the server's connections to them: one watcher per node (the
    node's REACHED and SERVED events, read by a thread of this directory's) and one for the
    batches it sends itself. `record(path, nbytes)`: counts bytes of batches made on other
    hosts, by path ("server" or "node")."""

    def __init__(
        self,
        key: bytes,
        record: Callable[[str, int], None],
        remake: Callable[[NodeBatch, int], Address | None] = lambda batch, remake_id: None,
    ) -> None:
        self._key = key
        self.record = record
        # Sends a batch to be made again by a live actor (any thread), under a remake id;
        # returns that actor's node, or None when none can take it now.
        self._remake = remake
        # NOTE [ Node lost ]: batches to be made again, and those being made, by remake id.
        self._orphans: deque[weakref.ref[NodeBatch]] = deque()
        self._remaking: dict[int, tuple[weakref.ref[NodeBatch], Address]] = {}
        self._remake_ids = itertools.count()
        self.remade = 0  # batches made again and arrived here (describe(), tests)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a stream reached a node
        # The nodes watched, with their watcher's socket and what it has half read.
        self._watchers: dict[Address, tuple[socket.socket, bytearray]] = {}
        self._pushing = threading.Lock()  # one PUSH at a time on any watcher
        # Per stream nonce: the nodes all its connections reached (forgotten at its close).
        self._reached: dict[bytes, set[Address]] = {}
        # The batches on nodes that a stream may still fetch, by (node, slot, generation).
        self._kept: weakref.WeakValueDictionary[tuple[Address, int, int], NodeBatch] = (
            weakref.WeakValueDictionary()
        )
        # The server's own connection per node (one fetch at a time on each: its lock).
        self._own_nonce = node.new_nonce(1)
        self._own: dict[Address, tuple[threading.Lock, list[socket.socket]]] = {}
        self._closed = False
        self._thread: threading.Thread | None = None

    def kept(
        self,
        address: Address,
        slot: int,
        generation: int,
        offset: int,
        nbytes: int,
        header_nbytes: int = 0,
        task: tuple[int, Any, int | None] | None = None,
    ) -> NodeBatch:
        """The handle of a batch an actor keeps (the pool's thread); its node is watched from
        now on (connecting the first time: at most tcp.CONNECT_TIMEOUT, once per actor)."""
        batch = NodeBatch(self, address, slot, generation, offset, nbytes, header_nbytes, task)
        with self._lock:
            self._kept[(address, slot, generation)] = batch
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(
                    target=self._read_events, name="rl-node-watch", daemon=True
                )
                self._thread.start()
        if address not in self._watchers and not self._watch(address):
            self._lost(address)  # an actor gone already (or unreachable): made again
        return batch

    def _watch(self, address: Address) -> bool:
        """Connects the node's watcher; False when it cannot be (the node is taken as lost)."""
        try:
            sock = tcp.connect(*address, node.ticket(self._key, self._own_nonce))
            sock.sendall(node.REQUEST.pack(node.WATCH, 0, 0, 0))
        except (OSError, tcp.DataConnectionError) as exc:
            log.info("the node data server at %s:%d cannot be watched: %s", *address, exc)
            return False
        with self._lock:
            if self._closed:
                sock.close()
                return False
            self._watchers[address] = (sock, bytearray())
        return True

    def _read_events(self) -> None:
        """The watchers' thread: each node's events, until the directory closes."""
        while not self._closed:
            with self._lock:
                watched = {sock: address for address, (sock, _) in self._watchers.items()}
            self._dispatch()
            try:
                ready, _, _ = select.select(list(watched), [], [], 0.2)
            except (OSError, ValueError):
                continue  # one closed meanwhile
            for sock in ready:
                address = watched[sock]
                try:
                    data = sock.recv(1 << 16)
                except OSError:
                    data = b""
                if not data:  # the node (its actor) is gone
                    with self._lock:
                        self._watchers.pop(address, None)
                    sock.close()
                    self._lost(address)
                    continue
                pending = self._watchers[address][1]
                pending += data
                while len(pending) >= node.EVENT.size:
                    self._event(address, *node.EVENT.unpack_from(pending))
                    del pending[: node.EVENT.size]

    def _event(
        self, address: Address, kind: bytes, nonce: bytes, slot: int, generation: int, n: int
    ) -> None:
        if kind == node.REACHED:
            with self._lock:
                reached = self._reached.get(nonce)
                if reached is not None:  # else the stream has ended
                    reached.add(address)
                    self._changed.notify_all()
        elif kind in (node.REMADE, node.UNMADE):
            self._remade(address, kind, slot, generation, n)
        elif kind == node.SERVED:
            if nonce != self._own_nonce:  # counted here: a stream may end before this comes
                self.record("node", n)
            batch = self._kept.get((address, slot, generation))
            if batch is not None:  # else its batch is long done with
                batch.served(nonce, n)

    # --- NOTE [ Node lost ] -----------------------------------------------------------------

    def _lost(self, address: Address) -> None:
        """The node's actor is gone: its batches no stream has yet are made again elsewhere."""
        with self._lock:
            kept = list(self._kept.values())
        orphans = [batch for batch in kept if batch.address == address and batch.orphan()]
        for ref, at in list(self._remaking.values()):
            batch = ref()
            if at == address and batch is not None and batch.state == ORPHANED:
                orphans.append(batch)  # it was being made there
        if orphans:
            log.warning(
                "the Ray actor at %s:%d is gone with %d batch(es) no trainer had fetched: "
                "making them again",
                *address,
                len(orphans),
            )
        self._orphans.extend(weakref.ref(batch) for batch in orphans)  # any thread: a deque

    def _dispatch(self) -> None:
        """Sends each orphan to an actor to make again, while some actor can take one."""
        while self._orphans and not self._closed:
            batch = self._orphans[0]()
            if batch is None or batch.state != ORPHANED:
                self._orphans.popleft()  # its stream let go of it, or it came meanwhile
                continue
            if batch.remakes >= MAX_REMAKES or batch.task is None:
                self._orphans.popleft()
                batch.lose(
                    f"a batch was lost with the Ray actor(s) holding it {batch.remakes + 1} "
                    "times: not made again"
                )
                continue
            remake_id = next(self._remake_ids)
            at = self._remake(batch, remake_id)
            if at is None:
                return  # no actor can take it now: next round
            self._orphans.popleft()
            batch.remakes += 1
            self._remaking[remake_id] = (weakref.ref(batch), at)

    def _remade(
        self, address: Address, kind: bytes, remake_id: int, size: int, header: int
    ) -> None:
        ref, _ = self._remaking.pop(remake_id, (None, address))
        batch = ref() if ref is not None else None
        room = batch.room if batch is not None else None
        if kind == node.UNMADE:
            if batch is not None:
                batch.lose("the batch could not be made again (the dataset raised there)")
            return
        if batch is None or room is None or size != len(room) or header != batch.header_nbytes:
            if batch is not None:
                batch.lose(
                    f"the batch was made again as {size} bytes ({header} of header) where it "
                    f"had {batch.nbytes} ({batch.header_nbytes}): a dataset that is not "
                    "deterministic for a batch's indices and seed"
                )
            with contextlib.suppress(tcp.DataConnectionError):  # dropped there all the same
                self.fetch(address, node.REMADE_SLOTS + remake_id, 0, 0, memoryview(b""))
            return
        try:
            self.fetch(address, node.REMADE_SLOTS + remake_id, 0, 0, room)
        except tcp.DataConnectionError:
            if batch.state == ORPHANED:
                self._orphans.append(weakref.ref(batch))  # that actor is gone too
            return
        self.remade += 1
        batch.arrived()

    def push(self, batch: NodeBatch, nonce: bytes) -> bool:
        """Tells the batch's node to write it to the stream `nonce`'s connections (any
        thread); False when its node is not watched (any more)."""
        with self._lock:
            watcher = self._watchers.get(batch.address)
        if watcher is None:
            return False
        push = node.PUSH.pack(nonce, batch.slot, batch.generation, batch.offset, batch.nbytes)
        try:
            with self._pushing:
                watcher[0].sendall(push)
        except OSError:
            # Broken, or timed out part-way (the watcher's POLL_INTERVAL timeout): what the node
            # reads next would be out of step. Shut, the watchers' thread finds the node lost.
            with contextlib.suppress(OSError):
                watcher[0].shutdown(socket.SHUT_RDWR)
            return False
        return True

    def watched(self, address: Address) -> bool:
        """Whether the node's events reach this server (else it is named to no stream)."""
        with self._lock:
            return address in self._watchers

    def nodes(self) -> list[Address]:
        with self._lock:
            return list(self._watchers)

    def ticket(self, nonce: bytes) -> bytes:
        with self._lock:
            self._reached.setdefault(nonce, set())
        return node.ticket(self._key, nonce)

    def wait_reached(
        self, nonce: bytes, address: Address, deadline: float, stopped: Callable[[], bool]
    ) -> bool:
        """Whether the stream `nonce` has reached the node at `address`, waiting for it until
        time.monotonic() `deadline` (or `stopped()`)."""
        with self._lock:
            while address not in self._reached.get(nonce, ()):
                left = deadline - time.monotonic()
                if left <= 0 or stopped():
                    return False
                self._changed.wait(min(left, 0.05))
            return True

    def forget(self, nonce: bytes) -> None:
        with self._lock:
            self._reached.pop(nonce, None)

    def fetch(
        self, address: Address, slot: int, generation: int, offset: int, into: memoryview
    ) -> None:
        """Reads a batch from its node into `into`, for the server to send itself; raises
        tcp.DataConnectionError when it cannot (the node is gone, or the batch: STALE)."""
        with self._lock:
            if self._closed:
                raise tcp.DataConnectionError("the pool has stopped")
            lock, held = self._own.setdefault(address, (threading.Lock(), []))
        with lock:
            if not held:
                host, port = address
                held.append(tcp.connect(host, port, node.ticket(self._key, self._own_nonce)))
            sock = held[0]
            try:
                node.fetch(sock, slot, generation, offset, into, lambda: False)
            except tcp.DataConnectionError:
                held.clear()
                sock.close()
                raise
        self.record("server", len(into))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            own, self._own = self._own, {}
            watchers, self._watchers = self._watchers, {}
            self._reached.clear()
            self._changed.notify_all()
        socks = [sock for _, held in own.values() for sock in held]
        socks += [sock for sock, _ in watchers.values()]
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.close()
        if self._thread is not None:
            self._thread.join(1.0)
