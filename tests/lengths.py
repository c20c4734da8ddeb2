"""Datasets and a sampler whose lengths are missing or broken (tests/unit/test_lengths.py,
tests/integration/test_lengths.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import Dataset, Sampler


class BrokenLen(Dataset[int]):
    """A map-style dataset whose __len__ raises (a bug in it: the field it counts is unset)."""

    def __init__(self) -> None:
        self.items: list[int] | None = None

    def __len__(self) -> int:
        return len(self.items)  # type: ignore[arg-type]  # the bug: TypeError

    def __getitem__(self, i: int) -> int:
        return i


class NoLen(Dataset[int]):
    """A map-style dataset without __len__: only a sampler that does not need it samples it."""

    def __getitem__(self, i: int) -> int:
        return i


class FirstTen(Sampler[int]):
    """A sampler without __len__: indices 0 to 9 of any dataset."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __iter__(self) -> Iterator[int]:
        return iter(range(10))
