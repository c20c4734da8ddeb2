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
- **splice**: `os.splice` file -> pipe (1 MiB) -> socket, the same page references by hand;
- **zerocopy**: `send(..., MSG_ZEROCOPY)` on a socket with `SO_ZEROCOPY` (the kernel's
  msg_zerocopy.rst): the kernel pins the mapped pages instead of copying them and says on the
  socket's error queue when it is done with them (a notice may cover several calls); each also
  says whether it copied them after all, which it does when the receiver is on the same host
  (msg_zerocopy.rst, "Loopback"; measured on veth into another namespace too). The column
  `copied/notices` counts those.

for two kinds of file: a `memfd_create` one and a file in /dev/shm (what torch's
`share_memory_()`, and so a worker's slot, uses). Sender CPU is the sending thread's
`time.thread_time()` per batch, median of `--rounds`; GB/s is the batch bytes over the wall
time of a round; `copied/notices` is summed over the rounds. The thread's time leaves out what
the kernel does for it in softirq (where loopback delivers, and where MSG_ZEROCOPY's copy
lands) on a kernel that accounts irq time apart (CONFIG_IRQ_TIME_ACCOUNTING), so the machine's
busy CPU per batch (/proc/stat, both ends and softirq; run it on an idle machine) and its
softirq part are shown beside it. A round that stalls for ROUND_TIMEOUT fails.

    python benchmarks/sendcost.py [--mb 9.63] [--batches 40] [--rounds 5] [--cross-host]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: benchmarks/ is not a package on the path
    sys.path.insert(0, str(ROOT))

from benchmarks import netns, processes  # noqa: E402
from benchmarks.send_ways import SO_ZEROCOPY, Notices, sender, shm_file  # noqa: E402
from remote_loader.protos import tcp  # noqa: E402

# The most a round may take before it is given up as stalled (a receiver that died or hung):
# the sockets' SO_SNDTIMEO / SO_RCVTIMEO, and the wait for the last zero-copy notices.
ROUND_TIMEOUT = 60.0


def receive(sock: socket.socket, nbytes: int, batches: int) -> bool:
    """Reads `batches` batches into one buffer, then says so with one byte; False if the
    connection closed first."""
    buffer = memoryview(bytearray(nbytes))
    for _ in range(batches):
        got = 0
        while got < nbytes:
            n = sock.recv_into(buffer[got:], nbytes - got)
            if n == 0:
                return False
            got += n
    sock.sendall(b"k")
    return True


def receiver(sock: socket.socket, nbytes: int, batches: int) -> None:
    """The forked child, on loopback: never returns into the parent's code."""
    code = 1
    try:
        code = 0 if receive(sock, nbytes, batches) else 1
    finally:
        os._exit(code)


def receiver_in_namespace(nbytes: int, batches: int) -> int:
    """`--receive`: the receiver of a --cross-host round, run inside the namespace: prints the
    port it listens on, takes one connection and reads from it."""
    with socket.create_server(("0.0.0.0", 0)) as listener:
        print(f"sendcost receiver: serving on port {listener.getsockname()[1]}", flush=True)
        sock, _ = listener.accept()
    with sock:
        tcp.tune(sock)
        return 0 if receive(sock, nbytes, batches) else 1


@dataclasses.dataclass(frozen=True)
class Round:
    sender: float  # the sending thread's CPU s per batch
    machine: float  # the machine's busy CPU s per batch (both ends, softirq included)
    softirq: float  # of which softirq
    rate: float  # GB/s
    copied: int  # zero-copy notices that said the kernel copied
    notices: int  # zero-copy notices in all


MEDIANS = ("sender", "machine", "softirq", "rate")  # Round's fields shown as medians


def _machine_cpu() -> tuple[float, float]:
    """The machine's busy and softirq CPU seconds so far, all CPUs (/proc/stat's first line:
    user nice system idle iowait irq softirq steal ...; guest time is already in user, and
    steal is the hypervisor's, not work done here)."""
    with open("/proc/stat") as stat:
        ticks = [int(x) for x in stat.readline().split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq = ticks[:7]
    return (user + nice + system + irq + softirq) / hz, softirq / hz


def one_round(way: str, fd: int, nbytes: int, batches: int, link: netns.Link | None) -> Round:
    """One round of `batches` batches on a fresh connection: to a forked child on loopback, or
    (`link`) to a receiver in the link's namespace."""
    with contextlib.ExitStack() as stack:
        if link is None:
            ours, theirs = _tcp_pair()
            pid = os.fork()
            if pid == 0:
                ours.close()
                receiver(theirs, nbytes, batches)
            theirs.close()
            stack.callback(_reap_fork, pid)
        else:
            argv = [sys.executable, __file__, "--receive", str(nbytes), str(batches)]
            child = subprocess.Popen(link.wrap(argv), stdout=subprocess.PIPE, text=True)
            stack.callback(_reap_child, child)
            what = f"the receiver in {link.namespace}"
            port = processes.banner_port(processes.read_banner(child, what, ROUND_TIMEOUT), what)
            ours = socket.create_connection((link.server_ip, port), timeout=ROUND_TIMEOUT)
            ours.settimeout(None)  # blocking: sendfile and splice write the descriptor itself
            tcp.tune(ours)
        stack.callback(ours.close)
        # A receiver that stalls makes a send or the last read fail instead of hanging.
        timeout = struct.pack("ll", int(ROUND_TIMEOUT), 0)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeout)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeout)
        return _timed(way, fd, nbytes, batches, ours)


