"""Server CPU for N broadcast consumers of one job vs 1: is each batch made once for all?

With `sharing="broadcast"` every consumer of a job receives the identical sequence of batches,
and each batch is loaded, collated and encoded once for all of them; only sending it is paid
per consumer (same host, zero-copy: a small message; over a data connection: the kernel's copy
into the socket). This benchmark starts `remote-loader serve` as a separate process (persistent
workers) on a workload from benchmarks/workloads.py (or the built-in demo image folder) and
max(`--consumers`) consumer processes (spawn), each a `RemoteLoader` on the CPU with
`--transport` ("auto": shared memory here; "tcp": a data connection, as from another host).
After one untimed warm-up epoch read by all of them, every round reads `--epochs` epochs as a
fresh production (a job name of its own) for 1 consumer and then for each N of `--consumers`:

  (a) 1 consumer:  sharing="broadcast", world_size=1
  (b) N consumers: sharing="broadcast", world_size=N, ranks 0..N-1, one job

and measures the CPU seconds of the server process tree (the server, its fork server and its
workers: psutil user + system, after minus before), the wall seconds from "go" to the last
consumer's end, the batches each consumer received and whether they all received the same
batches (a digest of every batch; the 1-consumer run reads the same epochs, so its digest must
match too). The table shows each round and the medians of the ratios N/1; the target for the
server CPU ratio is at most 1.3.

Run from the repository root:

    python benchmarks/broadcast.py [--workload heavy|images|demo] [--consumers 2,4,8]
                                   [--transport auto|tcp|grpc] [--data-connections N]
                                   [--epochs 2] [--rounds 3]
                                   [--batch-size 64] [--workers 2] [--samples N]
    python benchmarks/broadcast.py --quick      # smoke run: 1 epoch, 1 round, few samples
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import multiprocessing
import multiprocessing.connection
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import psutil  # type: ignore[import-untyped, unused-ignore]
import torch
from tqdm import tqdm

from remote_loader.client import RemoteLoader
from remote_loader.server.datasets import DEMO_DATASET

# benchmarks/ is not a package on any default path; the server's workers import the workloads
# as benchmarks.workloads (see benchmarks/processes.py).
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import processes  # noqa: E402

WORKLOADS = {
    "heavy": "benchmarks.workloads:Heavy",
    "images": "benchmarks.workloads:Images",
    "demo": DEMO_DATASET,
}
TARGET_RATIO = 1.3
TARGET_CONSUMERS = 4  # the target is for 4 consumers
# Seconds a consumer may wait for one batch, and for the server when it connects.
BATCH_TIMEOUT = 300.0
CONNECT_TIMEOUT = 60.0
# Seconds the benchmark waits for a consumer's answer (its epochs, or getting ready).
REPLY_TIMEOUT = 900.0
# Tensors up to this size are hashed whole; bigger ones by their first and last bytes, so that
# the consumers' own CPU (which shares the machine with the server) stays small.
HASH_WHOLE_BYTES = 1 << 20
HASH_EDGE_BYTES = 64 * 1024


# --- measuring the server ----------------------------------------------------------------------


def _process_cpu(proc: Any) -> float:
    """User + system seconds of a psutil.Process, including its children it has reaped."""
    t = proc.cpu_times()
    return float(t.user + t.system + t.children_user + t.children_system)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """CPU seconds of each process of the server's tree at one moment."""

    main: float  # the server process itself
    others: dict[int, float]  # pid -> seconds: fork server, workers, resource tracker

    @staticmethod
    def take(server: Any) -> Snapshot:
        others = {}
        for child in server.children(recursive=True):
            try:
                others[child.pid] = _process_cpu(child)
            except psutil.NoSuchProcess:
                continue  # exited while we looked
        return Snapshot(_process_cpu(server), others)


@dataclasses.dataclass(frozen=True)
class ServerCpu:
    """What the server tree spent between two snapshots."""

    main: float
    others: float
    changed: bool  # a process of the tree started or ended in between

    @property
    def total(self) -> float:
        return self.main + self.others

    @staticmethod
    def between(before: Snapshot, after: Snapshot) -> ServerCpu:
        others = sum(cpu - before.others.get(pid, 0.0) for pid, cpu in after.others.items())
        return ServerCpu(after.main - before.main, others, set(before.others) != set(after.others))


# --- consumers (each its own process) ------------------------------------------------------------


