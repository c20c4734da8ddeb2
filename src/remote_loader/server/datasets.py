"""The built-in demo dataset: image files decoded with Pillow, randomly cropped and flipped.
Without a folder, a small deterministic folder of JPEGs is generated once into a cache directory.
"""

from __future__ import annotations

import colorsys
import os
import shutil
import uuid
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
import torch.utils.data
from PIL import Image

from remote_loader.server.config.spec import LoaderSpec

__all__ = [
    "DEMO_CLASSES",
    "DEMO_DIRNAME",
    "DEMO_IMAGE_SIZE",
    "DEMO_PER_CLASS",
    "ImageFolder",
    "cache_dir",
    "demo_folder",
]

# Sized so that the demo (2 trainers on 2 cores) decodes the whole folder well under a minute.
DEMO_CLASSES = 8
DEMO_PER_CLASS = 64
DEMO_IMAGE_SIZE = 96

# Bump the version in the folder name whenever the generated content changes, so that an old
# cache is never mistaken for the new one.
DEMO_DIRNAME = "demo-imagefolder-v1"
# Fixed encoder settings: the same pixels always give the same bytes.
DEMO_JPEG_QUALITY = 90
_DEMO_SEED = 20240601

Sample = tuple[torch.Tensor, int] | tuple[torch.Tensor, int, int]


