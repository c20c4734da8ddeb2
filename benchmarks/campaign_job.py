"""The job of benchmarks/campaign.py: a dataset whose every sample's bytes are computed from its
index (so a trainer can check them), and the batches each rank of the partition job is due.
"""

from __future__ import annotations

from typing import Any

import torch

SAMPLES = 512
SAMPLE_BYTES = 16 * 1024
BATCH = 16  # 32 batches an epoch, 16 per rank
EPOCHS = 2
SEED = 0
WORLD = 2


class Tagged(torch.utils.data.Dataset[tuple[torch.Tensor, int]]):
    """SAMPLES samples: sample i is SAMPLE_BYTES bytes computed from i, and i itself."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return payload(index), index


def payload(index: int) -> torch.Tensor:
    return ((torch.arange(SAMPLE_BYTES) * 31 + index * 7919) % 251).to(torch.uint8)


def expected(rank: int, epoch: int) -> list[tuple[int, tuple[int, ...]]]:
    """Rank `rank`'s batches of `epoch`: a local DistributedSampler's, as the server promises."""
    sampler: torch.utils.data.DistributedSampler[Any] = torch.utils.data.DistributedSampler(
        Tagged(), num_replicas=WORLD, rank=rank, shuffle=True, seed=SEED
    )
    sampler.set_epoch(epoch)
    ids = list(sampler)
    return [(epoch, tuple(ids[i : i + BATCH])) for i in range(0, len(ids), BATCH)]
