"""The trainer side of `remote-loader demo`: iterates a RemoteLoader and reports on stdout.

Prints one JSON line per event (the epoch's length, each batch, a final report), which the demo
turns into a progress bar and a summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter

import torch

from remote_loader.client import RemoteLoader


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    batches = samples = nbytes = 0
    exactly_once = True
    started = time.monotonic()
    with RemoteLoader(args.address) as loader:
        size = int(loader.info.dataset_length)
        for _ in range(args.epochs):
            print(json.dumps({"total": len(loader) * args.epochs}), flush=True)
            seen: Counter[int] = Counter()
            for images, labels, indices in loader:
                # A stand-in for a training step: touch every pixel once.
                images.float().mean()
                batches += 1
                samples += len(labels)
                nbytes += images.numel() * images.element_size()
                seen.update(indices.tolist())
                print(json.dumps({"batch": batches}), flush=True)
            exactly_once = exactly_once and seen == Counter(range(size))
    print(
        json.dumps(
            {
                "rank": args.rank,
                "batches": batches,
                "samples": samples,
                "bytes": nbytes,
                "seconds": time.monotonic() - started,
                "exactly_once": exactly_once,
                "device": str(torch.device(loader.device)),
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
