"""Stream admission: at most max_streams Stream calls at once, and the rule that gives the
place of a stream whose client reads nothing to a stream that arrives at a full server.

NOTE [ Idle streams ]

A Stream call holds one of the server's `max_streams` places from its admission to the end of
its handler. A client that opens a stream and stops reading (a raw client that read one
message; a trainer whose loop paused, its receiver's queue full) leaves the server's send waiting
for it: on gRPC flow control once the client's window and the socket buffers are full (the
handler thread blocks inside gRPC, between two `yield`s), or for room in its ring or data
connection. The keepalive rules (tests/integration/test_bounds.py) end a stream whose client is
gone, not one whose client is alive and does not read: that one would hold its place for ever.

Idle: a stream is idle while its send loop has handed its client a batch the client has not
taken. `StreamSlot.handing()` marks the start of each wait on the client: when the loop has a
batch for it, and again each time gRPC has taken one more of its Frames (the `yield` returned),
so a slow but reading client is never idle for long. `between()` ends it: waiting for the next
batch to be made is the server's doing, not the client's.

Rule: when a stream arrives at a full server, the stream idle longest, if it has been idle at
least `idle_stream_timeout` seconds, is closed with ABORTED ("no batch read for N s while
another stream waited") and the newcomer takes its place at once; otherwise the newcomer is
refused with RESOURCE_EXHAUSTED, as always. So a paused trainer keeps its stream as long as it
likes while the server has room, and for `idle_stream_timeout` s when it has none. A
RemoteLoader resumes an ABORTED stream from the first batch it did not receive (the batches
already in its buffers are still delivered first), with the backoff and retries of any broken
stream; a place is free for it again once some stream ends. Streams that wait for their data
connection are never idle: their waits on the
client have bounds of their own (the client's heartbeat, the accept timeout).

Actors:

    send loop (the stream's handler thread)      newcomer (another handler thread)
      entry = consumer.next()                      with lock:
      slot.handing()                                 if count < max_streams: count += 1
      for frame: yield frame; slot.handing()         else: victim = longest idle >= timeout
      slot.between()                                       none: refuse (RESOURCE_EXHAUSTED)
                                                           victim.counted = False
    victim (blocked in gRPC's send)                        the newcomer takes its place
      the call is cancelled with ABORTED by the      cancel the victim's call (outside lock)
      newcomer; gRPC stops waiting, the handler
      ends, its release() gives nothing back (counted = False)

Invariant: `_slots` holds exactly the admitted slots with `counted` True, at most max_streams.
For a moment the victim's handler and the newcomer's both run: the thread pool has
UNARY_THREADS beyond max_streams (server/api/server.py), and the victim's wait ends as soon as its
call is cancelled.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import grpc

log = logging.getLogger(__name__)

# An idle stream is closed for a newcomer after this many seconds of its client taking nothing
# (setting idle_stream_timeout; 0: never). Longer than a pause for a checkpoint or an
# evaluation on a crowded server would usually be; a trainer closed anyway resumes.
DEFAULT_IDLE_STREAM_TIMEOUT = 60.0


class StreamSlot:
    """One admitted stream's place under max_streams (NOTE [ Idle streams ])."""

    def __init__(self, context: grpc.ServicerContext) -> None:
        # Any: grpc-stubs leave RpcContext.cancel untyped.
        self._context: Any = context
        self.counted = True  # False once its place went to a newcomer
        self.evicted: str | None = None  # why its place went to a newcomer
        # Since when the client has had something to take and has not taken it; None: the
        # stream waits for a batch to be made (or is between its phases). Written by the
        # stream's thread only; read by newcomers (one reference, no lock needed).
        self._waiting_since: float | None = None

    def handing(self) -> None:
        """The send loop hands the client something (a batch, or its next Frame)."""
        self._waiting_since = time.monotonic()

    def between(self) -> None:
        """The send loop waits for its next batch to be made: not the client's doing."""
        self._waiting_since = None

    def idle_for(self, now: float) -> float:
        """Seconds the client has left what it was handed untaken (0: not waiting on it)."""
        since = self._waiting_since
        return 0.0 if since is None else max(0.0, now - since)

    def _close(self, reason: str) -> None:
        """Ends the call from another thread: its handler is blocked in gRPC's send, so it
        cannot abort itself. Cancelling with a status is grpc's (Cython) call API, not the
        public ServicerContext, whose cancel() says only CANCELLED; both are resumed by a
        RemoteLoader, the status says why. It carries no trailing metadata (a cancel sends
        status and details only; set_trailing_metadata is sent by the handler's own status,
        which its blocked send holds back), so no reason either: reasons.IDLE_STREAM names the
        kind, the client reads the ABORTED as any broken stream (NOTE [ Error reasons ])."""
        call: Any = getattr(getattr(self._context, "_rpc_event", None), "call", None)
        try:
            call.cancel(grpc.StatusCode.ABORTED.value[0], reason)
        except (AttributeError, TypeError):
            self._context.cancel()


class Admission:
    """Counts the running streams against `max_streams`; gives an idle one's place to a
    newcomer (NOTE [ Idle streams ]). `idle_stream_timeout` 0: never."""

    def __init__(self, max_streams: int, idle_stream_timeout: float) -> None:
        if max_streams < 1:
            raise ValueError(f"max_streams must be at least 1, got {max_streams}")
        if not idle_stream_timeout >= 0:
            raise ValueError(f"idle_stream_timeout must be >= 0, got {idle_stream_timeout}")
        self.max_streams = max_streams
        self.idle_stream_timeout = idle_stream_timeout
        self._changed = threading.Condition()
        self._slots: list[StreamSlot] = []  # the streams holding a place: the counted ones

    @property
    def running(self) -> int:
        """The streams holding a place now."""
        with self._changed:
            return len(self._slots)

    def admit(self, context: grpc.ServicerContext) -> StreamSlot | None:
        """A place for a new stream, taken from an idle stream if the server is full and one
        has been idle long enough; None: the server is full."""
        slot = StreamSlot(context)
        victim = None
        with self._changed:
            if len(self._slots) >= self.max_streams:
                victim = self._idlest()
                if victim is None:
                    return None
                idle = victim.idle_for(time.monotonic())
                victim.counted = False
                victim.evicted = (
                    f"no batch read for {idle:.0f} s while another stream waited for a place "
                    f"(the server runs its max_streams={self.max_streams} streams, "
                    f"idle_stream_timeout={self.idle_stream_timeout:g} s); resume from the "
                    "next batch"
                )
                self._slots.remove(victim)
            self._slots.append(slot)
        if victim is not None:
            assert victim.evicted is not None
            victim._close(victim.evicted)
        return slot

    def _idlest(self) -> StreamSlot | None:
        """With the lock held: the stream idle longest, if at least idle_stream_timeout."""
        if self.idle_stream_timeout <= 0:
            return None
        now = time.monotonic()
        idlest = max(self._slots, key=lambda s: s.idle_for(now), default=None)
        if idlest is None or idlest.idle_for(now) < self.idle_stream_timeout:
            return None
        return idlest

    def release(self, slot: StreamSlot) -> None:
        """The stream's handler is ending: its place is free, unless a newcomer has it."""
        with self._changed:
            if slot.counted:
                slot.counted = False
                self._slots.remove(slot)
                self._changed.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Waits up to `timeout` s for every place to be free; True if none is held."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._slots, timeout)
