"""The Ray pool's faults and lifecycle: a bridge that ends with its server, addresses that are no
Ray, a cluster without CPUs or gone, capacity lost mid-epoch, the actors' sys.path and the pool
kept between epochs. Real clusters on 127.0.0.1 (tests/helpers.py's start_cluster), real listeners,
real kills.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from ray.cluster_utils import Cluster

from remote_loader.client import RemoteLoader, RemoteLoaderError
from remote_loader.server.api.server import Server
from remote_loader.server.api.settings import ServerSettings
from remote_loader.server.cli.demo import serve_command
from remote_loader.server.config.file import spec_from_table
from remote_loader.server.config.spec import ConfigError, LoaderSpec, resolve
from remote_loader.server.engine import kept as kept_pools
from remote_loader.server.engine.pool import WorkerPool
from remote_loader.server.engine.ray.connect import CONNECT_TIMEOUT, GCS_PROBE_METHOD
from tests.helpers import (
    CASES,
    LOOPBACK,
    NODE,
    SEED,
    assert_same,
    descendants,
    first_error,
    loader_metric,
    local_batches,
    process_alive,
    serve_process,
    start_cluster,
    stop_process,
    subprocess_env,
    wait_until,
)


@pytest.fixture
def not_ray() -> Iterator[str]:
    """A loopback gRPC server with no services: it completes gRPC's handshake and answers
    every call UNIMPLEMENTED, as any gRPC server that is not Ray's would."""
    yield from _grpc_server(answers=())


@pytest.fixture
def half_ray() -> Iterator[str]:
    """A loopback gRPC server that answers the bridge's probe of a GCS
    (ray_connect.GCS_PROBE_METHOD) and nothing else: ray.init is left retrying for minutes,
    as against a GCS that hangs."""
    yield from _grpc_server(answers=(GCS_PROBE_METHOD,))


class _Answers(grpc.GenericRpcHandler):  # type: ignore[type-arg]
    def __init__(self, methods: tuple[str, ...]) -> None:
        self.methods = methods

    def service(self, details: Any) -> Any:
        if details.method not in self.methods:
            return None  # UNIMPLEMENTED
        return grpc.unary_unary_rpc_method_handler(lambda request, context: b"")


def _grpc_server(answers: tuple[str, ...]) -> Iterator[str]:
    server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers([_Answers(answers)])
    port = server.add_insecure_port(f"{LOOPBACK}:0")
    server.start()
    yield f"{LOOPBACK}:{port}"
    server.stop(0)


def listener(answer: bytes | None) -> tuple[socket.socket, str]:
    """A loopback socket that accepts and says nothing (None) or `answer`."""
    sock = socket.socket()
    sock.bind((LOOPBACK, 0))
    sock.listen()
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            held.append(conn)  # kept open: the peer sees silence, not a close
            if answer is not None:
                conn.sendall(answer)

    threading.Thread(target=accept, daemon=True).start()
    return sock, f"{LOOPBACK}:{sock.getsockname()[1]}"


@pytest.mark.timeout(120)
def test_a_killed_server_leaves_no_bridge_behind_while_it_connects(half_ray: str) -> None:
    proc = subprocess.Popen(
        [
            *serve_command(["--dataset", "tests.datasets:Squares", "--num-workers", "1"]),
            *["--pool", "ray", "--ray-address", half_ray, "--log-level", "WARNING"],
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=subprocess_env(),
    )
    try:
        assert proc.stdout is not None
        port = proc.stdout.readline().strip().rsplit(" ", 1)[-1]
        before = descendants(proc.pid)  # the fork server and its resource tracker
        # Not persistent: the first stream starts the pool, whose bridge then connects.
        threading.Thread(target=_stream_until_it_fails, args=(port,), daemon=True).start()
        assert wait_until(lambda: bool(descendants(proc.pid) - before), 60)
        # In ray.init now (the probe passes: the GCS method answers). A time, not a state: the
        # bridge's phase inside the killed server's process is not visible from here, and a kill
        # that lands earlier or later leaves the same check below (nothing of the family left).
        time.sleep(2.0)
        family = descendants(proc.pid)
        assert family - before
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert wait_until(lambda: not _alive(family), 10), (
            f"still running: {_cmdlines(_alive(family))}"
        )
    finally:
        proc.kill()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()


def _alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if process_alive(pid)}


