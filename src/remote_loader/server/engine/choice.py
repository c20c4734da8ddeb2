"""The backend choice: which pool a loader's spec names (`pool`), and `make_pool`, which makes it.

A pool is an Engine (server/engine/seam.py: begin_epoch / submit / poll / end_epoch) with a
lifetime (start / shutdown) and a description for Describe and the metrics. The Run, sharing,
reordering, resume and the transports do not know which backend runs: a third backend is a
module and a line in `make_pool`.

Both run on the one pool core (server/engine/pool.py), which supplies everything but the
workers; what a backend fills is the worker seam, server/engine/backend.py's WorkerBackend:

- "local" (server/engine/local.py's ProcessBackend): worker processes of this server.
- "ray" (server/engine/ray/backend.py's RayBackend): Ray actors on a cluster, through a bridge
  process; needs the `ray` extra, imported only when a loader asks for it. `require_backend`
  checks that at start-up (and in `check-config`), not when an epoch first starts a pool.
"""

from __future__ import annotations

import multiprocessing.context
import os
import sys
from typing import Protocol

from remote_loader.server.config.sampling import Batching
from remote_loader.server.config.spec import ConfigError, LoaderSpec
from remote_loader.server.engine.options import PoolOptions
from remote_loader.server.engine.seam import Engine
from remote_loader.server.telemetry.metrics import LoaderMetrics
from remote_loader.server.worker.dataset import SharedDataset

# The `ray` extra of pyproject.toml (a test holds them equal). The project is installed from its
# repository, not a package index, so the hint names the package itself.
RAY_REQUIREMENT = "ray>=2.40,<3"
RAY_INSTALL = (
    f'pip install "{RAY_REQUIREMENT}" (or, in a clone of the repository, pip install ".[ray]")'
)


class Pool(Engine, Protocol):
    """A worker pool of some backend."""

    @property
    def restarts(self) -> int:
        """Workers replaced after they died (or were stopped for a timeout)."""
        ...

    @property
    def kept_between_epochs(self) -> bool:
        """Kept for the next epoch without persistent_workers (server/engine/backend.py)."""
        ...

    def start(self) -> None: ...
    def shutdown(self) -> None: ...
    def describe(self) -> dict[str, int | str]: ...


def make_pool(
    spec: LoaderSpec,
    batching: Batching,
    ctx: multiprocessing.context.BaseContext,
    options: PoolOptions,
    *,
    metrics: LoaderMetrics,
    dataset: SharedDataset,
) -> Pool:
    """A pool of the spec's backend (`pool`; not started), made with the server's `options`,
    whose workers start from `dataset` (NOTE [ One dataset per loader ] in
    server/worker/dataset.py)."""
    from remote_loader.server.engine.backend import WorkerBackend
    from remote_loader.server.engine.pool import WorkerPool

    backend: WorkerBackend
    if spec.parts.pool.backend == "ray":
        require_backend(spec)
        from remote_loader.server.engine.ray.backend import RayBackend

        backend = RayBackend(
            spec, batching, ctx, options, dataset=dataset, record=metrics.remote_bytes
        )
    else:
        from remote_loader.server.engine.local import ProcessBackend

        backend = ProcessBackend(
            spec, batching, ctx, max_batch_bytes=options.max_batch_bytes, dataset=dataset
        )
    return WorkerPool(spec, batching, backend, metrics=metrics)


def require_backend(spec: LoaderSpec) -> None:
    """Raises ConfigError, with the install command, when the spec's pool backend cannot be
    imported here: at start-up, since a pool that is not persistent is first made by a stream."""
    if spec.parts.pool.backend != "ray":
        return
    # The loader's code in its Ray working_dir (a local folder): the server plans the epochs
    # with the same dataset the actors build, so it imports from there too.
    working_dir = spec.parts.pool.ray_runtime_env.get("working_dir")
    if isinstance(working_dir, str) and os.path.isdir(working_dir):
        path = os.path.abspath(working_dir)
        if path not in sys.path:
            sys.path.insert(0, path)
    try:
        import ray  # noqa: F401  (only to say what is missing, before a bridge starts)
    except ImportError as exc:
        raise ConfigError(
            f'loader {spec.name!r} has pool = "ray", but Ray cannot be imported here ({exc}): '
            f"{RAY_INSTALL}"
        ) from exc
