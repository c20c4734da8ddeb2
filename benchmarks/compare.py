"""Throughput of torch's DataLoader in this process vs RemoteLoader from a server on loopback.

For each workload in benchmarks/workloads.py (`Images`: transport-bound, `Heavy`: compute-bound)
the same dataset, batch size and worker count run both ways: a local `DataLoader` (forkserver,
persistent workers) and a `RemoteLoader` against `remote-loader serve` started as a separate
process. Timed rounds alternate local/remote after one untimed warm-up epoch each; the table
shows medians over rounds (batches/s, GB/s of tensor bytes, time to the first batch of an
epoch), the ratio remote/local, and CPU seconds per epoch: this process for both, the local
workers or the whole server process tree. A raw grpcio stream of 4 MiB `bytes` messages on
loopback, measured in the same run, is the transport ceiling. Every number is measured now.

Run from the repository root:

    python benchmarks/compare.py [--batch-size 64] [--workers 2] [--rounds 3] [--batches 40]
    python benchmarks/compare.py --quick        # smoke run: 10 batches, 1 round
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
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

from remote_loader.client import RemoteLoader
from remote_loader.server.cli import spawn_serve
from remote_loader.server.spec import resolve

ROOT = Path(__file__).resolve().parents[1]
# The workloads are imported by path ("benchmarks.workloads:Images") here, in the local
# DataLoader's workers and in the server's; benchmarks/ is not a package on any default path.
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

WORKLOADS = {
    "images": "benchmarks.workloads:Images",
    "heavy": "benchmarks.workloads:Heavy",
}
# The raw ceiling's message: the size of the frames RemoteLoader's server sends by default.
RAW_MESSAGE_BYTES = 4 * 1024 * 1024
RAW_METHOD = "/bench.Raw/Stream"
# Seconds a server process may take to print its port (it imports torch and starts workers).
STARTUP_TIMEOUT = 120.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
GB = 1e9


def subprocess_env() -> dict[str, str]:
    """This environment with the repository root first on PYTHONPATH."""
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


# --- measuring -------------------------------------------------------------------------------


def _process_table() -> dict[int, tuple[int, float]]:
    """pid -> (ppid, utime + stime in seconds) of every process in /proc."""
    table: dict[int, tuple[int, float]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                text = f.read()
        except OSError:
            continue  # exited while we looked
        # The command name (field 2) may hold spaces and parentheses: split after its last ")".
        fields = text[text.rindex(")") + 2 :].split()
        ppid, utime, stime = int(fields[1]), int(fields[11]), int(fields[12])
        table[int(entry.name)] = (ppid, (utime + stime) / CLOCK_TICKS)
    return table


def tree_cpu(root: int, *, include_root: bool = True, exclude: Iterable[int] = ()) -> float:
    """CPU seconds of `root` and its live descendants, skipping the subtrees of `exclude`."""
    table = _process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    skip = set(exclude)
    total = table[root][1] if include_root and root in table else 0.0
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in skip:
                total += table[child][1]
                todo.append(child)
    return total


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
    """The timed epochs of one loader and the CPU seconds they cost."""

    epochs: list[Epoch] = dataclasses.field(default_factory=list)
    main_cpu: float = 0.0  # this process (time.process_time), summed over the timed epochs
    loader_cpu: float = 0.0  # local workers, or the server process tree, summed likewise

    def median(self, value: Callable[[Epoch], float]) -> float:
        return statistics.median(value(e) for e in self.epochs)


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
    dataset: str, n: int, batch_size: int, workers: int
) -> tuple[subprocess.Popen[str], str]:
    """`remote-loader serve` for one dataset as a separate process; returns it and its address."""
    flags = [
        "--dataset",
        dataset,
        "--dataset-kwargs",
        json.dumps({"n": n}),
        "--batch-size",
        str(batch_size),
        "--num-workers",
        str(workers),
        "--persistent-workers",
    ]
    # stderr is inherited: server warnings and errors show up beside the table.
    proc, port = spawn_serve(flags, env=subprocess_env())
    return proc, f"127.0.0.1:{port}"


def stop_process(proc: subprocess.Popen[str]) -> None:
    """SIGTERM, then wait (closing its pipes); SIGKILL if it does not go in 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


# --- local vs remote -------------------------------------------------------------------------


