"""Fixtures: real servers on port 0 (in this process, or as `remote-loader serve` processes)."""

from __future__ import annotations

import dataclasses
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import wire
from remote_loader.server.api.server import Server
from remote_loader.server.api.settings import ServerSettings
from remote_loader.server.cli.main import spawn_serve
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.sharing.host import LoaderHost
from tests.unit_guard import pytest_runtest_protocol  # noqa: F401  (the `unit` mark's guard)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _cache_in_tmp(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The demo dataset caches its images; never in the home directory during tests.
    monkeypatch.setenv("REMOTE_LOADER_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@dataclasses.dataclass
class Served:
    """An in-process server: its address, its loaders (to look inside) and the server."""

    address: str
    hosts: dict[str, LoaderHost]
    server: Server


ServeLoaders = Callable[..., Served]
StartServer = Callable[..., str]


@pytest.fixture
def serve_loaders() -> Iterator[ServeLoaders]:
    """Starts an in-process server for the given specs on 127.0.0.1:0; keyword arguments are
    ServerSettings fields."""
    running: list[Served] = []

    def start(*specs: LoaderSpec, **settings: Any) -> Served:
        server = Server(ServerSettings(address="127.0.0.1:0", **settings), specs)
        server.start()
        running.append(Served(server.address, server.hosts, server))
        return running[-1]

    yield start
    for served in running:
        served.server.stop(0)


@pytest.fixture
def start_server(serve_loaders: ServeLoaders) -> StartServer:
    """Starts an in-process server for the given specs on 127.0.0.1:0; returns its address."""

    def start(*specs: LoaderSpec, **kwargs: Any) -> str:
        return serve_loaders(*specs, **kwargs).address

    return start


def subprocess_env(**extra: str) -> dict[str, str]:
    """This environment for a child process that imports `tests.*`: the repository first on
    PYTHONPATH, an existing PYTHONPATH (an install made with --target) kept after it."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def serve_process(*args: str, env: Mapping[str, str] = {}) -> tuple[subprocess.Popen[str], str]:
    """`remote-loader serve ARGS` on port 0 as a process, `env` added to this environment;
    returns it and its address."""
    env = subprocess_env(**env)  # workers import tests.datasets
    proc, port = spawn_serve(args, env=env, stderr=subprocess.PIPE)
    return proc, f"127.0.0.1:{port}"


def stop_process(proc: subprocess.Popen[str]) -> tuple[int, str]:
    """SIGTERM, then the exit code and stderr (closing the pipes)."""
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    return proc.returncode, err


def raw_stream(address: str, request: pb.StreamRequest) -> tuple[grpc.Channel, Any]:
    """A Stream call made by hand (no RemoteLoader): its channel, and the call of Frames."""
    channel = grpc.insecure_channel(address)
    call = channel.unary_stream(
        wire.STREAM_METHOD,
        request_serializer=pb.StreamRequest.SerializeToString,
        response_deserializer=pb.Frame.FromString,
    )(request)
    return channel, call


def wait_until(condition: Callable[[], bool], seconds: float) -> bool:
    """Polls `condition` every 20 ms for up to `seconds`; whether it became true."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie has exited; it only waits to be reaped)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def assert_same(a: Any, b: Any, path: str = "batch") -> None:
    """Exact equality of two batches: same types, dtypes, shapes and values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: {type(b)} is not a tensor"
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        )
        assert torch.equal(a.cpu(), b.cpu()), f"{path}: values differ\n{a}\n{b}"
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype, f"{path}: {b!r}"
        np.testing.assert_array_equal(a, b, err_msg=path)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{path}: keys {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {type(b)} of {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert type(a) is type(b) and a == b, f"{path}: {a!r} != {b!r}"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--conformance-examples",
        type=int,
        default=None,
        help="examples per case of tests/test_conformance.py (default 25; more to run it long)",
    )


# Where Ray would leave its files without the redirection below, for the check at the end.
RAY_DEFAULT_TEMP = Path("/tmp/ray")
RAY_TOKEN_FILE = Path.home() / ".ray" / "auth_token"


@dataclasses.dataclass
class RayFiles:
    """This session's Ray temp dir (None: the user chose one), and what was there before."""

    temp_dir: Path | None
    default_temp_before: set[str]
    token_existed: bool


RAY_FILES = pytest.StashKey[RayFiles]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # `-m unit` on the command line replaces pyproject's `-m 'not gpu'`: a test that needs CUDA
    # runs only where the marker expression names gpu (`pytest -m gpu`), never in the fast loop.
    if "gpu" in (config.option.markexpr or ""):
        return
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if item.get_closest_marker("gpu") is None]