def _stream_until_it_fails(port: str) -> None:
    try:
        with RemoteLoader(f"{LOOPBACK}:{port}", retries=0) as loader:
            list(loader)
    except RemoteLoaderError:
        pass  # the server was killed


def _cmdlines(pids: set[int]) -> list[str]:
    out = []
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            line = f.read().replace(b"\0", b" ")[:120]
        out.append(f"{pid}: {line!r}")
    return out


def ray_spec(**extra: Any) -> LoaderSpec:
    options: dict[str, Any] = {
        "name": "r",
        "dataset": "tests.datasets:Squares",
        "num_workers": 1,
        "pool": "ray",
        "ray_num_cpus": 0.25,
    }
    return LoaderSpec(**{**options, **extra})


@pytest.mark.timeout(90)
@pytest.mark.parametrize("answer", [None, b"HTTP/1.1 400 Bad Request\r\n\r\n"])
def test_a_listener_that_is_not_ray_is_a_clear_error(answer: bytes | None) -> None:
    sock, address = listener(answer)
    with sock:
        message, took = first_error(address, ray_spec())
    assert f"cannot use the Ray cluster at {address}" in message
    assert "does not answer as a Ray cluster" in message and "ray_address" in message
    print(f"not Ray ({answer!r}): error after {took:.1f} s")
    assert took < 60, took  # an error, not the 160 s it took (within PROBE_TIMEOUT here)


@pytest.mark.timeout(90)
def test_a_grpc_server_that_is_not_ray_is_a_clear_error(not_ray: str) -> None:
    message, took = first_error(not_ray, ray_spec())
    assert f"cannot use the Ray cluster at {not_ray}" in message
    assert "a gRPC server answers" in message and "not a Ray cluster's GCS" in message
    assert "ray_address" in message
    print(f"a gRPC server, not Ray: error after {took:.1f} s")
    # Told by its answer, not by ray.init's CONNECT_TIMEOUT (20 s) running out.
    assert took < CONNECT_TIMEOUT, took


@pytest.mark.timeout(150)
def test_a_cluster_without_free_cpus_says_what_is_missing() -> None:
    cluster = start_cluster(0)  # a head without CPUs, and no node
    try:
        message, took = first_error(cluster.address, ray_spec(num_workers=2, ray_num_cpus=1))
    finally:
        cluster.shutdown()  # type: ignore[no-untyped-call]
    assert "num_workers=2 x ray_num_cpus=1 = 2 CPUs asked, 0 free of 0" in message
    print(f"no free CPUs: error after {took:.1f} s")
    assert took < 90, took


@pytest.mark.timeout(180)
def test_a_cluster_that_goes_away_is_found_in_seconds() -> None:
    lost = start_cluster(1)
    spec = ray_spec(
        dataset="tests.datasets:Slow",
        dataset_kwargs={"n": 400, "seconds": 0.05},
        batch_size=1,
        ray_num_cpus=0.5,
    )
    settings = ServerSettings(address=f"{LOOPBACK}:0", ray_address=lost.address)
    with Server(settings, [spec]) as server, RemoteLoader(server.address, retries=0) as loader:
        it = iter(loader)
        for _ in range(3):
            next(it)
        lost.shutdown()  # type: ignore[no-untyped-call]
        gone = time.monotonic()
        with pytest.raises(RemoteLoaderError) as info:
            list(it)
        took = time.monotonic() - gone
    print(f"cluster gone: error {took:.1f} s after it was shut down")
    assert "Ray driver process exited" in str(info.value)
    # Ray's default, 60 s of reconnecting, is what this bounds (GCS_RECONNECT_TIMEOUT = 5 s).
    assert took < 40, took


@pytest.mark.timeout(300)
def test_capacity_lost_mid_epoch_keeps_the_epoch_and_grows_back() -> None:
    # Two nodes of one CPU beside a head without CPUs (the bridge's node), one actor each: no
    # spare CPU anywhere, so the actor of the removed node cannot be replaced until one joins.
    cluster = start_cluster(0)
    try:
        _capacity_lost(cluster)
    finally:
        cluster.shutdown()  # type: ignore[no-untyped-call]


