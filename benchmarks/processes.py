"""What the benchmarks share: starting and stopping `remote-loader serve`, and reading process
trees from /proc (CPU seconds, resident memory) without third-party packages."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterable, Sequence
from pathlib import Path

from remote_loader.server.cli import spawn_serve

ROOT = Path(__file__).resolve().parents[1]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


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