def compare(name: str, args: argparse.Namespace) -> tuple[Side, Side]:
    """Warm-up, then `args.rounds` alternating local/remote epochs of workload `name`."""
    path = WORKLOADS[name]
    n = args.batches * args.batch_size
    local_loader = DataLoader(
        resolve(path, "dataset")(n=n),
        batch_size=args.batch_size,
        num_workers=args.workers,
        persistent_workers=True,
        multiprocessing_context="forkserver",
    )
    server, address = start_loader_server(path, n, args.batch_size, args.workers)
    local, remote = Side(), Side()

    def workers_cpu() -> float:
        # This process's descendants but the server's tree: the fork server and its workers.
        return tree_cpu(os.getpid(), include_root=False, exclude=[server.pid])

    try:
        with RemoteLoader(address, device="cpu") as remote_loader:
            run_epoch(local_loader)  # starts the fork server and the persistent workers
            run_epoch(remote_loader)
            for _ in range(args.rounds):
                cpu, workers = time.process_time(), workers_cpu()
                local.epochs.append(run_epoch(local_loader))
                local.main_cpu += time.process_time() - cpu
                local.loader_cpu += workers_cpu() - workers

                cpu, served = time.process_time(), tree_cpu(server.pid)
                remote.epochs.append(run_epoch(remote_loader))
                remote.main_cpu += time.process_time() - cpu
                remote.loader_cpu += tree_cpu(server.pid) - served
    finally:
        stop_process(server)
        # The last reference: its iterator's finalizer shuts the persistent workers down.
        del local_loader
        gc.collect()
    return local, remote


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


def raw_ceiling(args: argparse.Namespace) -> list[float]:
    """GB/s of `args.batches` raw messages per round from a `--raw-server` process."""
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
                start = time.perf_counter()
                nbytes = sum(len(m) for m in call(request, wait_for_ready=True, timeout=600))
                if round_:
                    rates.append(nbytes / GB / (time.perf_counter() - start))
    finally:
        stop_process(proc)
    return rates


# --- main ------------------------------------------------------------------------------------


def _table(results: dict[str, tuple[Side, Side]], raw: list[float], rounds: int) -> str:
    header = (
        f"{'workload':<9} {'loader':<7} {'batches/s':>10} {'GB/s':>9} {'1st batch ms':>13} "
        f"{'main CPU s':>11} {'loader CPU s':>13}  loader CPU is"
    )
    lines = [header, "-" * len(header)]
    for name, (local, remote) in results.items():
        for label, side, whose in (
            ("local", local, "DataLoader workers"),
            ("remote", remote, "server + its workers"),
        ):
            rate = side.median(lambda e: e.batches_per_s)
            gb_rate = side.median(lambda e: e.gb_per_s)
            first_ms = side.median(lambda e: e.first_batch) * 1e3
            lines.append(
                f"{name:<9} {label:<7} {rate:>10.1f} {gb_rate:>9.3g} {first_ms:>13.1f} "
                f"{side.main_cpu / rounds:>11.2f} {side.loader_cpu / rounds:>13.2f}  {whose}"
            )
        ratio = statistics.median(
            r.batches_per_s / loc.batches_per_s
            for loc, r in zip(local.epochs, remote.epochs, strict=True)
        )
        lines.append(f"{name:<9} {'remote/local throughput':<35} {ratio:.2f}x")
    lines.append(
        f"raw grpcio ceiling ({RAW_MESSAGE_BYTES >> 20} MiB bytes messages, loopback): "
        f"{statistics.median(raw):.3f} GB/s"
    )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="num_workers, both sides")
    parser.add_argument("--rounds", type=int, default=3, help="timed epochs per loader")
    parser.add_argument("--batches", type=int, default=40, help="batches per epoch")
    parser.add_argument("--quick", action="store_true", help="smoke run: 10 batches, 1 round")
    parser.add_argument("--raw-server", action="store_true", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.raw_server:
        return raw_server()
    if args.quick:
        args.batches, args.rounds = 10, 1
    for flag in ("batch_size", "workers", "rounds", "batches"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be at least 1")
    print(
        f"DataLoader in-process vs RemoteLoader over loopback: batch {args.batch_size}, "
        f"{args.workers} workers, {args.batches} batches/epoch, {args.rounds} timed round(s) "
        f"(medians; CPU s per epoch)\n{os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"grpcio {grpc.__version__}\n",
        flush=True,
    )
    results = {name: compare(name, args) for name in WORKLOADS}
    raw = raw_ceiling(args)
    print(_table(results, raw, args.rounds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
