"""The `unit` mark's guard (tests/unit_guard.py): a test marked `unit` that starts a server, a
process or Ray fails, saying so and naming the mark, whether it starts it in its body or in a
fixture of a wider scope; the guard puts back what it replaced.

An inner pytest session in this process (pytester) runs a small test file with the guard as its
plugin. Nothing is started: the guard refuses every start, and the inner tests clean up after
themselves should it ever let one through.

The tests that start a server, a process or Ray: tests/integration/test_unit_guard.py.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess

import grpc
import pytest

from remote_loader.server.api import server as server_module
from tests.helpers import UNIT_MARKER_INI

pytest_plugins = ["pytester"]

INNER = """
import multiprocessing
import os
import subprocess
import sys
from concurrent import futures

import grpc
import pytest

from remote_loader.server.api.server import Server, create_server
from remote_loader.server.api.settings import ServerSettings
from remote_loader.server.config.spec import LoaderSpec

SPEC = LoaderSpec(name="squares", dataset="tests.datasets:Squares", batch_size=2)
SETTINGS = ServerSettings(address="127.0.0.1:0")


@pytest.fixture(scope="module")
def module_server():
    with Server(SETTINGS, [SPEC]) as server:
        yield server


def test_starts_a_server():
    with Server(SETTINGS, [SPEC]):
        pass


def test_creates_a_grpc_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    server.stop(None)


def test_starts_a_process():
    process = multiprocessing.get_context("spawn").Process(target=os.getpid)
    process.start()
    process.join()


def test_runs_a_command():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_forks():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def test_uses_a_module_scoped_server(module_server):
    pass


def test_pure():
    assert sum(range(4)) == 6
"""


def test_a_unit_test_that_starts_a_server_or_a_process_fails(pytester: pytest.Pytester) -> None:
    replaced = [
        (server_module.Server, "__init__"),
        (server_module, "create_server"),
        (grpc, "server"),
        (multiprocessing.process.BaseProcess, "start"),
        (subprocess.Popen, "__init__"),
        (os, "fork"),
    ]
    before = [getattr(owner, name) for owner, name in replaced]
    pytester.makeini(UNIT_MARKER_INI)
    pytester.makeconftest('pytest_plugins = ["tests.unit_guard"]')
    pytester.makepyfile(test_inner=INNER)

    # --assert=plain: the guard's module is imported already, its asserts cannot be rewritten.
    reprec = pytester.inline_run("-p", "no:cacheprovider", "--assert=plain")

    refused = {
        report.nodeid.split("::")[-1]: str(report.longrepr)
        for report in reprec.getreports("pytest_runtest_logreport")
        if report.failed
    }
    expected = {
        "test_starts_a_server": "a server (remote_loader Server)",
        "test_creates_a_grpc_server": "a gRPC server (grpc.server)",
        "test_starts_a_process": "a process (multiprocessing)",
        "test_runs_a_command": "a process (subprocess.Popen)",
        "test_forks": "a process (os.fork)",
        # Refused in its setup: the module-scoped fixture is set up inside the guard too.
        "test_uses_a_module_scoped_server": "a server (remote_loader Server)",
    }
    assert sorted(refused) == sorted(expected), refused
    for name, what in expected.items():
        message = f"RuntimeError: a unit test must not start {what}; move it to tests/integration/"
        assert message in refused[name], (name, refused[name])
    reports = reprec.getreports("pytest_runtest_logreport")
    passed = [r.nodeid for r in reports if r.when == "call" and r.passed]
    assert passed == ["test_inner.py::test_pure"]
    # Put back after each test: what this test (itself marked unit) saw before is there again.
    assert [getattr(owner, name) for owner, name in replaced] == before
