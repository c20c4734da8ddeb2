"""The shared-memory transport's sending end: a stream whose client offered shared memory and
proved it shares this host's /dev/shm gets its batches where their workers wrote them (NOTE
[ Zero-copy slots ] in remote_loader.protos.slots) when it also shares this process's pid
namespace and user, else through a ring (NOTE [ Shared-memory transport ] in
remote_loader.protos.shm, which holds the ring and both ends' protocol), batch by batch falling
back to Frames when the ring cannot take one.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable, Iterator

from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import shm, shm_probe, slots, wire
from remote_loader.server.batch.outgoing import Outgoing
from remote_loader.server.errors import ClientSilent
from remote_loader.server.transports.base import (
    DEFAULT_CLIENT_SILENCE,
    InbandSender,
    StreamStopped,
)

log = logging.getLogger(__name__)


def accept_offer(
    offer: pb.ShmOffer,
    max_ring_bytes: int,
    fallback: InbandSender,
    client_silence: float = DEFAULT_CLIENT_SILENCE,
    zero_copy: bool = True,
) -> ShmSender | None:
    """A sender for a stream whose request carries `offer`, or None: another host, or shared
    memory off. Batches the ring cannot take go through `fallback`. `zero_copy`: this server
    lets clients that can map its workers' slots do so."""
    if not offer.probe or max_ring_bytes <= 0 or not shm.available():
        return None
    probe = shm_probe.read_probe(offer.probe, offer.nonce)
    if probe is None or not shm_probe.can_share_with(probe.st_uid):
        return None  # another host, or a user that could not open this server's rings
    # The client may open this process's descriptors: it is the same user (not merely one this
    # server may give a ring to), and the pid it named holds the probe as seen from here.
    mappable = (
        zero_copy
        and probe.st_uid == os.geteuid()
        and slots.shares_pid_namespace(offer.pid, offer.probe_fd, probe.st_ino, probe.st_dev)
    )
    return ShmSender(probe.st_uid, max_ring_bytes, fallback, client_silence, zero_copy=mappable)


class ShmSender:
    """Hands a stream's batches over in shared memory; owns its rings until `close()`.

    `zero_copy`: a batch in a worker's slot is not copied at all; the client maps the slot and
    copies it out itself (NOTE [ Zero-copy slots ]), at most slots.SLOT_LEASES batches ahead of
    its releases. Anything else is copied into the ring:

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
        *,
        zero_copy: bool = False,
    ) -> None:
        self.owner_uid = owner_uid
        self.zero_copy = zero_copy
        # Zero-copy: the control ring (its cursor counts the slot batches released), and the
        # leases not yet released, by their number, oldest first.
        self.control: shm.RingWriter | None = None
        self._leased: collections.deque[tuple[int, Callable[[], None]]] = collections.deque()
        self._sent = 0  # slot batches sent
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

    def send(self, batch: int, outgoing: Outgoing, stopped: Callable[[], bool]) -> Iterator[bytes]:
        frame = self._lend(batch, outgoing, stopped)
        if frame is None:
            frame = self.frame(batch, outgoing.blob, outgoing.header_nbytes, stopped)
        if frame is None:
            return self.fallback.send(batch, outgoing, stopped)
        return iter((frame,))

    def _lend(self, batch: int, outgoing: Outgoing, stopped: Callable[[], bool]) -> bytes | None:
        """The Frame that hands batch `batch` over in its worker's slot (NOTE [ Zero-copy
        slots ]); None: it goes through the ring. Raises StreamStopped or ClientSilent while
        waiting for the client to release an earlier one."""
        ref = outgoing.slot
        if not self.zero_copy or ref is None:
            return None
        control = self.open_control()
        if control is None:
            return None
        self._end_leases(control.consumed())
        if len(self._leased) >= slots.SLOT_LEASES:
            oldest = self._leased[0][0]
            self._wait(
                lambda: control.consumed() >= oldest, stopped, "release a slot", ending=False
            )
            self._end_leases(control.consumed())
        self._leased.append((self._sent + 1, outgoing.lease.hold()))
        self._sent += 1
        self.batches += 1
        return wire.handle_frame(
            batch,
            outgoing.nbytes,
            outgoing.header_nbytes,
            shm=pb.ShmBatch(
                ring=control.name,
                ring_bytes=control.capacity,
                offset=ref.offset,
                release=self._sent,
                slot=pb.ShmSlot(
                    pid=os.getpid(),
                    fd=ref.fd,
                    inode=ref.inode,
                    size=ref.size,
                    generation=ref.generation,
                ),
            ),
        )

    def open_control(self) -> shm.RingWriter | None:
        """The stream's control ring (NOTE [ Zero-copy slots ]), made on first use; None when
        /dev/shm refused it (zero-copy is then off for the stream: batches go into the ring)."""
        if self.control is None and self.zero_copy:
            try:
                self.control = shm.RingWriter(shm.ALIGN, self.owner_uid)
            except shm.ShmUnavailable as exc:
                log.warning("no control ring (%s): batches are copied into the ring", exc)
                self.zero_copy = False
        return self.control

    def _end_leases(self, released: int) -> None:
        while self._leased and self._leased[0][0] <= released:
            self._leased.popleft()[1]()

    def _wait(
        self, ready: Callable[[], bool], stopped: Callable[[], bool], what: str, *, ending: bool
    ) -> None:
        """Waits for the client to make `ready()` true. Raises StreamStopped when `stopped()`
        turned true first, and ClientSilent when the client gave no sign of life for
        client_silence seconds, unless the stream is `ending` (a silent client is not waited
        for then: should it wake, a reused slot is a broken stream to it)."""
        waiting = self._waiting(stopped)
        control = self.control
        assert control is not None
        # Asleep on the control ring's doorbell (NOTE [ Doorbell ]). Without one, the first
        # look after 0.4 ms, not 50 us: the server waits here only when it is SLOT_LEASES
        # batches ahead of the client's copies, so waking sooner buys no throughput and costs
        # the server a wake-up per poll for every consumer (broadcast: per batch).
        if control.wait(ready, waiting, 400e-6):
            return
        if not waiting.silent:
            raise StreamStopped()
        if not ending:
            raise ClientSilent(
                f"the client did not {what} in shared memory and gave no sign of life "
                f"for {self.client_silence:g} s"
            )

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
        rings = (self.ring, self._previous, self.control)
        return sum(r.heartbeat() for r in rings if r is not None)

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
            self._attached(stopped)
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

        Zero-copy: waits until the client has released every slot batch, so the slots go back
        to their workers with nobody reading them.

        Raises StreamStopped when `stopped()` turned true first.
        """
        control = self.control
        if control is not None and self._leased:
            sent = self._sent
            self._wait(
                lambda: control.consumed() >= sent, stopped, "release its slots", ending=True
            )
            self._end_leases(control.consumed())
        self._attached(stopped)

    def _attached(self, stopped: Callable[[], bool]) -> None:
        """Waits until the client has opened the data ring (its name may go then)."""
        if self.ring is None:
            return
        waiting = self._waiting(stopped)
        if not self.ring.wait_attached(waiting) and not waiting.silent:
            raise StreamStopped()

    def close(self) -> None:
        """Unlinks the rings' names if the client has not, drops this side's mappings, and ends
        the leases left (a client still copying one sees its slot's generation change)."""
        self._end_leases(self._sent)
        for ring in (self.ring, self._previous, self.control):
            if ring is not None:
                ring.close()
        self.ring = self._previous = self.control = None


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
