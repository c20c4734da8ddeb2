"""Throughput of torch's DataLoader in this process vs RemoteLoader from a separate server, each
transport held against its physical ceiling measured in the same run.

For each workload (`images`: transport-bound, batches of about 9.6 MB from a nearly free
`__getitem__`; `heavy`: compute-bound, a few ms of convolutions per sample; both in
benchmarks/workloads.py; `demo`: the built-in image folder of remote_loader.server.datasets, 512
JPEGs decoded, randomly cropped and flipped, with `return_index`) the same dataset, batch size
and worker count run four ways: a local `DataLoader` (forkserver, persistent workers), and a
`RemoteLoader` against `remote-loader serve` started as a separate process, inside gRPC messages
(`transport="grpc"`), on a TCP data connection beside the gRPC stream (`transport="tcp"`: what a
trainer on another host gets by default) and through same-host shared memory (zero-copy from
the workers' slots, or the ring)
(`transport="auto"`, which picks it on one machine). Neither side shuffles. `images`
and `heavy` hold `--batches` batches; `demo` always reads its whole folder (512 / batch size
batches, the last one maybe short). Timed rounds alternate local/remote after one untimed warm-
up epoch each; the table shows medians over rounds (batches/s, GB/s of tensor bytes, time to the
first batch of an epoch), the ratios remote/local for each transport (median over rounds of each
round's ratio), CPU seconds per epoch and peak RSS over the timed epochs, of the client (this
process, for all sides) and of the server (local: the DataLoader's fork server and workers, i.e.
this process's descendants but the loader server's tree; remote: the server process tree, i.e.
the server, its fork server and its workers). A background thread samples RSS every 25 ms
(/proc/PID/statm); its own CPU is left out of the client's. RSS is summed over processes, so
memory shared between them (the fork server's pages its workers still share, shared-memory
tensors) is counted once in each process that maps it; the client's RSS also keeps what the
other side's epochs left allocated in this process. Below the table, per workload and loader:
CPU ms per batch of the client and of the server (CPU s over all timed epochs / their batches)
and "cores busy" (client + server CPU s / wall s of those epochs: 2.0 here means both cores of
this machine were spent on the loader and its consumer), and the transport each remote loader
reported in `stats().transport`.

Ceilings (benchmarks/ceilings.py; the raw ones measured in every round, right after the
loaders' epochs, so that a row and its ceiling see the same minute of the machine): a raw grpcio
stream of 4 MiB `bytes` messages (for `grpc`), a raw TCP socket moving batch-sized buffers
between two processes with `sendall` / `recv_into` (for `tcp`), `np.copyto` of one batch into
another buffer (for `shm`), and, with CUDA, pinned host-to-device copies of one batch (skipped
with a line saying so otherwise). Each remote row is printed as its GB/s and that as a fraction
of its transport's ceiling: "tcp 1.82 GB/s = 0.41 of raw socket 4.4 GB/s".

`--cross-host`: the loader server (and the raw ceilings' servers) run in a network namespace of
their own with a private /dev/shm, joined to this process by a veth pair (benchmarks/netns.py;
root and iproute2 needed). That is another host as far as RemoteLoader can tell: `transport=
"auto"` finds no shared memory and takes the data connection by itself, which the `tcp` row
checks (client stats and the server's "stream start ... transport=" log lines, both printed).
There is no `shm` row: shared memory between the two is exactly what the namespace removes.
`--link-rate RATE` (10gbit, 1gbit, ...) shapes both directions of the veth pair with tc's token
bucket filter, so the rows and the raw socket ceiling see a link of that rate.

`--tls`: every server speaks TLS with a throwaway CA and certificate (benchmarks/tlsfiles.py):
the loader server (so the `tcp` row is its TLS data connections, `grpc` TLS gRPC) and the raw
ceilings (raw grpcio over TLS; one raw TLS socket, wrapped as the data connections are).

`--train-step`: the client loop behaves like a trainer's on a CPU box: after each batch it does a
fixed amount of CPU work on its first tensor (`x.float().div_(255)` and a sum: one pass to widen
a uint8 image batch to float, one to scale it, one to reduce it), with torch's default intra-op
thread count unless `--client-threads` says otherwise (TRAIN_STEP_WHY). The step alone, on one
batch made in this process, is timed first (ms of wall time and of CPU per batch, and the
batches/s it allows: the trainer's own ceiling).

Every number is measured now. A progress bar on stderr advances per epoch; `--plot FILE.png`
draws the ratios and throughputs (needs matplotlib: pip install '.[bench]'). The load average
(/proc/loadavg) is printed at the start and at the end: the machine may be shared.

Run from the repository root:

    python benchmarks/compare.py [--batch-size 64] [--workers 2] [--rounds 3] [--batches 40]
                                 [--workloads images,heavy,demo] [--plot FILE.png]
                                 [--train-step] [--client-threads N]
    python benchmarks/compare.py --quick        # smoke run: 10 batches, 1 round
    python benchmarks/compare.py --device cuda  # where a GPU is: vs DataLoader(pin_memory=True)
    sudo python benchmarks/compare.py --cross-host [--link-rate 10gbit] [--tls]
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
import torch
from torch.utils.data import DataLoader, default_collate
from tqdm import tqdm

from remote_loader.client import TLS, RemoteLoader
from remote_loader.client.types import Transport
from remote_loader.server.config.spec import resolve
from remote_loader.server.datasets import DEMO_CLASSES, DEMO_DATASET, DEMO_PER_CLASS, demo_folder

# The workloads (and benchmarks.processes) are imported as benchmarks.* here, in the local
# DataLoader's workers and in the server's; benchmarks/ is not a package on any default path.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import ceilings, netns, report, tlsfiles  # noqa: E402
from benchmarks.measure import (  # noqa: E402
    Side,
    Workload,
    run_epoch,
    step_alone,
    touch,
    train_step,
)
from benchmarks.processes import (  # noqa: E402
    Placement,
    Served,
    loadavg,
    serve_at,
    tree_cpu,
    tree_pids,
)

WORKLOADS = {
    "images": "benchmarks.workloads:Images",
    "heavy": "benchmarks.workloads:Heavy",
    "demo": DEMO_DATASET,
}
# The built-in image folder's length, whatever --batches says.
DEMO_SAMPLES = DEMO_CLASSES * DEMO_PER_CLASS
# torch's intra-op threads in this process before main() changes them: a trainer's default.
DEFAULT_THREADS = torch.get_num_threads()


# CLIENT_THREADS_WHY: the training loop here only touches one sample per batch (touch()), but
# torch's intra-op pool (one thread per core by default) keeps spinning for a while after each
# op: measured per thread in /proc, 2.2-2.9 CPU s of every 5 s on this 2-core machine, taken from
# the workers and the server of every side alike. A trainer's loop runs on its own cores (and
# on the GPU); here it shares two with its loader, so by default it runs torch on one thread.
# `--client-threads 2` shows what torch's default does.
#
# TRAIN_STEP_WHY: `--train-step` asks the other question: a trainer on a CPU box, whose loop
# does real work per batch on the same cores as its loader. There the loop uses torch's default
# threads, as a trainer would, and the loaders compete with it for CPU: what decides is the
# CPU each side spends per batch (client and server), not the transport's speed alone.


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


# --- local vs remote -------------------------------------------------------------------------


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


def _workloads(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in WORKLOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(WORKLOADS)}; got {text!r}"
        )
    return list(dict.fromkeys(names))  # in the order given, each once


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="num_workers, both sides")
    parser.add_argument("--rounds", type=int, default=3, help="timed epochs per loader")
    parser.add_argument(
        "--batches",
        type=int,
        default=40,
        help="batches per epoch (images, heavy; demo reads its 512 images)",
    )
    parser.add_argument(
        "--workloads",
        type=_workloads,
        default=list(WORKLOADS),
        metavar="A,B,...",
        help=f"which to run, in this order (default {','.join(WORKLOADS)})",
    )
    parser.add_argument(
        "--plot", metavar="FILE.png", help="also draw the results into this image (matplotlib)"
    )
    parser.add_argument(
        "--client-threads",
        type=int,
        help="torch intra-op threads of this process, the training loop of every side "
        f"(default 1, see CLIENT_THREADS_WHY; with --train-step torch's {DEFAULT_THREADS})",
    )
    parser.add_argument(
        "--train-step",
        action="store_true",
        help="after each batch, a trainer's CPU work on it (x.float().div_(255).sum()); see "
        "TRAIN_STEP_WHY",
    )
    parser.add_argument(
        "--cross-host",
        action="store_true",
        help="servers in a network namespace of their own with a private /dev/shm, reached "
        "over a veth pair (root; benchmarks/netns.py); no shm row",
    )
    parser.add_argument(
        "--link-rate",
        metavar="RATE",
        help="with --cross-host: shape both directions of the veth pair to RATE (tc tbf), "
        "e.g. 10gbit, 1gbit",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="every server speaks TLS (a throwaway CA and certificate): the remote loaders, "
        "their data connections, and the raw grpcio and socket ceilings",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the training loop wants its batches: cpu (default), or cuda: the local "
        "DataLoader pins and copies each batch there, RemoteLoader(device='cuda') delivers it",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 10 batches, 1 round")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.batches, args.rounds = 10, 1
    if args.client_threads is None:
        args.client_threads = DEFAULT_THREADS if args.train_step else 1
    for flag in ("batch_size", "workers", "rounds", "batches", "client_threads"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be at least 1")
    if args.link_rate is not None and not args.cross_host:
        raise SystemExit("--link-rate shapes the --cross-host link: pass --cross-host too")
    if args.plot is not None:
        # Checked now, not after minutes of measuring.
        if importlib.util.find_spec("matplotlib") is None:
            raise SystemExit("--plot needs matplotlib: pip install '.[bench]'")
        if not Path(args.plot).resolve().parent.is_dir():
            raise SystemExit(f"--plot: no such directory for {args.plot!r}")
    if args.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: torch sees no CUDA device here")
    if args.cross_host:
        try:
            netns.check_prerequisites(rate=args.link_rate)
        except (netns.NetnsError, ValueError) as exc:
            raise SystemExit(f"--cross-host: {exc}") from None
    torch.set_num_threads(args.client_threads)  # CLIENT_THREADS_WHY, TRAIN_STEP_WHY
    names: list[str] = args.workloads
    demo = ""
    if "demo" in names:
        demo = f" (demo: its {DEMO_SAMPLES} images, {batches_per_epoch('demo', args)} batches)"
    loop = "train step" if args.train_step else "touch"
    settings = (
        f"batch {args.batch_size}, {args.workers} workers, {args.batches} batches/epoch{demo}, "
        f"{args.rounds} timed round(s), {args.client_threads} client thread(s), loop: {loop}"
        f", batches on {args.device}" + " (local: pin_memory=True)" * (args.device != "cpu")
    )
    if "demo" in names:
        demo_folder()  # generated once into the cache, before either side reads it
    link: netns.Link | None = None
    place = Placement()
    try:
        if args.cross_host:
            link = netns.Link.create(rate=args.link_rate)
            place = Placement(link)
        if args.tls:
            place = Placement(place.link, tlsfiles.make(place.host))
        where = place.describe() if place.link is None else place.link.describe()
        print(
            f"DataLoader in-process vs RemoteLoader {place.describe()}: {settings} "
            f"(medians; CPU s per epoch)\n{where}\n{os.cpu_count()} CPUs, torch "
            f"{torch.__version__}, grpcio {grpc.__version__}; load average at start "
            f"{loadavg()}\n",
            flush=True,
        )
        if args.cross_host:
            print("no shm row: the server's /dev/shm is private, as on another host\n", flush=True)
        labels = loaders_for(args.cross_host)
        # Warm-ups and rounds of every loader and the raw ceilings of every workload, then the
        # copies' ceilings.
        total = len(names) * (len(labels) + 1) * (args.rounds + 1) + ceilings.steps(len(names))
        with (
            tqdm(total=total, unit="epoch", file=sys.stderr, leave=False) as bar,
            ceilings.Raw(place) as raw,
        ):
            results = {name: compare(name, args, place, raw, bar) for name in names}
            top = raw.ceilings({name: r.batch_bytes for name, r in results.items()}, bar)
    finally:
        if link is not None:
            link.close()
        if place.tls is not None:
            tlsfiles.remove(place.tls)
    print(report.table(results, top, args.rounds))
    print(f"\nload average at end {loadavg()}")
    if args.plot is not None:
        report.plot(
            results,
            top.grpc,
            args.plot,
            f"DataLoader in-process vs RemoteLoader {place.describe()}: {settings}; "
            f"{os.cpu_count()} CPUs, torch {torch.__version__}, grpcio {grpc.__version__}",
        )
        print(f"\nchart: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
