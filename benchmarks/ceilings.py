"""Physical ceilings of compare.py's transports, measured in the same rounds as the loaders.

Each RemoteLoader transport is held against the most its medium moves on this machine at all,
for buffers of one batch of the workload (its tensor bytes, what the GB/s columns count), on
loopback or, with compare.py --cross-host, between the namespaces of benchmarks/netns.py:

- **raw grpcio** (`grpc`): a grpcio unary-stream call of `bytes` messages of 4 MiB (the frame
  size RemoteLoader's server sends by default), no serializers, from a server process to this
  process; GB/s per round of `batches` messages (a round right after each round of the
  loaders: NOTE [ Ceilings beside the rows ]). One figure for every workload: gRPC moves a
  batch in such frames whatever its size.
- **raw socket** (`tcp`): a sender process `sendall`s batch-sized buffers (filled, so that no
  zero page is sent) on one TCP connection (with compare.py --tls, one TLS connection, wrapped
  with the ssl contexts a TLS server's data listener and a TLS client's data connection use,
  and the raw grpcio call is TLS too); this process `recv_into`s each into one
  preallocated, touched buffer. Both sockets get protos/tcp.py's `tune()` (4 MiB buffers each
  way, no Nagle), as the data connection's do. GB/s per round; a round moves `batches` batches,
  or enough of them for MIN_ROUND_BYTES when batches are small (per-call overhead dominates).
- **memcpy** (`shm`): `np.copyto` of a batch-sized buffer into another preallocated one in this
  process; GB/s per sample of at least MIN_SAMPLE_BYTES, median of MEMCPY_SAMPLES. The ring
  copies each batch twice (into the ring in the server, out of it in the client), so `shm` at
  0.5 of it is the two copies back to back. Two 9.6 MB buffers may fit in a large last-level
  cache: the figure is then the cache's, a bound the ring (4 batches, other processes' copies
  in between) does not reach.
- **pinned host-to-device** (CUDA only): `copy_(non_blocking=True)` from a pinned batch-sized
  tensor into a device one, timed with CUDA events, median of MEMCPY_SAMPLES; the last hop of
  every side to a GPU. compare.py's loaders deliver to the CPU, so no row is held against it.

Run as a script, this file is the ceilings' server processes (compare.py starts them, inside
the server namespace with --cross-host):

    python benchmarks/ceilings.py grpc-server HOST [--tls CERT KEY]    # raw grpcio: its port
    python benchmarks/ceilings.py socket-sender HOST [--tls CERT KEY]  # raw socket: its port
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from remote_loader.client import TLS
from remote_loader.protos import tcp
from remote_loader.server.api.auth import load_tls

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: benchmarks/ is not a package on the path
    sys.path.insert(0, str(ROOT))

from benchmarks.processes import (  # noqa: E402
    Placement,
    banner_port,
    read_banner,
    stop_process,
    subprocess_env,
)

GB = 1e9
# The raw grpcio ceiling's message: the size of the frames RemoteLoader's server sends by default.
RAW_MESSAGE_BYTES = 4 * 1024 * 1024
RAW_METHOD = "/bench.Raw/Stream"
# A raw socket round moves at least this much, and a memcpy / host-to-device sample copies at
# least this much: a few KB per call would time the call, not the copy.
MIN_ROUND_BYTES = 64 * 1024 * 1024
MIN_SAMPLE_BYTES = 16 * 1024 * 1024
MEMCPY_SAMPLES = 31
# The raw socket's request: batches to send, bytes per batch.
REQUEST = struct.Struct("!QQ")
# A filler byte for buffers that are sent: not zero, so that every page is really allocated.
FILL = 0xA5

Bar = Any  # tqdm's bar: set_description(str), update()


@dataclasses.dataclass(frozen=True)
class Ceilings:
    """Every ceiling of one run, GB/s per round or sample (module doc); per workload where the
    buffer is one of its batches. `h2d` is None without CUDA."""

    where: str  # "loopback", or which namespaces the raw servers ran between
    batch_bytes: dict[str, int]
    grpc: list[float]
    socket: dict[str, list[float]]
    memcpy: dict[str, list[float]]
    h2d: dict[str, list[float]] | None
    tls: bool = False  # the raw grpcio and socket ceilings spoke TLS (--tls)

    def of(self, workload: str, transport: str) -> tuple[str, float] | None:
        """The ceiling of a transport ("grpc", "tcp", "shm") for a workload: name, median GB/s."""
        if transport == "grpc":
            return "raw grpcio" + " (TLS)" * self.tls, statistics.median(self.grpc)
        if transport == "tcp":
            raw = "raw TLS socket" if self.tls else "raw socket"
            return raw, statistics.median(self.socket[workload])
        if transport == "shm":
            return "memcpy", statistics.median(self.memcpy[workload])
        return None


def steps(workloads: int) -> int:
    """Progress bar updates that `Raw.ceilings` makes (the rounds update the caller's bar)."""
    return workloads * (2 if torch.cuda.is_available() else 1)


class Raw:
    """The raw grpcio server and the raw socket sender (module doc), started once where `place`
    says and measured one round at a time, right after the loaders' epochs of the same round.

    NOTE [ Ceilings beside the rows ]: this machine is shared and its speed drifts by tens of
    per cent from one minute to the next (the raw TLS socket alone: 0.47 to 0.78 GB/s over five
    runs of compare.py at load 1-2). A ceiling measured after every loader had finished put a row
    and its ceiling in different minutes, and the ratio moved with the machine (0.71 to 1.2 for
    the same code). Measured in the same round as the row, both see the same minute; the
    processes stay up between rounds, idle while the loaders run."""

    def __init__(self, place: Placement) -> None:
        self.place = place
        self.grpc: list[float] = []
        self.socket: dict[str, list[float]] = {}
        self._buffers: dict[int, memoryview] = {}
        self._stack = contextlib.ExitStack()
        self.sender_pid = 0  # the raw socket's sender process, once entered

    def __enter__(self) -> Raw:
        place = self.place
        with contextlib.ExitStack() as stack:
            proc, port = _start("grpc-server", place)
            stack.callback(stop_process, proc)
            options = [("grpc.max_receive_message_length", 2 * RAW_MESSAGE_BYTES)]
            target = f"{place.host}:{port}"
            if place.tls is None:
                channel = grpc.insecure_channel(target, options=options)
            else:
                ca = grpc.ssl_channel_credentials(place.tls.ca.read_bytes())
                channel = grpc.secure_channel(target, ca, options=options)
            stack.enter_context(channel)
            # No serializers: bytes in, bytes out, as the server's generic handler.
            self._call = channel.unary_stream(
                RAW_METHOD, request_serializer=None, response_deserializer=None
            )
            proc, port = _start("socket-sender", place)
            stack.callback(stop_process, proc)
            self.sender_pid = proc.pid
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            tcp.tune(sock)  # before connecting, as the client's end of a data connection
            sock.connect((place.host, port))
            if place.tls is not None:  # as a TLS client's data connection
                context = TLS(ca=place.tls.ca).data_context()
                sock = stack.enter_context(context.wrap_socket(sock, server_hostname=place.host))
            self._sock = sock
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()

    def round(self, name: str, nbytes: int, batches: int, *, timed: bool = True) -> None:
        """One round of each: `batches` raw grpcio messages, and raw socket buffers of `nbytes`
        (a batch of workload `name`); kept unless not `timed` (a warm-up)."""
        grpc_rate = self._grpc_round(batches)
        socket_rate = self.socket_round(nbytes, max(batches, math.ceil(MIN_ROUND_BYTES / nbytes)))
        if timed:
            self.grpc.append(grpc_rate)
            self.socket.setdefault(name, []).append(socket_rate)

    def _grpc_round(self, batches: int) -> float:
        start = time.perf_counter()
        stream = self._call(str(batches).encode(), wait_for_ready=True, timeout=600)
        nbytes = sum(len(m) for m in stream)
        return nbytes / GB / (time.perf_counter() - start)

    def socket_round(self, nbytes: int, count: int) -> float:
        """GB/s of `count` raw socket buffers of `nbytes`, received by this process."""
        if nbytes not in self._buffers:  # preallocated and touched, reused
            self._buffers[nbytes] = memoryview(bytearray([1]) * nbytes)
        view = self._buffers[nbytes]
        start = time.perf_counter()
        self._sock.sendall(REQUEST.pack(count, nbytes))
        for _ in range(count):
            if not _recv_exactly(self._sock, view):
                raise RuntimeError("the raw socket sender closed the connection")
        return count * nbytes / GB / (time.perf_counter() - start)

    def ceilings(self, batch_bytes: Mapping[str, int], bar: Bar) -> Ceilings:
        """The rounds' raw figures and, per workload, the copies measured now in this process."""
        sizes = dict(batch_bytes)
        memcpy_rates = {}
        for name, nbytes in sizes.items():
            bar.set_description(f"memcpy ceiling: {name}")
            memcpy_rates[name] = memcpy_ceiling(nbytes)
            bar.update()
        h2d_rates = None
        if torch.cuda.is_available():
            h2d_rates = {}
            for name, nbytes in sizes.items():
                bar.set_description(f"host-to-device ceiling: {name}")
                h2d_rates[name] = h2d_ceiling(nbytes)
                bar.update()
        where = "loopback" if self.place.link is None else "between the namespaces"
        tls = self.place.tls is not None
        return Ceilings(where, sizes, self.grpc, self.socket, memcpy_rates, h2d_rates, tls)


def _start(role: str, place: Placement) -> tuple[subprocess.Popen[str], int]:
    """This file as the `role` server process where `place` says; the process and its port."""
    tls = [] if place.tls is None else ["--tls", str(place.tls.cert), str(place.tls.key)]
    argv = place.wrap([sys.executable, str(Path(__file__).resolve()), role, place.host, *tls])
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=subprocess_env())
    return proc, banner_port(read_banner(proc, f"the {role} process"), f"the {role} process")


