"""Epochs without persistent_workers: RemoteLoader against torch's DataLoader, side by side.

Without persistent_workers every epoch starts new workers, locally and on the server alike; what
an epoch then costs beyond its batches is how fast a new worker is ready. The workload is
benchmarks/jpegs.py's JpegFolder (`--images` random JPEGs written into a temporary folder,
decoded, randomly cropped, flipped and normalized, in a module importing pandas to stand for
torchvision). The same dataset, batch size and worker count run two ways, alternating epoch by
epoch after one untimed warm-up epoch each: a local `DataLoader` in this process
(`--local-context`: multiprocessing's default start method here unless told, fork on Linux before
Python 3.14) and a `RemoteLoader` against `remote-loader serve` started as a separate process on
loopback. Every epoch is timed whole (its workers' start-up included), with the time to its
first batch. Printed: each epoch's seconds, the medians, and the ratio remote/local of the
medians; the load average (/proc/loadavg) at the start and the end, since the machine may be
shared.

Run from the repository root:

    python benchmarks/fresh_epochs.py [--images 300] [--epochs 6] [--workers 2]
                                      [--batch-size 32] [--local-context fork]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.jpegs import STAND_IN, JpegFolder, write_jpegs  # noqa: E402
from benchmarks.measure import Epoch, run_epoch  # noqa: E402
from benchmarks.processes import loadavg, start_server, stop_process  # noqa: E402
from remote_loader.client import RemoteLoader  # noqa: E402


def config(root: str, args: argparse.Namespace) -> str:
    """A config file serving the JPEG folder as loader "jpegs"; returns its path."""
    text = f"""
[loaders.jpegs]
dataset = "benchmarks.jpegs:JpegFolder"
dataset_kwargs = {{ root = "{root}" }}
batch_size = {args.batch_size}
num_workers = {args.workers}
persistent_workers = false
"""
    fd, path = tempfile.mkstemp(suffix=".toml", prefix="fresh-epochs-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--epochs", type=int, default=6, help="timed epochs of each loader")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--local-context", default=None, help="the local DataLoader's multiprocessing_context"
    )
    args = parser.parse_args(argv)
    print(f"load average at start: {loadavg()} ({os.cpu_count()} CPUs)")
    with tempfile.TemporaryDirectory(prefix="fresh-epochs-") as root:
        write_jpegs(root, args.images)
        path = config(root, args)
        proc, address = start_server(["--config", path])
        try:
            local = DataLoader(
                JpegFolder(root),
                batch_size=args.batch_size,
                num_workers=args.workers,
                persistent_workers=False,
                multiprocessing_context=args.local_context,
            )
            with RemoteLoader(address, "jpegs", device="cpu") as remote:
                sides: dict[str, list[Epoch]] = {"local": [], "remote": []}
                run_epoch(local)  # warm-up: the page cache, the server's first pool
                run_epoch(remote)
                for epoch in range(args.epochs):
                    sides["local"].append(run_epoch(local))
                    sides["remote"].append(run_epoch(remote))
                    print(
                        f"epoch {epoch}: local {sides['local'][-1].seconds:.3f} s "
                        f"(first batch {sides['local'][-1].first_batch:.3f} s), remote "
                        f"{sides['remote'][-1].seconds:.3f} s "
                        f"(first batch {sides['remote'][-1].first_batch:.3f} s)",
                        flush=True,
                    )
        finally:
            stop_process(proc)
            os.unlink(path)
    medians = {k: statistics.median(e.seconds for e in v) for k, v in sides.items()}
    firsts = {k: statistics.median(e.first_batch for e in v) for k, v in sides.items()}
    batches = sides["local"][0].batches
    print(
        f"{args.images} JPEGs, {batches} batches of {args.batch_size}, {args.workers} workers, "
        f"persistent_workers=False, local context {args.local_context or 'default'}, "
        f"the dataset's module importing {STAND_IN or 'nothing (no pandas)'} for torchvision"
    )
    for k in ("local", "remote"):
        print(f"  {k:6s} median epoch {medians[k]:.3f} s, first batch {firsts[k]:.3f} s")
    print(f"  remote / local: {medians['remote'] / medians['local']:.2f}x")
    print(f"load average at end: {loadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
