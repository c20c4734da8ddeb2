"""A Consumer: one stream's handle on the Run it reads, `next()` an entry, send it, `done()`
with it. The Run (server/sharing/run.py) makes its consumers and fills `Production`, what a
consumer reads of it; see NOTE [ Run states ] there for what `cond` guards.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.engine.seam import POLL_INTERVAL
from remote_loader.server.errors import CapturedError, Closing, Detached, LoaderBroken
from remote_loader.server.sharing.lanes import Entry
from remote_loader.server.sharing.membership import Membership
from remote_loader.server.sharing.policy import Policy, Seat
from remote_loader.server.telemetry.metrics import LoaderMetrics


class Production(Protocol):
    """What a Consumer reads of its Run (server/sharing/run.py): the lock that guards the Run
    and its policy, why no batch can be made, if none can, and whether the server closed it."""

    @property
    def spec(self) -> LoaderSpec: ...

    @property
    def metrics(self) -> LoaderMetrics: ...

    @property
    def cond(self) -> threading.Condition: ...

    @property
    def policy(self) -> Policy[Any]: ...

    @property
    def fatal(self) -> CapturedError | None: ...

    @property
    def closed_by_server(self) -> bool: ...


class Consumer:
    """One stream's handle on its Run: `next()` an entry, send it, `done()` with it.

    What it keeps is what every sharing mode needs; what one mode keeps per consumer is its
    policy's (`seat`, server/sharing/policy.py). `on_close(consumer, join)` is the registry's
    (Runs._detach, through the Run): `join` waits (bounded) for a Run this ends to end."""

    def __init__(
        self,
        run: Production,
        membership: Membership,
        seat: Seat,
        on_close: Callable[[Consumer, bool], None],
    ) -> None:
        self.run = run
        self.membership = membership
        self.seat = seat
        self.metrics = run.metrics.stream(membership.job, membership.sharing, membership.rank)
        self._taken_at = 0.0  # when next() last returned an entry (send time, for metrics)
        # How long that next() waited for its entry (NOTE [ Stall stages ] in protos/stall.py).
        self.waited = 0.0
        self.errors = 0  # errors at batch positions sent (the stream's end line)
        self._on_close = on_close
        # Both set by the Run, under its `cond`: the Run has let go of this consumer (next()
        # returns None), and why, if the consumer did not ask to go (next() raises it).
        self._closed = False
        self._detached: str | None = None

    @property
    def detached(self) -> str | None:
        """Why the Run let go of this consumer while it still read (None: it did not)."""
        return self._detached

    def next(self, cancelled: threading.Event) -> Entry | None:
        """The next entry to send, or None at the end of this consumer's epoch (or once
        `cancelled` is set). Raises Detached if the Run let go of this consumer."""
        run = self.run
        asked = time.monotonic()
        with run.cond:
            run.policy.asking(self.seat)
            while True:
                self._raise_if_let_go()
                if self._closed or cancelled.is_set():
                    return None
                entry = run.policy.take(self.seat)
                if entry is not None:
                    self._taken_at = time.monotonic()
                    self.waited = self._taken_at - asked
                    self.metrics.took(self.waited, self._taken_at - entry.made_at)
                    return entry
                if run.policy.finished(self.seat):
                    return None
                run.cond.wait(POLL_INTERVAL)

    def _raise_if_let_go(self) -> None:
        """With `cond` held: raises why this consumer gets nothing more, if it does not."""
        run = self.run
        if run.fatal is not None:
            e = run.fatal
            raise LoaderBroken(
                f"loader {run.spec.name!r} cannot make batches: {e.type} {e.where}: "
                f"{e.message}\nOriginal {e.traceback.rstrip()}",
                original=e,
            )
        if self._detached is not None:
            raise (Closing if run.closed_by_server else Detached)(self._detached)

    def done(self, entry: Entry) -> None:
        """This consumer has sent `entry` (or given up sending it)."""
        run = self.run
        self.metrics.sending(time.monotonic() - self._taken_at)
        with run.cond:
            run.policy.done(self.seat, entry)
            run.cond.notify_all()

    def sent(self, entry: Entry) -> None:
        """`entry` reached the client (for metrics: batches, bytes or errors served)."""
        if entry.error is not None:
            self.errors += 1
        self.metrics.sent(entry.nbytes, entry.error is not None)

    def close(self) -> None:
        """Detaches from the Run (idempotent); the last consumer out ends it, and this waits,
        at most RUN_JOIN_TIMEOUT, for the Run's thread to give its engine back."""
        self._on_close(self, True)

    def let_go(self) -> None:
        """Queues this consumer for its loader's reaper, which detaches it: for gRPC's
        cancellation callback, which runs on the thread that serves every call and so must
        not wait, not even for a lock. The stream's own `close()` in its handler does the
        waiting."""
        self._on_close(self, False)

    def dismiss(self, why: str) -> None:
        """The Run lets go of this consumer while it still reads (with `cond` held): its next
        `next()` raises `why`."""
        self._detached = why

    def mark_closed(self) -> bool:
        """The Run lets go of this consumer (with `cond` held); False if it already had, so
        what the consumer held is settled once."""
        first, self._closed = not self._closed, True
        return first