# --- raw grpcio ----------------------------------------------------------------------------------


def grpc_server(host: str, tls: Sequence[str] | None = None) -> int:
    """`grpc-server`: streams N messages of RAW_MESSAGE_BYTES (N is the request) until SIGTERM."""
    payload = bytes(RAW_MESSAGE_BYTES)

    def stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        for _ in range(int(request)):
            yield payload

    service, method = RAW_METHOD.strip("/").split("/")
    handler = grpc.method_handlers_generic_handler(
        service, {method: grpc.unary_stream_rpc_method_handler(stream)}
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    if tls is None:
        port = server.add_insecure_port(f"{host}:0")
    else:
        cert, key = (Path(path).read_bytes() for path in tls)
        port = server.add_secure_port(f"{host}:0", grpc.ssl_server_credentials([(key, cert)]))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    print(f"raw grpc: serving on port {port}", flush=True)
    while not stop.wait(0.5):
        pass
    server.stop(None).wait()
    return 0


# --- raw socket ----------------------------------------------------------------------------------


def _recv_exactly(sock: socket.socket, view: memoryview) -> bool:
    """Fills `view` from `sock`; False if the peer closed first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            return False
        got += n
    return True


def socket_sender(host: str, tls: Sequence[str] | None = None) -> int:
    """`socket-sender`: for each request (batches, bytes) on its one connection, sends that many
    batch-sized buffers; exits when the receiver closes (or on SIGTERM). With `tls` (certificate
    and key files), over TLS with the context a TLS server's data listener uses."""
    with socket.create_server((host, 0)) as listener:
        print(f"raw socket: serving on port {listener.getsockname()[1]}", flush=True)
        conn, _ = listener.accept()
    tcp.tune(conn)  # as the server's end of a data connection
    if tls is not None:
        server_tls = load_tls(tls[0], tls[1], None)
        assert server_tls is not None and server_tls.data_context is not None
        conn = server_tls.data_context.wrap_socket(conn, server_side=True)
    with conn:
        payload = bytearray()
        request = memoryview(bytearray(REQUEST.size))
        while _recv_exactly(conn, request):
            count, nbytes = REQUEST.unpack(request)
            if len(payload) != nbytes:
                payload = bytearray([FILL]) * nbytes
            view = memoryview(payload)
            for _ in range(count):
                conn.sendall(view)
    return 0


# --- copies in this process ------------------------------------------------------------------


def memcpy_ceiling(nbytes: int, samples: int = MEMCPY_SAMPLES) -> list[float]:
    """GB/s of np.copyto between two preallocated batch-sized buffers, per sample."""
    src = np.full(nbytes, FILL, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # faults dst's pages in, outside the timing
    per = max(1, math.ceil(MIN_SAMPLE_BYTES / nbytes))
    rates = []
    for _ in range(samples):
        start = time.perf_counter()
        for _ in range(per):
            np.copyto(dst, src)
        rates.append(per * nbytes / GB / (time.perf_counter() - start))
    return rates


def h2d_ceiling(nbytes: int, samples: int = MEMCPY_SAMPLES) -> list[float]:
    """GB/s of pinned host-to-device copies of a batch-sized tensor, per sample (needs CUDA)."""
    src = torch.full((nbytes,), FILL, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)  # the context, the allocation: outside the timing
    torch.cuda.synchronize()
    per = max(1, math.ceil(MIN_SAMPLE_BYTES / nbytes))
    rates = []
    for _ in range(samples):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(per):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        rates.append(per * nbytes / GB / (start.elapsed_time(end) / 1e3))
    return rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("role", choices=["grpc-server", "socket-sender"])
    parser.add_argument("host", help="the address to listen on (port: a free one)")
    parser.add_argument("--tls", nargs=2, metavar=("CERT", "KEY"), help="speak TLS")
    args = parser.parse_args(argv)
    if args.role == "grpc-server":
        return grpc_server(args.host, args.tls)
    return socket_sender(args.host, args.tls)


if __name__ == "__main__":
    sys.exit(main())
