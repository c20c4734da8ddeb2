"""Sampling: the (seed, epoch) -> batch-index sequence of one epoch, with torch's option rules.

An epoch's order is a pure function of (spec, seed, epoch): every epoch gets a fresh
`torch.Generator().manual_seed(seed + epoch)` (the convention `DistributedSampler` uses), from
which the workers' base seed and then the sampler's permutation are drawn in torch's order.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from remote_loader.server.spec import LoaderSpec, resolve


def _call_factory(
    path: str, what: str, dataset: Any, kwargs: Mapping[str, Any], generator: torch.Generator | None
) -> Any:
    factory = resolve(path, what)
    kwargs = dict(kwargs)
    # A random sampler must draw from the epoch's generator for the epoch to be reproducible;
    # factories that take one get it (torch's RandomSampler and friends all name it generator).
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # builtins without a signature
        params = {}  # type: ignore[assignment]
    if generator is not None and "generator" in params and "generator" not in kwargs:
        kwargs["generator"] = generator
    return factory(dataset, **kwargs)


def build_dataloader(
    spec: LoaderSpec, dataset: Any, generator: torch.Generator | None = None
) -> DataLoader[Any]:
    """A torch DataLoader with the spec's options; it starts no process.

    Building it is how options are validated: every conflict torch rejects raises here with
    torch's own exception type and message. Its sampler, batch_sampler and collate_fn are the
    ones an epoch runs with.
    """
    sampler = (
        _call_factory(spec.sampler, "sampler", dataset, spec.sampler_kwargs, generator)
        if spec.sampler
        else None
    )
    batch_sampler = (
        _call_factory(
            spec.batch_sampler, "batch_sampler", dataset, spec.batch_sampler_kwargs, generator
        )
        if spec.batch_sampler
        else None
    )
    collate_fn = resolve(spec.collate_fn, "collate_fn") if spec.collate_fn else None
    worker_init_fn = resolve(spec.worker_init_fn, "worker_init_fn") if spec.worker_init_fn else None
    return DataLoader(
        dataset,
        batch_size=spec.batch_size,
        shuffle=spec.shuffle,
        sampler=sampler,
        batch_sampler=batch_sampler,
        num_workers=spec.num_workers,
        collate_fn=collate_fn,
        drop_last=spec.drop_last,
        timeout=spec.timeout,
        worker_init_fn=worker_init_fn,
        generator=generator,
        prefetch_factor=spec.prefetch_factor,
        persistent_workers=spec.persistent_workers,
        in_order=spec.in_order,
    )


@dataclasses.dataclass(frozen=True)
class Batching:
    """How workers turn a task's indices into a batch; the same for every epoch of a spec."""

    is_iterable: bool
    auto_collation: bool
    drop_last: bool

    @classmethod
    def of(cls, loader: DataLoader[Any]) -> Batching:
        return cls(
            is_iterable=isinstance(loader.dataset, IterableDataset),
            auto_collation=loader.batch_sampler is not None,
            drop_last=loader.drop_last,
        )

    def collate_fn(self, spec: LoaderSpec) -> Callable[[Any], Any]:
        """The spec's collate_fn, else torch's default for this kind of batching."""
        if spec.collate_fn:
            fn: Callable[[Any], Any] = resolve(spec.collate_fn, "collate_fn")
            return fn
        if self.auto_collation:
            return torch.utils.data.default_collate
        return torch.utils.data.default_convert


@dataclasses.dataclass
class EpochPlan:
    """One epoch: the workers' base seed and the sequence of tasks (index lists, or one index)."""

    seed: int
    epoch: int
    base_seed: int
    tasks: Iterator[Any]


def plan_epoch(spec: LoaderSpec, dataset: Any, seed: int, epoch: int) -> EpochPlan:
    """The task sequence and base seed of one epoch, drawn exactly as torch draws them.

    torch's iterator first calls `iter(index_sampler)` (lazy for BatchSampler, eager for some
    custom batch samplers), then draws `base_seed` from the loader's generator, and only then
    does the sampler draw its permutation on the first `next()`. The same order here makes a
    local `DataLoader(..., generator=torch.Generator().manual_seed(seed + epoch))` and this
    epoch agree batch for batch, worker RNGs included.
    """
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    loader = build_dataloader(spec, dataset, generator)
    index_sampler = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
    sampler = loader.sampler
    set_epoch = getattr(sampler, "set_epoch", None)
    if callable(set_epoch):  # DistributedSampler-style samplers reshuffle per epoch this way
        set_epoch(epoch)
    tasks = iter(index_sampler)
    base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
    return EpochPlan(seed=seed, epoch=epoch, base_seed=base_seed, tasks=tasks)
