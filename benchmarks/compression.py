"""Compression on a slow link: throughput with compression="lz4" / "zstd" vs "none".

The loader server runs in a network namespace of its own, with a private /dev/shm, joined to
this process by a veth pair shaped to `--link-rate` (default 1gbit; benchmarks/netns.py), so
its batches reach this client over the TCP data connection exactly as on a second host. Two
workloads, each served by its own `remote-loader serve` (2 persistent workers):

  tokens  compressible: padded token-id batches, int64 ids below 32000 in sequences of varying
          length padded with 0, plus the attention mask (what an NLP loader sends; 8.4 MB/batch)
  noise   incompressible: uniform random uint8 images, each sample its own (9.6 MB/batch)

For each workload, after one untimed warm-up epoch per codec, `--rounds` rounds each read one
epoch of `--batches` batches with every codec in turn (a fresh RemoteLoader each, on the CPU),
and the table shows medians: batches/s, the link's payload MB/s (the encoded, compressed batch
as a local Compressor makes it, times batches/s), and each codec's throughput over "none"'s.
Targets (issue 16): on a 1 Gbit/s link, >= 2x uncompressed on the compressible workload, and
never below 0.95x on the incompressible one (compression turns itself off there).

Run as root from the repository root:

    python benchmarks/compression.py [--link-rate 1gbit] [--rounds 3] [--batches 30]
    python benchmarks/compression.py --quick        # smoke run: 6 batches, 1 round
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from remote_loader.client import RemoteLoader
from remote_loader.client.types import Compression
from remote_loader.protos import codec, compression

# benchmarks/ is not a package on any default path; the server imports the datasets as
# benchmarks.compression:Tokens (see benchmarks/processes.py).
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import netns  # noqa: E402
from benchmarks.processes import Placement, serve_at  # noqa: E402

CODECS: tuple[Compression, ...] = ("none", "lz4", "zstd")
BATCH_SIZE = 64
COMPRESSIBLE_TARGET = 2.0
INCOMPRESSIBLE_TARGET = 0.95
MB = 1e6


class Tokens:
    """`n` padded token sequences: {"input_ids": int64 [seq_len], "attention_mask": int64}.

    Sample i holds ids drawn below `vocab` for its first 40-100 % of `seq_len` (a seed of its
    own), zeros after: ids of a few significant bytes in 8-byte words, runs of padding, a 0/1
    mask. What a padded NLP batch looks like to a codec.
    """

    def __init__(self, n: int, seq_len: int = 8192, vocab: int = 32000) -> None:
        if n < 0 or seq_len < 1 or vocab < 2:
            raise ValueError(f"Tokens needs n >= 0, seq_len >= 1, vocab >= 2: {n}, {seq_len}")
        self.n, self.seq_len, self.vocab = n, seq_len, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for Tokens of length {self.n}")
        gen = torch.Generator().manual_seed(index)
        length = int(self.seq_len * (0.4 + 0.6 * torch.rand((), generator=gen).item()))
        ids = torch.zeros(self.seq_len, dtype=torch.int64)
        ids[:length] = torch.randint(1, self.vocab, (length,), generator=gen)
        mask = torch.zeros(self.seq_len, dtype=torch.int64)
        mask[:length] = 1
        return {"input_ids": ids, "attention_mask": mask}


class Noise:
    """`n` images [3, size, size] of uniform random uint8, sample i seeded with i: nothing in a
    batch repeats (benchmarks.workloads.Images repeats one image, which zstd's window finds)."""

    def __init__(self, n: int, size: int = 224) -> None:
        if n < 0 or size < 1:
            raise ValueError(f"Noise needs n >= 0 and size >= 1, got n={n}, size={size}")
        self.n, self.size = n, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for Noise of length {self.n}")
        gen = torch.Generator().manual_seed(index)
        return torch.randint(0, 256, (3, self.size, self.size), dtype=torch.uint8, generator=gen)


WORKLOADS = {"tokens": "benchmarks.compression:Tokens", "noise": "benchmarks.compression:Noise"}


def wire_bytes(name: str, codec_name: str, n: int) -> float:
    """The encoded size of batch 0 of workload `name` as a worker sends it with `codec_name`."""
    dataset: Any = Tokens(n) if name == "tokens" else Noise(n)
    batch = torch.utils.data.default_collate([dataset[i] for i in range(BATCH_SIZE)])
    compressor = None if codec_name == "none" else compression.Compressor(codec_name)
    return float(codec.encode(batch, compressor).total_nbytes)


def epoch(address: str, codec_name: Compression) -> float:
    """Batches/s of one epoch read with `codec_name`."""
    with RemoteLoader(address, device="cpu", compression=codec_name) as loader:
        start = time.perf_counter()
        batches = sum(1 for _ in loader)
        rate = batches / (time.perf_counter() - start)
        if loader.last_transport != "tcp":
            raise RuntimeError(
                f"the batches came by {loader.last_transport}, not the data connection: the "
                "namespace does not behave like another host"
            )
    return rate


def measure(
    name: str, args: argparse.Namespace, place: Placement, bar: tqdm[Any]
) -> dict[str, list[float]]:
    """Warm-up, then `args.rounds` rounds of one epoch per codec, against one server."""
    dataset = WORKLOADS[name]
    samples = args.batches * BATCH_SIZE
    flags = [
        "--dataset", dataset, "--dataset-kwargs", json.dumps({"n": samples}),
        "--batch-size", str(BATCH_SIZE), "--num-workers", "2", "--persistent-workers",
    ]  # fmt: skip
    served = serve_at(place, flags)
    rates: dict[str, list[float]] = {c: [] for c in CODECS}
    try:
        for codec_name in CODECS:
            bar.set_description(f"{name}: warm-up {codec_name}")
            epoch(served.address, codec_name)
            bar.update(1)
        for r in range(args.rounds):
            for codec_name in CODECS:
                bar.set_description(f"{name}: round {r + 1}/{args.rounds} {codec_name}")
                rates[codec_name].append(epoch(served.address, codec_name))
                bar.update(1)
    finally:
        served.stop()
    return rates


def _table(results: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> str:
    header = (
        f"{'workload':<9} {'codec':<6} {'batches/s':>10} {'MB/batch':>9} {'link MB/s':>10} "
        f"{'vs none':>8}"
    )
    lines = [header, "-" * len(header)]
    verdicts = []
    for name, rates in results.items():
        none = rates["none"]
        for codec_name in CODECS:
            rate = statistics.median(rates[codec_name])
            size = wire_bytes(name, codec_name, args.batches * BATCH_SIZE)
            ratio = statistics.median(r / n for r, n in zip(rates[codec_name], none, strict=True))
            lines.append(
                f"{name:<9} {codec_name:<6} {rate:>10.2f} {size / MB:>9.2f} "
                f"{rate * size / MB:>10.1f} {ratio:>7.2f}x"
            )
            if codec_name == "none":
                continue
            if name == "tokens":
                ok = ratio >= COMPRESSIBLE_TARGET
                verdicts.append(
                    f"{name} {codec_name}: {ratio:.2f}x uncompressed, target >= "
                    f"{COMPRESSIBLE_TARGET}: {'PASS' if ok else 'MISS'}"
                )
            else:
                ok = ratio >= INCOMPRESSIBLE_TARGET
                verdicts.append(
                    f"{name} {codec_name}: {ratio:.2f}x uncompressed, target >= "
                    f"{INCOMPRESSIBLE_TARGET}: {'PASS' if ok else 'MISS'}"
                )
    return "\n".join([*lines, "", *verdicts])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--link-rate", default="1gbit", help="tc rate of the link (1gbit)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=30, help="batches per epoch")
    parser.add_argument("--quick", action="store_true", help="smoke run: 6 batches, 1 round")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.batches, args.rounds = 6, 1
    if args.rounds < 1 or args.batches < 1:
        raise SystemExit("--rounds and --batches must be at least 1")
    for codec_name in CODECS[1:]:
        if not compression.available(codec_name):
            raise SystemExit(f"{codec_name}: {compression.install_hint(codec_name)}")
    try:
        netns.check_prerequisites(rate=args.link_rate)
    except (netns.NetnsError, ValueError) as exc:
        raise SystemExit(str(exc)) from None
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(
        f"compression over a {args.link_rate} link to a server in another network namespace: "
        f"batch {BATCH_SIZE}, {args.batches} batches/epoch, {args.rounds} round(s), 2 server "
        f"workers; {os.cpu_count()} CPUs, torch {torch.__version__}; load average at start "
        f"{load}\n",
        flush=True,
    )
    torch.set_num_threads(1)  # the client only decodes; the server's workers need the cores
    with netns.Link.create(rate=args.link_rate) as link:
        place = Placement(link)
        total = len(WORKLOADS) * len(CODECS) * (args.rounds + 1)
        with tqdm(total=total, unit="epoch", file=sys.stderr, leave=False) as bar:
            results = {name: measure(name, args, place, bar) for name in WORKLOADS}
    print(_table(results, args))
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"\nload average at end {load}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
