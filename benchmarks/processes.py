"""What the benchmarks share: starting and stopping `remote-loader serve` (and other servers
that announce "serving ... on port N"), and reading process trees from /proc (CPU seconds,
resident memory) without third-party packages."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from benchmarks.tlsfiles import TlsFiles
from remote_loader.server.cli.main import spawn_serve

ROOT = Path(__file__).resolve().parents[1]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
# Seconds a server process may take to print its port (it imports torch and starts workers).
STARTUP_TIMEOUT = 120.0


def subprocess_env() -> dict[str, str]:
    """This environment with the repository root first on PYTHONPATH, so that processes we start
    (and their workers) import the workloads as `benchmarks.workloads`."""
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def start_server(flags: Sequence[str]) -> tuple[subprocess.Popen[str], str]:
    """`remote-loader serve FLAGS` on 127.0.0.1, a free port, as a separate process; returns it
    and its address. Its stderr is inherited: server warnings show up beside the output."""
    proc, port = spawn_serve(flags, env=subprocess_env())
    return proc, f"127.0.0.1:{port}"


class Far(Protocol):
    """Another "host" servers can run on: benchmarks/netns.py's Link, or one of
    benchmarks/cpuhost.py's Hosts (`Hosts.on`)."""

    @property
    def server_ip(self) -> str: ...

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """The command line that runs `argv` on that host."""
        ...

    def describe(self) -> str: ...


@dataclasses.dataclass
class Placement:
    """Where servers run: on loopback (`link` None: 127.0.0.1, this namespace), or on `link`:
    inside its network namespace with a private /dev/shm, on its address (benchmarks/netns.py)."""

    link: Far | None = None
    # TLS for every server started here (`--tls`): its files; None: plaintext.
    tls: TlsFiles | None = None

    @property
    def host(self) -> str:
        """The address servers listen on and clients dial."""
        return "127.0.0.1" if self.link is None else self.link.server_ip

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """The command line that runs `argv` there."""
        return list(argv) if self.link is None else self.link.wrap(argv)

    def describe(self) -> str:
        return "over loopback" if self.link is None else "across network namespaces"


@dataclasses.dataclass
class Served:
    """A `remote-loader serve` process, its address, and (`serve_at` a link) its log file."""

    proc: subprocess.Popen[str]
    address: str
    log: Path | None = None

    def stop(self) -> collections.Counter[str]:
        """Stops the server; the transports its "stream start" log lines named, counted (none
        without a log)."""
        stop_process(self.proc)
        if self.log is None:
            return collections.Counter()
        text = self.log.read_text(errors="replace")
        self.log.unlink()
        # logfmt values are bare, or JSON strings when they hold spaces ("grpc (shm offered,
        # declined)").
        found = (
            re.search(r'transport=("(?:[^"\\]|\\.)*"|\S+)', line)
            for line in text.splitlines()
            if "stream start" in line
        )
        return collections.Counter(json.loads(m[1]) if m[1][0] == '"' else m[1] for m in found if m)


def serve_at(place: Placement, flags: Sequence[str]) -> Served:
    """`remote-loader serve FLAGS` as a separate process where `place` says, on a free port.

    On loopback: `start_server` (WARNING logs, stderr inherited). Across a link: the gRPC port
    and the data listener ("auto": the --address host, a free port) on the namespace's address,
    logging at INFO into a file (its lines would interleave with a progress bar) for the "stream
    start ... transport=" lines that `Served.stop` counts; the file is printed if it fails."""
    if place.tls is not None:
        flags = [*flags, *place.tls.serve_flags()]
    if place.link is None:
        return Served(*start_server(flags))
    argv = [
        sys.executable, "-m", "remote_loader.server.cli.main", "serve",
        "--address", f"{place.host}:0", "--data-address", "auto", "--log-level", "INFO", *flags,
    ]  # fmt: skip
    with tempfile.NamedTemporaryFile(
        "w", prefix="rlbench-serve-", suffix=".log", delete=False
    ) as f:
        log = Path(f.name)
        proc = subprocess.Popen(
            place.wrap(argv), stdout=subprocess.PIPE, stderr=f, text=True, env=subprocess_env()
        )
    try:
        port = banner_port(read_banner(proc, "remote-loader serve"), "remote-loader serve")
    except RuntimeError:
        print(log.read_text(errors="replace"), file=sys.stderr)
        log.unlink()
        raise
    return Served(proc, f"{place.host}:{port}", log)


def read_line(proc: subprocess.Popen[str], what: str, timeout: float) -> str:
    """The next stdout line of `proc`, waiting at most `timeout` s; RuntimeError saying whether
    it exited (its stderr, where it was not redirected, is above) or was silent."""
    if proc.stdout is None:
        raise ValueError(f"{what} was started without stdout=PIPE")
    ready, _, _ = select.select([proc.stdout], [], [], max(0.0, timeout))
    line = proc.stdout.readline() if ready else ""
    if not line:
        code = proc.poll()
        raise RuntimeError(
            f"{what} "
            + (f"exited with code {code}" if code is not None else f"was silent for {timeout:g} s")
        )
    return line


def read_banner(proc: subprocess.Popen[str], what: str, timeout: float = STARTUP_TIMEOUT) -> str:
    """The first stdout line of `proc`, waiting at most `timeout` s; kills it on failure."""
    try:
        return read_line(proc, what, timeout)
    except RuntimeError:
        proc.kill()
        proc.communicate()
        raise


def banner_port(line: str, what: str) -> int:
    """N of a "serving ... on port N" line."""
    match = re.search(r"on port (\d+)", line)
    if not match:
        raise RuntimeError(f"{what}: expected 'serving ... on port N', got {line!r}")
    return int(match.group(1))


def stop_process(proc: subprocess.Popen[str]) -> None:
    """SIGTERM, then wait (closing its pipes); SIGKILL if it does not go in 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def process_table() -> dict[int, tuple[int, float]]:
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


def tree_pids(
    root: int,
    *,
    include_root: bool = True,
    exclude: Iterable[int] = (),
    table: dict[int, tuple[int, float]] | None = None,
) -> list[int]:
    """`root` and its live descendants, skipping the subtrees of `exclude`."""
    if table is None:
        table = process_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    skip = set(exclude)
    pids = [root] if include_root and root in table else []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in skip:
                pids.append(child)
                todo.append(child)
    return pids


def tree_cpu(root: int, *, include_root: bool = True, exclude: Iterable[int] = ()) -> float:
    """CPU seconds of `root` and its live descendants, skipping the subtrees of `exclude`."""
    table = process_table()
    pids = tree_pids(root, include_root=include_root, exclude=exclude, table=table)
    return sum(table[pid][1] for pid in pids)


def process_rss(pid: int) -> int:
    """Resident bytes of process `pid` (/proc/PID/statm, as psutil reads it); 0 once it exited."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return 0


def machine_cpu_seconds() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal (guest time is inside user already)
    return (sum(fields[:8]) - fields[3] - fields[4]) / CLOCK_TICKS


def loadavg() -> str:
    """The load averages of /proc/loadavg (1, 5, 15 min): the machine may be shared."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])
