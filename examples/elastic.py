"""An elastic restart: a job of 3 ranks stops mid-epoch, restarts as 2, and between the two
lives every sample of the epoch is read exactly once.

python examples/elastic.py                 # starts a server itself, then torchrun twice

Life 1: `torchrun --nproc-per-node 3` runs this file as ranks; each takes --steps batches of
epoch 0 and saves its loader's state with its (pretend) checkpoint, then the job goes away, as
a job does when a node is lost. Life 2: `torchrun --nproc-per-node 2` on what is left; each
rank loads rank 0's saved state (DDP ranks are in step, so any rank's says it all) and reads the
rest of the epoch. The server deals what the 3 ranks had not consumed out to the 2 (docs/resume.md,
"On another number of ranks"). At the end the samples of both lives are counted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the server imports the dataset below as examples.elastic
    sys.path.insert(0, str(ROOT))

from remote_loader.client import RemoteLoader  # noqa: E402
from remote_loader.server import LoaderSpec, Server, ServerSettings  # noqa: E402

SAMPLES = 480
BATCH = 8


class Numbered(Dataset[torch.Tensor]):
    """Sample i is the number i: what a rank read is what it counts."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


def rank_main(args: argparse.Namespace) -> None:
    """One rank of either life (torchrun sets RANK, WORLD_SIZE and the rendezvous)."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = RemoteLoader(args.address, "numbers")  # rank and world size from the group
    checkpoint = Path(args.dir, "loader-state.json")
    if args.steps is not None:  # life 1: a few steps of epoch 0, then save and go away
        it = iter(loader)
        read = [int(i) for _ in range(args.steps) for i in next(it)]
        if rank == 0:
            checkpoint.write_text(json.dumps(loader.state_dict()))
    else:  # life 2: resume from the checkpoint, on however many ranks this job has
        loader.load_state_dict(json.loads(checkpoint.read_text()))
        read = [int(i) for batch in loader for i in batch]
    life = 1 if args.steps is not None else 2
    Path(args.dir, f"life{life}-rank{rank}.json").write_text(json.dumps(read))
    print(f"life {life}: rank {rank} of {dist.get_world_size()} read {len(read)} samples")
    loader.close()
    dist.barrier()
    dist.destroy_process_group()


def torchrun(ranks: int, *args: str) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc-per-node={ranks}", __file__, *args]
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", help="(a rank) the server")
    parser.add_argument("--dir", help="(a rank) where checkpoints and counts go")
    parser.add_argument("--steps", type=int, help="(a rank of life 1) batches before stopping")
    args = parser.parse_args()
    if args.address:
        rank_main(args)
        return 0
    spec = LoaderSpec(
        name="numbers", dataset="examples.elastic:Numbered", batch_size=BATCH, shuffle=True
    )
    with (
        Server(ServerSettings(address="127.0.0.1:0"), [spec]) as server,
        tempfile.TemporaryDirectory() as tmp,
    ):
        common = ["--address", server.address, "--dir", tmp]
        torchrun(3, *common, "--steps", "6")  # 3 ranks x 6 batches of the 20 each has
        torchrun(2, *common)  # 2 ranks share the 42 batches left: 21 each
        counts: Counter[int] = Counter()
        for path in Path(tmp).glob("life*-rank*.json"):
            counts.update(json.loads(path.read_text()))
    repeated = sorted(i for i, n in counts.items() if n > 1)
    missing = sorted(set(range(SAMPLES)) - set(counts))
    print(
        f"both lives together: {sum(counts.values())} samples read, {len(counts)} distinct, "
        f"{len(repeated)} repeated, {len(missing)} missing"
    )
    if repeated or missing:
        print("elastic check FAILED")
        return 1
    print("elastic check passed: every sample of the epoch exactly once across both lives")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
