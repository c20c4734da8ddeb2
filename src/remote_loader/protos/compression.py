"""Per-tensor compression of batches, for links slower than decompression.

NOTE [ Compression ]

A client on a slow link (1-10 Gbit/s between hosts) may ask its stream for `compression="lz4"`
or `"zstd"` (StreamRequest.compression; off by default: on loopback and shared memory the copy
is cheaper than any codec). The Run producing the epoch passes the name to its workers with
the epoch (EpochStart), so compression runs in every worker in parallel, never on the server's
send path; the client decompresses each leaf as it decodes the batch.

Per leaf: a tensor or array of at least MIN_BYTES is compressed on its own (a batch mixes
compressible labels, masks or token ids with incompressible JPEG-decoded noise); the result
replaces the leaf only if it saves at least 1 - MAX_RATIO of its bytes, and the header says so
(Tensor.compression, Tensor.raw_nbytes). A leaf that did not shrink is not tried again for
SKIP_BATCHES batches of that worker, so incompressible data costs one attempt in
SKIP_BATCHES + 1 batches: compression turns itself off where it does not pay.

Negotiated: a server that lacks the codec's package sends the batches uncompressed (and says so
in its log); the client reads whatever each leaf's header says, so both ends agree whatever
was installed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

# The names a client may ask for; "none" (or "") is no compression.
CODECS = ("lz4", "zstd")
_PACKAGES = {"lz4": "lz4", "zstd": "zstandard"}
# What `pip install` takes for each, as the `compression` extra of pyproject.toml says (a test
# holds them equal). The project is installed from its repository, not a package index, so a
# hint names the packages themselves; `pip install ".[compression]"` works from a clone's root.
_REQUIREMENTS = {"lz4": "lz4>=4", "zstd": "zstandard>=0.22"}
# Leaves smaller than this are sent as they are: a codec's fixed costs outweigh what it saves.
MIN_BYTES = 64 * 1024
# A leaf compressed to more than this fraction of its size is sent uncompressed.
MAX_RATIO = 0.9
# After a leaf did not shrink, that many of the worker's batches skip it.
SKIP_BATCHES = 16
# zstd's level: 1 is its fastest, still well ahead of lz4's ratio on typical tensors.
ZSTD_LEVEL = 1


class CompressionError(ValueError):
    """A compressed leaf cannot be decompressed (damaged, or a codec this client lacks)."""


def check(name: str) -> str:
    """`name` normalized ("" for none); raises ValueError naming the choices."""
    if name in ("", "none"):
        return ""
    if name not in CODECS:
        raise ValueError(f'compression must be "none", "lz4" or "zstd", got {name!r}')
    return name


def available(name: str) -> bool:
    """Whether this process has the codec's package."""
    return importlib.util.find_spec(_PACKAGES[name]) is not None


def install_hint(name: str) -> str:
    """The command that installs codec `name`'s package, to paste into a shell."""
    return (
        f'pip install "{_REQUIREMENTS[name]}" (or, in a clone of the repository, '
        'pip install ".[compression]")'
    )


def _compress_fn(name: str) -> Callable[[Any], bytes]:
    if name == "lz4":
        import lz4.block

        return lambda data: lz4.block.compress(data, store_size=False)
    import zstandard

    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return compressor.compress


def leaf_bytes(source: torch.Tensor | np.ndarray) -> memoryview:
    """A tensor's or array's bytes as one flat buffer to compress (a copy only when strided)."""
    if isinstance(source, np.ndarray):
        return np.ascontiguousarray(source).reshape(-1).view(np.uint8).data
    t = source.resolve_conj().resolve_neg().contiguous()
    # Not reshape(-1): a contiguous tensor may keep any stride on a size-1 dimension.
    flat: memoryview = t.as_strided((t.numel(),), (1,)).view(torch.uint8).numpy().data
    return flat


class Compressor:
    """One worker's compressor for one epoch: compresses leaves that pay, skips those that
    did not for SKIP_BATCHES batches (see NOTE [ Compression ])."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._compress = _compress_fn(name)
        self._batch = 0
        # Leaf number in the batch -> the batch from which it is tried again.
        self._skip_until: dict[int, int] = {}

    def next_batch(self) -> None:
        self._batch += 1

    def compress(self, leaf: int, data: memoryview) -> bytes | None:
        """`data` compressed, or None when it is too small, skipped or did not shrink."""
        if data.nbytes < MIN_BYTES or self._skip_until.get(leaf, 0) > self._batch:
            return None
        out = self._compress(data)
        if len(out) > MAX_RATIO * data.nbytes:
            self._skip_until[leaf] = self._batch + SKIP_BATCHES + 1
            return None
        return out


def compressor_for(name: str, current: Compressor | None = None) -> Compressor | None:
    """A worker's compressor for an epoch that asks for `name`: `current` if it is that codec's
    (what it learned about the leaves that do not shrink holds across epochs), else a new one;
    None for none, or where the codec's package is missing (the batches go uncompressed)."""
    if not name or not available(name):
        return None
    if current is not None and current.name == name:
        return current
    return Compressor(name)


def decompress(name: str, data: memoryview, raw_nbytes: int) -> bytearray:
    """A leaf's bytes, `raw_nbytes` long; raises CompressionError."""
    try:
        if name == "lz4":
            import lz4.block

            out: bytearray = lz4.block.decompress(
                data, uncompressed_size=raw_nbytes, return_bytearray=True
            )
        elif name == "zstd":
            import zstandard

            out = bytearray(
                zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_nbytes)
            )
        else:
            raise CompressionError(f"unknown compression {name!r} in header")
    except ImportError as exc:
        raise CompressionError(
            f"the batch is {name}-compressed and this client lacks its package: "
            f"{install_hint(name)}"
        ) from exc
    except CompressionError:
        raise
    except Exception as exc:  # each package has its own error types
        raise CompressionError(f"cannot decompress a {name} leaf: {exc}") from exc
    if len(out) != raw_nbytes:
        raise CompressionError(
            f"a {name} leaf decompressed to {len(out)} bytes, its header says {raw_nbytes}"
        )
    return out