def _capacity_lost(cluster: Cluster) -> None:
    cluster.add_node(**{**NODE, "num_cpus": 1})
    doomed = cluster.add_node(**{**NODE, "num_cpus": 1})
    cluster.wait_for_nodes()
    spec = ray_spec(
        name="slow",
        dataset="tests.datasets:Slow",
        dataset_kwargs={"n": 30, "seconds": 0.05},
        batch_size=1,
        num_workers=2,
        persistent_workers=True,
        ray_num_cpus=1,
    )
    # torch's DataLoader order (tests/integration/test_parity.py's reference)
    expected = list(range(30))
    settings = ServerSettings(address=f"{LOOPBACK}:0", ray_address=cluster.address)
    with Server(settings, [spec]) as server, RemoteLoader(server.address) as loader:
        host = server.hosts["slow"]
        pool = host.persistent_pool
        assert isinstance(pool, WorkerPool) and host.pool_info["nodes"] == 2

        def pool_workers() -> float:  # the gauge, as /metrics shows it
            return loader_metric(host, "remote_loader_pool_workers", loader="slow", backend="ray")

        got = []
        for i, batch in enumerate(loader):
            got.append(int(batch))
            if i == 5:
                cluster.remove_node(doomed)
        assert got == expected  # every batch once, in order, though a worker was lost
        assert pool_workers() == 1  # the shortfall shows
        assert pool.working == 1
        cluster.add_node(**{**NODE, "num_cpus": 1})  # CPUs return
        for _ in range(10):  # the replacement starts while an epoch polls the bridge
            assert [int(b) for b in loader] == expected
            if pool.working == 2:
                break
        assert pool.working == 2
        assert pool_workers() == 2


@pytest.mark.timeout(240)
def test_a_local_ray_instance_does_not_warn_of_token_authentication() -> None:
    # Without ray_address nor persistent_workers, each epoch starts a local Ray instance, and
    # Ray warned "Token authentication is enabled" at every start.
    proc, address = serve_process(
        *["--dataset", "tests.datasets:Squares", "--dataset-kwargs", '{"n": 6}'],
        *["--num-workers", "1", "--pool", "ray", "--ray-num-cpus", "0.25"],
    )
    try:
        for epoch in range(2):
            with RemoteLoader(address, retries=0) as loader:
                loader.set_epoch(epoch)
                assert len(list(loader)) == 6
    finally:
        code, err = stop_process(proc)
    assert code == 0, err
    assert "Token authentication is enabled" not in err, err