def pytest_configure(config: pytest.Config) -> None:
    examples = config.getoption("--conformance-examples")
    if examples is not None:
        # Read when tests/test_conformance.py is imported, which is after this.
        os.environ["REMOTE_LOADER_CONFORMANCE_EXAMPLES"] = str(examples)
    config.stash[RAY_FILES] = redirect_ray_files()


def redirect_ray_files() -> RayFiles:
    """Keeps the Ray instances the tests start (tests/test_ray.py's cluster, a server's local
    instance, in this process or in `remote-loader serve` children: all inherit os.environ)
    from leaving files behind.

    - Session folders (logs, sockets, spilled objects): Ray puts them under $RAY_TMPDIR/ray
      (else $TMPDIR, else /tmp: /tmp/ray/session_*, never removed). Here a fresh folder of
      this session's, removed at its end. Short, under /tmp: Ray's Unix sockets live in it, and
      a socket path may have at most 107 characters.
    - ~/.ray/auth_token: Ray (2.60 here) turns token authentication on for a new local cluster when
      RAY_AUTH_MODE is unset, and writes a new token to that file when it finds none (ray
      _private/authentication/authentication_token_setup.py). A token in RAY_AUTH_TOKEN is
      found first, so none is written, and the tests still run the way a default cluster does:
      with token authentication.
    A RAY_TMPDIR / RAY_AUTH_* the user set is left alone."""
    before = set(os.listdir(RAY_DEFAULT_TEMP)) if RAY_DEFAULT_TEMP.is_dir() else set()
    temp_dir = None
    if "RAY_TMPDIR" not in os.environ:
        temp_dir = Path(tempfile.mkdtemp(prefix="rl-ray-", dir="/tmp"))
        os.environ["RAY_TMPDIR"] = str(temp_dir)
    if not any(f"RAY_AUTH_{name}" in os.environ for name in ("MODE", "TOKEN", "TOKEN_PATH")):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(16)
    return RayFiles(temp_dir, before, RAY_TOKEN_FILE.exists())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Removes this session's Ray folder; fails the run if Ray wrote where it should not have."""
    files = session.config.stash.get(RAY_FILES, None)
    if files is None or files.temp_dir is None:
        return
    used = any(files.temp_dir.iterdir())
    shutil.rmtree(files.temp_dir, ignore_errors=True)
    if not used:
        return  # no Ray ran here: anything new in /tmp/ray is another run's on this machine
    now = set(os.listdir(RAY_DEFAULT_TEMP)) if RAY_DEFAULT_TEMP.is_dir() else set()
    strays = [str(RAY_DEFAULT_TEMP / name) for name in sorted(now - files.default_temp_before)]
    if RAY_TOKEN_FILE.exists() and not files.token_existed:
        strays.append(str(RAY_TOKEN_FILE))
    if files.temp_dir.exists():
        strays.append(f"{files.temp_dir} (could not be removed: a Ray process still running?)")
    if strays:
        session.config.get_terminal_writer().line(
            "Ray left files outside this session's RAY_TMPDIR (or another Ray run on this "
            "machine made them meanwhile): " + ", ".join(strays),
            red=True,
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
