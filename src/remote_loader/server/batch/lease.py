"""A batch's hold on its worker's slot: one SlotLease from the worker's fill to the last
reader's release, whichever process that reader is in.

NOTE [ Slot lease ]

A worker writes each batch into a shared-memory slot of its own (server/worker/collating.py's
WorkerSlots) and rewrites that slot only once the server has given it back. Until then the
batch is read in place: by the server's senders, and, for a same-host client of a zero-copy
stream, by the client itself (NOTE [ Zero-copy slots ] in protos/slots.py). The SlotLease is
the one object that knows when every reader is done:

    worker process          server                                    client process
    --------------          ------                                    --------------
    take(): a free slot,    the pool core (server/engine/pool.py) makes the
      generation odd;       lease with the Result: its give-back
      write; even again;    names (incarnation, slot)
      Result(slot, gen)     the owner, the sharing policy's Entry
                            (server/sharing/lanes.py), holds it until every
                            consumer it owes the batch was sent it
                            (or dropped): `release()`
                            a zero-copy sender holds it per stream   maps the slot, copies
                            (`hold()`) until the client's control    the batch out, checks
                            ring says the batch was copied out, or   the generation, moves
                            the stream ended: the returned `end()`   its control cursor on
                            released and no hold left: give-back
    release(ids): the slot  -> SlotTable.release (server/engine/slots.py)
      is free again   <---  queues the id; it rides on the worker's
                            next Task (a Ray actor's: on the bridge's
                            own WorkerSlots, server/engine/ray/bridge.py)

Give-back runs exactly once, on whichever thread ends the last hold (a gRPC callback, a Run's
thread, a sender's), never while a hold remains; a hold taken after give-back is a bug and
asserts. A worker or actor replaced meanwhile is forgotten with its slots (SlotTable.forget):
the give-back finds nothing to queue, and readers keep their mapping until they let go.

Bounds: a stream holds at most slots.SLOT_LEASES leases (ShmSender waits for the client's
release beyond that, so a zero-copy stream keeps no more of the pool's memory than a ring would
hold); an Entry lives in a lane bounded by the Run's window (server/sharing/lanes.py); so a worker's
slots in use are bounded by the tasks in flight (prefetch_factor * num_workers) plus, per
zero-copy consumer, SLOT_LEASES.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


def _nothing() -> None:
    pass


class SlotLease:
    """One batch's hold on the slot it lies in. See NOTE [ Slot lease ].

    The owner's part ends with `release()`; each `hold()` adds a reader whose part ends when it
    calls what `hold()` returned. Once both are over, `give_back` runs, once. Thread-safe, and
    every ending idempotent. A batch in this process's memory has a lease that gives nothing
    back.
    """

    __slots__ = ("_give_back", "_given_back", "_holds", "_lock", "_mapping", "_released")

    def __init__(self, give_back: Callable[[], None] = _nothing, mapping: object = None) -> None:
        self._give_back = give_back
        # What keeps the slot mapped in this process, and its descriptor open, for as long as
        # the lease lasts (the batch's memoryview into it): a reader in another process opens
        # the slot by that descriptor, and the pool may have let its own view go meanwhile (a
        # pool shut down at the end of its Run clears its SlotTable while batches are read).
        self._mapping = mapping
        self._holds = 0
        self._released = False  # the owner is done
        self._given_back = False
        self._lock = threading.Lock()

    @property
    def given_back(self) -> bool:
        return self._given_back

    def hold(self) -> Callable[[], None]:
        """Keeps the slot (and the batch's bytes in it) past the owner's `release` until the
        returned function is called."""
        with self._lock:
            assert not self._given_back, "the slot was already given back"
            self._holds += 1
        ended = False

        def end() -> None:
            nonlocal ended
            with self._lock:
                if ended:
                    return
                ended = True
                self._holds -= 1
                give_back = self._due()
            if give_back:
                self._give_back()

        return end

    def release(self) -> None:
        """The owner is done with the batch; the slot goes back once no hold remains."""
        with self._lock:
            self._released = True
            give_back = self._due()
        if give_back:
            self._give_back()

    def _due(self) -> bool:
        """Under the lock: whether give-back is now due (and, if so, marks it done)."""
        if self._released and self._holds == 0 and not self._given_back:
            self._given_back = True
            self._mapping = None
            return True
        return False
