"""Two loaders served by one server, each against itself alone (issue 30).

    python benchmarks/two_loaders.py                       # heavy workload, b with 1 worker
    python benchmarks/two_loaders.py --b-workers auto --workload tanh --rounds 10

Three `remote-loader serve` processes run side by side for the whole run: "pair" serves loaders
a and b, "a" serves a only, "b" serves b only. Loader a is the CPU-heavy loader of the issue
(one worker, 16 samples per batch); b is the same loader with persistent workers and
--b-workers workers (a fixed count or "auto"). Each round reads one epoch of each loader from
its own server and one from the pair (the other loader idle there), in alternating order, so
that the machine's load (other people's work on the same cores) falls on both alike.

Printed per loader, medians over the rounds: batches/s alone and beside, their ratio (the
target: within 5 %), and, because wall time on a shared machine moves with other people's
load, what does not: the busy worker's CPU per batch, its minor page faults and involuntary
context switches per batch, and the CPU the idle neighbour's processes used during the epoch
(an idle persistent worker that polls or spins shows here). Also the machine: load average and
the cores others kept busy during each epoch (/proc/stat's busy time less ours).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# How often the sampler reads /proc during an epoch: a worker that exits with its epoch
# (persistent_workers = false) is counted up to its last sample.
SAMPLE_INTERVAL = 0.05
TARGET = 0.95


class Tanh:
    """`n` samples of a float [3, size, size] image put through `passes` tanh: the issue's second
    workload, memory-bound rather than compute-bound (each pass allocates a 600 kB tensor)."""

    def __init__(self, n: int, size: int = 224, passes: int = 8) -> None:
        if n < 0 or size < 1 or passes < 1:
            raise ValueError(
                f"Tanh needs n >= 0, size >= 1, passes >= 1; got {n}, {size}, {passes}"
            )
        self.n = n
        self.passes = passes
        self.image = torch.randn(3, size, size, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range for Tanh of length {self.n}")
        x = self.image
        for _ in range(self.passes):
            x = torch.tanh(x * 1.01)
        return x


WORKLOADS = {"heavy": "benchmarks.workloads:Heavy", "tanh": "benchmarks.two_loaders:Tanh"}


def config(args: argparse.Namespace, names: str) -> str:
    """A config file serving loaders `names` (a subset of "ab"); returns its path."""
    text = ""
    for name in names:
        workers = args.b_workers if name == "b" else "1"
        persistent = "true" if name == "b" or args.a_persistent else "false"
        text += f"""
[loaders.{name}]
dataset = "{WORKLOADS[args.workload]}"
dataset_kwargs = {{ n = {args.batches * args.batch_size} }}
batch_size = {args.batch_size}
num_workers = {workers if workers.isdigit() else f'"{workers}"'}
persistent_workers = {persistent}
seeding = "per_batch"
"""
    fd, path = tempfile.mkstemp(suffix=".toml", prefix=f"two-loaders-{names}-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


@dataclasses.dataclass(frozen=True)
class Counters:
    """One process's CPU seconds, minor faults and involuntary context switches so far."""

    cpu: float = 0.0
    minflt: int = 0
    nivcsw: int = 0

    def __sub__(self, other: Counters) -> Counters:
        return Counters(
            self.cpu - other.cpu, self.minflt - other.minflt, self.nivcsw - other.nivcsw
        )


