"""The consumers of benchmarks/broadcast.py, each a process of its own (spawn) reading its
orders with a RemoteLoader and reporting a digest of every batch, and the CPU of the server's
process tree they are measured against (psutil snapshots).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import multiprocessing
import multiprocessing.connection
import time
import traceback
from collections.abc import Sequence
from typing import Any

import psutil  # type: ignore[import-untyped, unused-ignore]
import torch

from remote_loader.client import RemoteLoader
from remote_loader.client.types import Transport

# Seconds a consumer may wait for one batch, and for the server when it connects.
BATCH_TIMEOUT = 300.0
CONNECT_TIMEOUT = 60.0
# Seconds the benchmark waits for a consumer's answer (its epochs, or getting ready).
REPLY_TIMEOUT = 900.0
# Tensors up to this size are hashed whole; bigger ones by their first and last bytes, so that
# the consumers' own CPU (which shares the machine with the server) stays small.
HASH_WHOLE_BYTES = 1 << 20
HASH_EDGE_BYTES = 64 * 1024


# --- measuring the server ----------------------------------------------------------------------


def _process_cpu(proc: Any) -> float:
    """User + system seconds of a psutil.Process, including its children it has reaped."""
    t = proc.cpu_times()
    return float(t.user + t.system + t.children_user + t.children_system)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """CPU seconds of each process of the server's tree at one moment."""

    main: float  # the server process itself
    others: dict[int, float]  # pid -> seconds: fork server, workers, resource tracker

    @staticmethod
    def take(server: Any) -> Snapshot:
        others = {}
        for child in server.children(recursive=True):
            try:
                others[child.pid] = _process_cpu(child)
            except psutil.NoSuchProcess:
                continue  # exited while we looked
        return Snapshot(_process_cpu(server), others)


@dataclasses.dataclass(frozen=True)
class ServerCpu:
    """What the server tree spent between two snapshots."""

    main: float
    others: float
    changed: bool  # a process of the tree started or ended in between

    @property
    def total(self) -> float:
        return self.main + self.others

    @staticmethod
    def between(before: Snapshot, after: Snapshot) -> ServerCpu:
        others = sum(cpu - before.others.get(pid, 0.0) for pid, cpu in after.others.items())
        return ServerCpu(after.main - before.main, others, set(before.others) != set(after.others))


# --- consumers (each its own process) ------------------------------------------------------------


def _digest_update(digest: Any, batch: Any) -> None:
    """Folds a batch into `digest`: shapes, dtypes, and the bytes (or, when big, their ends)."""
    if isinstance(batch, torch.Tensor):
        digest.update(f"{batch.dtype}{tuple(batch.shape)}".encode())
        flat = batch.detach().contiguous().reshape(-1).view(torch.uint8)
        if flat.numel() <= HASH_WHOLE_BYTES:
            digest.update(flat.numpy().tobytes())
        else:
            digest.update(flat[:HASH_EDGE_BYTES].numpy().tobytes())
            digest.update(flat[-HASH_EDGE_BYTES:].numpy().tobytes())
    elif isinstance(batch, list | tuple):
        digest.update(b"(")
        for item in batch:
            _digest_update(digest, item)
        digest.update(b")")
    elif isinstance(batch, dict):
        for key in sorted(batch, key=repr):
            digest.update(repr(key).encode())
            _digest_update(digest, batch[key])
    else:
        digest.update(repr(batch).encode())


@dataclasses.dataclass(frozen=True)
class Order:
    """What one consumer reads in one production."""

    job: str
    rank: int
    world_size: int
    first_epoch: int
    epochs: int
    transport: Transport
    data_connections: int | None  # the client's (None: its default)
    step: float = 0.0  # seconds each batch is held, as a trainer's step would (a sleep)


@dataclasses.dataclass(frozen=True)
class Report:
    """What one consumer received: batches per epoch and a digest of all of them."""

    batches: tuple[int, ...]
    digest: str
    seconds: float
    transport: str | None  # how the last batch came


def consumer_main(conn: multiprocessing.connection.Connection, address: str) -> None:
    """A consumer process: for each Order, connects, says "ready", waits for "go", reads."""
    with conn:
        try:
            while True:
                order = conn.recv()
                if order is None:
                    return
                assert isinstance(order, Order)
                with RemoteLoader(
                    address,
                    sharing="broadcast",
                    job=order.job,
                    rank=order.rank,
                    world_size=order.world_size,
                    device="cpu",
                    transport=order.transport,
                    data_connections=order.data_connections,
                    timeout=BATCH_TIMEOUT,
                    connect_timeout=CONNECT_TIMEOUT,
                ) as loader:
                    conn.send("ready")
                    if conn.recv() != "go":
                        return
                    start = time.perf_counter()
                    loader.set_epoch(order.first_epoch)
                    digest = hashlib.blake2b(digest_size=16)
                    counts = []
                    for _ in range(order.epochs):
                        n = 0
                        for batch in loader:
                            _digest_update(digest, batch)
                            if order.step:
                                time.sleep(order.step)
                            n += 1
                        counts.append(n)
                    seconds = time.perf_counter() - start
                    report = Report(
                        tuple(counts), digest.hexdigest(), seconds, loader.last_transport
                    )
                    conn.send(report)
        except (KeyboardInterrupt, EOFError, BrokenPipeError):
            return  # the benchmark is stopping
        except Exception:
            with contextlib.suppress(OSError):
                conn.send(("error", traceback.format_exc()))


class Consumers:
    """`n` consumer processes started with the spawn context, each behind a pipe."""

    def __init__(self, n: int, address: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns: list[multiprocessing.connection.Connection] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        for rank in range(n):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=consumer_main, args=(theirs, address), name=f"consumer-{rank}", daemon=True
            )
            proc.start()
            theirs.close()
            self.conns.append(ours)
            self.procs.append(proc)

    def _reply(self, rank: int) -> Any:
        conn = self.conns[rank]
        if not conn.poll(REPLY_TIMEOUT):
            raise RuntimeError(f"consumer {rank} did not answer within {REPLY_TIMEOUT:g} s")
        try:
            reply = conn.recv()
        except EOFError as exc:
            code = self.procs[rank].exitcode
            raise RuntimeError(f"consumer {rank} exited (exit code {code})") from exc
        if isinstance(reply, tuple) and reply and reply[0] == "error":
            raise RuntimeError(f"consumer {rank} failed:\n{reply[1]}")
        return reply

    def read(self, orders: Sequence[Order], server: Any) -> tuple[list[Report], float, ServerCpu]:
        """Consumers 0..len(orders)-1 read their orders together; returns their reports, the
        wall seconds from "go" to the last report, and the server's CPU in between."""
        for rank, order in enumerate(orders):
            self.conns[rank].send(order)
        for rank in range(len(orders)):
            if self._reply(rank) != "ready":
                raise RuntimeError(f"consumer {rank}: expected 'ready'")
        before = Snapshot.take(server)
        start = time.perf_counter()
        for rank in range(len(orders)):
            self.conns[rank].send("go")
        reports = []
        for rank in range(len(orders)):
            report = self._reply(rank)
            if not isinstance(report, Report):
                raise RuntimeError(f"consumer {rank}: expected a report, got {report!r}")
            reports.append(report)
        wall = time.perf_counter() - start
        return reports, wall, ServerCpu.between(before, Snapshot.take(server))

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=10)
        for conn in self.conns:
            conn.close()
