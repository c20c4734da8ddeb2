"""Striping: one batch cut into contiguous ranges (stripes), each carried by a thread of its own,
all at once: over a stream's data connections, a node's, or the receiver's large copies (the cut
and why, in NOTE [ TCP data connection ] in protos/tcp.py).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, wait

from remote_loader.protos.tcp import MAX_DATA_CONNECTIONS

# A stripe costs a thread handoff on each side (tens of microseconds). 1 MiB takes ~0.3 ms on
# 25 GbE and ~0.1 ms on 100 GbE, so that cost stays a small fraction of the stripe; and a batch
# below 2 MiB, over in a few hundred microseconds on any such link, goes on one connection.
MIN_STRIPE = 1 << 20
# Stripe boundaries are multiples of this: whole pages of the blob for each connection's copies.
STRIPE_ALIGN = 64 << 10


def stripes(total: int, connections: int) -> list[tuple[int, int]]:
    """How a batch of `total` bytes is cut on a stream with `connections` data connections: the
    (start, end) blob ranges, stripe i for connection i (NOTE [ TCP data connection ]).

    min(connections, total // MIN_STRIPE) of them, at least one; contiguous, covering
    [0, total), every boundary between two a multiple of STRIPE_ALIGN (the even cut rounded
    down), so their sizes are within 2 * STRIPE_ALIGN of each other and each is more than
    MIN_STRIPE - STRIPE_ALIGN: never empty.
    """
    if total < 0:
        raise ValueError(f"a batch has a size of at least 0 bytes, got {total}")
    if not 1 <= connections <= MAX_DATA_CONNECTIONS:
        raise ValueError(
            f"a stream has 1 to {MAX_DATA_CONNECTIONS} data connections, got {connections}"
        )
    count = min(connections, max(1, total // MIN_STRIPE))
    inner = (total * i // count // STRIPE_ALIGN * STRIPE_ALIGN for i in range(1, count))
    return list(itertools.pairwise([0, *inner, total]))


def concurrently(
    pool: Executor | None, tasks: Sequence[Callable[[], bool]], failed: threading.Event
) -> bool:
    """Runs `tasks[0]` on this thread and the others on `pool`, all at once: the stripes of one
    batch, each writing or reading its own connection. True when every task returned True;
    False when one was stopped (returned False).

    A task that raises sets `failed`, which the others' `stopped()` must watch (they return
    within POLL_INTERVAL); once all have returned, the first task's error (by stripe) is raised.
    No task outlives this call, so none touches the batch after it.
    """
    if len(tasks) > 1 and pool is None:
        raise ValueError(f"{len(tasks)} stripes need a pool for all but the first")

    def run(task: Callable[[], bool]) -> bool:
        try:
            return task()
        except BaseException:
            failed.set()
            raise

    futures: list[Future[bool]] = []
    try:
        if pool is not None:
            futures = [pool.submit(run, task) for task in tasks[1:]]
        done = run(tasks[0])
    except BaseException:
        failed.set()
        wait(futures)
        raise
    wait(futures)
    for future in futures:  # in stripe order: raises the first error
        done = future.result() and done
    return done
