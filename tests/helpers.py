"""What more than one test module uses, once: servers as processes and the waits on them, exact
comparisons and torch's reference batches, shared specs, logs and metrics, pools, sharing, shared
memory, cut connections, Ray clusters on this host, certificates (one section each, in that order).

Fixtures live in tests/conftest.py; this module holds plain functions, classes and constants,
imported by name (`from tests.helpers import wait_until`). Worker processes never import it: the
datasets that specs name by import string are in tests/datasets.py and its siblings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import inspect
import json
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
import pytest
import torch
import torch.utils.data
import torch.utils.data._utils.worker as torch_worker
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
)

from remote_loader.client import (
    RemoteLoader,
    RemoteLoaderError,
)
from remote_loader.protos import (
    codec,
    doorbell,
    shm,
    striping,
    wire,
)
from remote_loader.protos import loader_pb2 as pb
from remote_loader.server import errors as server_errors
from remote_loader.server.api.auth import ServerTLS
from remote_loader.server.api.server import Server
from remote_loader.server.api.settings import ServerSettings
from remote_loader.server.cli.main import spawn_serve
from remote_loader.server.config.spec import (
    LoaderSpec,
    resolve,
)
from remote_loader.server.engine.pool import WorkerPool
from remote_loader.server.sharing.host import LoaderHost
from tests.datasets import Squares

if TYPE_CHECKING:
    from ray.cluster_utils import Cluster

# --- Servers, processes and waits -----------------------------------------------------------------


ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Served:
    """An in-process server: its address, its loaders (to look inside) and the server."""

    address: str
    hosts: dict[str, LoaderHost]
    server: Server


ServeLoaders = Callable[..., Served]


StartServer = Callable[..., str]


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


def health_status(target: str | grpc.Channel) -> int:
    """The server's overall gRPC health (`target`: its address, or a channel to it)."""
    if isinstance(target, str):
        with grpc.insecure_channel(target) as channel:
            return health_status(channel)
    reply = health_pb2_grpc.HealthStub(target).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=10
    )
    return int(reply.status)


def wait_until(condition: Callable[[], bool], seconds: float) -> bool:
    """Polls `condition` every 20 ms for up to `seconds`; whether it became true."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def wait_for(condition: Callable[[], bool], seconds: float, what: str) -> None:
    """`wait_until`, failing the test with `what` named if `condition` stays false."""
    assert wait_until(condition, seconds), f"timed out waiting for {what}"


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie has exited; it only waits to be reaped)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (ProcessLookupError, FileNotFoundError):
        return False


def descendants(pid: int) -> set[int]:
    """Every living process below `pid`, from /proc's parent links."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return int(s.getsockname()[1])


def port_free(port: int) -> bool:
    """Whether a server could listen on 127.0.0.1:`port` now (SO_REUSEADDR, as gRPC binds: a
    connection of a dead server's in TIME_WAIT does not count, a listener does)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen()
        except OSError:
            return False
        return True


def data_sockets(port: int) -> int:
    """This process's open TCP sockets on `port`'s data connections, the server's ends (local
    port `port`, not the listener) and the client's (remote port `port`)."""
    ports: dict[str, bool] = {}  # inode: a connection on `port`
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
                on_port = int(local.rsplit(":", 1)[1], 16) == port or (
                    int(remote.rsplit(":", 1)[1], 16) == port
                )
                ports[inode] = on_port and state != "0A"  # 0A: LISTEN
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith("socket:[") and ports.get(target[8:-1], False):
            count += 1
    return count


# --- Batches: exact comparisons and torch's own reference -----------------------------------------


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


SEED = 1234