def _digest_update(digest: Any, batch: Any) -> None:
    """Folds a batch into `digest`: shapes, dtypes, and the bytes (or, when big, their ends)."""
    if isinstance(batch, torch.Tensor):
        digest.update(f"{batch.dtype}{tuple(batch.shape)}".encode())
        flat = batch.detach().contiguous().reshape(-1).view(torch.uint8)
        if flat.numel() <= HASH_WHOLE_BYTES:
            digest.update(flat.numpy().tobytes())
        else:
            digest.update(flat[:HASH_EDGE_BYTES].numpy().tobytes())
            digest.update(flat[-HASH_EDGE_BYTES:].numpy().tobytes())
    elif isinstance(batch, list | tuple):
        digest.update(b"(")
        for item in batch:
            _digest_update(digest, item)
        digest.update(b")")
    elif isinstance(batch, dict):
        for key in sorted(batch, key=repr):
            digest.update(repr(key).encode())
            _digest_update(digest, batch[key])
    else:
        digest.update(repr(batch).encode())


@dataclasses.dataclass(frozen=True)
class Order:
    """What one consumer reads in one production."""

    job: str
    rank: int
    world_size: int
    first_epoch: int
    epochs: int
    transport: str
    data_connections: int | None  # the client's (None: its default)


@dataclasses.dataclass(frozen=True)
class Report:
    """What one consumer received: batches per epoch and a digest of all of them."""

    batches: tuple[int, ...]
    digest: str
    seconds: float
    transport: str | None  # how the last batch came


def consumer_main(conn: multiprocessing.connection.Connection, address: str) -> None:
    """A consumer process: for each Order, connects, says "ready", waits for "go", reads."""
    with conn:
        try:
            while True:
                order = conn.recv()
                if order is None:
                    return
                assert isinstance(order, Order)
                with RemoteLoader(
                    address,
                    sharing="broadcast",
                    job=order.job,
                    rank=order.rank,
                    world_size=order.world_size,
                    device="cpu",
                    transport=order.transport,
                    data_connections=order.data_connections,
                    timeout=BATCH_TIMEOUT,
                    connect_timeout=CONNECT_TIMEOUT,
                ) as loader:
                    conn.send("ready")
                    if conn.recv() != "go":
                        return
                    start = time.perf_counter()
                    loader.set_epoch(order.first_epoch)
                    digest = hashlib.blake2b(digest_size=16)
                    counts = []
                    for _ in range(order.epochs):
                        n = 0
                        for batch in loader:
                            _digest_update(digest, batch)
                            n += 1
                        counts.append(n)
                    seconds = time.perf_counter() - start
                    report = Report(
                        tuple(counts), digest.hexdigest(), seconds, loader.last_transport
                    )
                    conn.send(report)
        except (KeyboardInterrupt, EOFError, BrokenPipeError):
            return  # the benchmark is stopping
        except Exception:
            with contextlib.suppress(OSError):
                conn.send(("error", traceback.format_exc()))


class Consumers:
    """`n` consumer processes started with the spawn context, each behind a pipe."""

    def __init__(self, n: int, address: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[multiprocessing.connection.Connection] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        for rank in range(n):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=consumer_main, args=(theirs, address), name=f"consumer-{rank}", daemon=True
            )
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)

    def _reply(self, rank: int) -> Any:
        conn = self.conns[rank]
        if not conn.poll(REPLY_TIMEOUT):
            raise RuntimeError(f"consumer {rank} did not answer within {REPLY_TIMEOUT:g} s")
        try:
            reply = conn.recv()
        except EOFError as exc:
            code = self.procs[rank].exitcode
            raise RuntimeError(f"consumer {rank} exited (exit code {code})") from exc
        if isinstance(reply, tuple) and reply and reply[0] == "error":
            raise RuntimeError(f"consumer {rank} failed:\n{reply[1]}")
        return reply

    def read(self, orders: Sequence[Order], server: Any) -> tuple[list[Report], float, ServerCpu]:
        """Consumers 0..len(orders)-1 read their orders together; returns their reports, the
        wall seconds from "go" to the last report, and the server's CPU in between."""
        for rank, order in enumerate(orders):
            self.conns[rank].send(order)
        for rank in range(len(orders)):
            if self._reply(rank) != "ready":
                raise RuntimeError(f"consumer {rank}: expected 'ready'")
        before = Snapshot.take(server)
        start = time.perf_counter()
        for rank in range(len(orders)):
            self.conns[rank].send("go")
        reports = []
        for rank in range(len(orders)):
            report = self._reply(rank)
            if not isinstance(report, Report):
                raise RuntimeError(f"consumer {rank}: expected a report, got {report!r}")
            reports.append(report)
        wall = time.perf_counter() - start
        return reports, wall, ServerCpu.between(before, Snapshot.take(server))

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
        for conn in self.conns:
            conn.close()


