"""Throughput of torch's DataLoader in this process vs RemoteLoader from a server on loopback.

For each workload (`images`: transport-bound, batches of about 9.6 MB from a nearly free
`__getitem__`; `heavy`: compute-bound, a few ms of convolutions per sample; both in
benchmarks/workloads.py; `demo`: the built-in image folder of remote_loader.server.datasets, 512
JPEGs decoded, randomly cropped and flipped, with `return_index`) the same dataset, batch size
and worker count run four ways: a local `DataLoader` (forkserver, persistent workers), and a
`RemoteLoader` against `remote-loader serve` started as a separate process, inside gRPC messages
(`transport="grpc"`), on a TCP data connection beside the gRPC stream (`transport="tcp"`: what a
trainer on another host gets by default) and through the same-host shared-memory ring
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
other side's epochs left allocated in this process. A raw grpcio stream of 4 MiB `bytes`
messages on loopback, measured in the same run, is the transport ceiling. Every number is
measured now. A progress bar on stderr advances per epoch; `--plot FILE.png` draws the ratios
and throughputs (needs matplotlib: pip install '.[bench]').

Run from the repository root:

    python benchmarks/compare.py [--batch-size 64] [--workers 2] [--rounds 3] [--batches 40]
                                 [--workloads images,heavy,demo] [--plot FILE.png]
    python benchmarks/compare.py --quick        # smoke run: 10 batches, 1 round
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import os
import re
import select
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from remote_loader.client import RemoteLoader
from remote_loader.server.datasets import DEMO_CLASSES, DEMO_DATASET, DEMO_PER_CLASS, demo_folder
from remote_loader.server.spec import resolve

# The workloads (and benchmarks.processes) are imported as benchmarks.* here, in the local
# DataLoader's workers and in the server's; benchmarks/ is not a package on any default path.
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.processes import (  # noqa: E402
    process_rss,
    start_server,
    stop_process,
    subprocess_env,
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
# The raw ceiling's message: the size of the frames RemoteLoader's server sends by default.
RAW_MESSAGE_BYTES = 4 * 1024 * 1024
RAW_METHOD = "/bench.Raw/Stream"
# Seconds a server process may take to print its port (it imports torch and starts workers).
STARTUP_TIMEOUT = 120.0
GB = 1e9
MB = 1e6
# Seconds between two RSS samples, and between two listings of the processes a side's loader
# runs in (a full /proc scan; its workers are persistent, so the list hardly ever changes).
RSS_INTERVAL = 0.025
RSS_RELIST = 0.5


# --- measuring -------------------------------------------------------------------------------


class PeakRss:
    """Within `with`: samples RSS every RSS_INTERVAL s in a thread and keeps the maxima.

    `client` is this process's peak, `server` the peak of the RSS summed over `server_pids()`
    (listed again every RSS_RELIST s), both in bytes; `cpu` is the sampling thread's own CPU
    seconds, for the caller to leave out of this process's.
    """

    def __init__(self, server_pids: Callable[[], list[int]]) -> None:
        self._server_pids = server_pids
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)
        self.client = 0
        self.server = 0
        self.cpu = 0.0

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        start = time.thread_time()
        me = os.getpid()
        pids: list[int] = []
        listed = float("-inf")
        while True:
            now = time.monotonic()
            if now - listed >= RSS_RELIST:
                pids, listed = self._server_pids(), now
            self.client = max(self.client, process_rss(me))
            self.server = max(self.server, sum(process_rss(pid) for pid in pids))
            if self._stop.is_set():
                break  # that was the last sample, taken after the epoch's end
            self._stop.wait(RSS_INTERVAL)
        self.cpu = time.thread_time() - start


def tensor_bytes(batch: Any) -> int:
    """Bytes held by the tensors in a batch (tuples, lists and dicts are walked)."""
    if isinstance(batch, torch.Tensor):
        return batch.nbytes
    if isinstance(batch, list | tuple):
        return sum(tensor_bytes(x) for x in batch)
    if isinstance(batch, dict):
        return sum(tensor_bytes(x) for x in batch.values())
    return 0


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    items = batch.values() if isinstance(batch, dict) else batch
    if isinstance(items, Iterable) and not isinstance(items, str | bytes):
        for x in items:
            found = _first_tensor(x)
            if found is not None:
                return found
    return None


def touch(batch: Any) -> None:
    """Reads one sample of the batch, so that it is really there, at almost no cost."""
    t = _first_tensor(batch)
    if t is not None:
        t[0].sum().item()


@dataclasses.dataclass(frozen=True)
class Epoch:
    """One timed epoch: wall seconds, seconds to the first batch, batches and tensor bytes."""

    seconds: float
    first_batch: float
    batches: int
    nbytes: int

    @property
    def batches_per_s(self) -> float:
        return self.batches / self.seconds

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / GB / self.seconds


def run_epoch(loader: Iterable[Any]) -> Epoch:
    """Iterates one epoch of `loader`, touching each batch."""
    start = time.perf_counter()
    first = float("nan")
    batches = nbytes = 0
    for batch in loader:
        if batches == 0:
            first = time.perf_counter() - start
        touch(batch)
        nbytes += tensor_bytes(batch)
        batches += 1
    return Epoch(time.perf_counter() - start, first, batches, nbytes)


@dataclasses.dataclass
class Side:
    """The timed epochs of one loader, the CPU seconds they cost and the peak RSS they saw."""

    epochs: list[Epoch] = dataclasses.field(default_factory=list)
    main_cpu: float = 0.0  # this process (time.process_time), summed over the timed epochs
    loader_cpu: float = 0.0  # local workers, or the server process tree, summed likewise
    main_rss: int = 0  # this process, bytes: the peak over the timed epochs
    loader_rss: int = 0  # local workers, or the server process tree, summed: the peak likewise

    def median(self, value: Callable[[Epoch], float]) -> float:
        return statistics.median(value(e) for e in self.epochs)

    def timed_epoch(
        self,
        loader: Iterable[Any],
        loader_cpu: Callable[[], float],
        loader_pids: Callable[[], list[int]],
    ) -> None:
        """Runs one timed epoch of `loader` and adds its numbers to this side."""
        cpu, loader_before = time.process_time(), loader_cpu()
        with PeakRss(loader_pids) as rss:
            self.epochs.append(run_epoch(loader))
        self.main_cpu += time.process_time() - cpu - rss.cpu
        self.loader_cpu += loader_cpu() - loader_before
        self.main_rss = max(self.main_rss, rss.client)
        self.loader_rss = max(self.loader_rss, rss.server)


# CLIENT_THREADS_WHY: the training loop here only touches one sample per batch (touch()), but
# torch's intra-op pool (one thread per core by default) keeps spinning for a while after each
# op: measured per thread in /proc, 2.2-2.9 CPU s of every 5 s on this 2-core machine, taken from
# the workers and the server of every side alike. A trainer's loop runs on its own cores (and
# on the GPU); here it shares two with its loader, so by default it runs torch on one thread.
# `--client-threads 2` shows what torch's default does.

# The loaders each workload runs, in each round's order: label -> RemoteLoader transport
# (None: torch's DataLoader in this process).
LOADERS: dict[str, str | None] = {"local": None, "grpc": "grpc", "tcp": "tcp", "shm": "auto"}
REMOTE = [label for label, transport in LOADERS.items() if transport is not None]


def ratios(local: Side, remote: Side) -> list[float]:
    """Remote batches/s over local batches/s, round by round."""
    return [
        r.batches_per_s / loc.batches_per_s
        for loc, r in zip(local.epochs, remote.epochs, strict=True)
    ]


# --- the loader server -----------------------------------------------------------------------


def _read_banner(proc: subprocess.Popen[str], what: str) -> str:
    """The first stdout line of `proc`, waiting at most STARTUP_TIMEOUT; kills it on failure."""
    if proc.stdout is None:
        raise ValueError(f"{what} was started without stdout=PIPE")
    ready, _, _ = select.select([proc.stdout], [], [], STARTUP_TIMEOUT)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        proc.communicate()
        raise RuntimeError(
            f"{what} printed nothing within {STARTUP_TIMEOUT:g} s (exit code "
            f"{proc.returncode}); its stderr is above"
        )
    return line


def _port(line: str, what: str) -> int:
    match = re.search(r"on port (\d+)", line)
    if not match:
        raise RuntimeError(f"{what}: expected 'serving ... on port N', got {line!r}")
    return int(match.group(1))


def start_loader_server(
    dataset: str, kwargs: dict[str, Any], batch_size: int, workers: int
) -> tuple[subprocess.Popen[str], str]:
    """`remote-loader serve` for one dataset as a separate process; returns it and its address."""
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
    return start_server(flags)


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


def compare(name: str, args: argparse.Namespace, bar: tqdm[Any]) -> dict[str, Side]:
    """Warm-up, then `args.rounds` alternating local/grpc/shm epochs of workload `name`."""
    path = WORKLOADS[name]
    kwargs = dataset_kwargs(name, args)
    bar.set_description(f"{name}: starting the server")
    local_loader = DataLoader(
        resolve(path, "dataset")(**kwargs),
        batch_size=args.batch_size,
        num_workers=args.workers,
        persistent_workers=True,
        multiprocessing_context="forkserver",
    )
    server, address = start_loader_server(path, kwargs, args.batch_size, args.workers)
    sides = {label: Side() for label in LOADERS}

    # Local: this process's descendants but the server's tree: the fork server and its workers.
    def workers() -> list[int]:
        return tree_pids(os.getpid(), include_root=False, exclude=[server.pid])

    def workers_cpu() -> float:
        return tree_cpu(os.getpid(), include_root=False, exclude=[server.pid])

    # Remote: the server, its fork server and its workers.
    def served() -> list[int]:
        return tree_pids(server.pid)

    def served_cpu() -> float:
        return tree_cpu(server.pid)

    def epoch(what: str) -> None:
        bar.set_description(f"{name}: {what}")

    remote_loaders = {
        label: RemoteLoader(address, device="cpu", transport=transport)
        for label, transport in LOADERS.items()
        if transport is not None
    }
    loaders: dict[str, Iterable[Any]] = {"local": local_loader, **remote_loaders}
    try:
        for label, loader in loaders.items():
            epoch(f"warm-up, {label}")
            run_epoch(loader)  # local: starts the fork server and the persistent workers
            bar.update()
            if label != "local" and remote_loaders[label].last_transport != label:
                raise RuntimeError(
                    f"the {label} loader's batches came over {remote_loaders[label].last_transport}"
                )
        for r in range(1, args.rounds + 1):
            for label, loader in loaders.items():
                epoch(f"round {r}/{args.rounds}, {label}")
                if label == "local":
                    sides[label].timed_epoch(loader, workers_cpu, workers)
                else:
                    sides[label].timed_epoch(loader, served_cpu, served)
                bar.update()
    finally:
        for remote_loader in remote_loaders.values():
            remote_loader.close()
        stop_process(server)
        # The last reference: its iterator's finalizer shuts the persistent workers down.
        del local_loader, loaders
        gc.collect()
    return sides


# --- the raw grpcio ceiling ------------------------------------------------------------------


def raw_server() -> int:
    """`--raw-server`: streams N messages of RAW_MESSAGE_BYTES (N is the request) until SIGTERM."""
    payload = bytes(RAW_MESSAGE_BYTES)

    def stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        for _ in range(int(request)):
            yield payload

    service, method = RAW_METHOD.strip("/").split("/")
    handler = grpc.method_handlers_generic_handler(
        service, {method: grpc.unary_stream_rpc_method_handler(stream)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    print(f"raw grpc: serving on port {port}", flush=True)
    while not stop.wait(0.5):
        pass
    server.stop(None).wait()
    return 0


def raw_ceiling(args: argparse.Namespace, bar: tqdm[Any]) -> list[float]:
    """GB/s of `args.batches` raw messages per round from a `--raw-server` process."""
    bar.set_description("raw grpcio: starting the server")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--raw-server"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=subprocess_env())
    rates = []
    try:
        port = _port(_read_banner(proc, "the raw grpc server"), "the raw grpc server")
        options = [("grpc.max_receive_message_length", 2 * RAW_MESSAGE_BYTES)]
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            # No serializers: bytes in, bytes out, as the server's generic handler.
            call = channel.unary_stream(
                RAW_METHOD, request_serializer=None, response_deserializer=None
            )
            request = str(args.batches).encode()
            for round_ in range(args.rounds + 1):  # round 0 is the warm-up
                bar.set_description(
                    f"raw grpcio: round {round_}/{args.rounds}" if round_ else "raw grpcio: warm-up"
                )
                start = time.perf_counter()
                nbytes = sum(len(m) for m in call(request, wait_for_ready=True, timeout=600))
                if round_:
                    rates.append(nbytes / GB / (time.perf_counter() - start))
                bar.update()
    finally:
        stop_process(proc)
    return rates


# --- the chart ---------------------------------------------------------------------------------


def plot(results: dict[str, dict[str, Side]], raw: list[float], path: str, title: str) -> None:
    """Draws the ratios remote/local, batches/s and GB/s of every loader into the image `path`."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    names = list(results)
    xs = list(range(len(names)))
    colors = {"local": "tab:blue", "grpc": "tab:orange", "tcp": "tab:purple", "shm": "tab:green"}
    fig, (ax_ratio, ax_rate, ax_gb) = plt.subplots(1, 3, figsize=(16, 5.2))

    # The median as a bar per transport, each round's ratio as a dot.
    every_ratio: list[float] = []
    width = 0.8 / len(REMOTE)
    for i, label in enumerate(REMOTE):
        offset = (i - (len(REMOTE) - 1) / 2) * width
        every = {name: ratios(results[name]["local"], results[name][label]) for name in names}
        medians = [statistics.median(every[name]) for name in names]
        bars = ax_ratio.bar(
            [x + offset for x in xs], medians, width=width, color=colors[label], label=label
        )
        ax_ratio.bar_label(bars, labels=[f"{m:.2f}x" for m in medians], padding=3, fontsize=8)
        ax_ratio.plot(
            [x + offset for x, name in zip(xs, names, strict=True) for _ in every[name]],
            [r for name in names for r in every[name]],
            "k.",
            alpha=0.6,
        )
        every_ratio += [r for rs in every.values() for r in rs]
    ax_ratio.axhline(1.0, color="black", linestyle="--", linewidth=1, label="parity (1.0)")
    ax_ratio.set_ylim(0, max(1.0, *every_ratio) * 1.35)
    ax_ratio.set_title("remote / local throughput (batches/s; dots: rounds)")
    ax_ratio.legend(loc="upper left", ncols=4)

    def grouped(ax: Any, value: Callable[[Epoch], float], fmt: str) -> list[float]:
        values = []
        width = 0.8 / len(LOADERS)
        for i, label in enumerate(LOADERS):
            offset = (i - (len(LOADERS) - 1) / 2) * width
            medians = [results[name][label].median(value) for name in names]
            bars = ax.bar(
                [x + offset for x in xs], medians, width=width, color=colors[label], label=label
            )
            ax.bar_label(bars, labels=[format(v, fmt) for v in medians], padding=2, fontsize=8)
            values += medians
        return values

    rates = grouped(ax_rate, lambda e: e.batches_per_s, ".1f")
    ax_rate.set_ylim(0, max(rates) * 1.3)  # room for the labels and the legend
    ax_rate.set_title("batches/s (median)")
    ax_rate.legend(loc="upper left", ncols=4)

    gb_rates = grouped(ax_gb, lambda e: e.gb_per_s, ".2g")
    ceiling = statistics.median(raw)
    ax_gb.axhline(
        ceiling,
        color="tab:red",
        linestyle="--",
        linewidth=1,
        label=f"raw grpcio ceiling {ceiling:.2f} GB/s",
    )
    ax_gb.set_yscale("log")
    # Room above the ceiling for the legend, below the smallest bar for its base.
    ax_gb.set_ylim(min(gb_rates) / 3, max(ceiling, *gb_rates) * 60)
    ax_gb.set_title("GB/s of tensor bytes (median, log scale)")
    handles, labels = ax_gb.get_legend_handles_labels()  # the line first: put it last
    ax_gb.legend(handles[1:] + handles[:1], labels[1:] + labels[:1], loc="upper left", ncols=2)

    for ax in (ax_ratio, ax_rate, ax_gb):
        ax.set_xticks(xs, names)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- main ------------------------------------------------------------------------------------


