"""What the send stage hands over for one batch: `Outgoing`, the encoded bytes, where they lie
in a worker's slot, and the lease that keeps them there (NOTE [ Slot lease ] in
server/batch/lease.py).

A leaf between the sharing stage, which makes one per batch it keeps (server/sharing/lanes.py's
Entry), and the send stage, which hands it to a client (server/transports/): neither imports the
other.
"""

from __future__ import annotations

import threading

from remote_loader.protos import wire
from remote_loader.server.batch.delivery import SlotRef
from remote_loader.server.batch.lease import SlotLease
from remote_loader.server.batch.node_batch import NodeBatch
from remote_loader.server.errors import DataConnectionLost


class Outgoing:
    """One encoded batch on its way out.

    `blob` (header then payload, `header_nbytes` of header) is valid while a sender's `send`
    runs; a sender that hands the client a reference instead of the bytes (NOTE [ Zero-copy
    slots ] in protos/slots.py: `slot`, where `blob` lies in its worker's slot; None: in this
    process's memory) keeps it valid past that with `lease.hold()`, until the callback it returns
    is called (idempotent, any thread).

    `node_batch`: the batch lies on the node that made it (NOTE [ Node data connection ] in
    protos/node.py); a sender may name it there (server/transports/node.py), and `blob` is
    fetched from that node into this process's buffer the first time a sender reads it.
    """

    def __init__(
        self,
        blob: memoryview,
        header_nbytes: int,
        slot: SlotRef | None,
        lease: SlotLease,
        node_batch: NodeBatch | None = None,
    ) -> None:
        self._blob = blob
        self.header_nbytes = header_nbytes
        self.slot = slot
        self.lease = lease
        self.node_batch = node_batch
        self.nbytes = len(blob)
        self._frames: list[bytes] | None = None
        self._lock = threading.Lock()  # several consumers' streams may send it at once
        self._fetched = node_batch is None
        self._fetching = threading.Lock()

    @property
    def blob(self) -> memoryview:
        """The batch's bytes; a node batch's are fetched from its node once, here. Raises
        DataConnectionLost when they cannot be (the node is gone: the stream is resumed, and
        the batch made again)."""
        if not self._fetched:
            assert self.node_batch is not None
            with self._fetching:
                if not self._fetched:
                    try:
                        self.node_batch.fetch_into(self._blob)
                    except ConnectionError as exc:
                        raise DataConnectionLost(
                            f"batch made on the node at {self.node_batch.address[0]}:"
                            f"{self.node_batch.address[1]} could not be fetched from it: {exc}"
                        ) from exc
                    self._fetched = True
        return self._blob

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
