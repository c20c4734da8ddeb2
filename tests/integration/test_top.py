"""`remote-loader top` against a live server: `--once` prints each trainer's stall and the stage
holding it, the figures /metrics shows; the live curses view, run under a pseudo-terminal
(`script`), shows them too and leaves with 0 on q and on Ctrl-C; over mutual TLS it takes the
trainers' flags and token.

The unit tests (no server, no process, no Ray): tests/unit/test_top.py.
"""

from __future__ import annotations

import os
import re
import select
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from remote_loader.client import TLS
from remote_loader.server.api.server import Server
from tests import stalls
from tests.helpers import PKI, TOKEN, ServeLoaders, scrape, subprocess_env, value, wait_for
from tests.stalls import stalled_spec

TOP = [sys.executable, "-m", "remote_loader.server.cli.main", "top"]
# A trainer's line: job, rank/world, sharing, epoch, stall, stage.
LINE = re.compile(r"^\s+train\s+(\d)/2\s+partition\s+\d+\s+(\d+)%\s+(workers|in flight|copy|-)")
ESCAPES = re.compile(rb"\x1b(\[[0-9;?]*[ -/]*[@-~]|[()][0-9A-Za-z]|[=>])")


@pytest.fixture(scope="module")
def stalled_job() -> Iterator[Server]:
    with stalls.stalled_job() as server:
        yield server


def stalls_in(text: str) -> dict[int, tuple[int, str]]:
    """Each trainer's (stall %, stage) by rank, from top's text."""
    return {int(m[1]): (int(m[2]), m[3]) for m in map(LINE.match, text.splitlines()) if m}


@pytest.mark.timeout(90)
def test_once_prints_each_trainers_stall_as_metrics_has_it(stalled_job: Server) -> None:
    result = subprocess.run(
        [*TOP, stalled_job.address, "--once"],
        capture_output=True,
        text=True,
        env=subprocess_env(PYTHONIOENCODING="utf-8"),
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    shown = stalls_in(result.stdout)
    assert set(shown) == {0, 1}, result.stdout
    assert stalled_job.metrics_port is not None
    samples = scrape(stalled_job.metrics_port)
    for rank, (percent, stage) in shown.items():
        assert percent > 50 and stage == "workers", result.stdout
        labels = {"job": "train", "sharing": "partition", "rank": str(rank)}
        metric = value(samples, "remote_loader_consumer_stall", loader="stalled", **labels)
        assert metric is not None and metric > 0.5
        assert abs(100 * metric - percent) < 20  # a few seconds apart, the same trainer
    assert "loader stalled  local  1 workers" in result.stdout


def test_once_says_why_when_the_server_does_not_answer() -> None:
    result = subprocess.run(
        [*TOP, "127.0.0.1:1", "--once", "--timeout", "1"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=60,
    )
    assert result.returncode == 2 and "UNAVAILABLE" in result.stderr


def _live_top(address: str, key: bytes) -> tuple[int, str]:
    """Runs the live view under `script`'s pseudo-terminal until both trainers' lines show,
    then types `key`; its exit code and the screen text it drew."""
    if shutil.which("script") is None:
        # Not a skip: util-linux's `script` is on every Debian (bsdutils, essential).
        pytest.fail("needs util-linux `script` for a pseudo-terminal (apt-get install bsdutils)")
    # `script` runs the command through $SHELL, and dash (CI's /bin/sh) stays as its parent:
    # Ctrl-C would kill that shell, and `script` report its 130, whatever top did. `exec`
    # makes top the process `script` waits for, under any shell.
    command = "exec " + shlex.join([*TOP, address, "--interval", "0.5"])
    env = subprocess_env(TERM="xterm", LINES="40", COLUMNS="160", LANG="C.UTF-8", SHELL="/bin/sh")
    screen = b""
    with subprocess.Popen(
        ["script", "-qfec", command, "/dev/null"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                ready, _, _ = select.select([proc.stdout], [], [], 0.2)
                if ready:
                    screen += os.read(proc.stdout.fileno(), 65536)
                text = ESCAPES.sub(b"\n", screen).decode("utf-8", "replace")
                if re.search(r"train.*workers", text) and text.count("partition") >= 2:
                    break
            proc.stdin.write(key)
            proc.stdin.flush()
            code = proc.wait(timeout=20)
            screen += proc.stdout.read()
        finally:
            if proc.poll() is None:
                proc.kill()
    return code, ESCAPES.sub(b"\n", screen).decode("utf-8", "replace")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("key", "name"), [(b"q", "q"), (b"\x03", "Ctrl-C")])
def test_the_live_view_shows_each_trainers_stall_and_quits_cleanly(
    stalled_job: Server, key: bytes, name: str
) -> None:
    code, text = _live_top(stalled_job.address, key)
    assert code == 0, f"{name}: exit {code}\n{text[-2000:]}"
    assert "remote-loader top" in text and "STALL" in text
    assert "train" in text and "workers" in text
    # Each rank's line, with its stall: curses may draw a line in pieces, so look for the
    # rank and a stall of at least 50% after it.
    for rank in (0, 1):
        assert re.search(rf"{rank}/2[\s\S]{{0,80}}?\b([5-9]\d|100)%", text), (rank, text[-2000:])


@pytest.mark.timeout(120)
def test_top_reaches_a_server_over_mutual_tls_with_the_trainers_token(
    serve_loaders: ServeLoaders,
    pki: PKI,
) -> None:
    served = serve_loaders(stalled_spec(), **pki.server_settings(mutual=True), token=TOKEN)
    mutual = TLS(ca=pki.ca, cert=pki.client_cert, key=pki.client_key, server_name="localhost")
    tls = ["--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert)]
    tls += ["--tls-key", str(pki.client_key), "--tls-server-name", "localhost"]

    def top(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*TOP, served.address, "--once", *tls],
            capture_output=True,
            text=True,
            env=subprocess_env(PYTHONIOENCODING="utf-8", **env),
            timeout=60,
        )

    with stalls.Trainer(served.address, "stalled", token=TOKEN, tls=mutual, job="train"):
        # The trainer's reports go over the same channel: TLS and token.
        wait_for(lambda: "%" in top({"REMOTE_LOADER_TOKEN": TOKEN}).stdout, 30, "a report")
        shown = top({"REMOTE_LOADER_TOKEN": TOKEN})
        refused = top({"REMOTE_LOADER_TOKEN": ""})
    assert shown.returncode == 0, shown.stderr
    assert re.search(r"train\s+0/1\s+partition\s+\d+\s+(\d+)% workers", shown.stdout), shown.stdout
    assert refused.returncode == 2 and "UNAUTHENTICATED" in refused.stderr
