"""Does a slow trainer across hosts get every epoch's end on its data connections? (NOTE [ End of
a stream ] in protos/tcp_closing.py.)

The server (`remote-loader serve` of benchmarks/workloads.py's Images, about 9.6 MB per batch of
64) runs in a network namespace of its own (benchmarks/netns.py: a veth pair, a private
/dev/shm), the client in this process with `transport="tcp"` and a training step of
`--step-ms` ms per batch (a sleep: slower than its loader, so the server ends each stream with
the last batches still in the kernel's buffers). For `--epochs` epochs it counts:

- resets: TcpExtTCPAbortOnData (data arriving at a socket after its close) plus
  TcpExtTCPAbortOnClose (a socket closed with data unread), each answered with a reset, in the
  server's namespace during the epochs (the root namespace's, where the client runs, are
  printed too, but other processes on the machine add to them);
- resumes: the client's `stats().reconnects` (a data connection that broke mid-batch), summed
  over the epochs (each epoch counts its own);
- batches made twice: the batches the server's "stream end" log lines count, less the epochs'
  batches (a resumed stream sends again what was lost);
- exactness: every batch equal to the dataset's, in order.

Run from the repository root, as root (namespaces):

    python benchmarks/stream_end.py [--epochs 20] [--batches 16] [--step-ms 40]
                                    [--link-rate 10gbit] [--loopback]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import netns  # noqa: E402
from benchmarks.processes import Placement, loadavg, serve_at  # noqa: E402
from benchmarks.workloads import Images  # noqa: E402
from remote_loader.client import RemoteLoader  # noqa: E402


def aborts(namespace: str | None) -> int:
    """TcpExtTCPAbortOnData + TcpExtTCPAbortOnClose of the root namespace (None) or of
    `namespace`: the resets its sockets sent for data they had not read."""
    argv = ["cat", "/proc/net/netstat"]
    if namespace is not None:
        argv = ["ip", "netns", "exec", namespace, *argv]
    lines = subprocess.run(argv, capture_output=True, text=True, check=True).stdout.splitlines()
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            counters = dict(zip(names.split(), values.split(), strict=True))
            return int(counters["TCPAbortOnData"]) + int(counters["TCPAbortOnClose"])
    raise RuntimeError("no TcpExt line in /proc/net/netstat")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batches", type=int, default=16, help="batches per epoch")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--step-ms", type=float, default=40.0, help="the training step")
    parser.add_argument("--connections", type=int, default=None, help="data_connections")
    parser.add_argument("--link-rate", default=None, help="shape the veth pair (tc tbf)")
    parser.add_argument("--loopback", action="store_true", help="no namespace: loopback")
    args = parser.parse_args(argv)
    if not args.loopback:
        netns.check_prerequisites(rate=args.link_rate)
    n = args.batches * args.batch_size
    reference = Images(n)
    # Every sample is the same image: a batch is exact when each of its images is that one.
    image = reference.image
    link = None if args.loopback else netns.Link.create(rate=args.link_rate)
    place = Placement(link)
    where = "loopback" if link is None else link.describe()
    print(f"{where}\n{os.cpu_count()} CPUs; load average at start {loadavg()}", flush=True)
    flags = [
        "--dataset", "benchmarks.workloads:Images", "--dataset-kwargs", f'{{"n": {n}}}',
        "--batch-size", str(args.batch_size), "--num-workers", "2", "--persistent-workers",
    ]  # fmt: skip
    try:
        served = serve_at(place, flags)
        server_ns = None if link is None else link.namespace
        try:
            with RemoteLoader(
                served.address,
                transport="tcp",
                prefetch=1,
                data_connections=args.connections,
                device="cpu",
            ) as loader:
                sum(1 for _ in loader)  # warm-up: workers, connections
                before, root_before = aborts(server_ns), aborts(None)
                resumes = 0
                started = time.monotonic()
                resets_per_epoch = []
                inexact = 0
                for _ in range(args.epochs):
                    at = aborts(server_ns)
                    got = 0
                    for images, _labels in loader:
                        inexact += int(not bool((images == image).all()))
                        got += 1
                        time.sleep(args.step_ms / 1000)
                    inexact += int(got != args.batches)
                    resets_per_epoch.append(aborts(server_ns) - at)
                    resumes += loader.stats().reconnects
                    if loader.last_transport != "tcp":
                        raise SystemExit(f"the batches came by {loader.last_transport}, not tcp")
                elapsed = time.monotonic() - started
                resets, root_resets = aborts(server_ns) - before, aborts(None) - root_before
        finally:
            log = served.log.read_text(errors="replace") if served.log is not None else ""
            served.stop()
    finally:
        if link is not None:
            link.close()
    sent = [int(m[1]) for m in re.finditer(r"stream end .*?\bbatches=(\d+)", log)]
    twice = sum(sent) - (args.epochs + 1) * args.batches if sent else None
    epochs_reset = sum(1 for r in resets_per_epoch if r)
    print(
        f"{args.epochs} epochs of {args.batches} batches ({args.batch_size} images, "
        f"{torch.Size([3, 224, 224]).numel() * args.batch_size / 1e6:.1f} MB), step "
        f"{args.step_ms:g} ms, prefetch 1, data_connections {args.connections or 'default'}: "
        f"{elapsed:.1f} s\n"
        f"resets sent by the server's namespace (TcpExtTCPAbortOnData + OnClose): {resets} "
        f"(epochs with one: {epochs_reset} of {args.epochs}); by the root namespace (the "
        f"client, and every other process here): {root_resets}\n"
        f"client resumes: {resumes}\n"
        f"batches made twice (server's stream end lines): "
        f"{'unknown (no log on loopback)' if twice is None else twice}\n"
        f"inexact or missing batches: {inexact}\n"
        f"load average at end {loadavg()}"
    )
    return 0 if resets == resumes == inexact == 0 and not twice else 1


if __name__ == "__main__":
    sys.exit(main())
