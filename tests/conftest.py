"""Fixtures: real servers on port 0 (in this process), and those several test modules share; hooks:
the `unit`/`integration` mark by folder and Ray's files kept in a folder of the session's.

Plain helpers (servers as processes, waits, comparisons, clusters) are in tests/helpers.py."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import secrets
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from remote_loader.client import (
    assembly,
)
from remote_loader.protos import batch_types, tcp
from remote_loader.server.api.server import Server
from remote_loader.server.api.settings import ServerSettings
from remote_loader.server.config.spec import LoaderSpec
from tests.helpers import (
    JOB_VARIABLES,
    PKI,
    Served,
    ServeLoaders,
    StartServer,
    issue_certificate,
    left_in_dev_shm,
    wait_until,
    write_pem,
)
from tests.unit_guard import pytest_runtest_protocol  # noqa: F401  (the `unit` mark's guard)


@pytest.fixture(autouse=True)
def _cache_in_tmp(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The demo dataset caches its images; never in the home directory during tests.
    monkeypatch.setenv("REMOTE_LOADER_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


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


# --- Fixtures that more than one test module uses ---------------------------------------------


@pytest.fixture
def no_ring_left_behind() -> Iterator[None]:
    """Fails the test if it leaves a ring or a doorbell in /dev/shm (modules of the shared-memory
    transport use it for every test: `pytestmark = pytest.mark.usefixtures(...)`)."""
    before = left_in_dev_shm()
    yield
    assert wait_until(lambda: not left_in_dev_shm() - before, 5.0), left_in_dev_shm() - before


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    out = tmp_path_factory.mktemp("pki")
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = issue_certificate("remote-loader test CA", ca_key, None)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = issue_certificate(
        "localhost",
        server_key,
        (ca.subject, ca_key),
        sans=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))],
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    client = issue_certificate(
        "trainer-0", client_key, (ca.subject, ca_key), usage=ExtendedKeyUsageOID.CLIENT_AUTH
    )
    write_pem(out / "ca.pem", ca, None)
    write_pem(out / "server.pem", server, server_key)
    write_pem(out / "client.pem", client, client_key)
    return PKI(
        out / "ca.pem",
        out / "server.pem",
        out / "server.key",
        out / "client.pem",
        out / "client.key",
    )


@pytest.fixture
def recv_spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[int]]:
    """The client's sockets that data arrived on (by fileno), through tcp.recv_into."""
    real: Callable[..., bool] = tcp.recv_into
    used: set[int] = set()
    lock = threading.Lock()

    def spy(sock: socket.socket, out: memoryview, *args: Any) -> bool:
        if len(out):
            with lock:
                used.add(sock.fileno())
        return real(sock, out, *args)

    monkeypatch.setattr(tcp, "recv_into", spy)
    yield used


@pytest.fixture
def fresh_types(monkeypatch: pytest.MonkeyPatch) -> batch_types.BatchTypes:
    """Type lookups and warnings as in a fresh process, so each test sees its own warnings."""
    types = batch_types.BatchTypes()
    monkeypatch.setattr(batch_types, "TYPES", types)
    return types


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache folder of this test's own (REMOTE_LOADER_CACHE), where the session's is shared."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("REMOTE_LOADER_CACHE", str(cache))
    return cache


@pytest.fixture
def job_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No job variables: each test sets its own."""
    for name in JOB_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def copy_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The copy of a batch in striped over 3 threads, as on a host with 12 CPUs or more (NOTE
    [ Copying a batch in ]); a pool of its own, shut down after."""
    monkeypatch.setattr(assembly, "COPY_THREADS", 3)
    monkeypatch.setattr(assembly, "_copy_pool", None)
    yield
    if assembly._copy_pool is not None:
        assembly._copy_pool[1].shutdown()


@pytest.fixture
def no_token_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # RemoteLoader reads REMOTE_LOADER_TOKEN when token= is not given; tests set it themselves.
    monkeypatch.delenv("REMOTE_LOADER_TOKEN", raising=False)


# --- Hooks: options, marks by folder, Ray's files ------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--conformance-examples",
        type=int,
        default=None,
        help=(
            "examples per case of tests/integration/test_conformance.py (default 25; more to run"
            " it long)"
        ),
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


UNIT_DIR = Path(__file__).resolve().parent / "unit"


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by the marks given here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The folder is the mark: every test in tests/unit/ is `unit` (and tests/unit_guard.py holds
    # it to that), every other one `integration`.
    for item in items:
        unit = item.path.is_relative_to(UNIT_DIR)
        item.add_marker(pytest.mark.unit if unit else pytest.mark.integration)
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
        # Read when tests/integration/test_conformance.py is imported, which is after this.
        os.environ["REMOTE_LOADER_CONFORMANCE_EXAMPLES"] = str(examples)
    config.stash[RAY_FILES] = redirect_ray_files()


def redirect_ray_files() -> RayFiles:
    """Keeps the Ray instances the tests start (tests/integration/test_ray.py's cluster, a
    server's local instance, in this process or in `remote-loader serve` children: all inherit
    os.environ) from leaving files behind.

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
