"""The shared-memory transport's sending end: a stream whose client offered shared memory and
proved it shares this host's /dev/shm gets its batches through a ring (NOTE [ Shared-memory
transport ] in remote_loader.protos.shm, which holds the ring and both ends' protocol), batch by
batch falling back to Frames when the ring cannot take one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import shm, wire
from remote_loader.server.errors import ClientSilent
from remote_loader.server.lanes import Entry
from remote_loader.server.transports.base import (
    DEFAULT_CLIENT_SILENCE,
    InbandSender,
    StreamStopped,
    payload,
)

log = logging.getLogger(__name__)


def accept_offer(
    offer: pb.ShmOffer,
    max_ring_bytes: int,
    fallback: InbandSender,
    client_silence: float = DEFAULT_CLIENT_SILENCE,
) -> ShmSender | None:
    """A sender for a stream whose request carries `offer`, or None: another host, or shared
    memory off. Batches the ring cannot take go through `fallback`."""
    if not offer.probe or max_ring_bytes <= 0 or not shm.available():
        return None
    owner = shm.verify_probe(offer.probe, offer.nonce)
    if owner is None or not shm.can_share_with(owner):
        return None  # another host, or a user that could not open this server's rings
    return ShmSender(owner, max_ring_bytes, fallback, client_silence)


class ShmSender:
    """Copies a stream's batches into its ring; owns the ring until `close()`.

    The ring is made for the first batch's size (shm.RING_BATCHES of them) and made again,
    larger, when a batch outgrows it; a batch bigger than `max_ring_bytes`, or any batch after
    /dev/shm refused a ring, goes through `fallback` (Frames). Every wait for the client ends
    when its heartbeat stands still for `client_silence` seconds (ClientSilent).
    """

    name = "shm"

    def __init__(
        self,
        owner_uid: int,
        max_ring_bytes: int,
        fallback: InbandSender,
        client_silence: float = DEFAULT_CLIENT_SILENCE,
    ) -> None:
        self.owner_uid = owner_uid
        self.fallback = fallback
        self.max_ring_bytes = max_ring_bytes
        self.client_silence = client_silence
        self.ring: shm.RingWriter | None = None
        # The ring before the last growth, kept mapped until the client opens the new one: a
        # client still reading its batches beats there (NOTE [ Ring space ]).
        self._previous: shm.RingWriter | None = None
        self._beats = 0  # the heartbeats seen last, and since when (monotonic)
        self._beat_at = 0.0
        self.disabled = False  # /dev/shm refused a ring: the rest of the stream goes as Frames
        self.batches = 0  # sent through shared memory

    def send(self, batch: int, entry: Entry, stopped: Callable[[], bool]) -> Iterator[bytes]:
        blob = payload(entry, self.fallback.shared)
        frame = self.frame(batch, blob, entry.delivery.header_nbytes, stopped)
        if frame is None:
            return self.fallback.send(batch, entry, stopped)
        return iter((frame,))

    def frame(
        self, batch: int, blob: memoryview, header_nbytes: int, stopped: Callable[[], bool]
    ) -> bytes | None:
        """The Frame that hands batch `batch` over through the ring; None: send it as Frames.

        Raises StreamStopped when `stopped()` turned true while waiting for room.
        """
        ring = self._ring_for(len(blob), stopped)
        if ring is None:
            return None
        waiting = self._waiting(stopped)
        placed = ring.place(blob, waiting)
        if placed is None:
            if waiting.silent:
                raise ClientSilent(
                    f"the client made no room in its shared-memory ring and gave no sign of life "
                    f"for {self.client_silence:g} s"
                )
            raise StreamStopped()
        offset, release = placed
        self.batches += 1
        return wire.handle_frame(
            batch,
            len(blob),
            header_nbytes,
            shm=pb.ShmBatch(
                ring=ring.name, ring_bytes=ring.capacity, offset=offset, release=release
            ),
        )

    def _waiting(self, stopped: Callable[[], bool]) -> _ClientWait:
        """A `stopped()` for one wait on the client that also turns true, marking itself
        `silent`, once the client's heartbeat has stood still for client_silence seconds."""
        self._beats, self._beat_at = self._heartbeats(), time.monotonic()
        return _ClientWait(stopped, self._silent)

    def _heartbeats(self) -> int:
        if self._previous is not None and self.ring is not None and self.ring.attached():
            self._previous.close()  # the client has moved on to the new ring
            self._previous = None
        return sum(r.heartbeat() for r in (self.ring, self._previous) if r is not None)

    def _silent(self) -> bool:
        beats, now = self._heartbeats(), time.monotonic()
        if beats != self._beats:
            self._beats, self._beat_at = beats, now
            return False
        return now - self._beat_at >= self.client_silence

    def _ring_for(self, nbytes: int, stopped: Callable[[], bool]) -> shm.RingWriter | None:
        if self.disabled:
            return None
        if self.ring is not None and nbytes <= self.ring.capacity:
            return self.ring
        capacity = shm.ring_bytes_for(nbytes, self.max_ring_bytes)
        if capacity is None:
            log.info(
                "a %d-byte batch is larger than max_ring_bytes (%d): sent as frames",
                nbytes,
                self.max_ring_bytes,
            )
            return None
        if self.ring is not None:
            # The client drops the old ring when it reads the first frame naming the new one,
            # having read the old one's batches by then; its name may go once it has opened it.
            self.finish(stopped)
            if self._previous is not None:
                self._previous.close()
            self._previous, self.ring = self.ring, None
        try:
            self.ring = shm.RingWriter(capacity, self.owner_uid)
        except shm.ShmUnavailable as exc:
            self.disabled = True
            log.warning("shared memory refused (%s): this stream continues over gRPC", exc)
            return None
        return self.ring

    def finish(self, stopped: Callable[[], bool]) -> None:
        """Before the stream ends or moves to a larger ring: waits until the client has opened
        the ring, which it does when it reads the first frame naming it (it may be a few
        batches behind). A client silent for client_silence seconds is not waited for: should
        it wake, it cannot open the ring and goes on over gRPC from the batch it needs.

        Raises StreamStopped when `stopped()` turned true first.
        """
        if self.ring is None:
            return
        waiting = self._waiting(stopped)
        if not self.ring.wait_attached(waiting) and not waiting.silent:
            raise StreamStopped()

    def close(self) -> None:
        """Unlinks the ring's name if the client has not, and drops this side's mappings."""
        for ring in (self.ring, self._previous):
            if ring is not None:
                ring.close()
        self.ring = self._previous = None


class _ClientWait:
    """`stopped` for one wait on the client, which also ends once `silent()` says so."""

    def __init__(self, stopped: Callable[[], bool], silent: Callable[[], bool]) -> None:
        self._stopped, self._silent = stopped, silent
        self.silent = False

    def __call__(self) -> bool:
        if self._stopped():
            return True
        self.silent = self._silent()
        return self.silent
