"""Sampling: the (seed, epoch) -> batch-index sequence of one epoch, with torch's option rules.

An epoch's order is a pure function of (spec, seed, epoch): every epoch gets a fresh
`torch.Generator().manual_seed(seed + epoch)` (the convention `DistributedSampler` uses), from
which the workers' base seed and then the sampler's permutation are drawn in torch's order.

Partitioned between `world_size` ranks, rank r's share is what a local DataLoader whose sampler
is `DistributedSampler(dataset, world_size, r, shuffle, seed, partition_drop_last)` would give
(the default sampler), or the loader's own order split by DistributedSampler's rule (a custom
sampler: split by sample; a custom batch_sampler: split by batch).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    IterDataPipe,
)

from remote_loader.server.config.spec import LoaderSpec, resolve


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
        # Checked by torch (its messages); the workers start from the fork server whatever it
        # says (LoaderSpec.multiprocessing_context).
        multiprocessing_context=spec.multiprocessing_context,
    )


@dataclasses.dataclass(frozen=True)
class LoaderWarning:
    """A warning torch's DataLoader machinery gave for a loader (LoaderInfo.warnings)."""

    # The warning's class: its name for a builtin ("UserWarning"), else "module.qualname".
    category: str
    message: str


def dataloader_with_warnings(
    spec: LoaderSpec, dataset: Any
) -> tuple[DataLoader[Any], tuple[LoaderWarning, ...]]:
    """build_dataloader, and the warnings torch gives for the loader, each once: those of
    building it, and those of the check torch makes again when it creates a multiprocess
    iterator (check_worker_number_rationality: more workers than this process's CPUs). The
    server's log has them at start-up and Describe hands them to the trainers, which
    would have seen them from a local DataLoader.

    Recorded, not raised nor shown: catch_warnings (which is not thread-safe; this runs while
    loaders are built, before the server serves) with every warning let through, so neither a
    filter that turns them into errors (pytest's) nor one that shows them once hides them.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = build_dataloader(spec, dataset)
        if loader.num_workers > 0:  # as torch's DataLoader._get_iterator does
            loader.check_worker_number_rationality()
    found: dict[tuple[str, str], LoaderWarning] = {}
    for record in caught:
        warning = LoaderWarning(_category_name(record.category), str(record.message))
        found.setdefault((warning.category, warning.message), warning)
    return loader, tuple(found.values())


def _category_name(category: type[Warning]) -> str:
    if category.__module__ == "builtins":
        return category.__qualname__
    return f"{category.__module__}.{category.__qualname__}"


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
    """One epoch: the workers' base seed and, per rank, its sequence of tasks.

    A task is what one worker fetch gets: a list of indices, or one index without automatic
    batching. `lane(rank)` may be called once per rank. `indices(rank)`, when set, is each of
    the rank's tasks' index in the epoch (an elastic resume, server/sharing/elastic.py); else rank
    r's k-th task is the epoch's batch k * world_size + r. `tasks()`, when set, is every rank's
    tasks at once, interleaved as deal() interleaves them (rank r's k-th at k * world_size + r,
    its index in the epoch), made in one pass over the epoch (a lane(r) per rank walks the
    whole epoch each: quadratic in world_size); use lane or tasks, not both.
    """

    seed: int
    epoch: int
    base_seed: int
    world_size: int
    lane: Callable[[int], Iterator[Any]]
    indices: Callable[[int], list[int]] | None = None
    tasks: Callable[[], list[Any]] | None = None
    # An IterDataPipe's: the seed of its random pipes (NOTE [ Epoch hooks ] in
    # server/worker/dataset.py); None for any other dataset.
    shared_seed: int | None = None


def share(items: Sequence[Any], rank: int, world_size: int, drop_last: bool) -> list[Any]:
    """Rank `rank`'s share of `items`, split exactly as DistributedSampler splits a dataset.

    Without drop_last the items are padded to a multiple of world_size by repeating them from
    the start; with it the tail that does not divide evenly is dropped. Every share has the
    same length.
    """
    # DistributedSampler over the list itself (not shuffled): torch's own rule, not a copy of it.
    sampler: DistributedSampler[Any] = DistributedSampler(
        items,  # type: ignore[arg-type]
        num_replicas=world_size,
        rank=rank,
        shuffle=False,
        drop_last=drop_last,
    )
    return [items[i] for i in sampler]


def deal(items: Sequence[Any], world_size: int, drop_last: bool) -> list[Any]:
    """Every rank's share of `items` at once, interleaved: share(items, r, world_size,
    drop_last) == deal(items, world_size, drop_last)[r::world_size], in time linear in
    len(items) + world_size (a share() per rank walks all the items each).

    DistributedSampler's rule, to which tests/unit/test_requests.py holds it: the items repeated
    from the start up to world_size * share_size (or cut to it, with drop_last).
    """
    total = share_size(len(items), world_size, drop_last) * world_size
    order = list(items)
    if total > len(order):
        return (order * math.ceil(total / len(order)))[:total]
    del order[total:]
    return order


def batch_dealt(
    dealt: list[Any], world_size: int, batch_size: int | None, drop_last: bool
) -> list[Any]:
    """BatchSampler(share, batch_size, drop_last) over every rank's share of `dealt` (deal()'s
    interleaving), interleaved the same way: rank r's k-th batch at k * world_size + r."""
    if batch_size is None:
        return dealt
    per_rank = len(dealt) // world_size  # deal() gives every rank as many
    # Row i holds every rank's i-th sample; zipping a batch's rows makes every rank's batch
    # in one C-level pass, not a Python call per rank (2**16 ranks cost seconds so).
    rows = [dealt[i * world_size : (i + 1) * world_size] for i in range(per_rank)]
    stop = per_rank - per_rank % batch_size if drop_last else per_rank
    batches: list[Any] = []
    for start in range(0, stop, batch_size):
        batches.extend(map(list, zip(*rows[start : start + batch_size], strict=True)))
    return batches


