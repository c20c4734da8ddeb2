"""A batch that lies on the node that made it (NOTE [ Node data connection ] in protos/node.py),
as the send stage sees it: a `NodeBatch`, fetched from its node by a trainer, or by the server
into its room for the batch (server/batch/node_directory.py watches the nodes).

A leaf between the Ray pool, which makes them from its actors' Results, and the send stage
(server/transports/node.py, server/batch/outgoing.py): neither imports the other.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from remote_loader.protos import tcp

Address = tuple[str, int]


class Directory(Protocol):
    """What a NodeBatch and the senders of its stream ask of the pool's nodes: the
    NodeDirectory (server/batch/node_directory.py) fills it. A protocol, so that this module,
    which the directory imports, does not import it back."""

    def watched(self, address: Address) -> bool: ...
    def nodes(self) -> list[Address]: ...
    def ticket(self, nonce: bytes) -> bytes: ...
    def wait_reached(
        self, nonce: bytes, address: Address, deadline: float, stopped: Callable[[], bool]
    ) -> bool: ...
    def push(self, batch: NodeBatch, nonce: bytes) -> bool: ...
    def forget(self, nonce: bytes) -> None: ...
    def fetch(
        self, address: Address, slot: int, generation: int, offset: int, into: memoryview
    ) -> None: ...


# A NodeBatch's states: on its node (KEPT), here in the server's room (HERE), its node lost
# and to be made again (ORPHANED), not fetched by the server but its node not (yet) known lost
# (FAILED_FETCH), or lost for good (LOST).
KEPT, HERE, ORPHANED, FAILED_FETCH, LOST = "kept", "here", "orphaned", "failed", "lost"
# How long a sender waits for a batch lost with its node to be made again, and for a failed
# fetch to show as its node's loss (the watcher's connection closing).
REMAKE_WAIT = 120.0
NODE_LOSS_WAIT = 10.0


class NodeBatch:
    """A batch that lies in slot `slot` (generation `generation`, from `offset`) of the actor
    whose data server is at `address`; `nbytes` long, `header_nbytes` of header. `task`: what
    made it (epoch key, indices, seed), to make it again if that actor is lost before the batch
    left its node (NOTE [ Node lost ])."""

    def __init__(
        self,
        directory: Directory,
        address: Address,
        slot: int,
        generation: int,
        offset: int,
        nbytes: int,
        header_nbytes: int = 0,
        task: tuple[int, Any, int | None] | None = None,
    ) -> None:
        self.directory = directory
        self.address = address
        self.slot = slot
        self.generation = generation
        self.offset = offset
        self.nbytes = nbytes
        self.header_nbytes = header_nbytes
        self.task = task
        # The server's room for the batch (the pool's buffer as large as the actor's slot, set
        # by the pool): where it is fetched to, or made again into.
        self.room: memoryview | None = None
        self.state = KEPT
        self.why = ""  # LOST: why
        self.remakes = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        # Per stream that was named the batch: bytes it fetched so far, and what to call once
        # it has all of them.
        self._served: dict[bytes, int] = {}
        self._waiting: dict[bytes, Callable[[], None]] = {}

    @property
    def on_node(self) -> bool:
        """Whether it is to be fetched from its node (not lost there, nor here already)."""
        return self.state == KEPT

    def fetch_into(self, into: memoryview) -> None:
        """The batch's bytes in `into` (its `room`), for the server to send itself: read from
        its node, or, where that node was lost, made again (waiting at most REMAKE_WAIT).
        Raises tcp.DataConnectionError when it cannot be had."""
        deadline = time.monotonic() + REMAKE_WAIT
        while True:
            with self._changed:
                while self.state in (ORPHANED, FAILED_FETCH):
                    left = deadline - time.monotonic()
                    if left > 0:
                        self._changed.wait(min(left, 0.2))
                        continue
                    if self.state == FAILED_FETCH:  # its node is not lost: tried again later
                        self.state = KEPT
                        raise tcp.DataConnectionError(self.why)
                    raise tcp.DataConnectionError(
                        f"a batch lost with its node was not made again within {REMAKE_WAIT:g} s"
                    )
                if self.state == HERE:
                    return
                if self.state == LOST:
                    raise tcp.DataConnectionError(self.why)
            try:
                self.directory.fetch(self.address, self.slot, self.generation, self.offset, into)
            except tcp.DataConnectionError as exc:
                # Its node is gone (its watcher finds out and has it made again), or this
                # server cannot reach it: waited for as long as a node's loss takes to show.
                with self._changed:
                    if self.state == KEPT:
                        self.state = FAILED_FETCH
                        self.why = str(exc)
                        deadline = min(deadline, time.monotonic() + NODE_LOSS_WAIT)
                continue
            self.arrived()

    def arrived(self) -> None:
        """Its bytes are in its room: nothing is lost with its node any more."""
        with self._changed:
            self.state = HERE
            self._changed.notify_all()

    def lose(self, why: str) -> None:
        with self._changed:
            self.state, self.why = LOST, why
            self._changed.notify_all()

    def orphan(self) -> bool:
        """Its node was lost: to be made again, unless it is here, lost or out already."""
        with self._changed:
            if self.state not in (KEPT, FAILED_FETCH) or self._sent():
                return False
            self.state = ORPHANED
            return True

    def _sent(self) -> bool:
        return any(n >= self.nbytes for n in self._served.values())

    def on_served(self, nonce: bytes, done: Callable[[], None]) -> None:
        """Calls `done` once the stream `nonce` has fetched the whole batch (any thread)."""
        with self._lock:
            if self._served.get(nonce, 0) < self.nbytes:
                self._waiting[nonce] = done
                return
        done()

    def served(self, nonce: bytes, nbytes: int) -> None:
        """The node sent `nbytes` of the batch to the stream `nonce` (the watchers' thread)."""
        with self._lock:
            total = self._served[nonce] = self._served.get(nonce, 0) + nbytes
            done = self._waiting.pop(nonce, None) if total >= self.nbytes else None
        if done is not None:
            done()

    def abandon(self, nonce: bytes) -> None:
        """The stream `nonce` ended without the batch: nothing to call."""
        with self._lock:
            self._waiting.pop(nonce, None)
