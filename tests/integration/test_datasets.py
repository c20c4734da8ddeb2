"""The demo folder made by three processes at once: one of them makes it, atomically, and all
three get its path.

The unit tests (no server, no process, no Ray): tests/unit/test_datasets.py.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest

from remote_loader.server.datasets import (
    DEMO_CLASSES,
    DEMO_DIRNAME,
    DEMO_PER_CLASS,
    demo_folder,
)
from tests.helpers import _files

# Each test caches in a folder of its own.
pytestmark = pytest.mark.usefixtures("own_cache")


def _generate_after_barrier(root: str, barrier: Any, results: Any) -> None:
    barrier.wait(timeout=60)
    results.put(str(demo_folder(root)))


def test_demo_folder_concurrent_generation(tmp_path: Path) -> None:
    # forkserver with the dataset module preloaded: each child forks from an interpreter that has
    # already imported torch, instead of importing it three times over on a small machine.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["remote_loader.server.datasets", __name__])
    barrier = ctx.Barrier(3)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_generate_after_barrier, args=(str(tmp_path), barrier, results))
        for _ in range(3)
    ]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.join(timeout=60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    exits = {proc.pid: proc.exitcode for proc in procs}
    assert list(exits.values()) == [0, 0, 0], f"generator processes exited with {exits}"
    # Each child's one short line fits the pipe, so joining before reading cannot deadlock.
    paths = [results.get(timeout=5) for _ in procs]
    results.close()
    results.join_thread()
    assert paths == [str(tmp_path / DEMO_DIRNAME)] * 3
    assert [p.name for p in tmp_path.iterdir()] == [DEMO_DIRNAME]
    assert len(_files(tmp_path / DEMO_DIRNAME)) == DEMO_CLASSES * DEMO_PER_CLASS