CASES: dict[str, dict[str, Any]] = {
    "map": {"dataset": "tests.datasets:Squares", "batch_size": 4},
    "map-shuffle": {"dataset": "tests.datasets:Squares", "batch_size": 4, "shuffle": True},
    "no-batching": {"dataset": "tests.datasets:Squares", "batch_size": None, "shuffle": True},
    "drop-last": {
        "dataset": "tests.datasets:Squares",
        "batch_size": 7,
        "drop_last": True,
        "shuffle": True,
    },
    "sampler": {
        "dataset": "tests.datasets:Squares",
        "batch_size": 3,
        "sampler": "tests.datasets:Reversed",
    },
    "batch-sampler": {
        "dataset": "tests.datasets:Squares",
        "batch_sampler": "tests.datasets:GrowingBatches",
    },
    "mixed-collate": {
        "dataset": "tests.datasets:Squares",
        "batch_size": 5,
        "shuffle": True,
        "collate_fn": "tests.datasets:mixed_collate",
    },
    "iterable": {"dataset": "tests.datasets:Sharded", "batch_size": 4},
    "iterable-drop-last": {"dataset": "tests.datasets:Sharded", "batch_size": 3, "drop_last": True},
    "random-aug": {"dataset": "tests.datasets:RandomAug", "batch_size": 4, "shuffle": True},
}


def _factory(path: str, dataset: Any, generator: torch.Generator | None) -> Any:
    factory = resolve(path)
    if "generator" in inspect.signature(factory).parameters:
        return factory(dataset, generator=generator)
    return factory(dataset)


def local_batches(spec: LoaderSpec, seed: int, epoch: int) -> list[Any]:
    """torch's own DataLoader over the same dataset and options."""
    dataset = resolve(spec.dataset)(**spec.dataset_kwargs)
    generator = torch.Generator().manual_seed(seed + epoch)
    loader = DataLoader(
        dataset,
        batch_size=spec.batch_size,
        shuffle=spec.shuffle,
        sampler=_factory(spec.sampler, dataset, generator) if spec.sampler else None,
        batch_sampler=(
            _factory(spec.batch_sampler, dataset, generator) if spec.batch_sampler else None
        ),
        collate_fn=resolve(spec.collate_fn) if spec.collate_fn else None,
        drop_last=spec.drop_last,
        num_workers=spec.num_workers,
        generator=generator,
        # Not fork unless the spec says so: this process runs gRPC threads (grpc/grpc#16001).
        multiprocessing_context=(
            (spec.multiprocessing_context or "forkserver") if spec.num_workers else None
        ),
        worker_init_fn=resolve(spec.worker_init_fn) if spec.worker_init_fn else None,
    )
    if spec.num_workers == 0:
        # Documented: with num_workers = 0 the server seeds its own RNGs as worker 0 would be
        # seeded; torch leaves the main process's RNGs alone, so do it here by hand.
        probe = torch.Generator().manual_seed(seed + epoch)
        base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=probe).item())
        random.seed(base_seed)
        torch.manual_seed(base_seed)
        np.random.seed(torch_worker._generate_state(base_seed, 0))
    return list(loader)


