"""One batch being put together from its Frames, in (pinned) host memory.

Every transport's receiving end fills one (client/transports/): in-band Frames part by part, a
ring in one piece, data connections a stripe each; the receiver then decodes it.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from remote_loader.client.errors import ProtocolError
from remote_loader.protos import codec, striping
from remote_loader.protos.buffers import BufferPool

# NOTE [ Copying a batch in ]: a batch out of shared memory (a slot or the ring) or an in-band
# part is copied into the receive buffer by the receiver's one thread. On a GPU host that copy
# bounds the shm transport: on a 16-core H200 box, 9.6 MB batches, shm delivered 4.7 GB/s where
# the four threads of tcp's striped connections delivered 5.9; striped as below, shm delivered
# 8.8-9.3 (benchmarks/RESULTS.md, "On a GPU"). numpy lets go of the GIL while it copies, so a
# large copy is cut as a data connection's batch is (striping.stripes: at least MIN_STRIPE bytes,
# aligned) and run as its stripes are (striping.concurrently), one stripe per thread of a small
# pool. Only where the host has cores to spare: a quarter of this process's CPUs, at most 4; on
# a 2-core box the copy stays on one thread, beside the server's workers.
# The pool (COPY_THREADS - 1 threads, made at the first striped copy) lives as long as the
# process, idle between batches, and is joined at its exit like any ThreadPoolExecutor's.
COPY_THREADS = min(4, len(os.sched_getaffinity(0)) // 4)

_copy_pool: tuple[int, ThreadPoolExecutor] | None = None
_copy_pool_lock = threading.Lock()


def _copiers() -> ThreadPoolExecutor:
    """The copy threads of this process (made again in a child after a fork, where the parent's
    threads do not exist)."""
    global _copy_pool
    with _copy_pool_lock:
        if _copy_pool is None or _copy_pool[0] != os.getpid():
            pool = ThreadPoolExecutor(COPY_THREADS - 1, thread_name_prefix="rl-copy")
            _copy_pool = (os.getpid(), pool)
        return _copy_pool[1]


def copy_in(dst: np.ndarray, src: np.ndarray) -> None:
    """`dst[:] = src` (1-D uint8 arrays of one length), striped over COPY_THREADS threads (this
    one among them) when it is large enough (NOTE [ Copying a batch in ])."""
    cuts = striping.stripes(len(dst), COPY_THREADS) if COPY_THREADS > 1 else [(0, len(dst))]
    if len(cuts) == 1:
        dst[:] = src
        return

    def copy(lo: int, hi: int) -> bool:
        dst[lo:hi] = src[lo:hi]
        return True

    tasks = [functools.partial(copy, lo, hi) for lo, hi in cuts]
    striping.concurrently(_copiers(), tasks, threading.Event())


class Assembly:
    """The receive buffer of one batch: its header, and its payload (pinned when `pin`, else
    from `buffers` when given).

    Built from the batch's first Frame (`meta`), whose sizes it checks; parts must arrive in
    order, and the batch is complete when all `parts` brought exactly `total` bytes.
    """

    def __init__(self, meta: Any, pin: bool, buffers: BufferPool | None = None) -> None:
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
        nbytes = self.total - self.payload_start
        if buffers is not None and not pin:
            self.payload = buffers.empty(nbytes)  # NOTE [ Reused buffers ]
        else:
            self.payload = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
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
            copy_in(
                self._payload_np[lo - self.payload_start : end - self.payload_start],
                np.frombuffer(data[lo - start :], dtype=np.uint8),
            )
        self.received = end
        self.next_part += 1
        return self._complete()

    def fill_range(self, lo: int, hi: int, read: Callable[[memoryview], bool]) -> bool:
        """Fills the blob's bytes [lo, hi) in place with `read(view)` (which fills `view`, False
        if stopped): the part below `header_nbytes` into the header, the padding up to
        `payload_start` into a scratch buffer, the rest straight into the payload. Disjoint
        ranges may be filled at once from several threads. False if stopped."""
        if not 0 <= lo <= hi <= self.total:
            raise ProtocolError(f"batch {self.batch}: bytes [{lo}, {hi}) of {self.total}")
        views = []
        if lo < self.header_nbytes:
            views.append(memoryview(self.header)[lo : min(hi, self.header_nbytes)])
        padding = min(hi, self.payload_start) - max(lo, self.header_nbytes)
        if padding > 0:
            views.append(memoryview(bytearray(padding)))
        if hi > self.payload_start:
            start = max(lo, self.payload_start) - self.payload_start
            views.append(self._payload_np.data[start : hi - self.payload_start])
        return all(read(view) for view in views)  # stops at the first False

    def receive(
        self,
        read: Callable[[int, memoryview], bool],
        stripes: Sequence[tuple[int, int]] | None = None,
        run: Callable[[Sequence[Callable[[], bool]]], bool] | None = None,
    ) -> bool:
        """Reads the whole batch beside the Frames, in `stripes`, contiguous (start, end)
        ranges that cover the blob (default: one, all of it): `read(i, view)` fills `view`
        from stripe i's connection (False if stopped), and `run(tasks)` runs one task per
        stripe, each filling its range with `fill_range`, and says whether all finished
        (default: one after another). True when complete, False if stopped."""
        if self.parts != 1 or self.next_part != 0:
            raise ProtocolError(f"batch {self.batch}: a data-connection batch is one part")
        if stripes is None:
            stripes = [(0, self.total)]
        ends = [0, *(hi for _, hi in stripes)]
        if [lo for lo, _ in stripes] != ends[:-1] or ends[-1] != self.total:
            raise ProtocolError(f"batch {self.batch}: stripes {stripes} do not cover {self.total}")
        tasks = [
            functools.partial(self.fill_range, lo, hi, functools.partial(read, i))
            for i, (lo, hi) in enumerate(stripes)
        ]
        if not (run(tasks) if run is not None else all(task() for task in tasks)):
            return False
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