def share_size(n: int, world_size: int, drop_last: bool) -> int:
    """len(share(items, ...)) for len(items) == n (DistributedSampler.num_samples)."""
    if drop_last and n % world_size:
        return max(0, math.ceil((n - world_size) / world_size))
    return math.ceil(n / world_size)


def epoch_length(loader: DataLoader[Any], spec: LoaderSpec, world_size: int) -> int:
    """Batches one rank of `world_size` receives per epoch; TypeError when unknown."""
    if world_size == 1:
        return len(loader)
    drop_last = spec.parts.sharing.partition_drop_last
    if spec.batch_sampler is not None:
        return share_size(len(loader.batch_sampler), world_size, drop_last)  # type: ignore[arg-type]
    samples = share_size(len(loader.sampler), world_size, drop_last)  # type: ignore[arg-type]
    if loader.batch_size is None:
        return samples
    if loader.drop_last:
        return samples // loader.batch_size
    return math.ceil(samples / loader.batch_size)


def batch_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of batch `index` of an epoch under `seeding = "per_batch"`.

    A hash, not `seed + index`: neighbouring batches (and epochs) must not get overlapping RNG
    streams, and the value must not depend on anything but (seed, epoch, index).
    """
    digest = hashlib.sha256(f"remote-loader:{seed}:{epoch}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _draw_base_seed(generator: torch.Generator) -> int:
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def plan_epoch(
    spec: LoaderSpec, dataset: Any, seed: int, epoch: int, world_size: int = 1
) -> EpochPlan:
    """The tasks and base seed of one epoch, drawn exactly as torch draws them.

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
    # DistributedSampler-style samplers (and batch samplers) reshuffle per epoch this way.
    for hooked in (sampler, loader.batch_sampler):
        set_epoch = getattr(hooked, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
    if world_size == 1:
        # torch's iterator draws an IterDataPipe's shared seed first (_share_dist_seed).
        shared_seed = _draw_base_seed(generator) if isinstance(dataset, IterDataPipe) else None
        tasks = iter(index_sampler)
        base_seed = _draw_base_seed(generator)
        return EpochPlan(
            seed,
            epoch,
            base_seed,
            1,
            lambda rank: tasks,
            tasks=lambda: list(tasks),
            shared_seed=shared_seed,
        )

    if isinstance(dataset, IterableDataset):
        raise ValueError("an IterableDataset cannot be partitioned by the server")
    drop = spec.parts.sharing.partition_drop_last
    batch_size = loader.batch_size
    if spec.batch_sampler is not None:
        # Split by batch: the loader's own batches of this epoch, dealt out like samples.
        tasks = iter(index_sampler)
        base_seed = _draw_base_seed(generator)
        batches = list(tasks)
        return EpochPlan(
            seed,
            epoch,
            base_seed,
            world_size,
            lambda r: iter(share(batches, r, world_size, drop)),
            tasks=lambda: deal(batches, world_size, drop),
        )

    def batched(samples: Any) -> Iterator[Any]:
        if batch_size is None:
            return iter(samples)
        return iter(BatchSampler(samples, batch_size, loader.drop_last))

    if spec.sampler is None:
        # The default sampler: exactly a local DataLoader over DistributedSampler (whose
        # generator, like the loader's, is seeded seed + epoch; the loader's generator gives
        # only the base seed, its first draw, since BatchSampler's iter() is lazy).
        base_seed = _draw_base_seed(generator)

        def default_lane(rank: int) -> Iterator[Any]:
            part: DistributedSampler[Any] = DistributedSampler(
                dataset,
                num_replicas=world_size,
                rank=rank,
                shuffle=spec.parts.batching.shuffle,
                seed=seed,
                drop_last=drop,
            )
            part.set_epoch(epoch)
            return batched(part)

        def default_tasks() -> list[Any]:
            # DistributedSampler's order does not depend on num_replicas (one permutation of
            # the dataset, seeded seed + epoch), so one replica's is the order every rank's
            # share is cut from; deal() cuts them all in one pass.
            whole: DistributedSampler[Any] = DistributedSampler(
                dataset, num_replicas=1, rank=0, shuffle=spec.parts.batching.shuffle, seed=seed
            )
            whole.set_epoch(epoch)
            dealt = deal(list(whole), world_size, drop)
            return batch_dealt(dealt, world_size, batch_size, loader.drop_last)

        return EpochPlan(seed, epoch, base_seed, world_size, default_lane, tasks=default_tasks)

    # A custom sampler: its order of this epoch (drawn after the base seed, as torch draws it),
    # split by sample, then batched per rank.
    if batch_size is None:  # torch calls iter(sampler) before the base seed draw
        sample_iter = iter(sampler)
        base_seed = _draw_base_seed(generator)
        samples = list(sample_iter)
    else:  # ... and iter(BatchSampler) is lazy: the sampler draws after it
        base_seed = _draw_base_seed(generator)
        samples = list(sampler)
    return EpochPlan(
        seed,
        epoch,
        base_seed,
        world_size,
        lambda r: batched(share(samples, r, world_size, drop)),
        tasks=lambda: batch_dealt(
            deal(samples, world_size, drop), world_size, batch_size, loader.drop_last
        ),
    )
