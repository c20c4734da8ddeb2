"""A Lightning training job fed by a RemoteLoader, as a user writes one: run by
tests/integration/test_libraries.py as a script (Lightning's DDP launcher starts the other ranks by
running this file again), it records what each training step received.

python tests/lightning_job.py --address HOST:PORT --out DIR [--devices 2] [--epochs 3]
    [--strategy ddp|ddp_spawn|ddp_notebook] [--checkpoint-every N] [--resume CKPT]

Each rank writes DIR/rank<R>.json when its training ends: its (Lightning epoch, sample indices)
per step and the RemoteLoader's rank and world size. Written from the training process itself:
under ddp_spawn and ddp_notebook that is a process Lightning started, not this one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: `tests` must import as a package
    sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from remote_loader.client import RemoteLoader  # noqa: E402


class Recorder(L.LightningModule):
    """A model of one weight; each step records which samples it was given."""

    def __init__(self, out: str) -> None:
        super().__init__()
        self.out = out
        self.weight = torch.nn.Parameter(torch.zeros(4))
        self.seen: list[tuple[int, list[int]]] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.seen.append((self.current_epoch, batch["index"].tolist()))
        loss: torch.Tensor = (batch["x"] * self.weight).sum()
        return loss

    def on_train_end(self) -> None:
        # Trainer.datamodule is set by fit(); its stubs do not say so.
        loader = cast(Any, self.trainer).datamodule.loader
        record = {"rank": loader.rank, "world_size": loader.world_size, "seen": self.seen}
        Path(self.out, f"rank{self.trainer.global_rank}.json").write_text(json.dumps(record))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class RemoteData(L.LightningDataModule):
    """The loader is built in __init__, before Lightning's launcher or torch.distributed exist:
    the rank must come from the job when the first epoch starts, not from here."""

    def __init__(self, address: str) -> None:
        super().__init__()
        self.loader = RemoteLoader(address, "train", device="cpu")

    def train_dataloader(self) -> RemoteLoader:
        return self.loader


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--strategy", default="ddp", help="with --devices 2 and more")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args(argv)

    data = RemoteData(args.address)
    model = Recorder(args.out)
    callbacks: list[L.Callback] = []
    if args.checkpoint_every:
        checkpoints = os.path.join(args.out, "checkpoints")
        callbacks += [
            # Mid-epoch ones (and one after an epoch's last batch), and one at each epoch's end.
            ModelCheckpoint(
                dirpath=checkpoints,
                filename="{epoch}-{step}",
                every_n_train_steps=args.checkpoint_every,
                save_top_k=-1,
            ),
            ModelCheckpoint(
                dirpath=checkpoints,
                filename="end-{epoch}",
                every_n_epochs=1,
                save_on_train_epoch_end=True,
                save_top_k=-1,
            ),
        ]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy if args.devices > 1 else "auto",
        max_epochs=args.epochs,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(args.checkpoint_every),
        callbacks=callbacks,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=data, ckpt_path=args.resume)
    data.loader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
