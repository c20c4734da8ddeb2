"""`remote-loader` progress output as the CLI writes it, without running a command: plain lines
into a pipe, a line every interval.

The tests that start a server, a process or Ray: tests/integration/test_cli.py.
"""

from __future__ import annotations

import io
import os
import re

from remote_loader.server.cli.demo import PlainProgress, progress_bars


def test_progress_into_a_pipe_is_plain_lines() -> None:
    read, write = os.pipe()  # not a terminal, as when the demo's output is piped or logged
    with os.fdopen(read) as reader, os.fdopen(write, "w") as writer:
        bars = progress_bars(2, writer)
        assert all(isinstance(bar, PlainProgress) for bar in bars)
        bars[0].total = 3
        bars[0].refresh()
        for _ in range(3):
            bars[0].update(1)  # within PLAIN_PROGRESS_INTERVAL: no line per batch
        bars[0].close()
        bars[1].close()
        writer.close()
        lines = reader.read().splitlines()
    assert lines[0] == "trainer 0: 0/3 batches"
    assert re.fullmatch(r"trainer 0: 3/3 batches in \d+\.\d s", lines[1]), lines
    assert re.fullmatch(r"trainer 1: 0 batches in \d+\.\d s", lines[2]), lines
    assert len(lines) == 3


def test_plain_progress_shows_a_line_every_interval() -> None:
    out = io.StringIO()
    bar = PlainProgress("trainer 0", out, interval=0.0)  # every update is past the interval
    bar.update(1)
    bar.update(2)
    assert out.getvalue().splitlines() == ["trainer 0: 1 batches", "trainer 0: 3 batches"]
