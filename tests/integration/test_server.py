"""The public Server: built from settings and specs, started and stopped, as a context manager."""

from __future__ import annotations

import re
import subprocess
import sys

import grpc
import pytest

from remote_loader.client import RemoteLoader
from remote_loader.server import ConfigError, LoaderSpec, Server, ServerSettings
from tests.helpers import ROOT, subprocess_env

SQUARES = LoaderSpec(name="squares", dataset="tests.datasets:Squares", batch_size=10)
LOCAL = ServerSettings(address="127.0.0.1:0")


def test_a_server_serves_its_loaders_inside_its_with_block() -> None:
    with Server(LOCAL, [SQUARES]) as server:
        assert server.port > 0 and server.address == f"127.0.0.1:{server.port}"
        assert server.data_port is not None and server.metrics_port is None
        with RemoteLoader(server.address, "squares", device="cpu") as loader:
            assert [int(i) for b in loader for i in b["index"]] == list(range(50))
        address = server.address
    # Stopped: the port no longer answers, and stopping again is harmless.
    server.stop()
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.FutureTimeoutError):
        grpc.channel_ready_future(channel).result(timeout=1.0)


def test_a_mapping_of_loaders_and_default_settings_are_accepted() -> None:
    server = Server(ServerSettings(address="127.0.0.1:0", max_streams=2), {"squares": SQUARES})
    try:
        server.start()
        assert repr(server) == f"<Server squares on port {server.port}>"
        with RemoteLoader(server.address, device="cpu") as loader:
            assert len(list(loader)) == 5
    finally:
        server.stop(0)


@pytest.mark.parametrize(
    ("loaders", "message"),
    [
        ([], "a server needs at least one loader"),
        ([SQUARES, SQUARES], "two loaders are named 'squares': names must be unique"),
    ],
)
def test_bad_loader_lists_are_refused(loaders: list[LoaderSpec], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Server(LOCAL, loaders)


def test_the_package_loads_grpc_only_when_the_server_is_asked_for() -> None:
    # Workers import remote_loader.server.worker.loop in the fork server, which must stay free of
    # gRPC (forking a process that runs gRPC is unsafe); `Server` is imported on first use.
    code = (
        "import sys, remote_loader.server.worker.loop as w, remote_loader.server as s;"
        "print('grpc' in sys.modules);"
        "s.Server;"
        "print('grpc' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True
    )
    assert result.stdout.split() == ["False", "True"], result.stderr


def test_the_send_stage_imports_nothing_of_the_sharing_stage() -> None:
    # Issue 28: the transports take an Outgoing (server/batch/outgoing.py), which the sharing
    # stage's Entry adapts itself to; were they to import lanes, run or policies, those would import
    # the transports back one day and close a circle.
    code = (
        "import sys, remote_loader.server.transports;"
        "print(sorted(m for m in sys.modules if m.rsplit('.', 1)[-1] in"
        " ('lanes', 'run', 'consumer', 'policy', 'policies', 'sharing', 'membership', 'elastic')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True
    )
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


def test_the_docs_server_example_runs() -> None:
    serving = (ROOT / "docs" / "serving.md").read_text()
    section = serving[serving.index("## Serving from Python") :]
    start = section.index("```python\n") + len("```python\n")
    code = section[start : section.index("\n```", start)]
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=subprocess_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(
        r"512 images in one epoch from <Server images on port \d+>\n", result.stdout
    )
