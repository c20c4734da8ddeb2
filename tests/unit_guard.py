"""The `unit` mark's promise, enforced: a test marked `unit` (tests/conftest.py marks every test
in tests/unit/) starts no server, no process and no Ray, so `python -m pytest -m unit` stays a
loop of seconds. While such a test runs (its setup, fixtures of any scope included, its call and
its teardown), every way the project starts one raises instead of starting it:

- `remote_loader.server.api.server.Server(...)` and `create_server(...)`, and `grpc.server(...)`
  beneath them (any gRPC server, a test's own included);
- `multiprocessing` processes (`BaseProcess.start`: torch's DataLoader workers, the local pool,
  `ProcessPoolExecutor`), `subprocess.Popen` (`remote-loader serve`, Ray's own processes) and
  `os.fork`;
- `ray.init`, when something has imported Ray.

A hook wrapper rather than an autouse fixture: a module- or session-scoped fixture that starts a
server is set up before any function-scoped fixture, so a fixture would not see it; the hook
wraps the whole setup. `tests/conftest.py` imports the hook; tests/unit/test_unit_guard.py loads
this module as a plugin of an inner pytest run.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
import sys
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import pytest

from remote_loader.server.api import server as server_module

MESSAGE = (
    "a unit test must not start {what}; move it to tests/integration/ (every test in tests/unit/"
    " is marked `unit`)"
)


def _refuse(what: str) -> Callable[..., Any]:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(MESSAGE.format(what=what))

    return refused


def _targets() -> list[tuple[Any, str, str]]:
    """(owner, attribute, what it starts) for each thing a unit test may not call."""
    targets: list[tuple[Any, str, str]] = [
        (server_module.Server, "__init__", "a server (remote_loader Server)"),
        (server_module, "create_server", "a server (create_server)"),
        (grpc, "server", "a gRPC server (grpc.server)"),
        (grpc.aio, "server", "a gRPC server (grpc.aio.server)"),
        (multiprocessing.process.BaseProcess, "start", "a process (multiprocessing)"),
        (subprocess.Popen, "__init__", "a process (subprocess.Popen)"),
        (os, "fork", "a process (os.fork)"),
    ]
    ray = sys.modules.get("ray")
    if ray is not None and hasattr(ray, "init"):
        targets.append((ray, "init", "Ray (ray.init)"))
    return targets


@contextmanager
def refusing_starts() -> Iterator[None]:
    """Within it, starting a server, a process or Ray raises RuntimeError (see the module)."""
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in _targets()]
    try:
        for owner, name, what in _targets():
            setattr(owner, name, _refuse(what))
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, object, object]:
    if item.get_closest_marker("unit") is None:
        return (yield)
    with refusing_starts():
        return (yield)
