"""A TCP relay that holds every chunk DELAY seconds before passing it on: latency without netem.

    python -m benchmarks.relay HOST DELAY PORT:TARGET [PORT:TARGET ...]

Listens on HOST:PORT and forwards each connection to HOST:TARGET, each direction through a
bounded queue (RELAY_QUEUE chunks of up to CHUNK bytes: a full queue stops reading, so the
sender waits) whose writer sends a chunk only when it is DELAY seconds old. Prints "relay
ready" once listening; runs until killed. Used by benchmarks/campaign.py's delay scenario.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import sys
import threading
import time
from collections.abc import Sequence

# A relay direction holds at most this many chunks (of up to CHUNK bytes) in flight.
RELAY_QUEUE = 256
CHUNK = 64 * 1024


def relay(pairs: Sequence[tuple[str, int, int]], delay: float) -> None:
    """Listens on (host, port) and forwards each connection to (host, target) with `delay`."""
    for host, port, target in pairs:
        listener = socket.create_server((host, port), reuse_port=True)
        threading.Thread(
            target=_accept, args=(listener, (host, target), delay), daemon=True
        ).start()
    print("relay ready", flush=True)
    threading.Event().wait()  # until killed


def _accept(listener: socket.socket, target: tuple[str, int], delay: float) -> None:
    while True:
        client, _ = listener.accept()
        try:
            server = socket.create_connection(target, timeout=10)
        except OSError:
            client.close()
            continue
        server.settimeout(None)
        for a, b in ((client, server), (server, client)):
            q: queue.Queue[tuple[float, bytes]] = queue.Queue(RELAY_QUEUE)
            threading.Thread(target=_read, args=(a, q, delay), daemon=True).start()
            threading.Thread(target=_write, args=(b, q), daemon=True).start()


def _read(sock: socket.socket, q: queue.Queue[tuple[float, bytes]], delay: float) -> None:
    with contextlib.suppress(OSError):
        while data := sock.recv(CHUNK):
            q.put((time.monotonic() + delay, data))
    q.put((time.monotonic() + delay, b""))


def _write(sock: socket.socket, q: queue.Queue[tuple[float, bytes]]) -> None:
    with contextlib.suppress(OSError):
        while True:
            due, data = q.get()
            time.sleep(max(0.0, due - time.monotonic()))
            if not data:
                sock.shutdown(socket.SHUT_WR)
                return
            sock.sendall(data)


def main(argv: Sequence[str]) -> None:
    usage = "usage: python -m benchmarks.relay HOST DELAY PORT:TARGET [PORT:TARGET ...]"
    if len(argv) < 3 or argv[0] in ("-h", "--help"):
        raise SystemExit(f"{usage}\n\n{__doc__}")
    try:
        host, delay = argv[0], float(argv[1])
        pairs = [(host, int(p), int(t)) for p, t in (pair.split(":") for pair in argv[2:])]
    except ValueError:
        raise SystemExit(
            f"{usage}\nDELAY is seconds (0.025) and each pair two ports (9000:8000); got "
            f"{' '.join(argv)!r}"
        ) from None
    relay(pairs, delay)


if __name__ == "__main__":
    main(sys.argv[1:])