@pytest.mark.timeout(240)
def test_actors_import_what_the_server_imports_not_its_cwd(tmp_path: Path) -> None:
    # Started from a folder holding another `tests` package (without `datasets.Squares`):
    # Ray put the driver's working directory on the actors' sys.path, so they imported it.
    decoy = tmp_path / "tests"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("")
    (decoy / "datasets.py").write_text("NOT_THE_ONE = True\n")
    cluster = start_cluster(1)
    try:
        # The console script, as a user runs it: the server's own sys.path has no cwd.
        script = os.path.join(os.path.dirname(sys.executable), "remote-loader")
        proc = subprocess.Popen(
            [
                *[script, "serve", "--address", f"{LOOPBACK}:0"],
                *["--dataset", "tests.datasets:Squares", "--dataset-kwargs", '{"n": 4}'],
                *["--num-workers", "1", "--pool", "ray", "--ray-num-cpus", "0.25"],
                *["--ray-address", cluster.address, "--log-level", "WARNING"],
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env=subprocess_env(),
        )
        assert proc.stdout is not None
        port = proc.stdout.readline().strip().rsplit(" ", 1)[-1]
        try:
            with RemoteLoader(f"{LOOPBACK}:{port}", retries=0) as loader:
                assert len(list(loader)) == 4
        finally:
            proc.stdout.close()
            stop_process(proc)
    finally:
        cluster.shutdown()  # type: ignore[no-untyped-call]


def test_a_missing_attribute_names_the_file_imported() -> None:
    with pytest.raises(ConfigError, match=r"the module imported is .*tests/datasets\.py"):
        resolve("tests.datasets:NoSuchThing", "dataset")


def test_ray_runtime_env_is_checked() -> None:
    base: dict[str, Any] = {"name": "x", "dataset": "tests.datasets:Squares", "num_workers": 1}
    with pytest.raises(ConfigError, match="unknown key 'conda'; allowed: working_dir"):
        LoaderSpec(pool="ray", ray_runtime_env={"conda": "env"}, **base)
    with pytest.raises(ConfigError, match=r"env_vars must be environment variables"):
        LoaderSpec(pool="ray", ray_runtime_env={"env_vars": {"A": 1}}, **base)
    with pytest.raises(ConfigError, match='ray_runtime_env is for pool = "ray"'):
        LoaderSpec(ray_runtime_env={"working_dir": "."}, **base)
    with pytest.raises(ConfigError, match="must be a table"):
        spec_from_table("x", {"dataset": "tests.datasets:Squares", "ray_runtime_env": "."})


@pytest.mark.timeout(240)
def test_a_dataset_module_only_in_ray_runtime_env_working_dir(tmp_path: Path) -> None:
    # The factory runs once, in the server (NOTE [ One dataset per loader ]); the samples are
    # made by the actors, which read the runtime_env's variable.
    (tmp_path / "rl_life_wd_data.py").write_text(
        "import os\n\n\nclass numbers:\n"
        "    def __init__(self, n):\n        self.n = n\n\n"
        "    def __len__(self):\n        return self.n\n\n"
        "    def __getitem__(self, i):\n"
        "        return i * 10 + int(os.environ.get('RL_LIFE_MARK', 0))\n"
    )
    spec = ray_spec(
        dataset="rl_life_wd_data:numbers",
        dataset_kwargs={"n": 5},
        batch_size=None,
        ray_runtime_env={"working_dir": str(tmp_path), "env_vars": {"RL_LIFE_MARK": "7"}},
    )
    cluster = start_cluster(1)
    try:
        settings = ServerSettings(address=f"{LOOPBACK}:0", ray_address=cluster.address)
        with Server(settings, [spec]) as server, RemoteLoader(server.address) as loader:
            # Made by the actors, in the runtime_env (its env_vars: the 7s).
            assert [int(b) for b in loader] == [7, 17, 27, 37, 47]
    finally:
        cluster.shutdown()  # type: ignore[no-untyped-call]
        sys.path[:] = [p for p in sys.path if p != str(tmp_path)]


@pytest.mark.timeout(300)
def test_a_pool_without_persistent_workers_is_kept_for_the_next_epoch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Without persistent_workers each epoch started a new Ray pool: a bridge, its connection
    # and new actors, seconds each (NOTE [ Ray pool reuse ] in server/engine/ray/backend.py).
    monkeypatch.setattr(kept_pools, "KEEP_IDLE_POOL", 3.0)
    cluster = start_cluster(1)
    probe = ray_spec(
        name="probe",
        dataset="tests.datasets:WorkerProbe",
        dataset_kwargs={"n": 4},
        batch_size=1,
        num_workers=2,
        worker_init_fn="tests.datasets:count_init",
    )
    aug = LoaderSpec(
        name="aug", num_workers=2, pool="ray", ray_num_cpus=0.25, **CASES["random-aug"]
    )
    settings = ServerSettings(address=f"{LOOPBACK}:0", ray_address=cluster.address)
    try:
        with Server(settings, [probe, aug]) as server:
            kept = server.hosts["probe"]._kept

            def epoch(name: str, number: int) -> list[Any]:
                with RemoteLoader(server.address, name, seed=SEED) as loader:
                    loader.set_epoch(number)
                    return list(loader)

            def bridge(name: str) -> int:
                pool = kept._pools[name][0]
                assert isinstance(pool, WorkerPool)
                (pid,) = pool.pids
                return pid

            first = [[int(t) for t in batch] for batch in epoch("probe", 0)]
            probe_bridge = bridge("probe")
            second = [[int(t) for t in batch] for batch in epoch("probe", 1)]
            assert bridge("probe") == probe_bridge  # the same pool ...
            assert {s[3] for s in second} == {s[3] for s in first}  # ... and actors,
            assert len({s[3] for s in first}) == 2
            # begun as new workers: worker_init_fn ran again in each, as torch's would.
            assert {s[2] for s in first} == {1} and {s[2] for s in second} == {2}

            # Another loader's pool makes room: the idle one goes, its CPUs given back.
            for number in (3, 4):  # a kept pool's epoch is torch's epoch
                expected = local_batches(
                    LoaderSpec(name="aug", num_workers=2, **CASES["random-aug"]), SEED, number
                )
                assert_same(epoch("aug", number), expected)
            assert not process_alive(probe_bridge) and "probe" not in kept._pools
            # And an idle pool goes after KEEP_IDLE_POOL without an epoch.
            aug_bridge = bridge("aug")
            assert wait_until(lambda: not process_alive(aug_bridge), 30)
            assert not kept._pools
    finally:
        cluster.shutdown()  # type: ignore[no-untyped-call]
