"""Datasets and exceptions for tests/unit/test_dropin.py and tests/integration/test_dropin.py, named
by import path ("tests.dropin_datasets:X"): server workers import this module, and so does the
client when it raises a worker's exception as its own type."""

from __future__ import annotations

import errno
from collections.abc import Iterator

from torch.utils.data import Dataset, IterableDataset


class Corrupt(Exception):
    """A dataset's own exception class."""


class NeedsTwo(Exception):
    """An exception that cannot be made from one message: torch raises RuntimeError for it."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")


# What sample i of Raising raises (None: it returns i).
RAISES: list[type[Exception] | None] = [
    None,
    ValueError,
    KeyError,
    IndexError,
    FileNotFoundError,
    Corrupt,
    NeedsTwo,
    None,
]


class Raising(Dataset[int]):
    """Sample i raises RAISES[i] (a different type for each), or is i."""

    def __len__(self) -> int:
        return len(RAISES)

    def __getitem__(self, i: int) -> int:
        kind = RAISES[i]
        if kind is None:
            return i
        if kind is NeedsTwo:
            raise NeedsTwo(f"sample-{i}", "unreadable")
        if kind is FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "No such file", f"sample-{i}.jpg")
        if kind is KeyError:
            raise KeyError(f"sample-{i}")
        raise kind(f"sample {i} failed")


class Overlong(IterableDataset[int]):
    """An IterableDataset whose __len__ says `said` while it yields `n` items: torch warns
    when a loader yields more than len() said (once len(loader) was asked)."""

    def __init__(self, n: int = 5, said: int = 3) -> None:
        self.n, self.said = n, said

    def __len__(self) -> int:
        return self.said

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))
