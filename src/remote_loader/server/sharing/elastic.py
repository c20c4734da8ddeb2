"""Elastic resume: an epoch partly consumed by a partition job of one world size, finished by a
job of another.

NOTE [ Elastic resume ]

A job checkpointed on w ranks restarts on w' (torchrun's elastic restarts after a node failure,
or more GPUs freed up). Each old rank r had consumed `consumed[r]` batches of its share of the
epoch (server/config/sampling.py deals batch k of rank r out as the epoch's batch k * w + r). What
the new job receives is exactly the old job's batches it had not consumed:

1. the old shares are planned again (the epoch's order depends only on seed, epoch and spec),
   and from each the batches past `consumed[r]` are kept, with their index in the epoch;
2. those are put back in epoch order and dealt out to the w' new ranks as DistributedSampler
   deals samples: rank r' takes every w'-th. DDP needs every rank to take the same number of
   steps, so a remainder is handled as `partition_drop_last` says for a fresh epoch: false
   repeats batches from the start of what is left (the only repetition, as DistributedSampler
   pads), true drops the tail (the only samples skipped);
3. a batch keeps its index in the epoch, so with seeding = "per_batch" its random
   augmentations are those the old job would have drawn: the batches are the very same.

Batches are moved whole, never re-cut, so a batch holds the samples it held in the old plan.
The epoch after is an ordinary epoch of w' ranks. A job resumed this way and checkpointed
again carries its own origin (`Reshard.origin`), and is planned from it the same way.

What a rank passes: in DDP the ranks are in step, so every old rank had consumed the same
number of batches and any old rank's state says it all (RemoteLoader.load_state_dict). Ranks
that were not in step combine their states first (RemoteLoader.job_state). Refused, with the
reason: another sharing mode or job, a consumed count past a rank's share, an IterableDataset
(its order is not the server's to re-deal), a spec whose fingerprint changed (batch_size among
it: batches would not line up).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from remote_loader.protos import loader_pb2 as pb
from remote_loader.server.config.sampling import EpochPlan, deal, plan_epoch, share_size
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.sharing.membership import MAX_WORLD_SIZE

# Reshards of reshards a request may carry: each is a job restarted mid-epoch at another size.
MAX_RESHARD_DEPTH = 16

# NOTE [ Resharding cost ]
#
# What a request naming a reshard costs the server, by who asks:
#
#   Describe, and a Stream's admission:  the length and every refusal from the counts alone
#       (resharded_length): a sum per job, no plan; time in the ranks of all the jobs.
#   the Run a Stream starts:  the plan (resharded_plan), made once for all the new ranks:
#       each earlier job's tasks, interleaved as sampling.deal deals them (rank r's k-th at
#       k * w + r), in one pass over the epoch; what each rank left, in one pass more; then
#       the new ranks' shares, cut per rank only when that rank joins.
#       Made outside Runs._lock (Runs.attach): a slow plan delays only its own stream.
#
# A share() per rank walks the whole epoch each (quadratic in the ranks): a Describe of 16384
# ranks took 0.85 s, and one of 65536 burned 13 s of CPU after its caller gave up. Now the time
# grows with the epoch's batches plus the ranks, which MAX_RESHARD_RANKS bounds: the new
# world_size plus every earlier job's (benchmarks/reshard.py measures 65536 ranks).
MAX_RESHARD_RANKS = 1 << 17


class ReshardError(ValueError):
    """A resume from another world size that cannot be honoured exactly; says why."""


@dataclasses.dataclass(frozen=True)
class Reshard:
    """How far the ranks of an earlier job got in an epoch (pb.Reshard as a value)."""

    world_size: int
    consumed: tuple[int, ...]
    origin: Reshard | None = None

    @classmethod
    def of(cls, message: pb.Reshard, depth: int = 0) -> Reshard | None:
        """The message's value; None when it is unset (world_size 0)."""
        if message.world_size == 0:
            if len(message.consumed) or message.HasField("origin"):
                raise ReshardError("reshard.world_size must be at least 1")
            return None
        if message.world_size > MAX_WORLD_SIZE:
            raise ReshardError(
                f"reshard.world_size must be at most {MAX_WORLD_SIZE}, got {message.world_size}"
            )
        if depth >= MAX_RESHARD_DEPTH:
            raise ReshardError(f"a reshard may carry at most {MAX_RESHARD_DEPTH} origins")
        origin = cls.of(message.origin, depth + 1) if message.HasField("origin") else None
        return cls(message.world_size, tuple(message.consumed), origin)


