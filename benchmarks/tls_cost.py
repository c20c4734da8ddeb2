"""Where a TLS data connection's time goes on this machine: the trainer's side against a raw TLS
receiver, and how many data connections pay (NOTE [ TLS data connection ] in protos/tcp.py).

compare.py --cross-host --tls gives the ratio of the TLS data connection to one raw TLS socket;
this script says what stands between them. One `remote-loader serve` of benchmarks/workloads.py's
Images (9.63 MB batches of 64, 2 workers, persistent) speaks TLS in a network namespace of its
own (benchmarks/netns.py, benchmarks/tlsfiles.py); this process holds one RemoteLoader
(`transport="tcp"`) per `--data-connections` value and, in every round, reads `--epochs` epochs
from each in turn, each followed by one raw TLS socket round (benchmarks/ceilings.py: a sender
process in the namespace `sendall`s batch-sized buffers, this process `recv_into`s them) of as
many batches. Per data-connection count it prints:

- GB/s and its ratio to the raw TLS socket round right after it, per round and the median;
- CPU ms per batch: this process (the trainer: gRPC, the receiver, every stripe's decryption)
  the server process and its workers, against the raw pair's: this process while
  it received the raw rounds and the raw sender process (encryption and the kernel's copies,
  nothing else).

The raw pair has a sender and a receiver, one core each; the loader adds its workers and its
bookkeeping on both ends, on the same two cores. Run from the repository root, as root:

    python benchmarks/tls_cost.py [--data-connections 1,4] [--rounds 6] [--epochs 2]
"""

from __future__ import annotations

import argparse
import collections
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import ceilings, netns, tlsfiles  # noqa: E402
from benchmarks.processes import Placement, loadavg, process_table, tree_cpu, tree_pids  # noqa: E402
from benchmarks.rounds import WORKLOADS, dataset_kwargs, start_loader_server  # noqa: E402
from remote_loader.client import TLS, RemoteLoader  # noqa: E402
from remote_loader.protos import tcp  # noqa: E402

WORKLOAD = "images"
BATCH_SIZE = 64
WORKERS = 2
GB = 1e9


def own_cpu() -> float:
    """CPU seconds of this process so far, every thread's."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def server_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds so far of the server process itself and of its descendants (the fork server
    and the workers)."""
    table = process_table()
    descendants = tree_pids(pid, include_root=False, table=table)
    return table[pid][1], sum(table[each][1] for each in descendants)


def loader_round(
    loader: RemoteLoader, epochs: int, nbytes: int, server_pid: int
) -> dict[str, float]:
    """`epochs` epochs of `loader`: GB/s, and CPU ms per batch of this process ("client"), the
    server process ("server") and its descendants ("workers")."""
    served, worked = server_cpu(server_pid)  # /proc read before the clock starts
    start, cpu = time.perf_counter(), own_cpu()
    batches = sum(sum(1 for _ in loader) for _ in range(epochs))
    wall = time.perf_counter() - start
    client = own_cpu() - cpu
    served_now, worked_now = server_cpu(server_pid)
    return {
        "GB/s": batches * nbytes / GB / wall,
        "client": 1e3 * client / batches,
        "server": 1e3 * (served_now - served) / batches,
        "workers": 1e3 * (worked_now - worked) / batches,
    }


def raw_round(raw: ceilings.Raw, nbytes: int, count: int) -> dict[str, float]:
    """One raw TLS socket round of `count` buffers of `nbytes`: GB/s, and CPU ms per batch of
    this process receiving ("receiver") and of the sender process ("sender")."""
    cpu, sent = own_cpu(), tree_cpu(raw.sender_pid)
    rate = raw.socket_round(nbytes, count)
    return {
        "raw GB/s": rate,
        "receiver": 1e3 * (own_cpu() - cpu) / count,
        "sender": 1e3 * (tree_cpu(raw.sender_pid) - sent) / count,
    }