def read_counters(pid: int) -> tuple[int, str, Counters] | None:
    """(ppid, command line, counters) of `pid`; None once it exited."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except (OSError, ValueError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    nivcsw = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
    cpu = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return int(fields[1]), cmdline, Counters(cpu, int(fields[7]), nivcsw)


def server_tree(root: int) -> dict[int, tuple[str, Counters]]:
    """pid -> (role, counters) for a server and its descendants. Roles: "server" (the main
    process), "forkserver", "worker" (the fork server's children), "other"."""
    table: dict[int, tuple[int, str, Counters]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            read = read_counters(int(entry.name))
            if read is not None:
                table[int(entry.name)] = read
    tree: dict[int, tuple[str, Counters]] = {}
    if root in table:
        tree[root] = ("server", table[root][2])
    todo = [root]
    while todo:
        parent = todo.pop()
        for pid, (ppid, cmdline, counters) in table.items():
            if ppid != parent:
                continue
            if "forkserver" in cmdline and parent == root:
                role = "forkserver"
            elif parent != root and tree.get(parent, ("",))[0] == "forkserver":
                role = "worker"
            else:
                role = "other"
            tree[pid] = (role, counters)
            todo.append(pid)
    return tree


class Sampler:
    """Reads a server tree's counters every SAMPLE_INTERVAL s while an epoch runs, so that the
    epoch's use is known per process, even for a worker that exited with it."""

    def __init__(self, root: int) -> None:
        self.root = root
        self.before = server_tree(root)
        self.last = dict(self.before)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL):
            self.last.update(server_tree(self.root))

    def used(self) -> dict[int, tuple[str, Counters]]:
        """Stops; pid -> (role, what it used since the start)."""
        self._stop.set()
        self._thread.join()
        self.last.update(server_tree(self.root))
        return {
            pid: (role, counters - self.before.get(pid, ("", Counters()))[1])
            for pid, (role, counters) in self.last.items()
        }


def machine_busy() -> float:
    """Busy CPU seconds of the whole machine so far (/proc/stat; steal left out)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = ticks[:7]
    return (user + nice + system + irq + softirq) / CLOCK_TICKS


@dataclasses.dataclass(frozen=True)
class Epoch:
    rate: float  # batches/s
    worker_cpu: float  # the busy worker's CPU seconds per batch
    worker_minflt: float  # its minor page faults per batch
    worker_nivcsw: float  # its involuntary context switches per batch
    neighbour_cpu: float  # CPU seconds all other workers of the server used in the epoch
    others_cores: float  # cores busy with other people's work during the epoch


def epoch(server_pid: int, address: str, name: str, number: int) -> Epoch:
    """One timed epoch of loader `name` (with what it cost, from /proc)."""
    from remote_loader.client import RemoteLoader

    sampler = Sampler(server_pid)
    client_before = time.process_time()
    busy_before = machine_busy()
    with RemoteLoader(address, name) as loader:
        loader.set_epoch(number)
        start = time.perf_counter()
        batches = sum(1 for _ in loader)
        elapsed = time.perf_counter() - start
    busy = machine_busy() - busy_before
    client = time.process_time() - client_before
    used = sampler.used()
    workers = sorted(
        (counters for role, counters in used.values() if role == "worker"), key=lambda c: c.cpu
    )
    if not workers or batches == 0:
        raise RuntimeError(f"loader {name!r}: no worker process found, or no batch read")
    busiest = workers[-1]
    ours = sum(c.cpu for _, c in used.values()) + client
    return Epoch(
        rate=batches / elapsed,
        worker_cpu=busiest.cpu / batches,
        worker_minflt=busiest.minflt / batches,
        worker_nivcsw=busiest.nivcsw / batches,
        neighbour_cpu=sum(c.cpu for c in workers[:-1]),
        others_cores=max(0.0, busy - ours) / elapsed,
    )


@contextlib.contextmanager
def servers(args: argparse.Namespace) -> Iterator[dict[str, tuple[int, str]]]:
    """The three servers: name -> (pid, address)."""
    from benchmarks.processes import start_server, stop_process

    started = {}
    paths = []
    try:
        for names in ("ab", "a", "b"):
            path = config(args, names)
            paths.append(path)
            started[names] = start_server(["--config", path, "--address", "127.0.0.1:0"])
        yield {names: (proc.pid, address) for names, (proc, address) in started.items()}
    finally:
        for proc, _ in started.values():
            stop_process(proc)
        for path in paths:
            os.unlink(path)


def _median(epochs: list[Epoch], field: str) -> float:
    return float(statistics.median(getattr(e, field) for e in epochs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="heavy")
    parser.add_argument("--b-workers", default="1", help='b\'s num_workers: N or "auto"')
    parser.add_argument(
        "--a-persistent",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="a's persistent_workers (b's are always persistent)",
    )
    parser.add_argument("--batches", type=int, default=40, help="batches per epoch")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=1, help="untimed epochs of each")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    if not (args.b_workers == "auto" or (args.b_workers.isdigit() and int(args.b_workers) > 0)):
        parser.error(f'--b-workers must be a positive count or "auto", got {args.b_workers!r}')
    print(
        f"machine: {os.cpu_count()} cores, load {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
        f"{args.workload} workload, {args.batches} batches of {args.batch_size}; a: 1 worker, "
        f"persistent {args.a_persistent}; b: {args.b_workers} worker(s), persistent; "
        f"{args.warmup} warm-up and {args.rounds} timed rounds"
    )
    results: dict[tuple[str, str], list[Epoch]] = {}
    with servers(args) as running:
        ways = {
            (name, where): running[name if where == "alone" else "ab"]
            for name in "ab"
            for where in ("alone", "beside")
        }
        for r in range(args.warmup + args.rounds):
            order = ("alone", "beside") if r % 2 == 0 else ("beside", "alone")
            for name in "ab":
                for where in order:
                    pid, address = ways[(name, where)]
                    e = epoch(pid, address, name, r)
                    if r >= args.warmup:
                        results.setdefault((name, where), []).append(e)
            if r >= args.warmup:
                line = ", ".join(
                    f"{n} {w} {results[(n, w)][-1].rate:5.2f}"
                    for n in "ab"
                    for w in ("alone", "beside")
                )
                print(
                    f"round {r - args.warmup + 1}: {line} batches/s; load {os.getloadavg()[0]:.2f}"
                )
    print(f"load at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(
        "loader  where   batches/s  worker CPU ms/batch  minflt/batch  nivcsw/batch  "
        "neighbour CPU s  others' cores"
    )
    for (name, where), epochs in results.items():
        print(
            f"{name:6}  {where:6}  {_median(epochs, 'rate'):9.2f}  "
            f"{_median(epochs, 'worker_cpu') * 1000:19.1f}  "
            f"{_median(epochs, 'worker_minflt'):12.0f}  "
            f"{_median(epochs, 'worker_nivcsw'):12.1f}  {_median(epochs, 'neighbour_cpu'):15.2f}  "
            f"{_median(epochs, 'others_cores'):13.2f}"
        )
    worst = 1.0
    for name in "ab":
        alone, beside = results[(name, "alone")], results[(name, "beside")]
        paired = [b.rate / a.rate for a, b in zip(alone, beside, strict=True)]
        ratio = _median(beside, "rate") / _median(alone, "rate")
        cpu = _median(beside, "worker_cpu") / _median(alone, "worker_cpu")
        worst = min(worst, ratio)
        print(
            f"{name}: beside / alone = {ratio:.2f} (per-round ratios: median "
            f"{statistics.median(paired):.2f}, {min(paired):.2f}-{max(paired):.2f}); "
            f"worker CPU per batch beside / alone = {cpu:.2f}"
        )
    print(f"worst ratio {worst:.2f} (target >= {TARGET})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
