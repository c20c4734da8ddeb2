"""An ImageFolder-like JPEG pipeline for benchmarks/fresh_epochs.py ("benchmarks.jpegs:JpegFolder").

torchvision's ImageFolder + RandomResizedCrop + RandomHorizontalFlip + Normalize, written with
PIL, numpy and torch (torchvision cannot be imported with this project's CPU torch wheel), in a
module that imports pandas at its top to stand for torchvision's import (0.2-0.5 s here with
torch loaded, what torchvision costs): a fresh worker that imports the dataset's modules again
pays it. pandas comes with the test extra (a dependency of `datasets`); without it the module
imports nothing in its place, and STAND_IN says so.
"""

from __future__ import annotations

import importlib
import os
import random
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

try:  # stands for `import torchvision` (the module docstring)
    STAND_IN: str | None = importlib.import_module("pandas").__name__
except ImportError:
    STAND_IN = None

# ImageNet's channel means and deviations, as torchvision's Normalize is usually given them.
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)


def write_jpegs(root: str, n: int = 300, classes: int = 3, size: int = 160) -> None:
    """`n` random JPEGs of `size` x `size`, in `classes` class folders under `root`."""
    gen = np.random.default_rng(0)
    for c in range(classes):
        os.makedirs(os.path.join(root, f"class{c}"), exist_ok=True)
    for i in range(n):
        # Smooth noise (upsampled), so the JPEG decodes like a photo, not like static.
        small = gen.integers(0, 256, (size // 8, size // 8, 3), dtype=np.uint8)
        image = Image.fromarray(small).resize((size, size), Image.Resampling.BILINEAR)
        image.save(os.path.join(root, f"class{i % classes}", f"{i:05d}.jpg"), quality=90)


class JpegFolder(Dataset[tuple[torch.Tensor, int]]):
    """root/CLASS/*.jpg: a random crop of 8-100% of the area resized to `size`, flipped half
    the time, as a normalized float tensor [3, size, size], and the class index."""

    def __init__(self, root: str, size: int = 112) -> None:
        self.size = size
        classes = sorted(p.name for p in Path(root).iterdir() if p.is_dir())
        self.samples = [
            (str(path), label)
            for label, name in enumerate(classes)
            for path in sorted((Path(root) / name).glob("*.jpg"))
        ]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        with Image.open(path) as f:
            image = f.convert("RGB")
        width, height = image.size
        area = width * height * random.uniform(0.08, 1.0)
        side = max(1, min(width, height, int(area**0.5)))
        left = random.randint(0, width - side)
        top = random.randint(0, height - side)
        image = image.resize(
            (self.size, self.size), Image.Resampling.BILINEAR, (left, top, left + side, top + side)
        )
        if random.random() < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        x = torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float().div_(255)
        return (x - MEAN) / STD, label
