r"""The headline figure: a training loop on a CPU-starved host, fed by a local `DataLoader` on
that host or by remote-loader from a server on another host, side by side.

    python benchmarks/headline.py [--trainers 1,2,4] [--quota 0.25] [--headroom 0.5]
                                  [--seconds 24] [--rounds 4] [--plot benchmarks/headline.png]

As root: network namespaces, a bridge and cgroup v1's cpu and cpuacct controllers
(benchmarks/cpuhost.py). Ctrl-C or an error still removes every namespace and cgroup it made.

Pipeline: what torchvision users write for ImageNet, with PIL, numpy and torch (torchvision does
not load beside this project's CPU torch wheel): benchmarks/jpegs.py's JpegFolder over `--images`
JPEGs of `--image-size` pixels that this script writes into a temporary folder, each decoded,
randomly cropped (8-100 % of the area), resized to `--crop`, flipped half the time and
normalised; batches of `--batch-size` float32 crops. A step is a fixed wait (`time.sleep`): an
accelerator's step takes no host CPU.

Hosts: the trainers' host, capped at `--quota` cores (a node with GPUs and few CPUs: every
trainer of a count runs there, so its cores stay the same as trainers are added), and the
server's host, uncapped: it has what the trainers' host leaves of the machine, less what other
people's processes take. Nothing but TCP joins them (private /dev/shm each).

Loaders: `local`, a `DataLoader` with `--workers` persistent workers in each training process;
`remote`, `RemoteLoader` of `remote-loader serve` (`--server-workers` persistent workers) on the
server's host, which takes the TCP data connection. The n trainers of a count are the ranks of
one job and read the same share either way: `DistributedSampler(rank, n, shuffle, seed 0)`
locally, `sharing="partition"` of a loader that shuffles with seed 0 remotely.

Calibration, printed as it goes: one local trainer with no step on the capped host (L batches/s:
what the starved host makes), and before each count one remote trainer with no step on the
trainers' host uncapped (T: what the server makes now; other people's load moves it). The step of
n trainers is n / (`--headroom` x T) unless `--step-ms` says: the job asks the same batches/s at
every count, `--headroom` of what the one server can make, so that it can keep up, and many times
L, so that the trainers' host is starved. (On this 2-core machine the server cannot grow with the
job; a fixed step would ask 4 trainers for 4x the batches of one.) Where the server keeps up,
remote / local is about headroom x T / L: the step sets it; the stall says whether it held.

Measurement. At each count the trainers of both loaders are started (remote first, rank after
rank: `Trainers.start`) and paused; then the loaders take turns, `--rounds` windows each, the
order rotated each round: the loader's trainers resume, step WARM s uncounted (what their queues
filled while paused) and are counted for `--seconds` / `--rounds` s. So both loaders' figures
come from the same minutes of the machine. Per window: steps/s per trainer (the mean over
trainers), stall (the share of the window spent in `next()`), the cores the trainers' host and
the server's host used (cpuacct), the cores the rest of the machine used (other people:
/proc/stat less this run's hosts) and the load average. The table: medians over rounds, and
remote / local steps/s (the median of the rounds' ratios, their range).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.cpuhost import Hosts, check_cgroups  # noqa: E402
from benchmarks.headline_report import STALL_TARGET, Window, plot, summarize, table  # noqa: E402
from benchmarks.headline_trainer import TrainerSpec  # noqa: E402
from benchmarks.netns import NetnsError  # noqa: E402
from benchmarks.processes import (  # noqa: E402
    Placement,
    Served,
    loadavg,
    machine_cpu_seconds,
    read_line,
    serve_at,
    subprocess_env,
)

TRAINERS, SERVER = "trainers", "server"
# Started in this order at each count, remote first: its data connections' handshakes are timed,
# and the capped host is quiet before the local trainers' workers start.
LOADERS = ("remote", "local")
# Seconds from "go" to the window's warm-up (every trainer has read it by then), and seconds
# stepped uncounted before it counts: a paused loader's queues are full (a DataLoader's prefetch,
# a RemoteLoader's and the server's window) and the first steps would take them for free.
LEAD = 0.5
WARM = 3.0
# Seconds trainers may take to be ready (importing torch on a fraction of a core), and to report
# once a window is over (one more step; a starved local step can take seconds).
READY_TIMEOUT = 300.0
REPORT_TIMEOUT = 120.0


class Trainers:
    """The n training processes of one loader, ranks of one job, on the trainers' host."""

    def __init__(self, bench: Bench, n: int, loader: str, step_s: float) -> None:
        self.bench, self.n, self.loader, self.step_s = bench, n, loader, step_s
        self.procs: list[subprocess.Popen[str]] = []

    def start(self) -> None:
        """Starts the ranks one after the other, each once the one before is ready: n processes
        importing torch at once on a fraction of a core would take their first stream's data
        connections past their handshake timeout (protos/tcp.py), and the first epoch inside
        gRPC."""
        bench = self.bench
        bench.jobs += 1
        for rank in range(self.n):
            spec = TrainerSpec(
                mode=self.loader, rank=rank, world_size=self.n, step_s=self.step_s,
                batch_size=bench.args.batch_size, crop=bench.args.crop, root=bench.root,
                workers=bench.args.workers, address=bench.address, job=f"job{bench.jobs}",
                threads=max(1, int(bench.args.quota)),
            )  # fmt: skip
            argv = [sys.executable, "-m", "benchmarks.headline_trainer"]
            argv.append(json.dumps(dataclasses.asdict(spec)))
            proc = subprocess.Popen(
                bench.hosts.wrap(TRAINERS, argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                text=True, env=subprocess_env(),
                start_new_session=True,  # Ctrl-C reaches the parent only, which cleans up
            )  # fmt: skip
            self.procs.append(proc)
            if (line := self._line(proc, time.monotonic() + READY_TIMEOUT)).strip() != "ready":
                raise RuntimeError(f"a {self.loader} trainer said {line!r}, not 'ready'")

    def _line(self, proc: subprocess.Popen[str], deadline: float) -> str:
        return read_line(proc, f"a {self.loader} trainer", deadline - time.monotonic())

    def go(self, start: float, stop: float) -> None:
        for proc in self.procs:
            if proc.stdin is not None:
                proc.stdin.write(f"go {start!r} {stop!r}\n")
                proc.stdin.flush()

    def reports(self) -> list[dict[str, Any]]:
        deadline = time.monotonic() + REPORT_TIMEOUT + self.step_s
        return [json.loads(self._line(proc, deadline)) for proc in self.procs]

    def close(self) -> None:
        """EOF to each trainer, a few seconds to end; the caller kills what is left."""
        for proc in self.procs:
            with contextlib.suppress(OSError):
                if proc.stdin is not None:
                    proc.stdin.close()
        deadline = time.monotonic() + 10
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            if proc.stdout is not None:
                proc.stdout.close()


@dataclasses.dataclass
class Bench:
    """The hosts, the server's address and the settings of this run."""

    hosts: Hosts
    args: argparse.Namespace
    root: str
    address: str = ""
    jobs: int = 0  # remote job names, one per Trainers: each starts at epoch 0

    def measure(
        self, n: int, loaders: Sequence[str], step_s: float, rounds: int, seconds: float
    ) -> list[Window]:
        """`n` trainers of each loader, loaders taking turns for `rounds` windows of `seconds`
        (module doc); the windows, printed as they end."""
        groups: list[Trainers] = []
        windows: list[Window] = []
        try:
            for loader in loaders:  # one after the other: each starts on a quiet host
                groups.append(Trainers(self, n, loader, step_s))
                groups[-1].start()
            for r in range(rounds):
                for group in groups[r % len(groups) :] + groups[: r % len(groups)]:
                    windows.append(self.window(group, seconds))
                    print(windows[-1].line(r + 1), flush=True)
        finally:
            for group in groups:
                group.close()
            self.hosts.kill(TRAINERS)  # whatever outlived its trainer (a DataLoader worker)
        return windows

    def window(self, group: Trainers, seconds: float) -> Window:
        load = float(loadavg().split()[0])
        start = time.monotonic() + LEAD + WARM
        stop = start + seconds
        group.go(start, stop)
        time.sleep(max(0.0, start - time.monotonic()))
        before = self.counters()
        time.sleep(max(0.0, stop - time.monotonic()))
        after = self.counters()
        used = [(a - b) / seconds for a, b in zip(after, before, strict=True)]
        return Window(
            trainers=group.n, loader=group.loader, step_s=group.step_s, reports=group.reports(),
            trainer_cores=used[0], server_cores=used[1], other_cores=used[2] - used[0] - used[1],
            throttled=round(used[3] * seconds), load=load,
        )  # fmt: skip

    def counters(self) -> tuple[float, float, float, float]:
        """CPU seconds of the trainers' host, of the server's and of the machine; periods in
        which the trainers' host was throttled."""
        return (
            self.hosts.cpu_seconds(TRAINERS),
            self.hosts.cpu_seconds(SERVER),
            machine_cpu_seconds(),
            float(self.hosts.throttled(TRAINERS)),
        )


def start_server(bench: Bench) -> Served:
    """`remote-loader serve` of the JPEG folder on the server's host."""
    args = bench.args
    flags = [
        "--dataset", "benchmarks.jpegs:JpegFolder",
        "--dataset-kwargs", json.dumps({"root": bench.root, "size": args.crop}),
        "--batch-size", str(args.batch_size), "--shuffle", "--seed", "0",
        "--num-workers", str(args.server_workers), "--persistent-workers",
    ]  # fmt: skip
    return serve_at(Placement(bench.hosts.on(SERVER)), flags)


def server_rate(bench: Bench) -> float:
    """T: batches/s of one remote trainer with no step on the uncapped trainers' host."""
    bench.hosts.set_quota(TRAINERS, None)
    try:
        (served,) = bench.measure(1, ["remote"], 0.0, 1, bench.args.calibrate_seconds)
    finally:
        bench.hosts.set_quota(TRAINERS, bench.args.quota)
    t = served.steps_per_s
    print(
        f"T = {t:.1f} batches/s: what the server made for one uncapped trainer with no step "
        f"({served.server_cores / t * 1e3:.0f} ms of server CPU a batch, "
        f"{served.trainer_cores / t * 1e3:.1f} ms of the trainer's)",
        flush=True,
    )
    return t


def local_rate(bench: Bench) -> float:
    """L: batches/s of one local trainer with no step on the capped trainers' host."""
    (starved,) = bench.measure(1, ["local"], 0.0, 1, bench.args.calibrate_seconds)
    rate = starved.steps_per_s
    print(
        f"L = {rate:.1f} batches/s: what a local DataLoader made on {bench.args.quota:g} cores "
        f"with no step ({starved.trainer_cores / rate * 1e3:.0f} ms of CPU a batch)",
        flush=True,
    )
    return rate


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = parser.add_argument
    add("--trainers", default="1,2,4", help="trainer counts (default 1,2,4)")
    add("--quota", type=float, default=0.25, help="cores of the trainers' host (default 0.25)")
    add("--step-ms", type=float, help="the step (default: n / (headroom x T), module doc)")
    add("--headroom", type=float, default=0.5, help="share of T the job asks (default 0.5)")
    add("--seconds", type=float, default=24.0, help="counted seconds per loader and count")
    add("--rounds", type=int, default=4, help="windows --seconds is cut into (default 4)")
    add("--calibrate-seconds", type=float, default=8.0)
    add("--workers", type=int, default=2, help="the local DataLoader's workers (default 2)")
    add("--server-workers", type=int, default=2, help="the server's workers (default 2)")
    add("--images", type=int, default=8192)
    add("--image-size", type=int, default=400, help="JPEG side, px (default 400)")
    add("--crop", type=int, default=112)
    add("--batch-size", type=int, default=32)
    add("--plot", metavar="FILE.png", help="draw steps/s and stall into this image")
    args = parser.parse_args(argv)
    try:
        args.counts = sorted({int(n) for n in args.trainers.split(",")})
    except ValueError:
        parser.error(f"--trainers is a comma-separated list of counts; got {args.trainers!r}")
    if args.counts[0] < 1:
        parser.error("--trainers: counts of at least 1")
    if args.step_ms is not None and args.step_ms <= 0:
        parser.error("--step-ms must be > 0")
    if not 0 < args.headroom <= 1:
        parser.error("--headroom is in (0, 1]")
    if args.rounds < 1 or args.seconds <= 0 or args.workers < 0 or args.server_workers < 1:
        parser.error("--rounds and --server-workers >= 1, --workers >= 0, --seconds > 0")
    if args.plot is not None and not Path(args.plot).resolve().parent.is_dir():
        parser.error(f"--plot: no such directory for {args.plot!r}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_cgroups()
    except NetnsError as exc:
        print(f"headline: {exc}", file=sys.stderr)
        return 2
    from benchmarks.jpegs import write_jpegs

    began, start_load = time.monotonic(), loadavg()
    print(f"load average at start: {start_load} ({os.cpu_count()} cores)", flush=True)
    windows: list[Window] = []
    rates: dict[int, float] = {}  # T before each count
    with (
        tempfile.TemporaryDirectory(prefix="rl-headline-") as root,
        Hosts({SERVER: None, TRAINERS: args.quota}) as hosts,
    ):
        print(hosts.describe(), flush=True)
        write_jpegs(root, args.images, size=args.image_size)
        bench = Bench(hosts, args, root)
        server = start_server(bench)
        bench.address = server.address
        try:
            starved = local_rate(bench)
            for n in args.counts:
                served = server_rate(bench)
                step = args.step_ms / 1e3 if args.step_ms else n / (args.headroom * served)
                print(
                    f"{n} trainer(s): step {step * 1e3:.0f} ms, the job asks {n / step:.1f} "
                    f"batches/s (T {served:.1f}, L {starved:.1f})",
                    flush=True,
                )
                rates[n] = served
                windows += bench.measure(n, LOADERS, step, args.rounds, args.seconds / args.rounds)
        finally:
            logged = server.stop()
    end_load = loadavg()
    transports = set().union(*(w.transports for w in windows if w.loader == "remote"))
    made = "/".join(f"{t:.1f}" for t in rates.values())
    logs = ", ".join(f"{t} x{k}" for t, k in sorted(logged.items()))
    conditions = (
        f"{os.cpu_count()} cores; load average {start_load} at start, {end_load} at end; "
        f"trainers' host capped at {args.quota:g} cores, server uncapped with "
        f"{args.server_workers} workers, local DataLoader {args.workers} workers; "
        f"{args.images} JPEGs of {args.image_size} px, crops of {args.crop}, batches of "
        f"{args.batch_size}; T = {made} batches/s (the server, before each count), "
        f"L = {starved:.1f} (local, capped); remote over {', '.join(sorted(transports))} "
        f"(server's log: {logs}); {args.rounds} rounds of {args.seconds / args.rounds:g} s per "
        f"row; {time.monotonic() - began:.0f} s in all"
    )
    print(f"\n{table(summarize(windows), args.quota)}\n\n{conditions}")
    for n in args.counts:
        stall = statistics.median(
            w.stall for w in windows if (w.trainers, w.loader) == (n, "remote")
        )
        verdict = "under" if stall < STALL_TARGET else "OVER"
        print(f"{n} trainer(s): remote stall {stall:.1%}, {verdict} {STALL_TARGET:.0%}")
    if args.plot:
        plot(windows, args.plot, conditions)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except KeyboardInterrupt:  # the hosts, the server and the trainers are gone by now
        print("headline: interrupted; its namespaces and cgroups were removed", file=sys.stderr)
        raise SystemExit(130) from None
