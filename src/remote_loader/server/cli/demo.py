"""`remote-loader demo`: a `serve` process on the demo images and trainer processes (the ranks of
one job, client/demo.py), their progress, and a check that together they got every sample."""

from __future__ import annotations

import json
import re
import select
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TextIO

from remote_loader.server.datasets import DEMO_DATASET

# How long a spawned server may take to build its loaders and start listening.
SERVE_START_TIMEOUT = 120.0
# How long the demo waits for a trainer before it stops it.
DEMO_TRAINER_TIMEOUT = 600.0


def demo_flags(
    batch_size: int = 32, num_workers: int = 2, ray_address: str | None = None
) -> list[str]:
    """`serve` flags for the demo loader: the built-in image folder, shuffled, with indices;
    with `ray_address`, its workers are Ray actors of that cluster, one CPU each."""
    flags = [
        "--dataset",
        DEMO_DATASET,
        "--name",
        "demo",
        "--dataset-kwargs",
        json.dumps({"return_index": True}),
        "--batch-size",
        str(batch_size),
        "--shuffle",
        "--num-workers",
        str(num_workers),
    ]
    if num_workers > 0:
        flags.append("--persistent-workers")
    if ray_address is not None:
        flags += ["--pool", "ray", "--ray-address", ray_address, "--ray-num-cpus", "1"]
    return flags


def serve_command(args: Sequence[str]) -> list[str]:
    """The command line of `remote-loader serve ARGS` listening on 127.0.0.1, port 0."""
    return [
        sys.executable,
        "-m",
        "remote_loader.server.cli.main",
        "serve",
        "--address",
        "127.0.0.1:0",
        *args,
    ]


def spawn_serve(
    args: Sequence[str], env: Mapping[str, str] | None = None, stderr: int | None = None
) -> tuple[subprocess.Popen[str], int]:
    """Starts `remote-loader serve ARGS --address 127.0.0.1:0` as a process.

    Returns the process and the port it listens on, read from its first line of output; raises
    RuntimeError (with the server's stderr, when piped) if it exits before serving.
    """
    proc = subprocess.Popen(
        [*serve_command(args), "--log-level", "WARNING"],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=None if env is None else dict(env),
    )
    assert proc.stdout is not None
    # Bounded: a server stuck before it listens must not hang the caller.
    ready, _, _ = select.select([proc.stdout], [], [], SERVE_START_TIMEOUT)
    line = proc.stdout.readline() if ready else ""  # "remote-loader: serving ... on port N"
    match = re.search(r"on port (\d+)$", line.strip())
    if match is None:
        proc.kill()
        _, err = proc.communicate()
        raise RuntimeError(
            f"remote-loader serve did not start (exit code {proc.returncode})"
            + (f": {err.strip()}" if err else "")
        )
    return proc, int(match.group(1))


def run_demo(
    trainers: int, epochs: int, batch_size: int, num_workers: int, ray_address: str | None = None
) -> int:
    """Starts a server and `trainers` trainer processes, shows their progress, checks the data.
    With `ray_address`, the server's workers are actors of that Ray cluster."""
    from remote_loader.server.datasets import demo_folder

    where = f", workers as Ray actors of {ray_address}" if ray_address else ""
    print(f"remote-loader demo: images in {demo_folder()}{where}", flush=True)
    started = time.monotonic()
    server, port = spawn_serve(demo_flags(batch_size, num_workers, ray_address))
    reports: dict[int, dict[str, Any]] = {}
    try:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "remote_loader.client.demo",
                    "--address",
                    f"127.0.0.1:{port}",
                    "--rank",
                    str(rank),
                    "--world-size",
                    str(trainers),
                    "--epochs",
                    str(epochs),
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            for rank in range(trainers)
        ]
        bars = progress_bars(trainers)
        lock = threading.Lock()

        def follow(rank: int, proc: subprocess.Popen[str]) -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                msg = json.loads(line)
                with lock:
                    if "total" in msg:
                        bars[rank].total = msg["total"]
                        bars[rank].refresh()
                    elif "batch" in msg:
                        bars[rank].update(1)
                    else:
                        reports[rank] = msg

        threads = [threading.Thread(target=follow, args=(r, p)) for r, p in enumerate(procs)]
        for t in threads:
            t.start()
        codes = [_wait_or_kill(p, DEMO_TRAINER_TIMEOUT) for p in procs]
        for t in threads:
            t.join()
        for bar in bars:
            bar.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    return _summary(reports, codes, time.monotonic() - started, epochs)