def _counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,4; got {text!r}") from None
    if not counts or not all(1 <= c <= tcp.MAX_DATA_CONNECTIONS for c in counts):
        raise argparse.ArgumentTypeError(
            f"each count must be between 1 and {tcp.MAX_DATA_CONNECTIONS}; got {text!r}"
        )
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data-connections", type=_counts, default=[1, 4], metavar="N,N")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--epochs", type=int, default=2, help="epochs per loader per round")
    parser.add_argument("--batches", type=int, default=40, help="batches per epoch")
    args = parser.parse_args(argv)
    for flag in ("rounds", "epochs", "batches"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag} must be at least 1")
    try:
        netns.check_prerequisites(rate=None)
    except netns.NetnsError as exc:
        raise SystemExit(f"tls_cost.py: {exc}") from None

    counts: list[int] = args.data_connections
    kwargs = dataset_kwargs(
        WORKLOAD, argparse.Namespace(batches=args.batches, batch_size=BATCH_SIZE)
    )
    print(
        f"TLS data connections vs one raw TLS socket, across namespaces: {WORKLOAD} batches of "
        f"{BATCH_SIZE}, {WORKERS} workers, {args.batches} batches/epoch, {args.epochs} epoch(s) "
        f"per loader per round, {args.rounds} rounds; load average at start {loadavg()}",
        flush=True,
    )
    # Per data-connection count (0: the raw pair), each figure's value in every round.
    figures: dict[int, dict[str, list[float]]] = {
        c: collections.defaultdict(list) for c in [*counts, 0]
    }
    link = netns.Link.create()
    files = tlsfiles.make(link.server_ip)
    try:
        place = Placement(link, files)
        server = start_loader_server(WORKLOADS[WORKLOAD], kwargs, BATCH_SIZE, WORKERS, place)
        loaders = {
            c: RemoteLoader(
                server.address,
                device="cpu",
                transport="tcp",
                tls=TLS(ca=files.ca),
                data_connections=c,
            )
            for c in counts
        }
        try:
            with ceilings.Raw(place) as raw:
                nbytes = 0
                for loader in loaders.values():  # warm-up: workers, connections, buffers
                    for batch in loader:
                        nbytes = sum(t.numel() * t.element_size() for t in batch)
                raw.round(WORKLOAD, nbytes, args.batches, timed=False)
                for r in range(1, args.rounds + 1):
                    for c, loader in loaders.items():
                        mine = loader_round(loader, args.epochs, nbytes, server.proc.pid)
                        theirs = raw_round(raw, nbytes, args.epochs * args.batches)
                        mine["ratio"] = mine["GB/s"] / theirs["raw GB/s"]
                        for figure, value in [*mine.items(), *theirs.items()]:
                            figures[c if figure in mine else 0][figure].append(value)
                    print(f"round {r}/{args.rounds} done", file=sys.stderr, flush=True)
        finally:
            for loader in loaders.values():
                loader.close()
            server.stop()
    finally:
        link.close()
        tlsfiles.remove(files)

    def median(c: int, figure: str) -> float:
        return statistics.median(figures[c][figure])

    print(
        f"\n{'connections':>11} {'GB/s':>6} {'ratio':>6}  {'per round':<40} "
        f"{'client ms/b':>11} {'server ms/b':>11} {'workers ms/b':>12}"
    )
    for c in counts:
        rounds = " ".join(f"{x:.2f}" for x in figures[c]["ratio"])
        print(
            f"{c:>11} {median(c, 'GB/s'):>6.3f} {median(c, 'ratio'):>6.2f}  {rounds:<40} "
            f"{median(c, 'client'):>11.2f} {median(c, 'server'):>11.2f} "
            f"{median(c, 'workers'):>12.2f}"
        )
    print(
        f"{'raw TLS':>11} {median(0, 'raw GB/s'):>6.3f} {'':>6}  {'':<40} "
        f"{median(0, 'receiver'):>11.2f} {median(0, 'sender'):>11.2f}"
    )
    print(f"load average at end {loadavg()}")
    print(
        "ratio: the loader's GB/s over the raw TLS socket round right after it. client: this "
        "process; server: the server process; workers: its descendants (the fork server and "
        "the workers, who collate each batch into its slot); raw TLS: this process receiving, "
        "the sender process sending; CPU ms per batch, medians over the rounds."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
