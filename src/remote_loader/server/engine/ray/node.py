"""An actor's data server: trainers, and the server when it sends a batch itself, fetch the
batches the actor keeps in its slots here (NOTE [ Node data connection ] in protos/node.py).

Runs in the actor's process, beside its lane's thread, which fills the slots: a slot is read
here only while the server holds its lease (the batch's stream has not fetched it yet), and the
generation word is checked before and after each read, so a slot reused under a read (its
stream gone) is never passed off as the batch.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import queue
import select
import socket
import struct
import sys
import threading
from typing import Any

import numpy as np

from remote_loader.protos import node, striping, tcp
from remote_loader.protos import slots as slot_protocol
from remote_loader.server.worker.collating import WorkerSlots

log = logging.getLogger(__name__)

# How long an event may wait for room on the server's watcher before the watch is given up.
WATCH_SEND_TIMEOUT = 30.0
# How often an idle stream's pusher looks whether its trainer has gone.
IDLE_CHECK = 1.0
# The actor's GIL switch interval while it serves batches (NOTE [ Serving beside the maker ]).
SWITCH_INTERVAL = 0.0005


@dataclasses.dataclass(frozen=True)
class Remake:
    """Down a KEEP lane: make this batch of a lost actor's again, for the server to fetch (NOTE
    [ Node lost ] in server/batch/node_directory.py)."""

    remake_id: int
    epoch_key: int
    indices: Any
    seed: int | None


class NodeServer:
    """Listens on `host` (the node's address) for node data connections; tells the server's
    watcher (protos/node.py: WATCH) which streams reached it and what it served them."""

    def __init__(self, host: str, key: bytes, slots: WorkerSlots) -> None:
        # NOTE [ Serving beside the maker ]: a request waits for the GIL, which the actor's
        # lane thread holds while it makes a batch; Python hands it over every switch interval
        # (5 ms by default), so each stripe asked for would wait up to that. The actor's
        # process is ours: its threads switch ten times as often.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))
        self._key = key
        self._slots = slots
        self._watcher: socket.socket | None = None
        self._closed = False
        # Batches made again for the server, by remake id, until it has fetched each (one per
        # batch a lost actor kept: bounded by the pool's slots).
        self._remade: dict[int, np.ndarray] = {}
        self._telling = threading.Lock()  # one event at a time on the watcher
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(64)
        self.address = (host, int(self._listener.getsockname()[1]))
        self._lock = threading.Lock()
        # Open connections, oldest first (at most node.MAX_NODE_CONNECTIONS).
        self._open: collections.OrderedDict[socket.socket, None] = collections.OrderedDict()
        # Per stream: its connections that said HELLO (at most node.MAX_NONCES streams).
        self._hellos: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        # Per trainer's stream: what writes its batches to its connections.
        self._pushers: dict[bytes, _Pusher] = {}
        threading.Thread(target=self._accept, name="rl-node-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                self._open[sock] = None
                while len(self._open) > node.MAX_NODE_CONNECTIONS:
                    oldest, _ = self._open.popitem(last=False)
                    with contextlib.suppress(OSError):
                        oldest.shutdown(socket.SHUT_RDWR)  # its thread sees it and ends
            threading.Thread(target=self._serve, args=(sock,), name="rl-node", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            nonce = self._greet(sock)
            if nonce is not None and node.pushed(nonce):
                return  # a trainer's: its stream's pusher owns it now
            if nonce is not None:
                while self._answer(sock, nonce):
                    pass
        except OSError:
            pass
        with self._lock:
            self._open.pop(sock, None)
        sock.close()

    def _greet(self, sock: socket.socket) -> bytes | None:
        """The nonce of a connection whose HELLO carries a ticket of this pool's; None (the
        connection is closed without a word) for anything else."""
        sock.settimeout(tcp.HANDSHAKE_TIMEOUT)
        hello = _read(sock, tcp.HELLO_BYTES)
        if hello is None or not hello.startswith(tcp.MAGIC):
            return None
        nonce = node.nonce_of(self._key, hello[len(tcp.MAGIC) :])
        if nonce is None:
            return None
        tcp.tune(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        pusher = None
        if node.pushed(nonce):
            # Before its ACK: the trainer makes its connections one after the other, so
            # connection i is the stream's i-th here, and carries stripe i.
            sock.settimeout(tcp.POLL_INTERVAL)  # as tcp.send expects
            with self._lock:
                pusher = self._pushers.get(nonce)
                if pusher is None:
                    pusher = self._pushers[nonce] = _Pusher(self, nonce)
                if len(pusher.conns) >= node.connections_of(nonce):
                    return None  # one more than its ticket says: a replay
                pusher.conns.append(sock)
                count = len(pusher.conns)
        else:
            sock.settimeout(None)  # between requests a connection is quiet
            with self._lock:
                count = self._hellos.pop(nonce, 0) + 1
                self._hellos[nonce] = count
                while len(self._hellos) > node.MAX_NONCES:
                    self._hellos.popitem(last=False)
        sock.sendall(node.OK)
        if count == node.connections_of(nonce):
            if pusher is not None:
                pusher.start()
            self._tell(node.REACHED, nonce)
        return nonce

    def _tell(
        self, kind: bytes, nonce: bytes, slot: int = 0, generation: int = 0, n: int = 0
    ) -> None:
        event = node.EVENT.pack(kind, nonce, slot, generation, n)
        with self._telling:
            if self._watcher is None:
                return  # the server has not watched yet, or its watch broke: it falls back
            try:
                self._watcher.sendall(event)
            except OSError:
                # Broken, or no room for WATCH_SEND_TIMEOUT (a server that stopped reading),
                # maybe part-way: shut, so that the server takes this node as lost rather than
                # read its events out of step.
                with contextlib.suppress(OSError):
                    self._watcher.shutdown(socket.SHUT_RDWR)
                self._watcher = None

    def _answer(self, sock: socket.socket, nonce: bytes) -> bool:
        """One request: the bytes asked for, or STALE. False when the connection is done."""
        request = _read(sock, node.REQUEST.size)
        if request is None:
            return False
        slot, generation, offset, length = node.REQUEST.unpack(request)
        if slot >= node.REMADE_SLOTS and slot != node.WATCH:
            return self._answer_remade(sock, slot - node.REMADE_SLOTS, offset, length)
        if slot == node.WATCH:
            # Its reads wait for PUSHes for good (it is quiet between them); its sends, of
            # events from the pushers and the lane's thread, give up (SO_SNDTIMEO).
            timeval = struct.pack("ll", int(WATCH_SEND_TIMEOUT), 0)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
            with self._telling:  # the server's watcher, replacing any earlier one
                self._watcher = sock
            return self._watch(sock)
        try:
            view = self._slots.view(slot)
        except KeyError:  # dropped since: its batch is long gone
            sock.sendall(node.STALE)
            return True
        try:
            if (
                offset < slot_protocol.SLOT_HEADER
                or offset + length > len(view)
                or slot_protocol.generation(view) != generation
            ):
                sock.sendall(node.STALE)
                return True
            sock.settimeout(tcp.STALL_TIMEOUT)  # a trainer that stops reading is let go
            sock.sendall(node.OK)
            sock.sendall(view[offset : offset + length])
            sock.settimeout(None)
            if slot_protocol.generation(view) != generation:
                return False  # reused under the read: the bytes sent may be torn, so break
        finally:
            del view  # a slot viewed here would count as in use (WorkerSlots.take)
        self._tell(node.SERVED, nonce, slot, generation, length)
        return True

    def remade(self, remake_id: int, blob: np.ndarray | None, header_nbytes: int) -> None:
        """The lane's thread made a remake (None: it failed): kept until the server fetches it."""
        if blob is None:
            self._tell(node.UNMADE, bytes(node.NONCE_BYTES), remake_id)
            return
        self._remade[remake_id] = blob
        self._tell(node.REMADE, bytes(node.NONCE_BYTES), remake_id, len(blob), header_nbytes)

    def _answer_remade(self, sock: socket.socket, remake_id: int, offset: int, length: int) -> bool:
        blob = self._remade.pop(remake_id, None)  # fetched once, by the server
        if blob is None or offset + length > len(blob):
            sock.sendall(node.STALE)
            return True
        sock.settimeout(tcp.STALL_TIMEOUT)
        sock.sendall(node.OK)
        sock.sendall(blob.data[offset : offset + length])
        sock.settimeout(None)
        return True

    def _watch(self, sock: socket.socket) -> bool:
        """The watcher's thread: the server's PUSHes, each to its stream's pusher, until the
        watcher closes."""
        while (data := _read(sock, node.PUSH.size)) is not None:
            nonce, *batch = node.PUSH.unpack(data)
            with self._lock:
                pusher = self._pushers.get(nonce)
            if pusher is not None:  # else that stream's connections are gone
                pusher.queue.put((batch[0], batch[1], batch[2], batch[3]))
        with self._telling:
            if self._watcher is sock:
                self._watcher = None
        return False

    def _push(self, pusher: _Pusher, slot: int, generation: int, offset: int, length: int) -> None:
        """Writes a batch to a stream's connections, a status byte before each stripe (STALE
        when the slot no longer holds it); raises OSError when the stream's trainer is gone."""
        stripes = striping.stripes(length, len(pusher.conns))
        try:
            view: memoryview | None = self._slots.view(slot)
        except KeyError:
            view = None
        try:
            fresh = (
                view is not None
                and offset >= slot_protocol.SLOT_HEADER
                and offset + length <= len(view)
                and slot_protocol.generation(view) == generation
            )
            for conn, (lo, hi) in zip(pusher.conns, stripes, strict=False):
                tcp.send(conn, memoryview(node.OK if fresh else node.STALE), pusher.stopped)
                if fresh:
                    assert view is not None
                    part = view[offset + lo : offset + hi]
                    tcp.send(conn, part, pusher.stopped)
                    del part
            if fresh and view is not None and slot_protocol.generation(view) != generation:
                raise OSError("the slot was rewritten under its push")  # torn: break
        finally:
            del view  # a slot viewed here would count as in use (WorkerSlots.take)
        if fresh:
            self._tell(node.SERVED, pusher.nonce, slot, generation, length)

    def _ended(self, pusher: _Pusher) -> None:
        with self._lock:
            if self._pushers.get(pusher.nonce) is pusher:
                del self._pushers[pusher.nonce]
            for conn in pusher.conns:
                self._open.pop(conn, None)
        for conn in pusher.conns:
            conn.close()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


