"""The send stage: how one stream's batches leave the server.

Plain Frames (remote_loader.protos.wire) always work. A stream whose client offered shared
memory and proved it shares this host's /dev/shm sends its batches through a ring instead
(NOTE [ Shared-memory transport ] in remote_loader.protos.shm), batch by batch falling back to
Frames when the ring cannot take one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import shm, wire

log = logging.getLogger(__name__)


class StreamStopped(Exception):
    """The stream was cancelled, or its consumer detached, while waiting for the client."""


def accept_offer(offer: pb.ShmOffer, max_ring_bytes: int) -> ShmSender | None:
    """A sender for a stream whose request carries `offer`, or None to send plain Frames."""
    if not offer.probe or max_ring_bytes <= 0 or not shm.available():
        return None
    owner = shm.verify_probe(offer.probe, offer.nonce)
    if owner is None or not shm.can_share_with(owner):
        return None  # another host, or a user that could not open this server's rings
    return ShmSender(owner, max_ring_bytes)


class ShmSender:
    """Copies a stream's batches into its ring; owns the ring until `close()`.

    The ring is made for the first batch's size (shm.RING_BATCHES of them) and made again,
    larger, when a batch outgrows it; a batch bigger than `max_ring_bytes`, or any batch after
    /dev/shm refused a ring, goes as plain Frames.
    """

    def __init__(self, owner_uid: int, max_ring_bytes: int) -> None:
        self.owner_uid = owner_uid
        self.max_ring_bytes = max_ring_bytes
        self.ring: shm.RingWriter | None = None
        self.disabled = False  # /dev/shm refused a ring: the rest of the stream goes as Frames
        self.batches = 0  # sent through shared memory

    def frame(
        self, batch: int, blob: memoryview, header_nbytes: int, stopped: Callable[[], bool]
    ) -> bytes | None:
        """The Frame that hands batch `batch` over through the ring; None: send it as Frames.

        Raises StreamStopped when `stopped()` turned true while waiting for room.
        """
        ring = self._ring_for(len(blob), stopped)
        if ring is None:
            return None
        placed = ring.place(blob, stopped)
        if placed is None:
            raise StreamStopped()
        offset, release = placed
        self.batches += 1
        return wire.control_frame(
            pb.Frame(
                batch=batch,
                part=0,
                parts=1,
                total_bytes=len(blob),
                header_bytes=header_nbytes,
                shm=pb.ShmBatch(
                    ring=ring.name, ring_bytes=ring.capacity, offset=offset, release=release
                ),
            )
        )

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
            self.close()
        try:
            self.ring = shm.RingWriter(capacity, self.owner_uid)
        except shm.ShmUnavailable as exc:
            self.disabled = True
            log.warning("shared memory refused (%s): this stream continues over gRPC", exc)
            return None
        return self.ring

    def finish(self, stopped: Callable[[], bool]) -> None:
        """Before the stream ends: waits until the client has opened the ring, which it does
        when it reads the first frame naming it (it may be a few batches behind).

        Raises StreamStopped when `stopped()` turned true first.
        """
        if self.ring is not None and not self.ring.wait_attached(stopped):
            raise StreamStopped()

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
            self.ring = None
