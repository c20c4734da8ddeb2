"""The pieces of torch's worker loop that every way of loading shares (a worker process, a Ray
actor, the server itself with num_workers = 0): seeding as torch seeds worker `w`, and turning
one task's indices into one collated batch, as torch's fetchers do.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.utils.data._utils.worker as torch_worker

from remote_loader.server.config.sampling import Batching


def seed_rngs(base_seed: int, worker_id: int) -> int:
    """Seeds `random`, `torch` and `numpy` the way torch's _worker_loop does; returns the seed."""
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    # torch derives numpy's 128-bit seed from (base_seed, worker_id) with this function; using it
    # (rather than a look-alike) is what makes numpy augmentations match a local DataLoader.
    np.random.seed(torch_worker._generate_state(base_seed, worker_id))
    return seed


class Fetcher:
    """Turns one task into one collated batch (torch's _MapDatasetFetcher and
    _IterableDatasetFetcher in one)."""

    def __init__(self, dataset: Any, batching: Batching, collate_fn: Callable[[Any], Any]) -> None:
        self.dataset = dataset
        self.batching = batching
        self.collate_fn = collate_fn
        self._iter: Any = iter(dataset) if batching.is_iterable else None
        self.ended = False

    def fetch(self, indices: Any) -> Any:
        """The collated batch; raises StopIteration when an IterableDataset has run dry."""
        if self.batching.is_iterable:
            return self._fetch_iterable(indices)
        if self.batching.auto_collation:
            getitems = getattr(self.dataset, "__getitems__", None)
            data = getitems(indices) if getitems else [self.dataset[i] for i in indices]
        else:
            data = self.dataset[indices]
        return self.collate_fn(data)

    def _fetch_iterable(self, indices: Any) -> Any:
        if self.ended:
            raise StopIteration
        if not self.batching.auto_collation:
            try:
                return self.collate_fn(next(self._iter))
            except StopIteration:
                self.ended = True
                raise
        data = []
        for _ in indices:
            try:
                data.append(next(self._iter))
            except StopIteration:
                self.ended = True
                break
        if not data or (self.batching.drop_last and len(data) < len(indices)):
            raise StopIteration
        return self.collate_fn(data)
