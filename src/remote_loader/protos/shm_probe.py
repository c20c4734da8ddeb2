"""The probe: do a client and a server see the same /dev/shm (NOTE [ Shared-memory transport ]
in protos/shm.py)?

The client writes a random nonce into a file of its own (`Probe`) and names it in its request;
a server that reads that nonce from that file (`verify_probe`) shares the client's /dev/shm, and
learns the client's uid from the file's owner (`can_share_with`: whether a ring it makes can be
opened by that user). Whoever probes next removes probes a killed client left (NOTE [ Stale
probes ]).
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
import stat
import threading
import time

from remote_loader.protos.shm import SHM_DIR, ShmUnavailable, segment_path, unlink_segment

PROBE_PREFIX = "rl-probe-"
# A client names the probe the server opens: only this exact shape is accepted, so no request can
# point the server at anything else (no "/", no "..", fixed length).
_PROBE_NAME = re.compile(r"rl-probe-[0-9a-f]{32}")
NONCE_BYTES = 16

# NOTE [ Stale probes ]
#
# A client killed between making its probe and its stream's first message leaves the file:
# nothing it owned outlives it to unlink it (a probe is not registered with the resource
# tracker: the server, not the client, must be able to unlink it first). So whoever next
# probes on that /dev/shm, a client making its probe or a server reading one, unlinks the
# probe files older than PROBE_STALE_AFTER. A probe lives for one request's round trip, so a
# probe that old is a dead client's; were it a live client's stuck that long, the server would
# find it gone and the stream would go over gRPC or TCP instead, as without shared memory.
# Age, not the creator's pid: the name carries no pid, and the pid a request names is only
# readable by a server in the client's pid namespace. Another user's probe cannot be unlinked
# (/dev/shm is sticky) and is left to a process of that user (or root).
PROBE_STALE_AFTER = 60.0


def sweep_stale_probes(now: float | None = None) -> list[str]:
    """Unlinks the probe files last written more than PROBE_STALE_AFTER seconds before `now`
    (time.time()); returns their names (see NOTE [ Stale probes ])."""
    now = time.time() if now is None else now
    swept: list[str] = []
    try:
        names = [n for n in os.listdir(SHM_DIR) if _PROBE_NAME.fullmatch(n)]
    except OSError:
        return swept
    for name in names:
        try:
            st = os.stat(segment_path(name), follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and now - st.st_mtime > PROBE_STALE_AFTER:
                os.unlink(segment_path(name))
                swept.append(name)
        except OSError:  # gone meanwhile, or another user's
            continue
    return swept


class Probe:
    """The client's half of the negotiation: a small file only a process sharing /dev/shm reads.

    The probe stays open (`fd`) until `remove()`: a server that also finds it under
    /proc/<pid>/fd/<fd> shares this process's pid namespace (NOTE [ Zero-copy slots ] in
    protos/slots.py). `remove()` is idempotent and safe to call from any thread.
    """

    def __init__(self) -> None:
        sweep_stale_probes()  # NOTE [ Stale probes ]
        self.name = PROBE_PREFIX + secrets.token_hex(16)
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.pid = os.getpid()
        self._lock = threading.Lock()
        try:
            # Readable by all: a server running as another user must read it (the nonce proves
            # only that the two share /dev/shm; it guards nothing).
            fd = os.open(segment_path(self.name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            raise ShmUnavailable(f"cannot create {segment_path(self.name)}: {exc}") from exc
        try:
            os.fchmod(fd, 0o644)  # not narrowed by the umask
            os.write(fd, self.nonce)
        except OSError as exc:
            os.close(fd)
            unlink_segment(self.name)
            raise ShmUnavailable(f"cannot write {segment_path(self.name)}: {exc}") from exc
        self.fd: int | None = fd

    def remove(self) -> None:
        with self._lock:
            fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)
        unlink_segment(self.name)


def can_share_with(uid: int) -> bool:
    """Whether a ring this process makes (mode 0600) can be opened by a client running as `uid`.

    Yes for the same user, for a root client, and for a root server (which gives the ring to
    the client's user).
    """
    me = os.geteuid()
    return uid in (me, 0) or me == 0


def verify_probe(name: str, nonce: bytes) -> int | None:
    """The server's half: the probe owner's uid if `name` holds `nonce`, else None."""
    st = read_probe(name, nonce)
    return None if st is None else st.st_uid


def read_probe(name: str, nonce: bytes) -> os.stat_result | None:
    """The probe file's status if `name` holds `nonce`, else None.

    Removes the probe either way. Never follows a link, reads only a regular file of the exact
    size, and compares in constant time.
    """
    if not _PROBE_NAME.fullmatch(name) or len(nonce) != NONCE_BYTES:
        return None
    sweep_stale_probes()  # NOTE [ Stale probes ]
    try:
        fd = os.open(segment_path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None  # another host, another IPC namespace, or another user's file
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != NONCE_BYTES:
            return None
        content = os.read(fd, NONCE_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
        unlink_segment(name)
    return st if hmac.compare_digest(content, nonce) else None
