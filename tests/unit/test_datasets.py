"""The demo dataset without a server: the demo folder generated once and atomically, and
ImageFolder. Every test points REMOTE_LOADER_CACHE at a folder of its own (`own_cache`), so none
touches the home directory.

The tests that start a server, a process or Ray: tests/integration/test_datasets.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils.data
from PIL import Image

from remote_loader.server import datasets
from remote_loader.server.datasets import (
    DEMO_CLASSES,
    DEMO_DIRNAME,
    DEMO_IMAGE_SIZE,
    DEMO_PER_CLASS,
    ImageFolder,
    cache_dir,
    demo_folder,
)
from tests.helpers import _files

# Each test caches in a folder of its own.
pytestmark = pytest.mark.usefixtures("own_cache")


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_folder(tmp_path_factory.mktemp("demo"))


def _write_image(path: Path, width: int, height: int, seed: int = 0) -> np.ndarray[Any, Any]:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)  # PNG: lossless, so the test knows the decoded pixels
    return pixels


# -- cache_dir -----------------------------------------------------------------------------------


def test_cache_dir_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REMOTE_LOADER_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("REMOTE_LOADER_CACHE")
    assert cache_dir() == tmp_path / "xdg" / "remote-loader"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "remote-loader"


# -- demo_folder ---------------------------------------------------------------------------------


def test_demo_folder_layout(demo_root: Path) -> None:
    assert demo_root.name == DEMO_DIRNAME
    class_dirs = sorted(p for p in demo_root.iterdir())
    assert [p.name for p in class_dirs] == [f"class_{i:02d}" for i in range(DEMO_CLASSES)]
    for class_dir in class_dirs:
        names = sorted(p.name for p in class_dir.iterdir())
        assert names == [f"img_{i:03d}.jpg" for i in range(DEMO_PER_CLASS)]
    with Image.open(class_dirs[0] / "img_000.jpg") as image:
        assert image.format == "JPEG"
        assert image.size == (DEMO_IMAGE_SIZE, DEMO_IMAGE_SIZE)
        assert image.mode == "RGB"
    # Nothing left behind beside it.
    assert [p.name for p in demo_root.parent.iterdir()] == [DEMO_DIRNAME]


def test_demo_folder_defaults_to_cache_dir(own_cache: Path) -> None:
    assert demo_folder() == own_cache / DEMO_DIRNAME
    assert (own_cache / DEMO_DIRNAME / "class_07" / "img_063.jpg").is_file()


def test_demo_folder_is_deterministic(tmp_path: Path, demo_root: Path) -> None:
    again = demo_folder(tmp_path / "other")
    assert again != demo_root
    first, second = _files(demo_root), _files(again)
    assert len(first) == DEMO_CLASSES * DEMO_PER_CLASS
    assert first == second
    # ...and the images are not all alike.
    assert len(set(first.values())) == len(first)


def test_demo_folder_is_reused(
    tmp_path: Path, demo_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    some_file = demo_root / "class_03" / "img_010.jpg"
    before = (demo_root.stat().st_mtime_ns, some_file.stat().st_mtime_ns)

    def must_not_run(dest: Path) -> None:
        raise AssertionError("the demo folder was generated again")

    monkeypatch.setattr(datasets, "_write_demo_images", must_not_run)
    assert demo_folder(demo_root.parent) == demo_root
    assert (demo_root.stat().st_mtime_ns, some_file.stat().st_mtime_ns) == before


def test_demo_folder_losing_the_race_uses_the_winner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = datasets._write_demo_images
    calls: list[Path] = []

    def write_then_lose(dest: Path) -> None:
        calls.append(dest)
        real_write(dest)
        if len(calls) == 1:
            # Another "process" finishes first, while this one is between writing and renaming.
            demo_folder(tmp_path)

    monkeypatch.setattr(datasets, "_write_demo_images", write_then_lose)
    assert demo_folder(tmp_path) == tmp_path / DEMO_DIRNAME
    assert len(calls) == 2
    assert [p.name for p in tmp_path.iterdir()] == [DEMO_DIRNAME]
    assert len(_files(tmp_path / DEMO_DIRNAME)) == DEMO_CLASSES * DEMO_PER_CLASS


def test_demo_folder_cleans_up_after_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(dest: Path) -> None:
        (dest / "partial").mkdir()
        raise OSError("disk full")

    monkeypatch.setattr(datasets, "_write_demo_images", broken)
    with pytest.raises(OSError, match="disk full"):
        demo_folder(tmp_path)
    assert list(tmp_path.iterdir()) == []


# -- ImageFolder ---------------------------------------------------------------------------------


def test_image_folder_over_demo(demo_root: Path) -> None:
    dataset = ImageFolder(demo_root)
    assert len(dataset) == DEMO_CLASSES * DEMO_PER_CLASS
    assert dataset.classes == [f"class_{i:02d}" for i in range(DEMO_CLASSES)]
    assert dataset.class_to_idx == {name: i for i, name in enumerate(dataset.classes)}
    assert dataset.samples == sorted(dataset.samples)
    assert dataset.samples[0] == (str(demo_root / "class_00" / "img_000.jpg"), 0)
    assert dataset.samples[-1] == (str(demo_root / "class_07" / "img_063.jpg"), 7)
    for index in (0, DEMO_PER_CLASS, len(dataset) - 1):
        image, label = dataset[index][:2]
        assert image.shape == (3, 64, 64)
        assert image.dtype == torch.uint8
        assert image.is_contiguous()
        assert label == index // DEMO_PER_CLASS


def test_image_folder_defaults_to_demo_folder(own_cache: Path) -> None:
    dataset = ImageFolder(crop=32)
    assert dataset.root == own_cache / DEMO_DIRNAME
    assert len(dataset) == DEMO_CLASSES * DEMO_PER_CLASS
    assert dataset[5][0].shape == (3, 32, 32)


def test_image_folder_batches_through_a_data_loader(demo_root: Path) -> None:
    loader = torch.utils.data.DataLoader(ImageFolder(demo_root, crop=48), batch_size=4)
    images, labels = next(iter(loader))
    assert images.shape == (4, 3, 48, 48)
    assert images.dtype == torch.uint8
    assert labels.tolist() == [0, 0, 0, 0]


def test_image_folder_crops_follow_the_torch_seed(demo_root: Path) -> None:
    dataset = ImageFolder(demo_root)
    indices = [0, 100, 200, 300]

    def crops(seed: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        return [dataset[i][0] for i in indices]

    first, again, other = crops(1), crops(1), crops(2)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_image_folder_full_crop_without_flip_is_the_decoded_image(demo_root: Path) -> None:
    dataset = ImageFolder(demo_root, crop=DEMO_IMAGE_SIZE, flip=False)
    for index in (0, 333):
        image, _ = dataset[index][:2]
        with Image.open(dataset.samples[index][0]) as opened:
            expected = np.asarray(opened.convert("RGB")).transpose(2, 0, 1)
        assert np.array_equal(image.numpy(), expected)


def test_image_folder_flip_mirrors_the_crop(tmp_path: Path) -> None:
    pixels = _write_image(tmp_path / "a" / "x.png", 16, 16)
    dataset = ImageFolder(tmp_path, crop=16)
    seen = set()
    for seed in range(20):
        torch.manual_seed(seed)
        image = dataset[0][0].numpy().transpose(1, 2, 0)
        if np.array_equal(image, pixels):
            seen.add("as is")
        elif np.array_equal(image, pixels[:, ::-1]):
            seen.add("mirrored")
        else:
            pytest.fail("a full-size crop is neither the image nor its mirror")
    assert seen == {"as is", "mirrored"}


def test_image_folder_return_index(demo_root: Path) -> None:
    dataset = ImageFolder(demo_root, crop=16, return_index=True)
    sample = dataset[70]
    assert len(sample) == 3
    assert sample[0].shape == (3, 16, 16)
    assert sample[1:] == (1, 70)


@pytest.mark.parametrize(
    ("size", "crop"),
    [((40, 20), 32), ((20, 40), 32), ((10, 10), 24), ((30, 30), 30)],
)
def test_image_folder_resizes_small_images_up(
    tmp_path: Path, size: tuple[int, int], crop: int
) -> None:
    _write_image(tmp_path / "only" / "small.png", *size)
    image, label = ImageFolder(tmp_path, crop=crop)[0][:2]
    assert image.shape == (3, crop, crop)
    assert image.dtype == torch.uint8
    assert label == 0


def test_image_folder_scans_extensions_and_skips_hidden_folders(tmp_path: Path) -> None:
    _write_image(tmp_path / "b" / "one.PNG", 8, 8)
    _write_image(tmp_path / "b" / "nested" / "two.png", 8, 8)
    (tmp_path / "b" / "notes.txt").write_text("not an image")
    _write_image(tmp_path / "a" / "three.png", 8, 8)
    _write_image(tmp_path / ".hidden" / "four.png", 8, 8)
    dataset = ImageFolder(tmp_path, crop=8)
    assert dataset.classes == ["a", "b"]
    assert [(Path(p).name, label) for p, label in dataset.samples] == [
        ("three.png", 0),
        ("two.png", 1),
        ("one.PNG", 1),
    ]
    # Extensions match whatever their case.
    assert len(ImageFolder(tmp_path, crop=8, extensions=(".PNG",))) == 3
    with pytest.raises(ValueError, match="no images"):
        ImageFolder(tmp_path, crop=8, extensions=(".jpg",))


@pytest.mark.parametrize("index", [-1, -600, 512, 10_000])
def test_image_folder_index_out_of_range(demo_root: Path, index: int) -> None:
    dataset = ImageFolder(demo_root)
    with pytest.raises(IndexError, match=f"index {index} out of range"):
        dataset[index]


def test_image_folder_missing_root(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=r"nowhere.*does not exist"):
        ImageFolder(missing)


def test_image_folder_root_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file.jpg").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"file\.jpg.*is a file"):
        ImageFolder(tmp_path / "file.jpg")


def test_image_folder_without_class_folders(tmp_path: Path) -> None:
    _write_image(tmp_path / "loose.png", 8, 8)
    with pytest.raises(ValueError, match="no class sub-folders"):
        ImageFolder(tmp_path)


def test_image_folder_without_images(tmp_path: Path) -> None:
    (tmp_path / "cat").mkdir()
    (tmp_path / "dog").mkdir()
    (tmp_path / "dog" / "readme.txt").write_text("no pictures here")
    with pytest.raises(ValueError, match=r"no\s+images.*\.jpg"):
        ImageFolder(tmp_path)


@pytest.mark.parametrize(
    ("crop", "error"),
    [(0, ValueError), (-3, ValueError), (1.5, TypeError), ("64", TypeError), (True, TypeError)],
)
def test_image_folder_bad_crop(demo_root: Path, crop: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="crop"):
        ImageFolder(demo_root, crop=crop)