def cache_dir() -> Path:
    """The cache root: $REMOTE_LOADER_CACHE if set, else $XDG_CACHE_HOME/remote-loader, else
    ~/.cache/remote-loader."""
    explicit = os.environ.get("REMOTE_LOADER_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "remote-loader"
    return Path.home() / ".cache" / "remote-loader"


def demo_folder(root: str | os.PathLike[str] | None = None) -> Path:
    """Return ``<root or cache_dir()>/demo-imagefolder-v1``, generating it first if absent.

    The folder is written under a temporary sibling name and renamed into place, so concurrent
    callers (several worker processes starting at once) never see a half-written folder. A caller
    whose rename loses the race uses the winner's folder and deletes its own copy.
    """
    parent = Path(root) if root is not None else cache_dir()
    final = parent / DEMO_DIRNAME
    if final.is_dir():
        return final
    parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkdtemp: its 0o700 mode would survive the rename and hide a shared cache.
    tmp = parent / f".{DEMO_DIRNAME}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        _write_demo_images(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            # POSIX refuses to rename onto a non-empty directory: another process won.
            if not final.is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _write_demo_images(dest: Path) -> None:
    """Write DEMO_CLASSES folders ``class_NN`` of DEMO_PER_CLASS JPEGs ``img_NNN.jpg`` into dest."""
    for class_index in range(DEMO_CLASSES):
        class_dir = dest / f"class_{class_index:02d}"
        class_dir.mkdir()
        for image_index in range(DEMO_PER_CLASS):
            pixels = _demo_pixels(class_index, image_index)
            Image.fromarray(pixels).save(
                class_dir / f"img_{image_index:03d}.jpg", format="JPEG", quality=DEMO_JPEG_QUALITY
            )


def _demo_pixels(class_index: int, image_index: int) -> npt.NDArray[np.uint8]:
    """One HxWx3 demo image: a gradient in the class's hue, a few shapes, and noise.

    The shapes and noise make two crops of one image differ, so augmentation is visible.
    """
    rng = np.random.default_rng((_DEMO_SEED, class_index, image_index))
    size = DEMO_IMAGE_SIZE
    colour = np.array(colorsys.hsv_to_rgb(class_index / DEMO_CLASSES, 0.75, 0.95)) * 255.0
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64) / (size - 1)
    angle = rng.uniform(0.0, 2.0 * np.pi)
    ramp = np.cos(angle) * xx + np.sin(angle) * yy
    ramp = (ramp - ramp.min()) / (ramp.max() - ramp.min())
    image = colour * (0.3 + 0.7 * ramp[..., None])
    for _ in range(3):
        height, width = (int(n) for n in rng.integers(size // 8, size // 3, size=2))
        top = int(rng.integers(0, size - height))
        left = int(rng.integers(0, size - width))
        image[top : top + height, left : left + width] = rng.uniform(0.0, 255.0, size=3)
    centre_y, centre_x = rng.uniform(0.2, 0.8, size=2)
    radius = rng.uniform(0.08, 0.2)
    disc = (yy - centre_y) ** 2 + (xx - centre_x) ** 2 < radius**2
    image[disc] = 255.0 - colour
    image += rng.normal(0.0, 10.0, size=image.shape)
    pixels: npt.NDArray[np.uint8] = np.clip(np.rint(image), 0, 255).astype(np.uint8)
    return pixels


class ImageFolder(torch.utils.data.Dataset[Sample]):
    """Images in class sub-folders of root, decoded, randomly cropped and flipped.

    Sample i is ``(image, label)`` (or ``(image, label, i)`` with return_index), where image is a
    contiguous uint8 tensor of shape [3, crop, crop]. Crop offsets and flips come from the global
    torch RNG, which DataLoader seeds per worker, so a seeded loader gives the same crops again.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        crop: int = 64,
        flip: bool = True,
        return_index: bool = False,
        extensions: tuple[str, ...] = (".jpg", ".jpeg", ".png"),
    ) -> None:
        if isinstance(crop, bool) or not isinstance(crop, int):
            raise TypeError(f"ImageFolder crop must be an int, got {type(crop).__name__} {crop!r}")
        if crop <= 0:
            raise ValueError(f"ImageFolder crop must be a positive number of pixels, got {crop}")
        folder = Path(root) if root is not None else demo_folder()
        if not folder.exists():
            raise FileNotFoundError(
                f"ImageFolder root {str(folder)!r} does not exist; expected a folder with one "
                "sub-folder of images per class (or pass root=None for the built-in demo folder)"
            )
        if not folder.is_dir():
            raise FileNotFoundError(
                f"ImageFolder root {str(folder)!r} is a file; expected a folder with one "
                "sub-folder of images per class"
            )
        # Hidden folders (.ipynb_checkpoints, temporary copies) are not classes.
        self.classes: list[str] = sorted(
            entry.name for entry in folder.iterdir() if entry.is_dir() and entry.name[0] != "."
        )
        if not self.classes:
            raise ValueError(
                f"ImageFolder root {str(folder)!r} has no class sub-folders; expected one "
                "sub-folder of images per class, e.g. root/cat/001.jpg and root/dog/002.jpg"
            )
        self.class_to_idx: dict[str, int] = {name: i for i, name in enumerate(self.classes)}
        wanted = tuple(ext.lower() for ext in extensions)
        self.samples: list[tuple[str, int]] = sorted(
            (str(path), self.class_to_idx[name])
            for name in self.classes
            for path in (folder / name).rglob("*")
            if path.suffix.lower() in wanted and path.is_file()
        )
        if not self.samples:
            raise ValueError(
                f"ImageFolder root {str(folder)!r} has class sub-folders {self.classes} but no "
                f"images in them; expected files ending in one of {list(wanted)}"
            )
        self.root = folder
        self.crop = crop
        self.flip = flip
        self.return_index = return_index

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < len(self.samples):
            raise IndexError(
                f"ImageFolder index {index} out of range; expected 0 <= index < {len(self.samples)}"
            )
        path, label = self.samples[index]
        with Image.open(path) as opened:
            image = opened.convert("RGB")
        crop = self.crop
        width, height = image.size
        if width < crop or height < crop:
            scale = crop / min(width, height)
            size = (max(crop, round(width * scale)), max(crop, round(height * scale)))
            image = image.resize(size, Image.Resampling.BILINEAR)
            width, height = image.size
        top = int(torch.randint(0, height - crop + 1, ()).item())
        left = int(torch.randint(0, width - crop + 1, ()).item())
        image = image.crop((left, top, left + crop, top + crop))
        if self.flip and float(torch.rand(())) < 0.5:
            image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        # np.asarray of a Pillow image is read-only, and torch warns on a read-only array: one
        # copy into CHW order gives a writable, contiguous array for from_numpy to share.
        chw = np.array(np.asarray(image).transpose(2, 0, 1), order="C")
        tensor = torch.from_numpy(chw)
        if self.return_index:
            return tensor, label, index
        return tensor, label


# The loader `remote-loader serve` hosts without a config, and the examples serve.
DEMO_DATASET = "remote_loader.server.datasets:ImageFolder"


def demo_spec(batch_size: int = 32, num_workers: int = 2) -> LoaderSpec:
    """The loader `serve` hosts without a config: the built-in image folder, shuffled."""
    return LoaderSpec(
        name="demo",
        dataset=DEMO_DATASET,
        dataset_kwargs={"return_index": True},
        batch_size=batch_size,
        shuffle=True,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
    )
