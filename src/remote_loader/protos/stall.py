"""Is the GPU waiting? The stages a trainer's wait is put down to, the stamp that lets a client
tell them apart, and the bound on the reports that carry them to the server.

NOTE [ Stall stages ]

A trainer stalls when its training loop is blocked in `next()`. Each such wait is put down to
the stage that held the batch it waited for:

  workers    the batch was not made yet when the server's stream asked for it: the stream
             waited for the workers (or, with num_workers = 0, the server) to make it.
  in flight  the batch was made before its stream asked, but had not reached this client's
             receiver: it sat in a queue, in gRPC's flow-control window, on the network.
  copy       the receiver had its first bytes and was receiving the rest, decoding it and
             starting its copy to the device.

How each side knows:

  server   the stream handler times its wait for the next entry (Consumer.next). When it
           waited STAMP_MIN_SECONDS or more, part 0 of the batch carries
           `Frame.waited_us` (`stamped`: prepended, as protobuf merges fields in any order and
           `wire.parse_frame` reads everything before `data`; a Frame that announces a node
           before the batch is passed over). Absent: ready ahead.
  receiver stamps when part 0 arrived and when the batch was decoded (`copy`), and keeps
           the server's stamp (`workers`) with the batch.
  loop     `split_wait(waited, workers, copy)`: of a wait of `waited` seconds, the server's
           wait is the workers' share (at most all of it), the receiver's time the copy's
           share of what is left, and the rest was in flight.

Cost: a stamp is prepended only when the stream waited at least STAMP_MIN_SECONDS, that is
when the workers are the bottleneck and the stream has time to spare. On a handle frame (shared
memory, data connection, node) that is a few bytes; on an in-band part 0 it is one more copy
of at most a chunk (4 MiB, under a millisecond), made while the stream would have waited anyway.
An older client ignores the field (field 14 is new).

Reports (client/report.py -> Report RPC -> server/telemetry/stall.py): a RemoteLoader sends
one small StallReport (about 100 bytes) per REPORT_INTERVAL while it reads, so control traffic
is bounded by one unary call per second per stream. The server keeps at most one report per
reporter (its `reporter` id), drops a report that comes MIN_REPORT_GAP after the previous one
of the same reporter (RESOURCE_EXHAUSTED), forgets a reporter silent for REPORT_TTL, and holds
HISTORY samples of history for each: the memory is bounded by its count of reporters (the
consumer-series cap, NOTE [ Stall board ] in server/telemetry/stall.py). A server that
predates Report answers UNIMPLEMENTED: the client stops reporting for good.
"""

from __future__ import annotations

from remote_loader.protos import loader_pb2, wire

WORKERS = "workers"
IN_FLIGHT = "in flight"
COPY = "copy"
STAGES = (WORKERS, IN_FLIGHT, COPY)

# The stream's wait a stamp is worth sending for (a batch taken at once waits microseconds).
STAMP_MIN_SECONDS = 0.001
# The sliding window of a trainer's stall, and how often it is reported.
WINDOW_SECONDS = 10.0
REPORT_INTERVAL = 1.0
# Server side: reports closer than this for one reporter are refused (a client sends one per
# REPORT_INTERVAL; half of it leaves room for jitter), a reporter silent this long is forgotten,
# and each keeps this many samples (one per report: about the last minute).
MIN_REPORT_GAP = 0.5
REPORT_TTL = 10.0
HISTORY = 60


def wait_stamp(seconds: float) -> bytes:
    """The serialized Frame field saying the stream waited `seconds` for the batch; b"" when
    that is under STAMP_MIN_SECONDS."""
    if seconds < STAMP_MIN_SECONDS:
        return b""
    return loader_pb2.Frame(waited_us=round(seconds * 1e6)).SerializeToString()


def split_wait(waited: float, workers: float, copy: float) -> dict[str, float]:
    """A wait of `waited` seconds for a batch whose stream waited `workers` seconds for it and
    whose receiver spent `copy` seconds on it, by stage (the parts add up to `waited`)."""
    on_workers = min(waited, max(0.0, workers))
    on_copy = min(waited - on_workers, max(0.0, copy))
    return {WORKERS: on_workers, IN_FLIGHT: waited - on_workers - on_copy, COPY: on_copy}


def stamped(frame: bytes, seconds: float) -> bytes | None:
    """`frame` with the stamp saying its stream waited `seconds` for the batch (`frame` as it
    is under STAMP_MIN_SECONDS), if it is the batch's first Frame; None if it is a Frame sent
    before it (a node's announcement), for the stamp to go on the next one."""
    stamp = wait_stamp(seconds)
    if not stamp:
        return frame
    meta, _ = wire.parse_frame(frame)
    if meta.parts == 0:
        return None
    return stamp + frame
