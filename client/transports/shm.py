"""The shared-memory transport's receiving end: batches copied out of the stream's ring, for a
client that proved it shares the server's /dev/shm (NOTE [ Shared-memory transport ] in
remote_loader.protos.shm, which holds the ring and both ends' protocol).
"""

from __future__ import annotations

from remote_loader.client.assembly import Assembly
from remote_loader.client.errors import ProtocolError
from remote_loader.client.transports.base import TransportUnusable
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import shm


class ShmEnd:
    """Copies each batch out of the ring its Frame names and hands the ring's space back.

    `probe` is the offer this stream's request carries (None: shared memory not offered): the
    server reads it, and removes it, to learn that this process shares its /dev/shm; `answered`
    removes it too, in case the server never did. The ring is opened on the first batch that
    names it, and again when the server moves the stream to a larger one.
    """

    name = "shm"

    def __init__(self, what: str, probe: shm.Probe | None) -> None:
        self._what = what
        self._probe = probe
        self._ring: shm.RingReader | None = None

    def offer(self) -> pb.ShmOffer | None:
        """What the stream's request says to offer shared memory; None: not offered."""
        probe = self._probe
        return None if probe is None else pb.ShmOffer(probe=probe.name, nonce=probe.nonce)

    def answered(self) -> None:
        """The server answered the stream: it has read the probe, or never will."""
        if self._probe is not None:
            self._probe.remove()
            self._probe = None

    def fill(self, meta: pb.Frame, data: memoryview, assembly: Assembly) -> bool:
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

    def beat(self) -> None:
        if self._ring is not None:
            self._ring.beat()

    def close(self) -> None:
        self.answered()
        if self._ring is not None:  # each stream has its own ring
            self._ring.close()
            self._ring = None