_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as uint8, in C order, using no kernel of its own dtype.

    torch.equal has no kernel for float8, complex32, bits* or int1..uint7; same-width ints do.
    """
    t = t.resolve_conj().resolve_neg()
    width = _SAME_WIDTH.get(t.element_size())
    if width is not None:
        t = t.view(width)
    dense = torch.empty(t.shape, dtype=t.dtype)  # not .contiguous(): it may keep odd strides
    return dense.copy_(t).view(-1).view(torch.uint8)


def assert_exact(got: Any, want: Any) -> None:
    """`got` is exactly what decoding `want` must give, down to the bits of every float."""
    if isinstance(want, torch.Tensor):
        assert type(got) is torch.Tensor
        assert (got.dtype, got.shape, got.requires_grad) == (want.dtype, want.shape, False)
        assert torch.equal(raw_bytes(got), raw_bytes(want))
    elif isinstance(want, np.ndarray | np.generic):
        want = np.asarray(want)
        assert type(got) is np.ndarray
        assert (got.dtype.str, got.shape) == (want.dtype.str, want.shape)
        assert got.tobytes() == want.tobytes()
    elif isinstance(want, bytes | bytearray | memoryview):
        assert type(got) is bytes
        assert got == bytes(want)
    elif isinstance(want, float):
        assert type(got) is float
        assert struct.pack("<d", got) == struct.pack("<d", want)
    elif isinstance(want, list | tuple):
        # A namedtuple comes back as its class (NOTE [ Batch types ]), another subclass as its base.
        plain = list if isinstance(want, list) else tuple
        assert type(got) is (type(want) if hasattr(want, "_fields") else plain)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_exact(g, w)
    elif isinstance(want, dict):
        assert type(got) is dict
        assert len(got) == len(want)
        for (gk, gv), (wk, wv) in zip(got.items(), want.items(), strict=True):
            assert_exact(gk, wk)
            assert_exact(gv, wv)
    else:
        assert type(got) is type(want)
        assert got == want


def roundtrip(obj: object) -> Any:
    """encode, write_blob into a fresh buffer full of junk, then decode the header and payload."""
    encoded = codec.encode(obj)
    blob = torch.full((encoded.total_nbytes,), 0xAB, dtype=torch.uint8)
    encoded.write_blob(blob)
    start = codec.payload_offset(len(encoded.header))
    assert blob[len(encoded.header) : start].eq(0).all()
    header = blob[: len(encoded.header)].numpy().tobytes()
    assert header == encoded.header
    return codec.decode(header, blob[start:])


def packed(enforce_sorted: bool) -> tuple[PackedSequence, torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([5, 3, 2]) if enforce_sorted else torch.tensor([2, 5, 3])
    padded = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0))
    for row, length in enumerate(lengths.tolist()):
        padded[row, length:] = 0
    sequence = pack_padded_sequence(
        padded, lengths, batch_first=True, enforce_sorted=enforce_sorted
    )
    return sequence, padded, lengths


# torch's `where` for a worker's exception (ExceptionWrapper), which the server's workers say too.
WORKER_0 = "in DataLoader worker process 0"


# --- Specs several modules serve ------------------------------------------------------------------


SQUARES = LoaderSpec(name="squares", dataset="tests.datasets:Squares", batch_size=4)


# A stream of this loader stays open for a while: 40 samples of 0.25 s, made one at a time.
SLOW = LoaderSpec(
    name="slow",
    dataset="tests.datasets:Slow",
    dataset_kwargs={"n": 40, "seconds": 0.25},
    batch_size=1,
)


# Samples that take a few ms each, so the server is still producing when a connection breaks
# (batches made ahead and buffered by gRPC would make the break harmless).
SLOW_SAMPLES: dict[str, Any] = {
    "dataset": "tests.datasets:Slow",
    "dataset_kwargs": {"n": 120, "seconds": 0.01},
}


LOADER = '[loaders.a]\ndataset = "tests.datasets:Squares"\n'


def sizes_spec(sizes: list[int], num_workers: int = 2, **options: Any) -> LoaderSpec:
    return LoaderSpec(
        name="sizes",
        dataset="tests.datasets:Sizes",
        dataset_kwargs={"sizes": sizes},
        batch_size=None,
        num_workers=num_workers,
        **options,
    )


def serve_sizes(sizes: list[int], num_workers: int, *flags: str) -> tuple[Any, str]:
    """`remote-loader serve` of the Sizes dataset (one batch per size) plus `flags`."""
    return serve_process(
        "--dataset",
        "tests.datasets:Sizes",
        "--dataset-kwargs",
        json.dumps({"sizes": sizes}),
        "--batch-size",
        "none",
        "--num-workers",
        str(num_workers),
        *flags,
    )


def expected(sizes: list[int]) -> list[torch.Tensor]:
    return [torch.full((n,), i % 256, dtype=torch.uint8) for i, n in enumerate(sizes)]


MiB = striping.MIN_STRIPE


# --- Logs and metrics -----------------------------------------------------------------------------


def log_lines(caplog: pytest.LogCaptureFixture, prefix: str, count: int) -> list[str]:
    """The service's log lines starting with `prefix`, waiting (5 s at most) for `count`:
    a stream's end line is written by its handler thread after the client has its answer."""

    def lines() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.name == "remote_loader.server.api.stream" and r.getMessage().startswith(prefix)
        ]

    wait_until(lambda: len(lines()) >= count, 5)
    return lines()


