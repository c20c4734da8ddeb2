"""`share` splits a loader's samples as torch's DistributedSampler does.

The tests that start a server, a process or Ray: tests/integration/test_sharing.py.
"""

from __future__ import annotations

import pytest

from remote_loader.server.config.sampling import share, share_size
from tests.helpers import (
    distributed,
)

# --- partition ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 5, 12, 13])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("drop_last", [False, True])
def test_share_splits_like_distributed_sampler(n: int, world_size: int, drop_last: bool) -> None:
    items = [f"item{i}" for i in range(n)]
    shares = [share(items, r, world_size, drop_last) for r in range(world_size)]
    assert {len(s) for s in shares} == {share_size(n, world_size, drop_last)}
    for r, part in enumerate(shares):  # rank r's share is DistributedSampler's, item for item
        mine = distributed(n, world_size, r, shuffle=False, drop_last=drop_last)
        assert part == [items[i] for i in mine]
    union = [x for part in shares for x in part]
    if drop_last:
        assert len(set(union)) == len(union)  # no item twice: the tail was dropped
    elif n:
        assert set(union) == set(items)  # everything, plus repeats padding the last round
