"""DistributedDataParallel training on two CPU processes, each fed its share by one server.

python examples/ddp.py                     # starts a server on the demo image folder itself
python examples/ddp.py --epochs 3

remote-loader serve --address 127.0.0.1:50051 &
python examples/ddp.py --address 127.0.0.1:50051

Each rank creates `RemoteLoader(address)` with no rank or world size: both come from the
initialized torch.distributed group, and the server hands each rank its own share of every
epoch, as a DistributedSampler would. At the end, rank 0 gathers the sample indices every rank
received in epoch 0 and checks that the shares are disjoint and together cover the dataset.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import sys
from collections import Counter

import torch
import torch.distributed as dist

# Imported before any process group exists, on purpose: its functions take
# `group=group.WORLD` as a default argument, evaluated at import, so a first import after
# init_process_group() pins the default group for good. DDP's constructor imports it (through
# torch._dynamo), and destroy_process_group() then cannot free the gloo group: its worker threads
# ran on into interpreter exit, where a rank now and then aborted with "terminate called without
# an active exception" after all its work was done.
import torch.distributed.nn
from torch import nn
from torch.multiprocessing.spawn import ProcessExitedException, spawn
from torch.nn.parallel import DistributedDataParallel

from remote_loader.client import RemoteLoader
from remote_loader.server import Server, ServerSettings
from remote_loader.server.datasets import demo_spec

WORLD_SIZE = 2
CLASSES = 8  # the demo image folder's
# Pooling to a fixed size first keeps the model independent of the loader's crop size.
POOLED = 8


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server() -> Server:
    """The demo image folder, served by this process on a free port."""
    server = Server(ServerSettings(address="127.0.0.1:0"), [demo_spec()])
    server.start()
    return server


def say(line: str) -> None:
    # One write per line: spawned ranks share the terminal with unbuffered stdout, and print()
    # writes the text and its newline separately, so two ranks' lines could run together.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def check_shares(shares: list[list[int]], dataset_length: int) -> bool:
    """Prints and checks the ranks' epoch-0 indices: DistributedSampler pads the epoch to a
    multiple of the world size by repeating indices, so exactly that many may repeat."""
    world = len(shares)
    share = len(shares[0])
    padding = share * world - dataset_length
    counts = Counter(i for indices in shares for i in indices)
    repeats = sum(counts.values()) - len(counts)
    covered = set(counts) == set(range(dataset_length))
    equal = all(len(indices) == share for indices in shares)
    ok = equal and covered and 0 <= padding < world and repeats == padding
    for rank, indices in enumerate(shares):
        print(f"rank {rank} received {len(indices)} samples in epoch 0")
    print(
        f"shares: {world} x {share} samples for a dataset of {dataset_length} "
        f"(padding {padding}); {repeats} repeated, union covers the dataset: "
        f"{'yes' if covered else 'NO'}"
    )
    print("partition check " + ("passed" if ok else "FAILED"))
    return ok


def train(rank: int, address: str, epochs: int, init_method: str) -> None:
    # Two trainers and the server's workers share the machine; torch's default of one thread
    # per core in every process would only make them fight over the cores.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, init_method=init_method)
    try:
        # The model lives in fit() only, so that DDP's reducer, which holds the group, is gone
        # before the group is destroyed (see the torch.distributed.nn import above).
        epoch0, dataset_length = fit(rank, address, epochs)
        gc.collect()  # DDP sits in reference cycles: free it now, while the group is alive
        shares: list[list[int] | None] = [None] * WORLD_SIZE
        dist.all_gather_object(shares, epoch0)
        ok = True
        if rank == 0:
            gathered = [indices for indices in shares if indices is not None]
            ok = len(gathered) == WORLD_SIZE and check_shares(gathered, dataset_length)
        dist.barrier()  # leave together: neither tears the group down under the other
        if not ok:
            # Not an exception: the parent reports the exit code, without a traceback.
            sys.exit(1)
    finally:
        dist.destroy_process_group()
    left = gloo_threads()
    if left:
        # Not an abort at exit some runs later: the reason, every run.
        say(f"rank {rank}: the process group was not freed; threads still running: {left}")
        sys.exit(1)
    say(f"rank {rank}: process group freed")


def gloo_threads() -> list[str]:
    """The gloo threads still running in this process (Linux: /proc; elsewhere none known): a
    freed process group has joined them all."""
    tasks = f"/proc/{os.getpid()}/task"
    if not os.path.isdir(tasks):
        return []
    names = []
    for task in os.listdir(tasks):
        try:
            with open(f"{tasks}/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue  # the thread ended meanwhile
    return sorted(name for name in names if "gloo" in name)


def fit(rank: int, address: str, epochs: int) -> tuple[list[int], int]:
    """Trains a DDP model; returns the sample indices of epoch 0 and the dataset's length."""
    # Seeded apart on purpose: DDP broadcasts rank 0's parameters when it wraps the model, so
    # the replicas start equal all the same.
    torch.manual_seed(rank)
    model = DistributedDataParallel(
        nn.Sequential(
            nn.AdaptiveAvgPool2d(POOLED), nn.Flatten(), nn.Linear(3 * POOLED * POOLED, CLASSES)
        )
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    epoch0: list[int] = []
    # device="cpu": the model lives on the CPU (gloo), even where CUDA exists.
    with RemoteLoader(address, device="cpu") as loader:
        for epoch in range(epochs):
            loader.set_epoch(epoch)  # where DistributedSampler.set_epoch would go
            batches, total_loss = 0, 0.0
            for images, labels, indices in loader:
                loss = nn.functional.cross_entropy(model(images.float() / 255), labels)
                optimizer.zero_grad()
                loss.backward()  # the all-reduce of the gradients happens here
                optimizer.step()
                batches += 1
                total_loss += loss.item()
                if epoch == 0:
                    epoch0.extend(indices.tolist())
            if batches != len(loader):
                raise RuntimeError(f"rank {rank}: {batches} batches, len() said {len(loader)}")
            say(
                f"rank {rank} epoch {epoch}: {batches} batches "
                f"(len(loader) {len(loader)}), loss {total_loss / max(batches, 1):.3f}"
            )
        return epoch0, int(loader.info.dataset_length)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--address", default=None, help="a running server (default: start one on the demo data)"
    )
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()

    server = None if args.address else start_server()
    address = server.address if server is not None else args.address
    try:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        spawn(train, args=(address, args.epochs, init_method), nprocs=WORLD_SIZE, join=True)
    except ProcessExitedException as exc:
        print(f"ddp example FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
    print("ddp example passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