# --- the loader server -------------------------------------------------------------------------


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    """`remote-loader serve` for the workload, as a separate process; returns it and its address."""
    if args.workload == "demo":
        kwargs: dict[str, Any] = {"return_index": True}
    else:
        kwargs = {"n": args.samples}
    flags = [
        "--dataset",
        WORKLOADS[args.workload],
        "--name",
        f"bench-{args.workload}",
        "--dataset-kwargs",
        json.dumps(kwargs),
        "--batch-size",
        str(args.batch_size),
        "--num-workers",
        str(args.workers),
        "--shuffle",
    ]
    if args.workers > 0:
        flags.append("--persistent-workers")
    if args.broadcast_window is not None:
        flags += ["--broadcast-window", str(args.broadcast_window)]
    return processes.start_server(flags)


# --- rounds ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Production:
    """One timed production: `consumers` consumers reading the same epochs of one job."""

    consumers: int
    reports: list[Report]
    wall: float
    cpu: ServerCpu

    @property
    def batches(self) -> int:
        """Batches each consumer received (the first's; `same_count` says if all agree)."""
        return sum(self.reports[0].batches)

    @property
    def same_count(self) -> bool:
        return len({r.batches for r in self.reports}) == 1

    @property
    def digests(self) -> set[str]:
        return {r.digest for r in self.reports}

    @property
    def transports(self) -> set[str | None]:
        return {r.transport for r in self.reports}


@dataclasses.dataclass(frozen=True)
class Round:
    single: Production
    groups: dict[int, Production]  # by number of consumers

    def cpu_ratio(self, n: int) -> float:
        return ratio(self.groups[n].cpu.total, self.single.cpu.total)

    def wall_ratio(self, n: int) -> float:
        return ratio(self.groups[n].wall, self.single.wall)

    def same_batches(self, n: int) -> bool:
        """Every consumer of both productions got the identical sequence of batches."""
        group = self.groups[n]
        return (
            self.single.same_count
            and group.same_count
            and self.single.batches == group.batches
            and len(self.single.digests | group.digests) == 1
        )


def ratio(a: float, b: float) -> float:
    """a / b, NaN when b is 0 (a run too short for the clock's 10 ms ticks)."""
    return a / b if b > 0 else float("nan")


def orders(
    job: str, n: int, first_epoch: int, epochs: int, args: argparse.Namespace
) -> list[Order]:
    return [
        Order(job, rank, n, first_epoch, epochs, args.transport, args.data_connections)
        for rank in range(n)
    ]


def run(args: argparse.Namespace) -> tuple[list[Round], ServerCpu, float]:
    """Warm-up, then `args.rounds` rounds of 1 and N consumers; also the warm-up's numbers."""
    server, address = start_server(args)
    consumers: Consumers | None = None
    rounds: list[Round] = []
    try:
        tree = psutil.Process(server.pid)
        most = max(args.consumers)
        consumers = Consumers(most, address)
        total = 1 + (1 + len(args.consumers)) * args.rounds
        with tqdm(total=total, unit="run", desc="warm-up", leave=False) as bar:
            # Epoch 0, read by everyone: workers, code paths and the consumers' imports warm.
            warm = orders("bench-warmup", most, 0, 1, args)
            _, warm_wall, warm_cpu = consumers.read(warm, tree)
            bar.update(1)
            for r in range(args.rounds):
                # Fresh epochs for each round; every production reads the same ones, as another
                # job each.
                first = 1 + r * args.epochs
                productions = {}
                for n in (1, *args.consumers):
                    bar.set_description(f"round {r + 1}/{args.rounds}: {n} consumer(s)")
                    job = orders(f"bench-{r}-{n}", n, first, args.epochs, args)
                    productions[n] = Production(n, *consumers.read(job, tree))
                    bar.update(1)
                single = productions.pop(1)
                rounds.append(Round(single, productions))
    finally:
        if consumers is not None:
            consumers.close()
        processes.stop_process(server)
    return rounds, warm_cpu, warm_wall


# --- main --------------------------------------------------------------------------------------


def _times(value: float, width: int) -> str:
    """A ratio as "1.23x" right-aligned in `width`; "n/a" when it could not be measured."""
    text = "n/a" if value != value else f"{value:.2f}x"  # NaN != NaN
    return f"{text:>{width}}"