class Progress(Protocol):
    """What the demo asks of a progress bar: a tqdm, or PlainProgress."""

    total: float | None

    def update(self, n: float | None = 1) -> bool | None: ...
    def refresh(self) -> None: ...
    def close(self) -> None: ...


# Without a terminal (a pipe, a CI log) each trainer's progress is a plain line at most this
# often, plus one when its length is known and one at its end.
PLAIN_PROGRESS_INTERVAL = 5.0


class PlainProgress:
    """A trainer's progress as plain lines: tqdm's carriage returns and cursor moves (one bar
    per trainer, each at its own position) are blank or garbled lines in a file or a pipe."""

    def __init__(
        self, desc: str, stream: TextIO, interval: float = PLAIN_PROGRESS_INTERVAL
    ) -> None:
        self.desc = desc
        self.total: float | None = None
        self.n = 0.0
        self._stream = stream
        self._interval = interval
        self._started = self._shown = time.monotonic()

    def update(self, n: float | None = 1) -> bool | None:
        self.n += 1 if n is None else n
        if time.monotonic() - self._shown >= self._interval:
            self._show()
        return None

    def refresh(self) -> None:  # the demo calls it once the length is known
        self._show()

    def close(self) -> None:
        self._show(f" in {time.monotonic() - self._started:.1f} s")

    def _show(self, suffix: str = "") -> None:
        self._shown = time.monotonic()
        of = f"/{self.total:g}" if self.total is not None else ""
        print(f"{self.desc}: {self.n:g}{of} batches{suffix}", file=self._stream, flush=True)


def progress_bars(trainers: int, stream: TextIO | None = None) -> list[Progress]:
    """One progress bar per trainer on `stream` (stderr): tqdm's on a terminal, else plain
    lines."""
    stream = stream if stream is not None else sys.stderr
    if not stream.isatty():
        return [PlainProgress(f"trainer {rank}", stream) for rank in range(trainers)]
    from tqdm import tqdm

    return [
        tqdm(desc=f"trainer {rank}", unit="batch", position=rank, leave=True, file=stream)
        for rank in range(trainers)
    ]


def _wait_or_kill(proc: subprocess.Popen[str], timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _summary(
    reports: dict[int, dict[str, Any]], codes: list[int], seconds: float, epochs: int
) -> int:
    ok = True
    print(f"\nsummary ({seconds:.1f} s wall)")
    for rank, code in enumerate(codes):
        report = reports.get(rank)
        if code != 0 or report is None:
            print(f"  trainer {rank}: FAILED (exit code {code})")
            ok = False
            continue
        mbps = report["bytes"] / 1e6 / max(report["seconds"], 1e-9)
        print(
            f"  trainer {rank} (rank {rank} of {len(codes)}): {report['batches']} batches, "
            f"{report['samples']} samples, {report['bytes'] / 1e6:.1f} MB at {mbps:.1f} MB/s"
            f" over {report.get('transport') or 'nothing'}"
        )
    if ok:
        ok = _check_partition([reports[r] for r in range(len(codes))], epochs)
    print("demo " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


def _check_partition(reports: list[dict[str, Any]], epochs: int) -> bool:
    """Each epoch: equal shares that together hold every sample, repeats only as padding."""
    size = reports[0]["dataset_length"]
    ok = True
    for epoch in range(epochs):
        shares = [r["received"][epoch] for r in reports]
        counts = Counter(i for share in shares for i in share)
        equal = len({len(share) for share in shares}) == 1
        # DistributedSampler pads the last round with samples from the start of the epoch.
        padding = len(shares[0]) * len(shares) - size
        complete = set(counts) == set(range(size)) and sum(counts.values()) == size + padding
        good = equal and complete and 0 <= padding < len(shares)
        ok = ok and good
        repeats = f", {padding} repeated as padding" if padding else ", none twice"
        print(
            f"  epoch {epoch}: {len(shares)} equal shares of {len(shares[0])} samples; together "
            f"every one of the {size} samples{repeats}: {'yes' if good else 'NO'}"
        )
    return ok
