"""Elastic resumes planned in one pass (NOTE [ Resharding ]): every rank's DistributedSampler
share dealt out, and the linear plan held to the per-rank algorithm it replaced.

The tests that start a server, a process or Ray: tests/integration/test_requests.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from remote_loader.server.config.sampling import (
    build_dataloader,
    deal,
    epoch_length,
    plan_epoch,
    share,
)
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.sharing.elastic import (
    Reshard,
    ReshardError,
    resharded_length,
    resharded_plan,
)
from tests import datasets

# --- the linear plan is the per-rank plan ------------------------------------------------------


def old_shares(
    spec: LoaderSpec, dataset: Any, seed: int, epoch: int, reshard: Reshard, world_size: int
) -> list[list[tuple[int, Any]]]:
    """The resharding algorithm before NOTE [ Resharding cost ]: a share() per new rank, a lane
    per old rank (quadratic in the ranks), kept here as the reference the new one must equal."""
    rest = old_remaining(spec, dataset, seed, epoch, reshard)
    drop = spec.partition_drop_last
    return [share(rest, rank, world_size, drop) for rank in range(world_size)]


def old_remaining(
    spec: LoaderSpec, dataset: Any, seed: int, epoch: int, reshard: Reshard
) -> list[tuple[int, Any]]:
    w = reshard.world_size
    if reshard.origin is None:
        plan = plan_epoch(spec, dataset, seed, epoch, w)
        lanes = [[(k * w + r, task) for k, task in enumerate(plan.lane(r))] for r in range(w)]
    else:
        lanes = old_shares(spec, dataset, seed, epoch, reshard.origin, w)
    rest: list[tuple[int, Any]] = []
    for lane, consumed in zip(lanes, reshard.consumed, strict=True):
        if consumed > len(lane):
            raise ReshardError("a rank consumed more than its share")
        rest.extend(lane[consumed:])
    rest.sort(key=lambda item: item[0])
    return rest


@st.composite
def specs(draw: st.DrawFn) -> LoaderSpec:
    """Every way an epoch's order is made: the default sampler (shuffled or not), a custom
    sampler (split by sample), a custom batch_sampler (split by batch)."""
    n = draw(st.integers(1, 30))
    kind = draw(st.sampled_from(["default", "sampler", "batch_sampler"]))
    options: dict[str, Any] = {"partition_drop_last": draw(st.booleans())}
    if kind == "batch_sampler":
        options["batch_sampler"] = "tests.datasets:GrowingBatches"
    else:
        options["batch_size"] = draw(st.sampled_from([None, 1, 3]))
        if options["batch_size"] is not None:
            options["drop_last"] = draw(st.booleans())
        if kind == "sampler":
            options["sampler"] = "tests.datasets:Reversed"
        else:
            options["shuffle"] = draw(st.booleans())
    return LoaderSpec(
        name="p", dataset="tests.datasets:Squares", dataset_kwargs={"n": n}, seed=3, **options
    )


@given(
    items=st.lists(st.integers(), max_size=30),
    world_size=st.integers(1, 40),
    drop_last=st.booleans(),
)
def test_deal_interleaves_every_ranks_distributed_sampler_share(
    items: list[int], world_size: int, drop_last: bool
) -> None:
    dealt = deal(items, world_size, drop_last)
    for rank in range(world_size):
        assert dealt[rank::world_size] == share(items, rank, world_size, drop_last)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs(), data=st.data())
def test_the_linear_resharding_plan_equals_the_per_rank_one(
    spec: LoaderSpec, data: st.DataObject
) -> None:
    dataset = datasets.Squares(spec.dataset_kwargs["n"])
    epoch = data.draw(st.integers(0, 3), label="epoch")
    # One or two earlier jobs (a resume of a resume), each a world size and its counts: mostly
    # within each rank's share, sometimes one past it (both algorithms must refuse it).
    reshard: Reshard | None = None
    for _ in range(data.draw(st.integers(1, 2), label="jobs")):
        w = data.draw(st.integers(1, 7), label="world_size")
        if reshard is None:
            per_rank = len(list(plan_epoch(spec, dataset, 0, epoch, w).lane(0)))
        else:
            try:
                per_rank = len(old_shares(spec, dataset, 0, epoch, reshard, w)[0])
            except ReshardError:  # refused already: any counts will do
                per_rank = 0
        top = per_rank + data.draw(st.sampled_from([0, 0, 0, 1]), label="past")
        counts = data.draw(st.lists(st.integers(0, top), min_size=w, max_size=w), label="counts")
        reshard = Reshard(w, tuple(counts), reshard)
    assert reshard is not None
    world_size = data.draw(st.integers(1, 9), label="new world_size")
    try:
        expected = old_shares(spec, dataset, 0, epoch, reshard, world_size)
    except ReshardError:
        with pytest.raises(ReshardError):
            resharded_plan(spec, dataset, 0, epoch, reshard, world_size)
        return
    plan = resharded_plan(spec, dataset, 0, epoch, reshard, world_size)
    assert plan.indices is not None
    got = [list(zip(plan.indices(r), plan.lane(r), strict=True)) for r in range(world_size)]
    assert got == expected
    loader = build_dataloader(spec, dataset)
    length = resharded_length(
        reshard,
        world_size,
        spec.partition_drop_last,
        epoch,
        lambda w: epoch_length(loader, spec, w),
    )
    assert length == len(expected[0])
