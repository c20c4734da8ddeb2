"""The ways benchmarks/sendcost.py sends one batch out of a shared-memory file on a socket: send,
sendfile, splice and MSG_ZEROCOPY (whose completion notices `Notices` reads), and the file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import select
import socket
import struct
import tempfile
from collections.abc import Callable, Iterator

PIPE_BYTES = 1 << 20  # splice's pipe: F_SETPIPE_SZ, as large as an unprivileged pipe may be
# Linux's uapi values (asm-generic/socket.h, linux/socket.h, linux/errqueue.h); Python 3.11's
# socket module does not name them.
SO_ZEROCOPY = 60
MSG_ZEROCOPY = 0x4000000
SO_EE_ORIGIN_ZEROCOPY = 5
SO_EE_CODE_ZEROCOPY_COPIED = 1
EXTENDED_ERR = struct.Struct("=IBBBBII")  # struct sock_extended_err


class Notices:
    """A MSG_ZEROCOPY sender's completion notices, read off its socket's error queue: how many
    of its send calls the kernel is done with, and how many notices said it copied.

    A notice covers the calls [first, last] (numbered from 0); notices usually come in order,
    not always (msg_zerocopy.rst), so the calls covered are added up, not the last taken."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.calls = 0  # zero-copy send calls made
        self.done = 0  # of them, those the kernel is done with
        self.notices = 0
        self.copied = 0  # of the notices

    def read(self, wait: bool = False) -> None:
        """Reads every notice queued (with `wait`, waits up to a second for one first)."""
        if wait:  # a queued notice shows as POLLERR, which poll reports unasked
            poller = select.poll()
            poller.register(self.sock, 0)
            poller.poll(1000)
        while True:
            try:
                _, ancillary, _, _ = self.sock.recvmsg(
                    0, 1024, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT
                )
            except BlockingIOError:
                return
            for _level, _type, data in ancillary:
                number, origin, _, code, _, first, last = EXTENDED_ERR.unpack_from(data)
                if origin != SO_EE_ORIGIN_ZEROCOPY:
                    raise OSError(number, f"an error on the socket's queue: {os.strerror(number)}")
                self.done += last - first + 1
                self.notices += 1
                self.copied += code & SO_EE_CODE_ZEROCOPY_COPIED


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


@contextlib.contextmanager
def sender(
    way: str, fd: int, nbytes: int, notices: Notices | None = None
) -> Iterator[Callable[[socket.socket], None]]:
    """One batch's send in `way`, out of file `fd` (zerocopy: its notices read into `notices`)."""
    if way in ("send", "zerocopy"):
        with mmap.mmap(fd, nbytes) as mapped:
            view = memoryview(mapped)
            try:
                if notices is None:
                    yield lambda sock: sock.sendall(view)
                else:
                    yield _zero_copy(view, notices)
            finally:
                view.release()  # before the map closes, which refuses while a view is out
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


def _zero_copy(view: memoryview, notices: Notices) -> Callable[[socket.socket], None]:
    """A batch's send of `view` with MSG_ZEROCOPY, counting its calls and reading the notices
    as they come (the kernel refuses more with ENOBUFS while too many pages are pinned)."""

    def send_zero_copy(sock: socket.socket) -> None:
        sent = 0
        while sent < len(view):
            try:
                sent += sock.send(view[sent:], MSG_ZEROCOPY)
                notices.calls += 1
            except OSError as exc:  # ENOBUFS: too many pinned pages not yet given back
                if exc.errno != errno.ENOBUFS:
                    raise
                notices.read(wait=True)
            notices.read()

    return send_zero_copy
