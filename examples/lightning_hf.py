"""A Lightning Trainer fed by a RemoteLoader over a Hugging Face streaming dataset.

python examples/lightning_hf.py                 # starts a server for the dataset itself
python examples/lightning_hf.py --epochs 3

The server builds `shuffled_stream()` once (the dataset factory below: an HF IterableDataset of
4 shards behind a seeded shuffle buffer) and its two workers start from that object. Each epoch
the server calls the dataset's `set_epoch(epoch)` in its workers, so the stream reshuffles per
epoch as it does under a local DataLoader whose script calls `ds.set_epoch(epoch)`; Lightning
sets the epoch through `loader.sampler.set_epoch`, which the RemoteLoader takes as the next
epoch to stream. At the end the example prints each epoch's first ids and checks that every
epoch held every id once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the server's workers import this file as `examples.lightning_hf`
    sys.path.insert(0, str(ROOT))

from remote_loader.client import RemoteLoader  # noqa: E402
from remote_loader.server import LoaderSpec, Server, ServerSettings  # noqa: E402

ROWS = 64


def shuffled_stream(rows: int = ROWS) -> Any:
    """The dataset factory the server calls (once): an HF IterableDataset, shuffled."""
    import datasets

    ds = datasets.Dataset.from_dict(
        {"id": list(range(rows)), "x": [[float(i)] * 4 for i in range(rows)]}
    )
    return (
        ds.to_iterable_dataset(num_shards=4).shuffle(seed=42, buffer_size=16).with_format("torch")
    )


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.ids: dict[int, list[int]] = {}

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.ids.setdefault(self.current_epoch, []).extend(batch["id"].tolist())
        loss: torch.Tensor = self.layer(batch["x"]).pow(2).mean()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    spec = LoaderSpec(
        name="train",
        dataset="examples.lightning_hf:shuffled_stream",
        batch_size=8,
        num_workers=2,
    )
    with Server(ServerSettings(address="127.0.0.1:0"), [spec]) as server:
        loader = RemoteLoader(server.address, "train", device="cpu")
        model = Model()
        trainer = L.Trainer(
            accelerator="cpu",
            max_epochs=args.epochs,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, train_dataloaders=loader)
        loader.close()
    ok = True
    for epoch, ids in sorted(model.ids.items()):
        whole = sorted(ids) == list(range(ROWS))
        ok &= whole
        print(f"epoch {epoch}: first ids {ids[:6]}, every id once: {'yes' if whole else 'NO'}")
    orders = [tuple(ids) for _, ids in sorted(model.ids.items())]
    reshuffled = len(set(orders)) == len(orders)
    print(f"each epoch in its own order: {'yes' if reshuffled else 'NO'}")
    return 0 if ok and reshuffled else 1


if __name__ == "__main__":
    sys.exit(main())