def _table(results: dict[str, dict[str, Side]], raw: list[float], rounds: int) -> str:
    header = (
        f"{'workload':<9} {'loader':<7} {'batches/s':>10} {'GB/s':>9} {'1st batch ms':>13} "
        f"{'client CPU s':>13} {'server CPU s':>13} {'client RSS MB':>14} {'server RSS MB':>14}"
    )
    lines = [header, "-" * len(header)]
    for name, sides in results.items():
        for label, side in sides.items():
            rate = side.median(lambda e: e.batches_per_s)
            gb_rate = side.median(lambda e: e.gb_per_s)
            first_ms = side.median(lambda e: e.first_batch) * 1e3
            lines.append(
                f"{name:<9} {label:<7} {rate:>10.1f} {gb_rate:>9.3g} {first_ms:>13.1f} "
                f"{side.main_cpu / rounds:>13.2f} {side.loader_cpu / rounds:>13.2f} "
                f"{side.main_rss / MB:>14.0f} {side.loader_rss / MB:>14.0f}"
            )
        for label in REMOTE:
            ratio = statistics.median(ratios(sides["local"], sides[label]))
            lines.append(f"{name:<9} {label + '/local throughput':<35} {ratio:.2f}x")
    lines += [
        f"raw grpcio ceiling ({RAW_MESSAGE_BYTES >> 20} MiB bytes messages, loopback): "
        f"{statistics.median(raw):.3f} GB/s",
        "",
        "local: torch's DataLoader in this process. grpc, tcp, shm: RemoteLoader inside gRPC "
        "messages, on a TCP data",
        "connection beside the gRPC stream, and through the shared-memory ring.",
        "client: this process, which reads the batches (all sides). server: local, the "
        "DataLoader's fork server and",
        "workers; remote, the server process, its fork server and its workers. CPU s: per "
        "epoch. RSS MB: the peak over",
        "the timed epochs, summed over the processes (memory they share is counted in each "
        "that maps it).",
    ]
    return "\n".join(lines)


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
        default=1,
        help="torch intra-op threads of this process, the training loop of every side "
        "(default 1; see CLIENT_THREADS_WHY)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 10 batches, 1 round")
    parser.add_argument("--raw-server", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.raw_server:
        return raw_server()
    if args.quick:
        args.batches, args.rounds = 10, 1
    for flag in ("batch_size", "workers", "rounds", "batches", "client_threads"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be at least 1")
    if args.plot is not None:
        # Checked now, not after minutes of measuring.
        if importlib.util.find_spec("matplotlib") is None:
            raise SystemExit("--plot needs matplotlib: pip install '.[bench]'")
        if not Path(args.plot).resolve().parent.is_dir():
            raise SystemExit(f"--plot: no such directory for {args.plot!r}")
    torch.set_num_threads(args.client_threads)  # CLIENT_THREADS_WHY
    names: list[str] = args.workloads
    demo = ""
    if "demo" in names:
        demo = f" (demo: its {DEMO_SAMPLES} images, {batches_per_epoch('demo', args)} batches)"
    settings = (
        f"batch {args.batch_size}, {args.workers} workers, {args.batches} batches/epoch{demo}, "
        f"{args.rounds} timed round(s), {args.client_threads} client thread(s)"
    )
    print(
        f"DataLoader in-process vs RemoteLoader over loopback: {settings} "
        f"(medians; CPU s per epoch)\n{os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"grpcio {grpc.__version__}\n",
        flush=True,
    )
    if "demo" in names:
        demo_folder()  # generated once into the cache, before either side reads it
    # Warm-ups and rounds of every loader of every workload, and of the raw ceiling.
    epochs = (len(names) * len(LOADERS) + 1) * (args.rounds + 1)
    with tqdm(total=epochs, unit="epoch", file=sys.stderr, leave=False) as bar:
        results = {name: compare(name, args, bar) for name in names}
        raw = raw_ceiling(args, bar)
    print(_table(results, raw, args.rounds))
    if args.plot is not None:
        plot(
            results,
            raw,
            args.plot,
            f"DataLoader in-process vs RemoteLoader over loopback: {settings}; "
            f"{os.cpu_count()} CPUs, torch {torch.__version__}, grpcio {grpc.__version__}",
        )
        print(f"\nchart: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