def check_ranks(reshard: Reshard, world_size: int) -> None:
    """Raises ReshardError when resharding to `world_size` would plan more ranks than
    MAX_RESHARD_RANKS (see NOTE [ Resharding cost ])."""
    sizes = [world_size]
    origin: Reshard | None = reshard
    while origin is not None:
        sizes.append(origin.world_size)
        origin = origin.origin
    if sum(sizes) > MAX_RESHARD_RANKS:
        raise ReshardError(
            f"an elastic resume plans every rank of every job that took part: world_size "
            f"{world_size} plus the earlier jobs' {', '.join(map(str, sizes[1:]))} make "
            f"{sum(sizes)} ranks, and at most MAX_RESHARD_RANKS={MAX_RESHARD_RANKS} are "
            "planned per request; resume on fewer ranks, or start the epoch afresh"
        )


def resharded_plan(
    spec: LoaderSpec, dataset: Any, seed: int, epoch: int, reshard: Reshard, world_size: int
) -> EpochPlan:
    """The epoch's plan for `world_size` ranks finishing what `reshard`'s job left; raises
    ReshardError when that cannot be done exactly (see NOTE [ Elastic resume ])."""
    check_ranks(reshard, world_size)
    dealt = _dealt(spec, dataset, seed, epoch, reshard, world_size)
    base_seed = plan_epoch(spec, dataset, seed, epoch, 1).base_seed
    # Per rank, built when it joins (ranks that never join cost nothing), and once: the Run
    # looks a task's index up for every task it submits.
    indices: dict[int, list[int]] = {}

    def indices_of(rank: int) -> list[int]:
        if rank not in indices:
            indices[rank] = [index for index, _ in dealt[rank::world_size]]
        return indices[rank]

    return EpochPlan(
        seed,
        epoch,
        base_seed,
        world_size,
        lambda rank: iter([task for _, task in dealt[rank::world_size]]),
        indices=indices_of,
    )


def resharded_length(
    reshard: Reshard,
    world_size: int,
    drop_last: bool,
    epoch: int,
    epoch_length: Callable[[int], int],
) -> int:
    """How many batches each rank of resharded_plan(...) gets (`drop_last`: the spec's
    partition_drop_last), from the counts alone: no plan is made, so admission and Describe
    cost the ranks, not the epoch. `epoch_length(w)`: one rank's batches in an ordinary
    epoch of w ranks. Raises ReshardError as resharded_plan does."""
    check_ranks(reshard, world_size)
    return share_size(_left(reshard, drop_last, epoch, epoch_length), world_size, drop_last)


def _left(reshard: Reshard, drop_last: bool, epoch: int, epoch_length: Callable[[int], int]) -> int:
    """How many batches `reshard`'s job left of the epoch (len(_remaining(...)))."""
    w = reshard.world_size
    if reshard.origin is None:
        per_rank = epoch_length(w)
    else:
        per_rank = share_size(_left(reshard.origin, drop_last, epoch, epoch_length), w, drop_last)
    _check_consumed(reshard, per_rank, epoch)
    return per_rank * w - sum(reshard.consumed)


def _check_consumed(reshard: Reshard, per_rank: int, epoch: int) -> None:
    """Raises ReshardError unless each of `reshard`'s ranks consumed at most its share."""
    if len(reshard.consumed) != reshard.world_size:
        raise ReshardError(
            f"reshard.consumed must give one count per rank of the earlier job: "
            f"{len(reshard.consumed)} counts for world_size {reshard.world_size}"
        )
    for rank, count in enumerate(reshard.consumed):
        if count > per_rank:
            raise ReshardError(
                f"rank {rank} of the earlier job is said to have consumed {count} batches, "
                f"but its share of epoch {epoch} holds {per_rank}"
            )


def _dealt(
    spec: LoaderSpec, dataset: Any, seed: int, epoch: int, reshard: Reshard, world_size: int
) -> list[tuple[int, Any]]:
    """Every new rank's (index in the epoch, task) pairs, interleaved as sampling.deal
    interleaves them: rank r's k-th at k * world_size + r."""
    rest = _remaining(spec, dataset, seed, epoch, reshard)
    return deal(rest, world_size, spec.parts.sharing.partition_drop_last)


def _remaining(
    spec: LoaderSpec, dataset: Any, seed: int, epoch: int, reshard: Reshard
) -> list[tuple[int, Any]]:
    """What `reshard`'s job had not consumed, in epoch order: one pass over the epoch's tasks
    and one over the job's ranks (NOTE [ Resharding cost ])."""
    w = reshard.world_size
    # Every old rank's tasks, interleaved: rank r's k-th at position k * w + r.
    old: list[tuple[int, Any]]
    if reshard.origin is None:
        tasks = plan_epoch(spec, dataset, seed, epoch, w).tasks
        assert tasks is not None  # plan_epoch always sets it
        old = list(enumerate(tasks()))  # position k * w + r is the batch's index in the epoch
    else:
        old = _dealt(spec, dataset, seed, epoch, reshard.origin, w)
    _check_consumed(reshard, len(old) // w, epoch)  # every old rank's share is that long
    consumed = reshard.consumed
    rest = [item for position, item in enumerate(old) if position // w >= consumed[position % w]]
    # Already in epoch order but for the repeats a padded share ends with.
    rest.sort(key=lambda item: item[0])
    return rest
