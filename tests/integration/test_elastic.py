"""Elastic resume: an epoch begun by a partition job of w ranks, finished by one of w' ranks,
every batch of the epoch exactly once across both lives (NOTE [ Elastic resume ] in
server/sharing/elastic.py), over real gRPC and a server restart."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from remote_loader.client import RemoteLoader, RequestError
from remote_loader.server.config.spec import LoaderSpec
from tests.helpers import ServeLoaders, assert_same

EPOCH = 2
SEED = 11


def squares(name: str, n: int = 60, **options: Any) -> LoaderSpec:
    return LoaderSpec(
        name=name,
        dataset="tests.datasets:Squares",
        dataset_kwargs={"n": n},
        batch_size=2,
        shuffle=True,
        seed=SEED,
        **options,
    )


def key(batch: Any) -> tuple[int, ...]:
    return tuple(int(i) for i in batch["index"])


def first_life(
    address: str, name: str, world: int, reads: list[int]
) -> tuple[list[Any], list[dict[str, Any]]]:
    """Each rank of `world` reads its `reads[rank]` first batches and saves its state."""
    got: list[Any] = []
    states = []
    for rank in range(world):
        with RemoteLoader(address, name, rank=rank, world_size=world, job="j") as loader:
            loader.set_epoch(EPOCH)
            it = iter(loader)
            got += [next(it) for _ in range(reads[rank])]
            states.append(json.loads(json.dumps(loader.state_dict())))
    return got, states


def second_life(
    address: str, name: str, world: int, state: dict[str, Any]
) -> tuple[list[list[Any]], list[dict[str, Any]]]:
    """Each rank of `world` resumes from `state` and reads the rest of the epoch."""
    shares, states = [], []
    for rank in range(world):
        with RemoteLoader(address, name, rank=rank, world_size=world, job="j") as loader:
            loader.load_state_dict(state)
            length = len(loader)
            shares.append(list(loader))
            if state["world_size"] != world:  # DDP sizes schedules by it: this epoch's share
                assert len(shares[-1]) == length
            states.append(loader.state_dict())
    return shares, states


def whole_epoch(address: str, name: str, world: int) -> list[Any]:
    batches = []
    for rank in range(world):
        with RemoteLoader(address, name, rank=rank, world_size=world, job="j") as loader:
            loader.set_epoch(EPOCH)
            batches += list(loader)
    return batches


@pytest.mark.parametrize(("old", "new", "reads"), [(3, 2, [2, 2, 2]), (2, 3, [3, 3])])
def test_an_epoch_resumes_exactly_on_another_world_size(
    serve_loaders: ServeLoaders, old: int, new: int, reads: list[int]
) -> None:
    spec = squares("sq")
    before = serve_loaders(spec)
    first, states = first_life(before.address, "sq", old, reads)
    expected = whole_epoch(before.address, "sq", old)
    before.server.stop(0)
    after = serve_loaders(spec)  # a server restart in between: the order is the spec's
    shares, end_states = second_life(after.address, "sq", new, states[0])  # any rank's state
    assert len({len(share) for share in shares}) == 1  # DDP: every rank the same steps
    rest = [batch for share in shares for batch in share]
    # Every batch of the epoch exactly once across both lives, each batch as it was planned.
    assert Counter(map(key, first + rest)) == Counter(map(key, expected))
    by_key = {key(b): b for b in expected}
    for batch in rest:
        assert_same(batch, by_key[key(batch)])
    # The next epoch is an ordinary one of the new world size.
    assert {(s["epoch"], s["batches"], s["reshard"]) for s in end_states} == {(EPOCH + 1, 0, None)}


def test_ddp_ranks_resume_from_rank_0s_state(serve_loaders: ServeLoaders) -> None:
    # Lightning's checkpoint holds rank 0's loader state and every DDP rank loads it: a rank
    # resumes at that position in its own share (NOTE [ Any rank's state ]).
    served = serve_loaders(squares("sq"))
    first, states = first_life(served.address, "sq", 3, [4, 4, 4])
    shares, _ = second_life(served.address, "sq", 3, states[0])
    expected = whole_epoch(served.address, "sq", 3)
    assert [len(share) for share in shares] == [6, 6, 6]
    assert Counter(map(key, first + [b for s in shares for b in s])) == Counter(map(key, expected))


def test_ranks_out_of_step_resume_from_their_job_state(serve_loaders: ServeLoaders) -> None:
    served = serve_loaders(squares("sq"))
    first, states = first_life(served.address, "sq", 3, [2, 4, 0])
    job = RemoteLoader.job_state(states)
    assert job["consumed"] == [2, 4, 0]  # 24 batches left: 12 for each of 2 ranks
    shares, _ = second_life(served.address, "sq", 2, job)
    rest = [batch for share in shares for batch in share]
    expected = whole_epoch(served.address, "sq", 3)
    assert Counter(map(key, first + rest)) == Counter(map(key, expected))
    # And at the same world size a job state puts each rank back at its own position.
    shares, _ = second_life(served.address, "sq", 3, job)
    assert Counter(map(key, first + [b for s in shares for b in s])) == Counter(map(key, expected))


def test_a_resharded_epoch_resumes_again_on_a_third_size(serve_loaders: ServeLoaders) -> None:
    served = serve_loaders(squares("sq", n=120))
    first, states = first_life(served.address, "sq", 3, [4, 4, 4])
    # Two ranks resume it, read 3 batches each, and the job is saved again...
    second, again = [], []
    for rank in range(2):
        with RemoteLoader(served.address, "sq", rank=rank, world_size=2, job="j") as loader:
            loader.load_state_dict(states[0])
            it = iter(loader)
            second += [next(it) for _ in range(3)]
            again.append(json.loads(json.dumps(loader.state_dict())))
    assert again[0]["reshard"] == {"world_size": 3, "consumed": [4, 4, 4], "origin": None}
    # ... and six finish it (42 batches left: 7 each).
    shares, _ = second_life(served.address, "sq", 6, again[0])
    rest = [batch for share in shares for batch in share]
    expected = whole_epoch(served.address, "sq", 3)
    assert Counter(map(key, first + second + rest)) == Counter(map(key, expected))


def test_a_remainder_is_padded_or_dropped_as_partition_drop_last_says(
    serve_loaders: ServeLoaders,
) -> None:
    # 30 batches over 3 ranks, 1 read by each: 27 left for 2 ranks, one too many.
    served = serve_loaders(squares("pad"), squares("drop", partition_drop_last=True))
    for name, per_rank in (("pad", 14), ("drop", 13)):
        first, states = first_life(served.address, name, 3, [1, 1, 1])
        shares, _ = second_life(served.address, name, 2, states[0])
        assert [len(share) for share in shares] == [per_rank, per_rank]
        rest = Counter(map(key, [b for share in shares for b in share]))
        left = Counter(map(key, whole_epoch(served.address, name, 3))) - Counter(map(key, first))
        if name == "pad":
            assert rest - left == Counter({next(iter(sorted(rest - left))): 1})  # one repeated
            assert not left - rest
        else:
            assert len(left - rest) == 1 and not rest - left  # one dropped, none repeated


def test_per_batch_seeding_keeps_each_batch_s_augmentation(serve_loaders: ServeLoaders) -> None:
    spec = LoaderSpec(
        name="aug",
        dataset="tests.datasets:RandomAug",
        dataset_kwargs={"n": 48},
        batch_size=2,
        shuffle=True,
        seeding="per_batch",
        num_workers=2,
    )
    served = serve_loaders(spec)

    def index(batch: Any) -> tuple[int, ...]:
        return tuple(int(i) for i in batch[0])

    first, states = first_life(served.address, "aug", 3, [2, 2, 2])
    shares, _ = second_life(served.address, "aug", 2, states[0])
    by_index = {index(b): b for b in whole_epoch(served.address, "aug", 3)}
    for batch in first + [b for share in shares for b in share]:
        planned = by_index[index(batch)]
        assert_same(batch[:4], planned[:4])  # values drawn from every RNG; [4] is the worker


def test_what_cannot_be_honoured_exactly_is_refused(serve_loaders: ServeLoaders) -> None:
    served = serve_loaders(squares("sq"), LoaderSpec(name="it", dataset="tests.datasets:Sharded"))
    _, states = first_life(served.address, "sq", 3, [1, 1, 1])
    with (
        RemoteLoader(served.address, "sq", rank=0, world_size=2, job="j") as loader,
        pytest.raises(RequestError, match=r"consumed 11 batches, but its share .* holds 10"),
    ):
        loader.load_state_dict({**states[0], "batches": 11})  # past a 10-batch share
    with (
        RemoteLoader(served.address, "sq", sharing="dynamic", job="j") as loader,
        pytest.raises(ValueError, match="another consumer"),
    ):
        loader.load_state_dict(states[0])
    broadcast = {**states[0], "sharing": "broadcast"}
    with (
        RemoteLoader(served.address, "sq", sharing="broadcast", job="j") as loader,
        pytest.raises(ValueError, match="only partition sharing resumes on another world"),
    ):
        loader.load_state_dict(broadcast)
    with RemoteLoader(served.address, "it", rank=0, world_size=1, job="j") as loader:
        state = {**loader.state_dict(), "world_size": 2, "batches": 1, "rank": 0}
        with pytest.raises(RequestError, match=r"IterableDataset.*cannot resume on another"):
            loader.load_state_dict(state)
        assert loader.epoch == 0  # a refused state changes nothing
    with pytest.raises(ValueError, match="not of one job in one epoch: they differ in epoch"):
        RemoteLoader.job_state([states[0], {**states[1], "epoch": EPOCH + 1}])
