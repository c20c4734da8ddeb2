"""What an engine hands a Run for each task (server/engine/seam.py): an Outcome, holding the
batch's Delivery (its encoded blob and lease, or its error), and where the blob lies in its
worker's slot (SlotRef) for a client that maps it.
"""

from __future__ import annotations

import dataclasses

from remote_loader.server.batch.lease import SlotLease
from remote_loader.server.batch.node_batch import NodeBatch
from remote_loader.server.errors import CapturedError


@dataclasses.dataclass(frozen=True)
class SlotRef:
    """Where a delivered batch lies in its worker's slot, for a client that maps the slot
    itself (NOTE [ Zero-copy slots ] in protos/slots.py): the descriptor this process holds the
    slot open on, the file's inode and size, the blob's offset and the slot's generation."""

    fd: int
    inode: int
    size: int
    offset: int
    generation: int


@dataclasses.dataclass
class Delivery:
    """One batch made for a Run: its encoded blob, or the error raised making it.

    `blob` stays valid until its `lease` is over (NOTE [ Slot lease ] in server/batch/lease.py): the
    sharing stage owns it, zero-copy senders hold it.
    """

    blob: memoryview | None = None
    header_nbytes: int = 0
    error: CapturedError | None = None
    lease: SlotLease = dataclasses.field(default_factory=SlotLease)
    # The worker's slot holding `blob`, when a same-host client may map it (None: in this
    # process's memory, or a slot without a descriptor).
    slot: SlotRef | None = None
    # The batch lies on the node that made it, `blob` being only room for it here until a
    # sender reads it (NOTE [ Node data connection ] in protos/node.py).
    node_batch: NodeBatch | None = None
    # time.monotonic() when the Run submitted its task and read it back (set by the Run, for
    # the queue and latency metrics).
    submitted_at: float = 0.0
    received_at: float = 0.0


@dataclasses.dataclass
class Outcome:
    """A submitted task came back: its Delivery, or None when the worker had run dry."""

    task_id: int
    delivery: Delivery | None
