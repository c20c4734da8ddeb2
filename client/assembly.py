"""One batch being put together from its Frames, in (pinned) host memory.

Every transport's receiving end fills one (client/transports/): in-band Frames part by part, a
ring or a data connection in one piece; the receiver then decodes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from remote_loader.client.errors import ProtocolError
from remote_loader.protos import codec


class Assembly:
    """The receive buffer of one batch: its header, and its payload (pinned when `pin`).

    Built from the batch's first Frame (`meta`), whose sizes it checks; parts must arrive in
    order, and the batch is complete when all `parts` brought exactly `total` bytes.
    """

    def __init__(self, meta: Any, pin: bool) -> None:
        self.batch = meta.batch
        self.parts = meta.parts
        self.next_part = 0
        self.total = meta.total_bytes
        self.header_nbytes = meta.header_bytes
        self.payload_start = codec.payload_offset(self.header_nbytes)
        if (
            meta.parts < 1
            or self.header_nbytes > self.total
            or self.payload_start > max(self.total, self.header_nbytes)
        ):
            raise ProtocolError(f"batch {meta.batch}: inconsistent frame sizes")
        self.header = bytearray(self.header_nbytes)
        self.payload = torch.empty(
            self.total - self.payload_start, dtype=torch.uint8, pin_memory=pin
        )
        self._payload_np = self.payload.numpy()
        self.received = 0

    def add(self, meta: Any, data: memoryview) -> bool:
        """Copies one frame's data into place; True when the batch is complete."""
        if meta.batch != self.batch or meta.part != self.next_part:
            raise ProtocolError(
                f"expected part {self.next_part} of batch {self.batch}, "
                f"got part {meta.part} of batch {meta.batch}"
            )
        start, end = self.received, self.received + len(data)
        if end > self.total:
            raise ProtocolError(f"batch {self.batch}: more data than its {self.total} bytes")
        if start < self.header_nbytes:
            n = min(end, self.header_nbytes) - start
            self.header[start : start + n] = data[:n]
        lo = max(start, self.payload_start)
        if end > lo:
            self._payload_np[lo - self.payload_start : end - self.payload_start] = np.frombuffer(
                data[lo - start :], dtype=np.uint8
            )
        self.received = end
        self.next_part += 1
        return self._complete()

    def receive(self, read: Callable[[memoryview], bool]) -> bool:
        """Reads the whole batch with `read(view)` (which fills `view` from the data
        connection, False if stopped): header and padding, then the payload straight into
        place. True when complete, False if stopped."""
        if self.parts != 1 or self.next_part != 0:
            raise ProtocolError(f"batch {self.batch}: a data-connection batch is one part")
        head = bytearray(self.payload_start)
        if not read(memoryview(head)) or not read(self._payload_np.data):
            return False
        self.header[:] = head[: self.header_nbytes]
        self.received = self.total
        self.next_part = 1
        return self._complete()

    def _complete(self) -> bool:
        if self.next_part == self.parts:
            if self.received != self.total:
                raise ProtocolError(
                    f"batch {self.batch}: {self.received} of {self.total} bytes arrived"
                )
            return True
        return False
