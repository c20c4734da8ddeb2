"""Batches that lie on the node that made them (NOTE [ Node data connection ] in
protos/node.py), as the send stage sees them: a `RemoteBatch` per batch, and the pool's
`NodeDirectory` (tickets, which streams reached which node, the server's own fetches).

A leaf between the Ray pool, which makes both from its actors' Results and lane messages, and
the send stage (server/transports/node.py, server/outgoing.py): neither imports the other.
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable

from remote_loader.protos import node, tcp

log = logging.getLogger(__name__)

Address = tuple[str, int]


class NodeDirectory:
    """One pool's nodes: tickets for its streams, the nodes each stream has reached, its
    batches kept on them, and the server's connections to them: one watcher per node (the
    node's REACHED and SERVED events, read by a thread of this directory's) and one for the
    batches it sends itself. `record(path, nbytes)`: counts bytes of batches made on other
    hosts, by path ("server" or "node")."""

    def __init__(self, key: bytes, record: Callable[[str, int], None]) -> None:
        self._key = key
        self.record = record
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a stream reached a node
        # The nodes watched, with their watcher's socket and what it has half read.
        self._watchers: dict[Address, tuple[socket.socket, bytearray]] = {}
        # Per stream nonce: the nodes all its connections reached (forgotten at its close).
        self._reached: dict[bytes, set[Address]] = {}
        # The batches on nodes that a stream may still fetch, by (node, slot, generation).
        self._kept: weakref.WeakValueDictionary[tuple[Address, int, int], RemoteBatch] = (
            weakref.WeakValueDictionary()
        )
        # The server's own connection per node (one fetch at a time on each: its lock).
        self._own_nonce = node.new_nonce(1)
        self._own: dict[Address, tuple[threading.Lock, list[socket.socket]]] = {}
        self._closed = False
        self._thread: threading.Thread | None = None

    def kept(
        self, address: Address, slot: int, generation: int, offset: int, nbytes: int
    ) -> RemoteBatch:
        """The handle of a batch an actor keeps (the pool's thread); its node is watched from
        now on (connecting the first time: at most tcp.CONNECT_TIMEOUT, once per actor)."""
        if address not in self._watchers:
            self._watch(address)
        batch = RemoteBatch(self, address, slot, generation, offset, nbytes)
        self._kept[(address, slot, generation)] = batch
        return batch

    def _watch(self, address: Address) -> None:
        try:
            sock = tcp.connect(*address, node.ticket(self._key, self._own_nonce))
            sock.sendall(node.REQUEST.pack(node.WATCH, 0, 0, 0))
        except (OSError, tcp.DataConnectionError) as exc:
            # Its batches go through this server: no stream is told of the node.
            log.warning("the node data server at %s:%d cannot be watched: %s", *address, exc)
            return
        with self._lock:
            if self._closed:
                sock.close()
                return
            self._watchers[address] = (sock, bytearray())
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._read_events, name="rl-node-watch", daemon=True
                )
                self._thread.start()

    def _read_events(self) -> None:
        """The watchers' thread: each node's events, until the directory closes."""
        while not self._closed:
            with self._lock:
                watched = {sock: address for address, (sock, _) in self._watchers.items()}
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
        elif kind == node.SERVED:
            if nonce != self._own_nonce:  # counted here: a stream may end before this comes
                self.record("node", n)
            batch = self._kept.get((address, slot, generation))
            if batch is not None:  # else its batch is long done with
                batch.served(nonce, n)

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


class RemoteBatch:
    """A batch that lies in slot `slot` (generation `generation`, from `offset`) of the actor
    whose data server is at `address`; `nbytes` long."""

    def __init__(
        self,
        directory: NodeDirectory,
        address: Address,
        slot: int,
        generation: int,
        offset: int,
        nbytes: int,
    ) -> None:
        self.directory = directory
        self.address = address
        self.slot = slot
        self.generation = generation
        self.offset = offset
        self.nbytes = nbytes
        self._lock = threading.Lock()
        # Per stream that was named the batch: bytes it fetched so far, and what to call once
        # it has all of them.
        self._served: dict[bytes, int] = {}
        self._waiting: dict[bytes, Callable[[], None]] = {}

    def fetch_into(self, into: memoryview) -> None:
        """The batch's bytes, read from its node into `into` (the server sends it itself)."""
        self.directory.fetch(self.address, self.slot, self.generation, self.offset, into)

    def on_served(self, nonce: bytes, done: Callable[[], None]) -> None:
        """Calls `done` once the stream `nonce` has fetched the whole batch (any thread)."""
        with self._lock:
            if self._served.get(nonce, 0) < self.nbytes:
                self._waiting[nonce] = done
                return
        done()

    def served(self, nonce: bytes, nbytes: int) -> None:
        """The node sent `nbytes` of the batch to the stream `nonce` (the pool's thread)."""
        with self._lock:
            total = self._served[nonce] = self._served.get(nonce, 0) + nbytes
            done = self._waiting.pop(nonce, None) if total >= self.nbytes else None
        if done is not None:
            done()
