"""What sending one batch out of shared memory costs the sender's CPU, per way the kernel offers.

A tcp consumer costs the server one send of every batch it receives, out of the worker's
shared-memory slot (NOTE [ TCP data connection ] in protos/tcp.py); with broadcast, one per
consumer. This measures the candidates on one TCP connection (4 MiB buffers, no Nagle, as the
data connection's), a batch-sized shared-memory file on the sending side and a child process
that `recv_into`s every batch into one preallocated buffer on the other:

- **send**: `socket.sendall` of a memoryview of the mapped file (what the server does);
- **sendfile**: `os.sendfile` from the file's descriptor: the kernel references the file's
  pages instead of copying them, so the sender must not reuse them until the receiver has read
  them (on a NIC, until they are acknowledged);
- **splice**: `os.splice` file -> pipe (1 MiB) -> socket, the same page references by hand.

for two kinds of file: a `memfd_create` one and a file in /dev/shm (what torch's
`share_memory_()`, and so a worker's slot, uses). Sender CPU is the sending thread's
`time.thread_time()` per batch, median of `--rounds`; GB/s is the batch bytes over the wall
time of a round. On loopback the receiver's copy is not the sender's; MSG_ZEROCOPY is not
measured: loopback delivers such pages by copying them anyway (the kernel's msg_zerocopy.rst).

    python benchmarks/sendcost.py [--mb 9.63] [--batches 40] [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import mmap
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: benchmarks/ is not a package on the path
    sys.path.insert(0, str(ROOT))

from remote_loader.protos import tcp  # noqa: E402

PIPE_BYTES = 1 << 20  # splice's pipe: F_SETPIPE_SZ, as large as an unprivileged pipe may be


@contextlib.contextmanager
def shm_file(kind: str, nbytes: int) -> Iterator[int]:
    """A descriptor of a shared-memory file of `nbytes` filled bytes (no zero page is sent)."""
    if kind == "memfd":
        fd = os.memfd_create("sendcost")
    else:
        fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="sendcost-")
        os.unlink(path)
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes) as view:
            view[:] = bytes(range(256)) * (nbytes // 256) + bytes(nbytes % 256)
        yield fd
    finally:
        os.close(fd)


def receiver(sock: socket.socket, nbytes: int, batches: int) -> None:
    """The child: reads `batches` batches into one buffer, then says so with one byte."""
    buffer = memoryview(bytearray(nbytes))
    for _ in range(batches):
        got = 0
        while got < nbytes:
            n = sock.recv_into(buffer[got:], nbytes - got)
            if n == 0:
                os._exit(1)
            got += n
    sock.sendall(b"k")
    os._exit(0)


@contextlib.contextmanager
def sender(way: str, fd: int, nbytes: int) -> Iterator[Callable[[socket.socket], None]]:
    """One batch's send in `way`, out of file `fd`."""
    if way == "send":
        with mmap.mmap(fd, nbytes) as mapped:
            view = memoryview(mapped)
            yield lambda sock: sock.sendall(view)
            view.release()
        return
    if way == "sendfile":

        def send_file(sock: socket.socket) -> None:
            offset = 0
            while offset < nbytes:
                offset += os.sendfile(sock.fileno(), fd, offset, nbytes - offset)

        yield send_file
        return
    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_BYTES)

    def send_splice(sock: socket.socket) -> None:
        offset = 0
        while offset < nbytes:
            n = os.splice(fd, w, min(PIPE_BYTES, nbytes - offset), offset_src=offset)
            offset += n
            while n:
                n -= os.splice(r, sock.fileno(), n)

    try:
        yield send_splice
    finally:
        os.close(r)
        os.close(w)


def one_round(way: str, fd: int, nbytes: int, batches: int) -> tuple[float, float]:
    """Sender CPU s per batch and GB/s over `batches` batches on a fresh connection."""
    ours, theirs = _tcp_pair()
    pid = os.fork()
    if pid == 0:
        ours.close()
        receiver(theirs, nbytes, batches)
    theirs.close()
    with sender(way, fd, nbytes) as send:
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(batches):
            send(ours)
        ours.recv(1)  # everything arrived
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    os.waitpid(pid, 0)
    ours.close()
    return cpu / batches, nbytes * batches / wall / 1e9


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A connected pair of TCP sockets on loopback, tuned as the data connection's."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    for sock in (a, b):
        tcp.tune(sock)
    return a, b


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=float, default=9.63, help="batch size in MB (images')")
    parser.add_argument("--batches", type=int, default=40, help="batches per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.mb <= 0 or args.batches < 1 or args.rounds < 1:
        raise SystemExit("--mb must be positive, --batches and --rounds at least 1")
    nbytes = int(args.mb * 1e6)
    print(
        f"one TCP connection on loopback, {nbytes / 1e6:.2f} MB batches, {args.batches} per "
        f"round, {args.rounds} rounds (medians); {os.cpu_count()} CPUs, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}\n"
    )
    print(f"{'file':8} {'way':9} {'sender CPU ms/batch':>20} {'GB/s':>7}")
    for kind in ("memfd", "/dev/shm"):
        with shm_file(kind, nbytes) as fd:
            for way in ("send", "sendfile", "splice"):
                results = [one_round(way, fd, nbytes, args.batches) for _ in range(args.rounds)]
                cpu = statistics.median(r[0] for r in results)
                rate = statistics.median(r[1] for r in results)
                print(f"{kind:8} {way:9} {cpu * 1e3:20.2f} {rate:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
