"""One epoch of a RemoteLoader: the iterator a training loop gets from `iter(loader)` (a
receiver thread and the bounded queue it fills), and the figures it keeps (`LoaderStats`).
"""

from __future__ import annotations

import dataclasses
import queue
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from remote_loader.client.errors import ConnectionLostError, LoaderTimeoutError
from remote_loader.client.items import Failed, Finished, Item, Ready
from remote_loader.client.receiver import POLL_INTERVAL, Receiver
from remote_loader.client.stall import StallWindow


@dataclasses.dataclass(frozen=True)
class LoaderStats:
    """How an epoch went for the training loop (`RemoteLoader.stats()`).

    `wait_fraction` is the share of the wall time since the epoch's first `next()` that the
    loop spent blocked in `next()`: near 1, loading is the bottleneck (more server workers, a
    faster dataset); near 0, the training step is, and the loader keeps up.
    """

    epoch: int
    batches: int = 0  # batches received by the training loop (errors at a position not counted)
    # Their encoded bytes (header and tensor data): the server counts the same bytes in
    # remote_loader_bytes_served_total.
    bytes: int = 0
    wait_seconds: float = 0.0  # blocked in next()
    elapsed_seconds: float = 0.0  # since the epoch's first next(); up to its end once it ended
    wait_fraction: float = 0.0  # wait_seconds / elapsed_seconds, in [0, 1]
    reconnects: int = 0  # broken streams resumed (see `retries`)
    # How the latest batch came: "shm" (same host, shared memory), "tcp" (the data connection),
    # "node" (fetched from the Ray node that made it), "grpc", or None before any.
    transport: str | None = None
    # Of `bytes`, those fetched from the nodes that made them rather than through the server
    # (NOTE [ Node data connection ]): bytes - node_bytes crossed the server's host.
    node_bytes: int = 0
    # Over the last few seconds (about 10, across epochs; NOTE [ Stall stages ] in
    # protos/stall.py): the share blocked in next(), and the stage that held most of it,
    # "workers", "in flight" or "copy" ("" when the loop did not wait).
    window_wait_fraction: float = 0.0
    wait_stage: str = ""