def _reap_fork(pid: int) -> None:
    _, status = os.waitpid(pid, 0)  # the socket is closed first: a stalled child gets EOF
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError("the receiver failed")


def _reap_child(child: subprocess.Popen[str]) -> None:
    try:
        code: int | None = child.wait(ROUND_TIMEOUT)
    except subprocess.TimeoutExpired:
        code = None
    processes.stop_process(child)  # closes its pipe; stops one still there
    if code != 0:
        raise RuntimeError(f"the receiver failed or hung (exit status {code})")


def _timed(way: str, fd: int, nbytes: int, batches: int, ours: socket.socket) -> Round:
    """Sends `batches` batches in `way` on `ours` and waits until the receiver has them all."""
    notices = None
    if way == "zerocopy":
        ours.setsockopt(socket.SOL_SOCKET, SO_ZEROCOPY, 1)
        notices = Notices(ours)
    with sender(way, fd, nbytes, notices) as send:
        busy, softirq = _machine_cpu()
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(batches):
            send(ours)
        deadline = time.monotonic() + ROUND_TIMEOUT
        while notices is not None and notices.done < notices.calls:
            if time.monotonic() > deadline:  # the pages may be reused only once all are back
                raise RuntimeError(f"{notices.calls - notices.done} zero-copy sends never done")
            notices.read(wait=True)
        if ours.recv(1) != b"k":
            raise RuntimeError("the receiver did not read every batch")
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        busy_after, softirq_after = _machine_cpu()
    return Round(
        sender=cpu / batches,
        machine=(busy_after - busy) / batches,
        softirq=(softirq_after - softirq) / batches,
        rate=nbytes * batches / wall / 1e9,
        copied=notices.copied if notices else 0,
        notices=notices.notices if notices else 0,
    )


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
    parser.add_argument(
        "--cross-host",
        action="store_true",
        help="the receiver in a network namespace of its own, over a veth pair (root; "
        "benchmarks/netns.py), as compare.py --cross-host",
    )
    parser.add_argument("--receive", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.receive:
        return receiver_in_namespace(*args.receive)
    if args.mb <= 0 or args.batches < 1 or args.rounds < 1:
        raise SystemExit("--mb must be positive, --batches and --rounds at least 1")
    nbytes = int(args.mb * 1e6)
    with contextlib.ExitStack() as stack:
        link = None
        if args.cross_host:
            try:
                link = stack.enter_context(netns.Link.create())
            except netns.NetnsError as exc:
                raise SystemExit(f"--cross-host: {exc}") from None
        _measure(args, nbytes, link)
    return 0


def _measure(args: argparse.Namespace, nbytes: int, link: netns.Link | None) -> None:
    where = "on loopback"
    if link is not None:
        where = (
            f"across the veth pair {link.host_veth}-{link.ns_veth} (receiver in network "
            f"namespace {link.namespace} at {link.server_ip}, sender in the root namespace)"
        )
    print(
        f"one TCP connection {where}, {nbytes / 1e6:.2f} MB batches, {args.batches} per "
        f"round, {args.rounds} rounds (medians); {os.cpu_count()} CPUs, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}\n"
    )
    print(
        f"{'file':8} {'way':9} {'sender ms/batch':>15} {'machine ms/batch':>16} "
        f"{'of it softirq':>13} {'GB/s':>6} {'copied/notices':>14}"
    )
    for kind in ("memfd", "/dev/shm"):
        with shm_file(kind, nbytes) as fd:
            for way in ("send", "sendfile", "splice", "zerocopy"):
                rounds = [
                    one_round(way, fd, nbytes, args.batches, link) for _ in range(args.rounds)
                ]
                m = {
                    field: statistics.median(getattr(r, field) for r in rounds) for field in MEDIANS
                }
                copied = (
                    f"{sum(r.copied for r in rounds)}/{sum(r.notices for r in rounds)}"
                    if way == "zerocopy"
                    else ""
                )
                print(
                    f"{kind:8} {way:9} {m['sender'] * 1e3:15.2f} {m['machine'] * 1e3:16.2f} "
                    f"{m['softirq'] * 1e3:13.2f} {m['rate']:6.2f} {copied:>14}"
                )


if __name__ == "__main__":
    raise SystemExit(main())
