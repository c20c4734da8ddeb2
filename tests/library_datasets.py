"""Pipelines of real training libraries, named by import path ("tests.library_datasets:X").

The drop-in tests (tests/integration/test_libraries.py) serve each from a real server and compare it
batch for batch with torch's DataLoader over the same pipeline; worker processes import this module.
"""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset


class Indexed(Dataset[dict[str, Any]]):
    """Samples that say which they are: a training step can tell which epoch it was fed."""

    def __init__(self, n: int = 64) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"index": i, "x": torch.full((4,), float(i))}


def hf_ids(n: int = 64) -> Any:
    """A Hugging Face map-style dataset of ids with a float feature, as torch tensors."""
    import datasets

    ds = datasets.Dataset.from_dict({"id": list(range(n)), "x": [[float(i)] * 3 for i in range(n)]})
    return ds.with_format("torch")


def hf_stream(n: int = 64, shards: int = 4, seed: int | None = 42, buffer: int = 8) -> Any:
    """A Hugging Face IterableDataset of `shards` shards with a shuffle buffer, seeded or not:
    unseeded, the shuffle draws its seed when the dataset is built (once per loader)."""
    import datasets

    ds = datasets.Dataset.from_dict({"id": list(range(n))}).to_iterable_dataset(num_shards=shards)
    return ds.shuffle(seed=seed, buffer_size=buffer)


def write_shards(root: str, shards: int = 4, per_shard: int = 16) -> list[str]:
    """WebDataset tar shards of `shards * per_shard` samples (a .npy array and a .cls label)."""
    import webdataset as wds

    os.makedirs(root, exist_ok=True)
    paths = []
    for s in range(shards):
        path = os.path.join(root, f"shard-{s:04d}.tar")
        with wds.TarWriter(path) as sink:
            for k in range(per_shard):
                i = s * per_shard + k
                buf = io.BytesIO()
                np.save(buf, np.full((2, 3), i, dtype=np.float32))
                sink.write({"__key__": f"{i:06d}", "npy": buf.getvalue(), "cls": str(i).encode()})
        paths.append(path)
    return paths


def _label(text: Any) -> int:
    return int(text)


def webdataset_pipeline(root: str, shards: int = 4, seed: int = 7) -> Any:
    """A WebDataset as its users write one: shards split between workers, a seeded sample
    shuffle, decode, to_tuple, map_tuple."""
    import webdataset as wds

    urls = sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(".tar"))[:shards]
    return (
        wds.WebDataset(urls, shardshuffle=False, empty_check=False)
        .shuffle(16, seed=seed)
        .decode()
        .to_tuple("npy", "cls")
        .map_tuple(torch.from_numpy, _label)
    )