class EpochIterator(Iterator[Any]):
    """One epoch's stream: a receiver thread and the bounded queue it fills.

    NOTE [ An iterator's epoch ]: `iter(loader)` opens nothing. The first `next()` takes the
    loader's next epoch and position (`begin`), makes the loader's next epoch the one after,
    and starts the receiver; until then `epoch` and `batches` say what it would read now. An
    iterator dropped before its first `next()` (Lightning's iter() probe, a discarded peek) has
    used no epoch, and the loader's set_epoch() still reaches it.
    """

    _receiver: Receiver  # made by the first next()

    def __init__(
        self,
        begin: Callable[[queue.Queue[Item]], tuple[int, int, Receiver]],
        position: Callable[[], tuple[int, int]],
        prefetch: int,
        timeout: float | None,
        length: Callable[[], int],
        overlength: Callable[[int], str | None] = lambda yielded: None,
        window: StallWindow | None = None,
    ) -> None:
        """At the first `next()`, `begin(queue)` gives the epoch, the batch it starts from and
        the thread (not started) that fills `queue` (bounded: `prefetch` batches) with that
        epoch's stream; `position()` is that (epoch, batch) as it would be now. `timeout`
        bounds each `next()` (None: no bound, torch's timeout=0); `length()` is the loader's
        len(); `overlength(n)` is the warning to give when the n-th batch is yielded, if any;
        `window` is told of each wait (the loader's, across its epochs)."""
        self._begin = begin
        self._position = position
        self._timeout = timeout
        self._length = length
        self._overlength = overlength
        self._window = window if window is not None else StallWindow()
        self._queue: queue.Queue[Item] = queue.Queue(maxsize=prefetch)
        self._done = False
        self.finished = False  # the epoch's end was reached (StopIteration)
        self._started = False  # the first next() has made (and started) self._receiver
        self._epoch = 0
        self._batches = 0  # the epoch's position: batches yielded, including skipped ones
        self._yielded = 0  # batches this iterator yielded
        self.transport: str | None = None  # how the latest batch handed out arrived
        # For stats(): when the loop first asked, how long it has been blocked in next(), what
        # it received, and when the epoch ended (None while it runs).
        self._first_next: float | None = None
        self._waited = 0.0
        self._received = 0
        self._received_bytes = 0
        self._node_bytes = 0  # of them, fetched from nodes (transport "node")
        self._ended_at: float | None = None

    @property
    def started(self) -> bool:
        """Whether the first `next()` has taken an epoch (NOTE [ An iterator's epoch ])."""
        return self._started

    @property
    def epoch(self) -> int:
        """The epoch read, or the one the first `next()` would read if made now."""
        return self._epoch if self.started else self._position()[0]

    @property
    def batches(self) -> int:
        """The epoch's position: batches yielded, including those a resume skipped."""
        return self._batches if self.started else self._position()[1]

    def __len__(self) -> int:
        return self._length()

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        if not self._started:
            self._epoch, self._batches, self._receiver = self._begin(self._queue)
            self._started = True
            self._receiver.start()
        item = self._timed_get()
        if isinstance(item, Finished):
            self._done = self.finished = True
            self._receiver.join()
            raise StopIteration
        if isinstance(item, Failed):
            if item.final:
                self._done = True
                self._receiver.join()
            raise item.error
        self._batches += 1
        self._yielded += 1
        warning = self._overlength(self._yielded)
        if warning is not None:
            warnings.warn(warning, stacklevel=2)  # torch's, from its __next__
        return _on_device(item)

    def _timed_get(self) -> Item:
        """`_get`, counting the time the training loop is blocked in it (for stats())."""
        entered = time.monotonic()
        if self._first_next is None:
            self._first_next = entered
        self._window.blocked(entered)
        item: Item | None = None
        try:
            item = self._get()
        finally:
            left = time.monotonic()
            self._waited += left - entered
            if isinstance(item, Ready):
                self._window.waited(entered, left, item.workers_wait, item.copy_seconds)
            else:
                self._window.waited(entered, left)
        if isinstance(item, Ready):
            self._received += 1
            self._received_bytes += item.nbytes
            if item.transport == "node":
                self._node_bytes += item.nbytes
            # The receiver may already be batches ahead, on another transport (a batch larger
            # than the ring goes as frames): this is the one the training loop now gets.
            self.transport = item.transport
        elif isinstance(item, Finished) or item.final:
            self._ended_at = time.monotonic()
        return item

    def stats(self) -> LoaderStats:
        reconnects = self._receiver.reconnects if self._started else 0
        recent = self._window.figures()
        if self._first_next is None:
            return LoaderStats(
                epoch=self.epoch,
                reconnects=reconnects,
                transport=self.transport,
                window_wait_fraction=recent.wait_fraction,
                wait_stage=recent.stage,
            )
        elapsed = (self._ended_at or time.monotonic()) - self._first_next
        return LoaderStats(
            epoch=self.epoch,
            batches=self._received,
            bytes=self._received_bytes,
            node_bytes=self._node_bytes,
            wait_seconds=self._waited,
            elapsed_seconds=elapsed,
            wait_fraction=min(1.0, self._waited / elapsed) if elapsed > 0 else 0.0,
            reconnects=reconnects,
            transport=self.transport,
            window_wait_fraction=recent.wait_fraction,
            wait_stage=recent.stage,
        )

    def _get(self) -> Item:
        """The next item, waiting at most the loader's timeout, never on a dead receiver."""
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        while True:
            try:
                return self._queue.get(timeout=POLL_INTERVAL)
            except queue.Empty:
                if not self._receiver.is_alive() and self._queue.empty():
                    self._done = True
                    raise ConnectionLostError(
                        "the receiver thread ended without a result (the stream was stopped)"
                    ) from None
                if deadline is not None and time.monotonic() >= deadline:
                    raise LoaderTimeoutError(
                        f"RemoteLoader timed out after {self._timeout} seconds waiting "
                        f"for batch {self.batches} of epoch {self.epoch}"
                    ) from None

    def close(self) -> None:
        """Cancels the stream, if it began; the server stops producing for it."""
        self._done = True
        if self._started:
            self._receiver.stop()
            self._receiver.join(timeout=5.0)

    def __del__(self) -> None:
        # Backstop only: close() / RemoteLoader.close() are the cleanup path.
        if not self._done and self._started:
            self._receiver.stop()


def _on_device(item: Ready) -> Any:
    """Makes the training loop's stream wait for the batch's copy, and keeps memory safe."""
    if item.event is not None and item.device_payload is not None:
        stream = torch.cuda.current_stream(item.device_payload.device)
        stream.wait_event(item.event)
        # The payload was allocated on the copy stream and is used on this one: tell the caching
        # allocator, or it could hand the memory to the next copy while kernels still read it.
        item.device_payload.record_stream(stream)
    return item.batch
