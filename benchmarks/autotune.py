"""num_workers = "auto" against fixed worker counts on the compute-bound workload.

    python benchmarks/autotune.py                    # fixed 1, 2, 3 workers and "auto"
    python benchmarks/autotune.py --fixed 1,2,4,8 --max-workers 8 --batches 200   # a bigger box

One `remote-loader serve` process serves the same loader (seeding = "per_batch", persistent
workers) with each fixed count and with "auto", which starts from one worker. A RemoteLoader in
this process reads --warmup epochs of each (for "auto": the time it takes to find its count,
reported), then --rounds timed epochs in alternation. Printed: batches/s per loader (median),
the best fixed count, and "auto" as a fraction of it (the target: at least 0.9).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.processes import start_server, stop_process  # noqa: E402
from remote_loader.client import RemoteLoader  # noqa: E402


def config(args: argparse.Namespace, fixed: list[int]) -> str:
    loaders = {f"w{n}": str(n) for n in fixed}
    loaders["auto"] = '"auto"'
    text = ""
    for name, workers in loaders.items():
        text += f"""
[loaders.{name}]
dataset = "benchmarks.workloads:Heavy"
dataset_kwargs = {{ n = {args.batches * args.batch_size} }}
batch_size = {args.batch_size}
num_workers = {workers}
persistent_workers = true
seeding = "per_batch"
"""
        if name == "auto" and args.max_workers:
            text += f"max_workers = {args.max_workers}\n"
    fd, path = tempfile.mkstemp(suffix=".toml", prefix="autotune-bench-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def epoch(address: str, name: str, number: int) -> float:
    """Batches per second of one epoch of `name`."""
    with RemoteLoader(address, name) as loader:
        loader.set_epoch(number)
        start = time.perf_counter()
        batches = sum(1 for _ in loader)
        return batches / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", default="1,2,3", help="fixed worker counts to compare")
    parser.add_argument("--max-workers", type=int, help="for auto (default: the host's CPUs)")
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3, help="untimed epochs of each loader")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    fixed = [int(n) for n in args.fixed.split(",")]
    names = [f"w{n}" for n in fixed] + ["auto"]
    path = config(args, fixed)
    print(
        f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; heavy workload, "
        f"{args.batches} batches of {args.batch_size}, {args.warmup} warm-up epochs, "
        f"{args.rounds} rounds"
    )
    proc, address = start_server(["--config", path, "--address", "127.0.0.1:0"])
    try:
        started = time.perf_counter()
        for w in range(args.warmup):
            for name in names:
                epoch(address, name, w)
        print(f"warm-up: {time.perf_counter() - started:.1f} s")
        rates: dict[str, list[float]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names:
                rates[name].append(epoch(address, name, args.warmup + r))
    finally:
        stop_process(proc)
        os.unlink(path)
    medians = {name: statistics.median(values) for name, values in rates.items()}
    for name in names:
        print(f"{name:>5}: {medians[name]:7.1f} batches/s")
    best = max((n for n in names if n != "auto"), key=medians.__getitem__)
    ratio = medians["auto"] / medians[best]
    print(f"best fixed: {best}; auto / best = {ratio:.2f} (target >= 0.90)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