def _table(rounds: list[Round], groups: list[int]) -> str:
    header = (
        f"{'round':>5} {'consumers':>9} {'batches each':>12} {'same':>5} {'wall s':>8} "
        f"{'server CPU s':>12} {'= main':>8} {'+ workers':>9}  transport"
    )
    lines = [header, "-" * len(header)]
    for i, rnd in enumerate(rounds, 1):
        for prod in (rnd.single, *rnd.groups.values()):
            flag = "" if not prod.cpu.changed else "  (server processes changed)"
            how = ",".join(sorted(str(t) for t in prod.transports))
            lines.append(
                f"{i:>5} {prod.consumers:>9} {prod.batches:>12} "
                f"{'yes' if prod.same_count and len(prod.digests) == 1 else 'NO':>5} "
                f"{prod.wall:>8.2f} {prod.cpu.total:>12.2f} {prod.cpu.main:>8.2f} "
                f"{prod.cpu.others:>9.2f}  {how}{flag}"
            )
        for n, group in rnd.groups.items():
            lines.append(
                f"{i:>5} {f'{n}/1':>9} {'':>12} {'yes' if rnd.same_batches(n) else 'NO':>5} "
                f"{_times(rnd.wall_ratio(n), 8)} {_times(rnd.cpu_ratio(n), 12)} "
                f"{_times(ratio(group.cpu.main, rnd.single.cpu.main), 8)} "
                f"{_times(ratio(group.cpu.others, rnd.single.cpu.others), 9)}"
            )
    lines.append("")
    for n in groups:
        cpu_ratio = statistics.median(r.cpu_ratio(n) for r in rounds)
        wall_ratio = statistics.median(r.wall_ratio(n) for r in rounds)
        target = ""
        if n == TARGET_CONSUMERS:
            verdict = "PASS" if cpu_ratio <= TARGET_RATIO else "MISS"
            if cpu_ratio != cpu_ratio:  # NaN
                verdict = "n/a (too short to measure; run without --quick)"
            target = f"   target <= {TARGET_RATIO}: {verdict}"
        lines.append(
            f"{n} consumers / 1 (median of {len(rounds)}): server CPU {cpu_ratio:.2f}x, "
            f"wall {wall_ratio:.2f}x{target}"
        )
    same = all(r.same_batches(n) for r in rounds for n in groups)
    lines.append(f"every consumer received the identical batches: {'yes' if same else 'NO'}")
    return "\n".join(lines)


def _consumers(text: str) -> list[int]:
    try:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 2,4,8, got {text!r}") from None
    if not counts or counts[0] < 2:
        raise argparse.ArgumentTypeError(f"each N must be at least 2 (1 is always run): {text!r}")
    return counts


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="heavy")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="the server's num_workers")
    parser.add_argument(
        "--samples",
        type=int,
        default=1280,
        help="dataset length (heavy, images; the demo folder has a fixed 512 images)",
    )
    parser.add_argument(
        "--consumers",
        type=_consumers,
        default=[2, 4, 8],
        help="the broadcast group sizes N to compare with 1 (default 2,4,8)",
    )
    parser.add_argument(
        "--transport",
        choices=("auto", "tcp", "grpc"),
        default="auto",
        help='the consumers\' transport ("auto": shared memory on this host)',
    )
    parser.add_argument(
        "--data-connections",
        type=int,
        default=None,
        help="each consumer's data_connections over tcp (default: RemoteLoader's)",
    )
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per production")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--broadcast-window", type=int, default=None, help="the server's (default: its own)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 8 batches of samples, 1 epoch, 1 round"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.samples, args.epochs, args.rounds = 8 * args.batch_size, 1, 1
    for flag in ("batch_size", "samples", "epochs", "rounds"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be at least 1")
    if args.workers < 0:
        raise SystemExit("--workers must be at least 0")
    samples = "512 (the demo folder)" if args.workload == "demo" else str(args.samples)
    print(
        f"broadcast sharing, server CPU for {args.consumers} consumers vs 1 over "
        f"transport={args.transport} (data_connections={args.data_connections}): workload "
        f"{args.workload} ({WORKLOADS[args.workload]}), {samples} samples, batch "
        f"{args.batch_size}, {args.workers} server workers, {args.epochs} epoch(s) per "
        f"production, {args.rounds} round(s)\n{os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"grpcio {grpc.__version__}; server CPU = the server process (main) + its fork server "
        "and workers\n",
        flush=True,
    )
    try:
        rounds, warm_cpu, warm_wall = run(args)
    except KeyboardInterrupt:
        print("interrupted; the server and the consumers are stopped", file=sys.stderr)
        return 130
    print(
        f"warm-up (epoch 0, {max(args.consumers)} consumers): {warm_wall:.2f} s wall, "
        f"{warm_cpu.total:.2f} server CPU s\n"
    )
    print(_table(rounds, args.consumers))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
