"""Zero-copy slots: a same-host client reads a batch where its worker wrote it.

NOTE [ Zero-copy slots ]

Through the ring (NOTE [ Shared-memory transport ] in protos/shm.py) a batch is copied three
times after collation: by its worker into a shared-memory slot, by the server into the stream's
ring, by the client out of the ring (into pinned memory with CUDA). The middle copy buys
nothing when the client can map the slot itself, and it is paid once per consumer: four
broadcast consumers cost the server four copies of every batch. So when the client proved it
can, the server forwards only where the batch is:

    client                                    server
    ------                                    ------
    ShmOffer also carries its pid and the     finds /proc/<pid>/fd/<probe_fd> is the probe it
    descriptor it holds the probe open on     read (same inode): the client shares its pid
                                              namespace; with the same user it may open the
                                              server's descriptors too. Then, per batch in a
                                              worker's slot (the pool's, the Ray bridge's):
                                              holds the batch's slot lease (its slot stays the
                                              batch's: NOTE [ Slot lease ], server/batch/lease.py)
                                              and sends ShmBatch.slot: the server's pid, the fd it
                                              holds the slot open on, the file's inode and size,
                                              the offset and the slot's generation
    opens /proc/<pid>/fd/<fd> (once per       at most SLOT_LEASES batches per stream are leased
    slot: maps are cached), checks inode and  and not yet released; the slot goes back to its
    size, maps it read-only, copies the       worker once every consumer that leased it released
    batch out, checks the generation, then    it (the control ring's cursor passed its number)
    stores the batch's number in the control  and the policy is done with the entry
    ring's cursor                             (the lease's give-back)

The control ring is an ordinary ring of one ALIGN of data that only carries the header words:
its cursor counts the slot batches released, and its attached flag and heartbeat serve as a
data ring's do, so release, liveness and clean-up are the ring's (NOTE [ Ring space ]).

Whoever dies, nothing is torn or lost. The slot's first SLOT_HEADER bytes hold its generation, a
seqlock: a worker makes it odd before it writes a batch there and even (the value the server
forwards) once it is done. A slot is only rewritten after the server gave it back, which it does
when the client released it, or when the stream is over (finished: every batch was released
first; cancelled or broken: the client may be mid-copy). The client compares the generation
before and after its copy: a changed value means the slot was reused under it, and the batch
is treated as a broken stream (resumed from that batch), never delivered torn. Loads and stores
around the copy are ordered by x86's memory model. Elsewhere (arm64) the GIL's atomic
operations order the client's copy before its second look and its release, but nothing Python
can do orders a worker's odd generation before its first stores of the next batch, so a client
still copying a batch whose stream the server has let go of (cancelled, detached mid-copy)
might miss the rewrite there; the release path itself never rewrites a slot being read. A
server that dies takes its descriptors with it: a client
whose open fails gives shared memory up for the rest of the loader (TransportUnusable), and
resumes like any broken stream.

When it is not used: a client in another pid namespace (a container sharing only /dev/shm),
of another user, or a server with `zero_copy = false`, get the ring; batches not in a worker's
slot (num_workers = 0) go through the ring too.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import struct

# A slot's first bytes: its generation (little-endian u64), then padding to a cache line so the
# blob after it starts aligned (codec.ALIGN).
SLOT_HEADER = 64
_GENERATION = struct.Struct("<Q")
# Slot batches one stream may have leased and not yet released: as many as a ring holds, so a
# zero-copy stream keeps no more of the pool's memory busy than a ring would hold.
SLOT_LEASES = 4
# Slot files a client keeps mapped: the pool's slots in flight, with room to spare; the least
# recently used map goes first (a worker drops small slots as batches grow).
MAX_MAPS = 64


class SlotUnavailable(OSError):
    """A slot cannot be opened here (the server is gone, another pid namespace, another user)."""


class StaleSlot(RuntimeError):
    """A slot was rewritten while the batch was copied out of it: the copy is torn."""


# --- the writer's side (a worker, the Ray bridge) ----------------------------------------------


def begin_write(slot: memoryview) -> int:
    """Marks `slot` (its whole buffer) as being written: returns the generation to pass to
    `end_write`. A reader that copied across this sees a changed generation."""
    generation = int(_GENERATION.unpack_from(slot, 0)[0]) | 1
    _GENERATION.pack_into(slot, 0, generation)
    return generation + 1


def end_write(slot: memoryview, generation: int) -> None:
    """Marks `slot` as holding a whole batch at `generation` (even)."""
    _GENERATION.pack_into(slot, 0, generation)


# --- the server's side ----------------------------------------------------------------------


def shares_pid_namespace(pid: int, fd: int, inode: int, device: int) -> bool:
    """Whether /proc/<pid>/fd/<fd> is the file (`inode`, `device`): the process `pid` the client
    named is the one holding our probe, seen from here, so the two share a pid namespace and
    this process may open its descriptors (and, as the same user, it ours)."""
    if pid <= 0 or fd < 0:
        return False
    try:
        st = os.stat(f"/proc/{pid}/fd/{fd}")
    except OSError:
        return False
    return st.st_ino == inode and st.st_dev == device


# --- the client's side ----------------------------------------------------------------------


class SlotMaps:
    """The worker slots a client has mapped (read-only), by (pid, fd, inode); at most MAX_MAPS."""

    def __init__(self) -> None:
        self._maps: collections.OrderedDict[tuple[int, int, int], mmap.mmap] = (
            collections.OrderedDict()
        )

    def view(self, pid: int, fd: int, inode: int, size: int) -> memoryview:
        """The whole slot file; raises SlotUnavailable when it cannot be opened or is not the
        file the server named (a descriptor number reused since)."""
        key = (pid, fd, inode)
        mm = self._maps.get(key)
        if mm is None:
            mm = self._open(pid, fd, inode, size)
            self._maps[key] = mm
            while len(self._maps) > MAX_MAPS:
                self._close(self._maps.popitem(last=False)[1])
        else:
            self._maps.move_to_end(key)
        if len(mm) != size:
            raise SlotUnavailable(f"slot {fd} of process {pid} is {len(mm)} bytes, not {size}")
        return memoryview(mm)

    @staticmethod
    def _open(pid: int, fd: int, inode: int, size: int) -> mmap.mmap:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            own = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise SlotUnavailable(f"cannot open the server's slot {path}: {exc}") from exc
        try:
            st = os.fstat(own)
            if st.st_ino != inode or st.st_size != size:
                raise SlotUnavailable(
                    f"{path} is not the slot the server named (inode {st.st_ino}, {st.st_size} "
                    f"bytes; expected {inode}, {size})"
                )
            # Populated now, once per slot: else its first batches pay a page fault per 4 KiB.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            return mmap.mmap(own, size, flags=flags, prot=mmap.PROT_READ)
        except OSError as exc:
            raise SlotUnavailable(f"cannot map the server's slot {path}: {exc}") from exc
        finally:
            os.close(own)

    @staticmethod
    def _close(mm: mmap.mmap) -> None:
        with contextlib.suppress(BufferError):  # a view is alive; the map goes with it
            mm.close()

    def close(self) -> None:
        for mm in self._maps.values():
            self._close(mm)
        self._maps.clear()


def generation(slot: memoryview) -> int:
    """The slot's generation word now."""
    return int(_GENERATION.unpack_from(slot, 0)[0])


def check_generation(slot: memoryview, expected: int) -> None:
    """Raises StaleSlot unless the slot still holds the batch of generation `expected`."""
    now = generation(slot)
    if now != expected:
        raise StaleSlot(
            f"the slot was rewritten (generation {now}, expected {expected}): its batch was "
            "given back to the worker before this client had read it"
        )
