"""Idle pools kept for their loader's next epoch, one server's (NOTE [ Ray pool reuse ] in
server/engine/ray/backend.py).

A pool without persistent_workers whose backend keeps pools between epochs is parked here after
its Run, for its loader's next Run, at most `idle` seconds. It holds cluster CPUs meanwhile, so
a loader about to start a pool of its own first shuts down the pools other loaders keep: one
loader's epochs back to back reuse their pool, and an idle pool never stands in the way of
another loader's. Bound: one kept pool per loader.
"""

from __future__ import annotations

import logging
import threading

from remote_loader.server.engine.choice import Pool

log = logging.getLogger(__name__)

# How long a kept pool waits for its loader's next epoch before it is shut down.
KEEP_IDLE_POOL = 30.0


class KeptPools:
    """The server's kept pools, by loader name. Any thread."""

    def __init__(self, idle: float | None = None) -> None:
        self.idle = KEEP_IDLE_POOL if idle is None else idle
        self._pools: dict[str, tuple[Pool, threading.Timer]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def keep(self, loader: str, pool: Pool) -> None:
        """Parks `pool` for `loader`'s next Run; shuts it down when the server is closing or
        the loader already keeps one."""
        with self._lock:
            keep = not self._closed and loader not in self._pools
            if keep:
                timer = threading.Timer(self.idle, self._expire, args=(loader, pool))
                timer.daemon = True
                self._pools[loader] = (pool, timer)
                timer.start()
        if not keep:
            pool.shutdown()

    def take(self, loader: str) -> Pool | None:
        """The pool `loader` keeps, now its caller's; None when it keeps none."""
        with self._lock:
            kept = self._pools.pop(loader, None)
        if kept is None:
            return None
        kept[1].cancel()
        return kept[0]

    def make_room(self, loader: str) -> None:
        """Before `loader` starts a pool: the pools other loaders keep are shut down, their
        CPUs given back to the cluster."""
        with self._lock:
            others = [name for name in self._pools if name != loader]
            pools = [self._pools.pop(name) for name in others]
        for name, (pool, timer) in zip(others, pools, strict=True):
            timer.cancel()
            log.info("loader %r: its idle pool is stopped for loader %r's", name, loader)
            pool.shutdown()

    def _expire(self, loader: str, pool: Pool) -> None:
        with self._lock:
            kept = self._pools.get(loader)
            if kept is None or kept[0] is not pool:
                return  # taken or stopped meanwhile
            del self._pools[loader]
        log.info(
            "loader %r: its idle pool is stopped after %g s without an epoch", loader, self.idle
        )
        pool.shutdown()

    def close(self, loader: str | None = None) -> None:
        """Shuts down the pools kept for `loader` (None: all, and keeps none from now on)."""
        with self._lock:
            if loader is None:
                self._closed = True
            names = [n for n in self._pools if loader is None or n == loader]
            pools = [self._pools.pop(n) for n in names]
        for pool, timer in pools:
            timer.cancel()
            pool.shutdown()
