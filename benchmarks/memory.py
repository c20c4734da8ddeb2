"""Server memory over many epochs: is RSS after epoch 20 within 5 % of RSS after epoch 1?

Starts `remote-loader serve` (persistent workers) on the transport workload of
benchmarks/workloads.py as a separate process, reads `--epochs` epochs with a RemoteLoader, and
after each epoch records the resident set size of the server process and of its whole process
tree (server, fork server, workers; shared memory is counted in every process that maps it).
Prints both after the first and the last epoch and their ratio; the target is at most 1.05.

Run from the repository root:

    python benchmarks/memory.py [--epochs 20] [--batch-size 64] [--workers 2] [--batches 20]
                                [--transport auto|tcp|grpc]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from remote_loader.client import RemoteLoader

# benchmarks/ is not a package on any default path; the server's workers import the workload
# as benchmarks.workloads (see benchmarks/processes.py).
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.processes import process_rss, start_server, stop_process, tree_pids  # noqa: E402

TARGET = 1.05


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=20, help="batches per epoch")
    parser.add_argument(
        "--transport",
        choices=["auto", "tcp", "grpc"],
        default="auto",
        help="RemoteLoader's transport (auto: the shared-memory ring on this host)",
    )
    args = parser.parse_args(argv)
    if min(args.epochs, args.batch_size, args.workers, args.batches) < 1:
        raise SystemExit("--epochs, --batch-size, --workers and --batches must be at least 1")
    flags = [
        "--dataset",
        "benchmarks.workloads:Images",
        "--dataset-kwargs",
        json.dumps({"n": args.batches * args.batch_size}),
        "--batch-size",
        str(args.batch_size),
        "--num-workers",
        str(args.workers),
        "--persistent-workers",
    ]
    server, address = start_server(flags)
    after: list[tuple[int, int]] = []  # per epoch: (server process, whole tree) RSS
    try:
        with RemoteLoader(address, device="cpu", transport=args.transport) as loader:
            for epoch in range(args.epochs):
                batches = sum(1 for _ in loader)
                if batches != args.batches:
                    raise RuntimeError(f"epoch {epoch}: {batches} batches, not {args.batches}")
                tree = tree_pids(server.pid)
                after.append((process_rss(server.pid), sum(process_rss(p) for p in tree)))
                print(
                    f"epoch {epoch + 1:>3}: server {after[-1][0] / 1e6:8.1f} MB, "
                    f"tree {after[-1][1] / 1e6:8.1f} MB",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        stop_process(server)
    (first_main, first_tree), (last_main, last_tree) = after[0], after[-1]
    ratio = last_main / first_main
    print(
        f"server RSS after epoch 1: {first_main / 1e6:.1f} MB, after epoch {args.epochs}: "
        f"{last_main / 1e6:.1f} MB, ratio {ratio:.3f} (target <= {TARGET}: "
        f"{'PASS' if ratio <= TARGET else 'MISS'})\n"
        f"server tree RSS after epoch 1: {first_tree / 1e6:.1f} MB, after epoch "
        f"{args.epochs}: {last_tree / 1e6:.1f} MB, ratio {last_tree / first_tree:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
