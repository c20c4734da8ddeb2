"""Server CPU for N broadcast consumers of one job vs 1: is each batch made once for all?

With `sharing="broadcast"` every consumer of a job receives the identical sequence of batches,
and each batch is loaded, collated and encoded once for all of them; only handing it over is
paid per consumer (same host, zero-copy: a small Frame per batch naming the worker's slot, which
each consumer copies out itself; over a data connection: the kernel's copy into the socket).
This benchmark starts `remote-loader serve` as a separate process (persistent workers) on a
workload from benchmarks/workloads.py (or the built-in demo image folder) and max(`--consumers`)
consumer processes (spawn), each a `RemoteLoader` on the CPU with `--transport` ("auto": shared
memory here; "tcp": a data connection, as from another host), holding each batch `--step-ms` (a
trainer's step; 0: reading as fast as it can). After one untimed warm-up epoch read by all of
them, every round reads `--epochs` epochs as a fresh production (a job name of its own) for 1
consumer and then for each N of `--consumers`:

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
                                   [--epochs 2] [--rounds 3] [--step-ms 0]
                                   [--batch-size 64] [--workers 2] [--samples N]
    python benchmarks/broadcast.py --quick      # smoke run: 1 epoch, 1 round, few samples
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import torch
from tqdm import tqdm

from remote_loader.server.datasets import DEMO_DATASET

# benchmarks/ is not a package on any default path; the server's workers import the workloads
# as benchmarks.workloads (see benchmarks/processes.py).
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

try:
    import psutil  # type: ignore[import-untyped, unused-ignore]
except ModuleNotFoundError:
    raise SystemExit(
        "benchmarks/broadcast.py counts the server's CPU with psutil: pip install '.[bench]'"
    ) from None

from benchmarks import processes  # noqa: E402
from benchmarks.consumers import Consumers, Order, Report, ServerCpu  # noqa: E402

WORKLOADS = {
    "heavy": "benchmarks.workloads:Heavy",
    "images": "benchmarks.workloads:Images",
    "demo": DEMO_DATASET,
}
TARGET_RATIO = 1.3
TARGET_CONSUMERS = 4  # the target is for 4 consumers
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
        Order(
            job,
            rank,
            n,
            first_epoch,
            epochs,
            args.transport,
            args.data_connections,
            args.step_ms / 1000,
        )
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
    parser.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="each consumer holds each batch this long, as a trainer's step would (default 0: "
        "it reads as fast as it can)",
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
    if not args.step_ms >= 0:
        raise SystemExit("--step-ms must be at least 0")
    samples = "512 (the demo folder)" if args.workload == "demo" else str(args.samples)
    print(
        f"broadcast sharing, server CPU for {args.consumers} consumers vs 1 over "
        f"transport={args.transport} (data_connections={args.data_connections}): workload "
        f"{args.workload} ({WORKLOADS[args.workload]}), {samples} samples, batch "
        f"{args.batch_size}, {args.workers} server workers, {args.epochs} epoch(s) per "
        f"production, {args.rounds} round(s), consumer step {args.step_ms:g} ms\n"
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, "
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
