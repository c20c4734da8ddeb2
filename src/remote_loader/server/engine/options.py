"""PoolOptions: the server's settings every loader's pool is made with, made once from the
server's settings (ServerSettings.pool_options) and handed down: LoaderHost, make_pool, and the
backend that reads them."""

from __future__ import annotations

import dataclasses

from remote_loader.server.batch.messages import DEFAULT_MAX_BATCH_BYTES


@dataclasses.dataclass(frozen=True)
class PoolOptions:
    # The largest encoded batch a worker may make (server/batch/messages.py).
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES
    # The Ray cluster of pool = "ray" loaders (ray.init's address: HOST:PORT of the head's GCS,
    # or "auto"); None starts a local Ray instance.
    ray_address: str | None = None
    # Ray actors talk to the server on direct lanes (NOTE [ Ray direct lane ] in
    # server/engine/ray/lane.py); false: every batch through Ray's calls and object store.
    ray_direct: bool = True
    # With ray_direct: trainers fetch a batch made on another host from that node (NOTE [ Node
    # data connection ] in protos/node.py); false: through this server.
    ray_node_fetch: bool = True

    def __post_init__(self) -> None:
        if self.max_batch_bytes < 1:
            raise ValueError(f"max_batch_bytes must be at least 1, got {self.max_batch_bytes}")