class _Pusher:
    """One trainer stream's connections to this node, and the thread that writes the batches
    the server pushes to it, in the order pushed (the order the stream names them in). Between
    batches it reads what the trainer sends (heartbeats) and ends when the trainer closes."""

    def __init__(self, server: NodeServer, nonce: bytes) -> None:
        self.server = server
        self.nonce = nonce
        self.conns: list[socket.socket] = []
        # The batches pushed and not yet written: each holds its slot's lease in the server
        # until SERVED, so at most the pool's slots (no bound of its own needed).
        self.queue: queue.SimpleQueue[tuple[int, int, int, int]] = queue.SimpleQueue()

    def stopped(self) -> bool:
        return self.server._closed

    def start(self) -> None:
        threading.Thread(target=self._run, name="rl-node-push", daemon=True).start()

    def _run(self) -> None:
        try:
            while not self.stopped():
                try:
                    slot, generation, offset, length = self.queue.get(timeout=IDLE_CHECK)
                except queue.Empty:
                    if self._gone():
                        return
                    continue
                self.server._push(self, slot, generation, offset, length)
        except OSError:
            pass  # the trainer went (tcp.send: a broken connection, or a silent trainer)
        finally:
            self.server._ended(self)

    def _gone(self) -> bool:
        """Whether the trainer closed a connection; drops the heartbeats it sent meanwhile."""
        readable, _, _ = select.select(self.conns, [], [], 0)
        for conn in readable:
            try:
                if not conn.recv(1 << 12):
                    return True
            except (BlockingIOError, TimeoutError):
                continue
            except OSError:
                return True
        return False


def _read(sock: socket.socket, n: int) -> bytes | None:
    """Exactly `n` bytes; None when the peer closed first."""
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data
