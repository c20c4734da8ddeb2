"""The Report RPC: a trainer's stall, checked and kept on its loader's StallBoard (NOTE [ Stall
stages ] in protos/stall.py, NOTE [ Stall board ] in server/telemetry/stall.py)."""

from __future__ import annotations

import math
from collections.abc import Callable

import grpc

from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos.stall import STAGES
from remote_loader.server.api.status import statuses
from remote_loader.server.api.validation import Undecodable, decoded
from remote_loader.server.errors import InvalidRequest, ServerBusy, clip
from remote_loader.server.sharing.host import LoaderHost
from remote_loader.server.sharing.membership import DEFAULT_JOB, Membership
from remote_loader.server.telemetry.stall import Report


class Reports:
    """Takes StallReports for the loaders `host(name)` finds; `tick()` after each one kept (the
    status snapshot samples its rates then)."""

    def __init__(
        self, host: Callable[[str], LoaderHost], tick: Callable[[], None] = lambda: None
    ) -> None:
        self._host = host
        self._tick = tick

    def Report(
        self, request: pb.StallReport | Undecodable, context: grpc.ServicerContext
    ) -> pb.ReportReply:
        report = decoded("Report", request, context)
        with statuses(context):
            self.record(report)
        return pb.ReportReply()

    def record(self, request: pb.StallReport) -> None:
        """Keeps `request` on its loader's board; a ServerError when it is refused."""
        host = self._host(request.loader)
        kept = as_report(request)
        # The labels must be a consumer's the loader would take (a bounded sharing mode, a
        # rank within its world): SharingError otherwise, as for a stream.
        host.check(Membership(kept.sharing, kept.job, kept.rank, kept.world_size))
        why = host.metrics.stalls.record(request.reporter, kept)
        if why is not None:
            raise ServerBusy(f"stall report refused: {why}")
        self._tick()


def as_report(request: pb.StallReport) -> Report:
    """`request` as the board keeps it; InvalidRequest for a stage it does not know."""
    for stage in (request.stage, request.recent_stage):
        if stage and stage not in STAGES:
            raise InvalidRequest(
                f"unknown stall stage {clip(stage)!r}: expected one of {', '.join(STAGES)} or empty"
            )
    consumer = request.consumer
    return Report(
        job=consumer.job or DEFAULT_JOB,
        sharing=consumer.sharing or "partition",
        rank=consumer.rank,
        world_size=consumer.world_size if consumer.HasField("world_size") else 1,
        epoch=request.epoch,
        window=_clamped(request.window_seconds, math.inf),
        wait_fraction=_clamped(request.wait_fraction),
        stages={
            stage: _clamped(value)
            for stage, value in zip(
                STAGES, (request.workers, request.in_flight, request.copy), strict=True
            )
        },
        stage=request.stage,
        batches_per_second=_clamped(request.batches_per_second, math.inf),
        recent_wait_fraction=_clamped(request.recent_wait_fraction),
        recent_stage=request.recent_stage,
    )


def _clamped(value: float, top: float = 1.0) -> float:
    """`value` within [0, top]; 0 for NaN (a float field may hold anything)."""
    if math.isnan(value):
        return 0.0
    return min(max(value, 0.0), top)
