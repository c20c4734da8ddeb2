"""A training loop fed by a remote-loader server instead of a local DataLoader.

remote-loader serve --address 127.0.0.1:50051 &      # the demo image folder
python examples/train.py --address 127.0.0.1:50051 --epochs 2
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from remote_loader.client import RemoteLoader


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--loader", default=None, help="loader name (default: the only one)")
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()

    with RemoteLoader(args.address, args.loader) as loader:
        device = loader.device  # the current CUDA device if there is one, else the CPU
        model = nn.Sequential(nn.Flatten(), nn.LazyLinear(8)).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for epoch in range(args.epochs):
            started, seen = time.monotonic(), 0
            for batch in loader:  # already on `device`; pinned and copied on a side stream
                images, labels = batch[0], batch[1]
                loss = nn.functional.cross_entropy(model(images.float() / 255), labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                seen += len(labels)
            rate = seen / (time.monotonic() - started)
            print(
                f"epoch {epoch}: {len(loader)} batches, loss {loss.item():.3f}, "
                f"{rate:.0f} samples/s"
            )


if __name__ == "__main__":
    main()
