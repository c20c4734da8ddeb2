"""The trainer side of `remote-loader demo`: one rank iterating its share of a RemoteLoader.

Prints one JSON line per event (the epoch's length, each batch, a final report with the sample
indices it received per epoch), which the demo turns into a progress bar and a summary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from remote_loader.client import RemoteLoader


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    batches = samples = nbytes = 0
    received: list[list[int]] = []  # per epoch, the sample indices of this rank's share
    started = time.monotonic()
    with RemoteLoader(args.address, rank=args.rank, world_size=args.world_size) as loader:
        for _ in range(args.epochs):
            print(json.dumps({"total": len(loader) * args.epochs}), flush=True)
            seen: list[int] = []
            for images, labels, indices in loader:
                # A stand-in for a training step: touch every pixel once.
                images.float().mean()
                batches += 1
                samples += len(labels)
                nbytes += images.numel() * images.element_size()
                seen.extend(indices.tolist())
                print(json.dumps({"batch": batches}), flush=True)
            received.append(seen)
        transport = loader.last_transport  # "shm" on the server's host, else "grpc"
    print(
        json.dumps(
            {
                "rank": args.rank,
                "batches": batches,
                "samples": samples,
                "bytes": nbytes,
                "seconds": time.monotonic() - started,
                "dataset_length": int(loader.info.dataset_length),
                "received": received,
                "device": str(torch.device(loader.device)),
                "transport": transport,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
