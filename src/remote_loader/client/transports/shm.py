"""The shared-memory transport's receiving end: batches copied out of the workers' slots (NOTE
[ Zero-copy slots ] in remote_loader.protos.slots) or out of the stream's ring (NOTE
[ Shared-memory transport ] in remote_loader.protos.shm, which holds the ring and both ends'
protocol), for a client that proved it shares the server's /dev/shm.
"""

from __future__ import annotations

from remote_loader.client.assembly import Assembly
from remote_loader.client.errors import ProtocolError
from remote_loader.client.transports.base import BatchReused, TransportUnusable
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import shm, shm_probe, slots


class ShmEnd:
    """Copies each batch out of the ring its Frame names and hands the ring's space back.

    `probe` is the offer this stream's request carries (None: shared memory not offered): the
    server reads it, and removes it, to learn that this process shares its /dev/shm (and,
    through /proc, its pid namespace); `answered` removes it too, in case the server never did.
    The ring is opened on the first batch that names it, and again when the server moves the
    stream to a larger one; a batch in a worker's slot names the stream's control ring.
    """

    name = "shm"

    def __init__(
        self, what: str, probe: shm_probe.Probe | None, slot_maps: slots.SlotMaps | None = None
    ) -> None:
        self._what = what
        self._probe = probe
        self._ring: shm.RingReader | None = None
        self._control: shm.RingReader | None = None
        # The slots this loader has mapped, kept across its streams (the same pool's slots serve
        # every epoch); the owner closes them.
        self._slots = slot_maps if slot_maps is not None else slots.SlotMaps()

    def offer(self) -> pb.ShmOffer | None:
        """What the stream's request says to offer shared memory; None: not offered."""
        probe = self._probe
        if probe is None or probe.fd is None:
            return None
        return pb.ShmOffer(probe=probe.name, nonce=probe.nonce, pid=probe.pid, probe_fd=probe.fd)

    def answered(self) -> None:
        """The server answered the stream: it has read the probe, or never will."""
        if self._probe is not None:
            self._probe.remove()
            self._probe = None

    def fill(self, meta: pb.Frame, data: memoryview, assembly: Assembly) -> bool:
        if meta.shm.HasField("slot"):
            return self._fill_from_slot(meta, assembly)
        ref = meta.shm
        if self._ring is None or self._ring.name != ref.ring:
            if self._ring is not None:
                self._ring.close()  # the server moved to a larger ring: the old one is read
                self._ring = None
            try:
                self._ring = shm.RingReader(ref.ring, ref.ring_bytes)
            except shm.ShmUnavailable as exc:
                raise TransportUnusable(self.name, str(exc), "over gRPC") from exc
        try:
            view = self._ring.view(ref.offset, meta.total_bytes)
        except ValueError as exc:
            raise ProtocolError(f"{self._what}: batch {meta.batch}: {exc}") from exc
        complete = assembly.add(meta, view.data)  # the one copy, out of shared memory
        del view  # before the space goes back: the server may write there next
        self._ring.release(ref.release)
        return complete

    def _fill_from_slot(self, meta: pb.Frame, assembly: Assembly) -> bool:
        """Copies the batch out of its worker's slot, then releases it on the control ring."""
        ref, slot = meta.shm, meta.shm.slot
        try:
            control = self.control_ring(ref.ring, ref.ring_bytes)
        except shm.ShmUnavailable as exc:
            raise TransportUnusable(self.name, str(exc), "over gRPC") from exc
        try:
            whole = self._slots.view(slot.pid, slot.fd, slot.inode, slot.size)
        except slots.SlotUnavailable as exc:
            if control.server_closed():
                # Not a slot this process cannot open: one the server let go of with the
                # stream (a broadcast consumer detached, its Run's workers gone since).
                raise BatchReused(
                    f"{self._what}: batch {meta.batch}: the server let go of the stream ({exc})"
                ) from exc
            raise TransportUnusable(self.name, str(exc), "over gRPC") from exc
        if ref.offset < slots.SLOT_HEADER or ref.offset + meta.total_bytes > slot.size:
            raise ProtocolError(
                f"{self._what}: batch {meta.batch} at offset {ref.offset} of {meta.total_bytes} "
                f"bytes lies outside its {slot.size}-byte slot"
            )
        try:
            # NOTE [ Zero-copy slots ]: the generation before and after the copy tells a whole
            # batch from a slot given back and rewritten under it (the server let go of a
            # stream it thought over); a torn copy is never delivered.
            slots.check_generation(whole, slot.generation)
            complete = assembly.add(meta, whole[ref.offset : ref.offset + meta.total_bytes])
            slots.check_generation(whole, slot.generation)
        except slots.StaleSlot as exc:
            raise BatchReused(f"{self._what}: batch {meta.batch}: {exc}") from exc
        finally:
            del whole
        control.release(ref.release)
        return complete

    def control_ring(self, name: str, nbytes: int) -> shm.RingReader:
        """The stream's control ring (NOTE [ Zero-copy slots ]), opened the first time it is
        named. Raises ShmUnavailable, and ProtocolError for a second one."""
        if self._control is None:
            self._control = shm.RingReader(name, nbytes)
        elif self._control.name != name:
            raise ProtocolError(f"{self._what}: a second control ring in one stream")
        return self._control

    def server_closed(self) -> bool:
        """Whether the server has let go of the stream (closed its control ring)."""
        return self._control is not None and self._control.server_closed()

    def beat(self) -> None:
        for ring in (self._ring, self._control):
            if ring is not None:
                ring.beat()

    def close(self) -> None:
        self.answered()
        for ring in (self._ring, self._control):  # each stream has its own rings
            if ring is not None:
                ring.close()
        self._ring = self._control = None
