"""Datasets for benchmarks/compare.py, importable by path ("benchmarks.workloads:Images").

`Images` stresses transport (big samples, nearly free to make); `Heavy` stresses the workers
(small samples, a few milliseconds of CPU each).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Labels cycle through this many classes; the value only needs to be a cheap int.
NUM_CLASSES = 10


class Images:
    """`n` samples of one fixed uint8 image [3, size, size] and an int label.

    `__getitem__` returns the same tensor each time, so the cost measured is moving it (collate,
    encode, send), not making it. At size 224 a batch of 64 holds about 9.6 MB.
    """

    def __init__(self, n: int, size: int = 224) -> None:
        if n < 0 or size < 1:
            raise ValueError(f"Images needs n >= 0 and size >= 1, got n={n}, size={size}")
        self.n = n
        gen = torch.Generator().manual_seed(0)
        self.image = torch.randint(0, 256, (3, size, size), dtype=torch.uint8, generator=gen)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for Images of length {self.n}")
        return self.image, index % NUM_CLASSES


class Heavy:
    """`n` samples, each a small float tensor [channels] made by a CPU-heavy transform.

    A per-index random input [channels, size, size] goes through `layers` 3x3 convolutions with
    fixed weights, then a global average pool: a few milliseconds of one core per sample (the
    workers run torch single-threaded, as torch's DataLoader workers do).
    """

    def __init__(self, n: int, size: int = 64, channels: int = 16, layers: int = 8) -> None:
        if n < 0 or size < 3 or channels < 1 or layers < 1:
            raise ValueError(
                "Heavy needs n >= 0, size >= 3, channels >= 1 and layers >= 1, got "
                f"n={n}, size={size}, channels={channels}, layers={layers}"
            )
        self.n = n
        self.size = size
        self.channels = channels
        gen = torch.Generator().manual_seed(0)
        self.weights = [
            torch.randn(channels, channels, 3, 3, generator=gen) / (3.0 * channels**0.5)
            for _ in range(layers)
        ]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for Heavy of length {self.n}")
        gen = torch.Generator().manual_seed(index)
        x = torch.randn(1, self.channels, self.size, self.size, generator=gen)
        with torch.no_grad():
            for w in self.weights:
                x = torch.relu(F.conv2d(x, w, padding=1))
        return x.mean(dim=(0, 2, 3))
