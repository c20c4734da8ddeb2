"""The examples run end to end as a user would run them: each starts its own server."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from tests.helpers import ROOT, subprocess_env

# Within the marks' timeout, so a hung example fails with its output rather than pytest's.
RUN_TIMEOUT = 240


def run_example(*args: str) -> str:
    """Runs `python examples/ARGS` from the repository root; returns its output, checked."""
    # os.environ has REMOTE_LOADER_CACHE from the autouse fixture: the server's workers build
    # the demo images there, not in the home directory.
    env = subprocess_env()
    # A session of its own, so that a timeout can stop the example's server and ranks too, not
    # only the example's own process.
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(args)} ran past {RUN_TIMEOUT} s:\n{out}")
    assert proc.returncode == 0, f"{' '.join(args)} exited with {proc.returncode}:\n{out}"
    return out


@pytest.mark.timeout(300)
def test_ddp_ranks_get_disjoint_shares_from_torch_distributed() -> None:
    out = run_example("examples/ddp.py", "--epochs", "1")
    # rank and world size come from the process group: 512 samples / 2 ranks / batches of 32.
    counts = dict(re.findall(r"^rank (\d) epoch 0: (\d+) batches \(len\(loader\) 8\)", out, re.M))
    assert counts == {"0": "8", "1": "8"}, out
    assert "epoch 1" not in out, out
    assert "rank 0 received 256 samples in epoch 0" in out, out
    assert "rank 1 received 256 samples in epoch 0" in out, out
    assert "0 repeated, union covers the dataset: yes" in out, out
    assert "partition check passed" in out, out
    # Each rank's gloo group is freed by destroy_process_group(): no gloo thread runs on into
    # interpreter exit (where one could abort the rank after all its work had passed).
    assert "rank 0: process group freed" in out and "rank 1: process group freed" in out, out


@pytest.mark.timeout(300)
def test_broadcast_consumers_receive_the_same_batches() -> None:
    out = run_example("examples/broadcast.py")
    assert re.search(r"^consumer 0: 16 batches \(len\(loader\) 16\)$", out, re.M), out
    assert re.search(r"^consumer 1: 16 batches \(len\(loader\) 16\)$", out, re.M), out
    assert "16 batches, 512 samples each; every sample once: yes" in out, out
    assert re.search(r"^identical: yes$", out, re.M), out
    assert "broadcast example passed" in out, out


@pytest.mark.timeout(300)
def test_an_elastic_restart_reads_every_sample_once() -> None:
    out = run_example("examples/elastic.py")
    assert out.count("life 1: rank") == 3 and out.count("life 2: rank") == 2, out
    assert "read 48 samples" in out and "read 168 samples" in out, out
    assert "480 samples read, 480 distinct, 0 repeated, 0 missing" in out, out
    assert "elastic check passed" in out, out


@pytest.mark.timeout(300)
def test_lightning_over_a_hugging_face_stream_reshuffles_per_epoch() -> None:
    out = run_example("examples/lightning_hf.py", "--epochs", "2")
    assert "epoch 0: first ids" in out and "epoch 1: first ids" in out, out
    assert "every id once: NO" not in out, out
    assert "each epoch in its own order: yes" in out, out
