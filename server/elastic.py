"""Elastic resume: an epoch partly consumed by a partition job of one world size, finished by a
job of another.

NOTE [ Elastic resume ]

A job checkpointed on w ranks restarts on w' (torchrun's elastic restarts after a node failure,
or more GPUs freed up). Each old rank r had consumed `consumed[r]` batches of its share of the
epoch (server/sampling.py deals batch k of rank r out as the epoch's batch k * w + r). What the
new job receives is exactly the old job's batches it had not consumed:

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
from typing import Any

from remote_loader.protos import loader_pb2 as pb
from remote_loader.server.membership import MAX_WORLD_SIZE
from remote_loader.server.sampling import EpochPlan, plan_epoch, share
from remote_loader.server.spec import LoaderSpec

# Reshards of reshards a request may carry: each is a job restarted mid-epoch at another size.
MAX_RESHARD_DEPTH = 16


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


def resharded_plan(
    spec: LoaderSpec, dataset: Any, seed: int, epoch: int, reshard: Reshard, world_size: int
) -> EpochPlan:
    """The epoch's plan for `world_size` ranks finishing what `reshard`'s job left; raises
    ReshardError when that cannot be done exactly (see NOTE [ Elastic resume ])."""
    shares = _shares(spec, dataset, seed, epoch, reshard, world_size)
    base_seed = plan_epoch(spec, dataset, seed, epoch, 1).base_seed
    # Built once: the Run looks a task's index up for every task it submits.
    indices = [[index for index, _ in share] for share in shares]
    return EpochPlan(
        seed,
        epoch,
        base_seed,
        world_size,
        lambda rank: iter([task for _, task in shares[rank]]),
        indices=indices.__getitem__,
    )


def _shares(
    spec: LoaderSpec, dataset: Any, seed: int, epoch: int, reshard: Reshard, world_size: int
) -> list[list[tuple[int, Any]]]:
    """Per new rank, its (index in the epoch, task) pairs."""
    rest = _remaining(spec, dataset, seed, epoch, reshard)
    drop = spec.partition_drop_last
    return [share(rest, rank, world_size, drop) for rank in range(world_size)]


def _remaining(
    spec: LoaderSpec, dataset: Any, seed: int, epoch: int, reshard: Reshard
) -> list[tuple[int, Any]]:
    """What `reshard`'s job had not consumed, in epoch order."""
    w = reshard.world_size
    if len(reshard.consumed) != w:
        raise ReshardError(
            f"reshard.consumed must give one count per rank of the earlier job: "
            f"{len(reshard.consumed)} counts for world_size {w}"
        )
    if reshard.origin is None:
        plan = plan_epoch(spec, dataset, seed, epoch, w)
        lanes = [[(k * w + r, task) for k, task in enumerate(plan.lane(r))] for r in range(w)]
    else:
        lanes = _shares(spec, dataset, seed, epoch, reshard.origin, w)
    rest: list[tuple[int, Any]] = []
    for rank, (lane, consumed) in enumerate(zip(lanes, reshard.consumed, strict=True)):
        if consumed > len(lane):
            raise ReshardError(
                f"rank {rank} of the earlier job is said to have consumed {consumed} batches, "
                f"but its share of epoch {epoch} holds {len(lane)}"
            )
        rest.extend(lane[consumed:])
    rest.sort(key=lambda item: item[0])
    return rest
