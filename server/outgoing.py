"""What the send stage hands over for one batch: `Outgoing`, the encoded bytes, where they lie
in a worker's slot, and the lease that keeps them there (NOTE [ Slot lease ] in server/lease.py).

A leaf between the sharing stage, which makes one per batch it keeps (server/lanes.py's Entry),
and the send stage, which hands it to a client (server/transports/): neither imports the other.
"""

from __future__ import annotations

import threading

from remote_loader.protos import wire
from remote_loader.server.engine import SlotRef
from remote_loader.server.lease import SlotLease


class Outgoing:
    """One encoded batch on its way out.

    `blob` (header then payload, `header_nbytes` of header) is valid while a sender's `send`
    runs; a sender that hands the client a reference instead of the bytes (NOTE [ Zero-copy
    slots ] in protos/slots.py: `slot`, where `blob` lies in its worker's slot; None: in this
    process's memory) keeps it valid past that with `lease.hold()`, until the callback it returns
    is called (idempotent, any thread).
    """

    def __init__(
        self,
        blob: memoryview,
        header_nbytes: int,
        slot: SlotRef | None,
        lease: SlotLease,
    ) -> None:
        self.blob = blob
        self.header_nbytes = header_nbytes
        self.slot = slot
        self.lease = lease
        self.nbytes = len(blob)
        self._frames: list[bytes] | None = None
        self._lock = threading.Lock()  # several consumers' streams may send it at once

    def frames(self, batch: int, chunk_size: int) -> list[bytes]:
        """The batch as Frames numbered `batch`, built once and kept for every consumer.

        For broadcast, where every consumer sends the same batch as the same batch number: the
        Frames are cut once, whatever the number of gRPC consumers.
        """
        with self._lock:
            if self._frames is None:
                self._frames = list(
                    wire.batch_frames(batch, self.blob, self.header_nbytes, chunk_size)
                )
            return self._frames
