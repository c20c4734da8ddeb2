"""One workload of benchmarks/compare.py, local against remote: the loaders it runs (torch's
DataLoader here, a RemoteLoader per transport), their server, and the alternating timed rounds.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import json
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader, default_collate
from tqdm import tqdm

from benchmarks import ceilings
from benchmarks.measure import Side, Workload, run_epoch, step_alone, touch, train_step
from benchmarks.processes import Placement, Served, serve_at, tree_cpu, tree_pids
from remote_loader.client import TLS, RemoteLoader
from remote_loader.client.types import Transport
from remote_loader.server.config.spec import resolve
from remote_loader.server.datasets import DEMO_CLASSES, DEMO_DATASET, DEMO_PER_CLASS

WORKLOADS = {
    "images": "benchmarks.workloads:Images",
    "heavy": "benchmarks.workloads:Heavy",
    "demo": DEMO_DATASET,
}
# The built-in image folder's length, whatever --batches says.
DEMO_SAMPLES = DEMO_CLASSES * DEMO_PER_CLASS


def loaders_for(cross_host: bool) -> dict[str, Transport | None]:
    """The loaders each workload runs, in each round's order: label -> RemoteLoader transport
    (None: torch's DataLoader in this process). Across hosts `auto` must find the data
    connection by itself (checked), and there is no shared memory to measure."""
    if cross_host:
        return {"local": None, "grpc": "grpc", "tcp": "auto"}
    return {"local": None, "grpc": "grpc", "tcp": "tcp", "shm": "auto"}


def start_loader_server(
    dataset: str, kwargs: dict[str, Any], batch_size: int, workers: int, place: Placement
) -> Served:
    """`remote-loader serve` for one dataset as a separate process, where `place` says."""
    flags = [
        "--dataset",
        dataset,
        "--dataset-kwargs",
        json.dumps(kwargs),
        "--batch-size",
        str(batch_size),
        "--num-workers",
        str(workers),
        "--persistent-workers",
    ]
    return serve_at(place, flags)


def dataset_kwargs(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments workload `name` is built with, on both sides."""
    if name == "demo":
        return {"return_index": True}  # as `remote-loader serve` hosts it by default
    return {"n": args.batches * args.batch_size}


def batches_per_epoch(name: str, args: argparse.Namespace) -> int:
    """Batches in one epoch of workload `name` (the last one may be short)."""
    batch_size: int = args.batch_size
    samples = DEMO_SAMPLES if name == "demo" else args.batches * batch_size
    return -(-samples // batch_size)


def compare(
    name: str, args: argparse.Namespace, place: Placement, raw: ceilings.Raw, bar: tqdm[Any]
) -> Workload:
    """Warm-up, then `args.rounds` alternating epochs of each loader of workload `name`, each
    round followed by one of the `raw` ceilings (the first also by their untimed warm-up)."""
    path = WORKLOADS[name]
    kwargs = dataset_kwargs(name, args)
    step = train_step if args.train_step else touch
    local_step = step
    if args.device != "cpu":
        local_step = functools.partial(on_device, step=step, device=torch.device(args.device))
    dataset = resolve(path, "dataset")(**kwargs)
    alone = None
    if args.train_step:
        # Before any loader runs, on a batch made here: the trainer's own ceiling.
        bar.set_description(f"{name}: the train step alone")
        batch = default_collate([dataset[i] for i in range(min(args.batch_size, len(dataset)))])
        alone = step_alone(batch, train_step)
        del batch
    bar.set_description(f"{name}: starting the server")
    local_loader = DataLoader(
        dataset,
        batch_size=args.batch_size,
        num_workers=args.workers,
        persistent_workers=True,
        multiprocessing_context="forkserver",
        # With a GPU, what a trainer writes: pinned batches, copied to it without blocking.
        pin_memory=args.device != "cpu",
    )
    server = start_loader_server(path, kwargs, args.batch_size, args.workers, place)
    labels = loaders_for(place.link is not None)
    sides = {label: Side() for label in labels}
    logged: collections.Counter[str] = collections.Counter()
    server_pid = server.proc.pid

    # Local: this process's descendants but the server's tree: the fork server and its workers.
    def workers() -> list[int]:
        return tree_pids(os.getpid(), include_root=False, exclude=[server_pid])

    def workers_cpu() -> float:
        return tree_cpu(os.getpid(), include_root=False, exclude=[server_pid])

    # Remote: the server, its fork server and its workers.
    def served() -> list[int]:
        return tree_pids(server_pid)

    def served_cpu() -> float:
        return tree_cpu(server_pid)

    def epoch(what: str) -> None:
        bar.set_description(f"{name}: {what}")

    tls = None if place.tls is None else TLS(ca=place.tls.ca)
    remote_loaders = {
        label: RemoteLoader(server.address, device=args.device, transport=transport, tls=tls)
        for label, transport in labels.items()
        if transport is not None
    }
    loaders: dict[str, Iterable[Any]] = {"local": local_loader, **remote_loaders}
    try:
        for label, loader in loaders.items():
            epoch(f"warm-up, {label}")
            # local: starts the fork server and the persistent workers
            run_epoch(loader, local_step if label == "local" else step)
            bar.update()
            if label != "local" and remote_loaders[label].last_transport != label:
                raise RuntimeError(
                    f"the {label} loader's batches came over {remote_loaders[label].last_transport}"
                )
        for r in range(1, args.rounds + 1):
            for label, loader in loaders.items():
                epoch(f"round {r}/{args.rounds}, {label}")
                if label == "local":
                    sides[label].timed_epoch(loader, workers_cpu, workers, local_step)
                else:
                    sides[label].timed_epoch(loader, served_cpu, served, step)
                bar.update()
            local = sides["local"]
            batch_bytes = -(-local.epochs[-1].nbytes // local.epochs[-1].batches)
            for timed in [False, True] if r == 1 else [True]:
                epoch(f"round {r}/{args.rounds}, raw ceilings" + " (warm-up)" * (not timed))
                raw.round(name, batch_bytes, args.batches, timed=timed)
                bar.update()
    finally:
        for remote_loader in remote_loaders.values():
            remote_loader.close()
        logged = server.stop()
        # The last reference: its iterator's finalizer shuts the persistent workers down.
        del local_loader, loaders
        gc.collect()
    local = sides["local"]
    batch_bytes = -(-sum(e.nbytes for e in local.epochs) // local.batches)
    return Workload(sides, batch_bytes, alone, logged)


def on_device(batch: Any, step: Callable[[Any], None], device: torch.device) -> None:
    """The local side's loop with `--device cuda`: every tensor of the (pinned) batch copied to
    the device without blocking, as a trainer does after `DataLoader(pin_memory=True)`, then
    `step` on the copies (RemoteLoader hands its batches over on the device already)."""
    step(_to(batch, device))


def _to(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return type(batch)(_to(v, device) for v in batch)
    return batch