def log_fields(line: str) -> dict[str, str]:
    return {k: v.strip('"') for k, v in re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)', line)}


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(served: Served | int) -> Samples:
    """Every sample of a server's metrics endpoint (or the one on that port), by (name, labels)."""
    port = served if isinstance(served, int) else served.server.metrics_port
    assert port is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def loader_metric(host: LoaderHost, name: str, **labels: str) -> float:
    """One sample of a loader's metrics as /metrics would show it (read through the metrics'
    public `collect()`: no metrics port needed), by its name and labels; 0 when there is none,
    as for a counter not yet incremented."""
    for family in host.metrics.collect():
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return 0.0


# --- Pools and their workers ----------------------------------------------------------------------


def persistent_pool(server: Server | Served, name: str) -> WorkerPool:
    """The local worker pool loader `name` keeps across epochs."""
    pool = server.hosts[name].persistent_pool
    assert isinstance(pool, WorkerPool)
    return pool


def kill_a_worker(pool: WorkerPool) -> None:
    """SIGKILL the process that read the loader's latest sample: a worker process of the local
    pool, a Ray actor's process (on this host: the cluster's nodes run here)."""
    log = pool.spec.dataset_kwargs["log"]
    with open(log) as readers:
        pid = int(readers.read().split()[-1])
    if pool.describe().get("kept"):
        pid = host_pid(pid)  # an actor's own pid namespace named it
    assert pid != os.getpid()
    os.kill(pid, signal.SIGKILL)


def copiers() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("rl-copy")}


JOB_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
)


# --- Consumers sharing a loader -------------------------------------------------------------------


SHARING_SEED, SHARING_EPOCH, SHARING_BATCH = 5, 1, 3


def distributed(
    n: int, world_size: int, rank: int, *, shuffle: bool, drop_last: bool = False, epoch: int = 0
) -> list[int]:
    """The sample indices torch's DistributedSampler (seed SHARING_SEED) gives rank `rank`."""
    sampler: DistributedSampler[int] = DistributedSampler(
        Squares(n),
        world_size,
        rank,
        shuffle=shuffle,
        seed=SHARING_SEED,
        drop_last=drop_last,
    )
    sampler.set_epoch(epoch)
    return list(sampler)


def indices(batches: list[Any]) -> list[list[int]]:
    return [b["index"].tolist() for b in batches]


def run_concurrently(*consumers: Callable[[], Any], timeout: float = 60) -> list[Any]:
    """Runs each callable in its own thread; returns their results, raising the first error."""
    results: list[Any] = [None] * len(consumers)
    errors: list[BaseException] = []

    def call(i: int) -> None:
        try:
            results[i] = consumers[i]()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(consumers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a consumer hung"
    if errors:
        raise errors[0]
    return results


def epoch_of(address: str, name: str, **kwargs: Any) -> Callable[[], list[list[int]]]:
    """A consumer that reads epoch SHARING_EPOCH and returns its batches' indices."""

    def consume() -> list[list[int]]:
        with RemoteLoader(address, name, seed=SHARING_SEED, **kwargs) as loader:
            loader.set_epoch(SHARING_EPOCH)
            got = indices(list(loader))
            if kwargs.get("sharing", "partition") != "dynamic":
                assert len(loader) == len(got)
            return got

    return consume


def broadcast_spec(log: str, **kwargs: Any) -> LoaderSpec:
    options: dict[str, Any] = {
        "name": "counted",
        "dataset": "tests.datasets:Counted",
        "dataset_kwargs": {"log": log, "n": 60},
        "batch_size": 4,
        "shuffle": True,
        "num_workers": 2,
        "broadcast_window": 3,
    }
    options.update(kwargs)
    return LoaderSpec(**options)


def local_epoch(n: int, batch_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(SHARING_SEED + SHARING_EPOCH)
    return indices(list(DataLoader(Squares(n), batch_size, shuffle=True, generator=generator)))


# --- Shared memory --------------------------------------------------------------------------------


def rings() -> set[str]:
    return {name for name in os.listdir(shm.SHM_DIR) if name.startswith(shm.RING_PREFIX)}


def left_in_dev_shm() -> set[str]:
    """The rings in /dev/shm, and their doorbells (NOTE [ Doorbell ] in protos/doorbell.py)."""
    prefixes = (shm.RING_PREFIX, doorbell.BELL_PREFIX)
    return {name for name in os.listdir(shm.SHM_DIR) if name.startswith(prefixes)}


# A tick so long that a wait which ends sooner was ended by the client's ring; a wait that polls
# instead (no bell) looks at the cursor many times meanwhile.
LONG_TICK = 30.0


# --- Connections cut on purpose -------------------------------------------------------------------


class CuttingProxy:
    """A TCP proxy on 127.0.0.1 whose `cut()` resets every connection passing through it."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self.cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._upstream)
            with self._lock:
                self._conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            # shutdown() first: it wakes the pump blocked in recv() on this socket (close()
            # alone would not, and the pump could then read a new socket given the same fd).
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        self.cuts += 1

    def close(self) -> None:
        self._listener.close()
        self.cut()


# --- Ray clusters on this host --------------------------------------------------------------------


LOOPBACK = "127.0.0.1"


NODE: dict[str, Any] = {"node_ip_address": LOOPBACK, "object_store_memory": 80 << 20, "num_cpus": 1}
# Ray picks the node's address itself unless told: on Linux it asks the route to the internet,
# which here is not loopback. With this, any node started in this process uses 127.0.0.1.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray gives its control store 30 s to start (and a raylet 30 s to register, not configurable):
# on a loaded 2-core machine that is not always enough, so the store gets more and a cluster
# that failed to start is started again once (start_cluster).
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")


def start_cluster(workers: int) -> Cluster:
    """A head without CPUs and `workers` nodes of one CPU, all on 127.0.0.1."""
    # Imported here, not with the module: every test imports this one, and only the tests that
    # start clusters need Ray (slow to import).
    from ray.cluster_utils import Cluster

    for attempt in (1, 2):
        c: Cluster | None = None
        try:
            c = Cluster(
                initialize_head=True,
                head_node_args={**NODE, "num_cpus": 0, "include_dashboard": False},
            )
            for _ in range(workers):
                c.add_node(**NODE)
            c.wait_for_nodes()
            return c
        except Exception:
            if c is not None:
                c.shutdown()  # type: ignore[no-untyped-call]
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


class ContainedCluster:
    """A head and one worker node started with `ray start --block`, each in a PID namespace of
    its own, as in containers: their processes' pids are not this host's, so this process
    cannot map an actor's memory through /proc and its lanes are COPY lanes (NOTE [ Ray direct
    lane ] in server/engine/ray/lane.py). On 127.0.0.2 (tests/integration/test_readme.py says why).
    Stopped by SIGKILL to each `unshare`, whose --kill-child takes its namespace down with it."""

    HOST = "127.0.0.2"

    def __init__(self, cpus: int = 2) -> None:
        with socket.socket() as probe:
            probe.bind((self.HOST, 0))
            port = probe.getsockname()[1]
        self.address = f"{self.HOST}:{port}"
        ray = [str(Path(sys.executable).parent / "ray"), "start", "--block"]
        contained = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc", *ray]
        # Without token authentication (tests/integration/test_readme.py runs a cluster with it):
        # given the session's RAY_AUTH_TOKEN but no RAY_AUTH_MODE, `ray start --head` asks for the
        # token and `ray start --address` does not send it.
        # And without RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER (set above for Cluster), which makes
        # `ray start --address` refuse to join.
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")}
        env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        env["RAY_AUTH_MODE"] = "disabled"
        quiet: dict[str, Any] = {
            "stdout": subprocess.DEVNULL,
            "stderr": subprocess.DEVNULL,
            "env": env,
        }
        head = [f"--node-ip-address={self.HOST}", f"--port={port}", "--num-cpus=0"]
        self.procs = [
            subprocess.Popen([*contained, "--head", *head, "--include-dashboard=false"], **quiet)
        ]
        try:
            node = [f"--address={self.address}", f"--node-ip-address={self.HOST}"]
            assert wait_for_port(self.HOST, port, 60), "the contained head did not start"
            self.procs.append(subprocess.Popen([*contained, *node, f"--num-cpus={cpus}"], **quiet))
            status = [ray[0], "status", f"--address={self.address}"]
            assert wait_until(
                lambda: f"/{cpus}.0 CPU" in subprocess.run(status, env=env, **CAPTURE).stdout, 90
            ), "the contained worker node did not join"
        except BaseException:
            self.shutdown()
            raise

    def shutdown(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait(30)


CAPTURE: dict[str, Any] = {"capture_output": True, "text": True, "timeout": 60}


def wait_for_port(host: str, port: int, timeout: float) -> bool:
    def accepts() -> bool:
        with socket.socket() as s:
            return s.connect_ex((host, port)) == 0

    return wait_until(accepts, timeout)


def host_pid(pid: int) -> int:
    """The pid, in this process's namespace, of a Ray actor whose own namespace calls it `pid`
    (its NSpid's last field)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        nspids = next(line.split()[1:] for line in status.splitlines() if line.startswith("NSpid"))
        if len(nspids) > 1 and int(nspids[-1]) == pid and b"RayWorker" in cmdline:
            return int(entry)
    raise AssertionError(f"no Ray actor whose own pid namespace calls it {pid}")


def first_error(ray_address: str, spec: LoaderSpec) -> tuple[str, float]:
    """The error a stream of a Ray loader served against `ray_address` ends in, and the
    seconds from the server's start to it."""
    settings = ServerSettings(address=f"{LOOPBACK}:0", ray_address=ray_address)
    started = time.monotonic()
    with (
        Server(settings, [spec]) as server,
        RemoteLoader(server.address, retries=0) as loader,
        pytest.raises(RemoteLoaderError) as info,
    ):
        list(loader)
    return str(info.value), time.monotonic() - started


# --- Tokens and certificates ----------------------------------------------------------------------


TOKEN = "s3cret-Token_0123456789"


@dataclasses.dataclass(frozen=True)
class PKI:
    """PEM files: a CA, a server certificate for localhost and 127.0.0.1, a client's."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def server_settings(self, mutual: bool = False) -> dict[str, str | None]:
        """The ServerSettings fields that serve with this PKI's server certificate."""
        return {
            "tls_cert": str(self.server_cert),
            "tls_key": str(self.server_key),
            "tls_client_ca": str(self.ca) if mutual else None,
        }

    def server_tls(self, mutual: bool = False) -> ServerTLS:
        return ServerTLS(
            cert=self.server_cert.read_bytes(),
            key=self.server_key.read_bytes(),
            client_ca=self.ca.read_bytes() if mutual else None,
        )


def issue_certificate(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
    *,
    sans: list[x509.GeneralName] | None = None,
    usage: x509.ObjectIdentifier | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    issuer_name, issuer_key = issuer or (name, key)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
            critical=False,
        )
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def write_pem(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.with_suffix(".key").write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )


# --- Errors, datasets, the unit guard -------------------------------------------------------------


def _server_classes() -> list[type[server_errors.CallFailed]]:
    found: list[type[server_errors.CallFailed]] = []
    todo: list[type[server_errors.CallFailed]] = [server_errors.CallFailed]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return found


SERVER_CLASSES = _server_classes()


def _files(folder: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


UNIT_MARKER_INI = "[pytest]\nmarkers =\n    unit: no server, no process, no Ray\n"
