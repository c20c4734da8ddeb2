"""The reporter: a thread that tells the server, once a second, how much its trainer stalled and
on which stage (the Report RPC; NOTE [ Stall stages ] in protos/stall.py).

Started by a RemoteLoader's stream, it reports while the training loop is reading (in next()
now, or within the window), and stops for good when the server does not know the call
(UNIMPLEMENTED: an older server). Any other failure is skipped: the next report follows. A loop
that stopped reading a window ago ends the thread (the next stream starts another), so a
RemoteLoader dropped without close() keeps no thread, nor its channel, alive for long.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable

import grpc

from remote_loader.client.stall import Figures, StallWindow
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import wire
from remote_loader.protos.stall import COPY, IN_FLIGHT, REPORT_INTERVAL, WORKERS

log = logging.getLogger(__name__)

REPORT_METHOD = f"/{wire.SERVICE_NAME}/Report"
# How long a stop() waits for the thread (at most one call in flight, itself bounded).
JOIN_TIMEOUT = 5.0


class StallReporter:
    """Reports `window`'s figures on `channel` every `interval` s, as the stream `follow` names.

    At most one call in flight and one per `interval` (the NOTE's bound); each call's deadline
    is the interval, so a server that does not answer delays no later report.
    """

    def __init__(
        self,
        channel: grpc.Channel,
        window: StallWindow,
        *,
        interval: float = REPORT_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._report = channel.unary_unary(
            REPORT_METHOD,
            request_serializer=pb.StallReport.SerializeToString,
            response_deserializer=pb.ReportReply.FromString,
        )
        self._window = window
        self._interval = interval
        self._clock = clock
        # One per RemoteLoader: the server tells apart trainers with the same labels by it.
        self.reporter = secrets.randbits(63) + 1
        self._lock = threading.Lock()
        self._stream: tuple[str, pb.Consumer, int] | None = None
        self._followed = 0.0  # when follow() last named a stream
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.unsupported = False  # the server answered UNIMPLEMENTED: no more reports
        self.sent = 0  # reports the server took

    def follow(self, loader: str, consumer: pb.Consumer, epoch: int) -> None:
        """The stream being read now; starts the thread unless it runs."""
        with self._lock:
            self._stream = (loader, consumer, epoch)
            self._followed = self._clock()
            if self._thread is not None or self.unsupported or self._stopped.is_set():
                return
            self._thread = threading.Thread(target=self._run, name="rl-stall-report", daemon=True)
            self._thread.start()

    def request(self, now: float, since: float) -> pb.StallReport | None:
        """The report for `now` (`since`: the previous one's time); None while not reading."""
        with self._lock:
            stream = self._stream
        if stream is None or not self._window.active(now):
            return None
        loader, consumer, epoch = stream
        figures = self._window.figures(now=now)
        recent = self._window.figures(window=max(now - since, 1e-3), now=now)
        return _message(loader, consumer, epoch, self.reporter, figures, recent)

    def _run(self) -> None:
        since = self._clock()
        while not self._stopped.wait(self._interval):
            now = self._clock()
            request = self.request(now, since)
            since = now
            if request is None:
                with self._lock:
                    if now - self._followed > self._window.window:
                        self._thread = None  # idle: the next follow() starts another
                        return
                continue
            try:
                self._report(request, timeout=self._interval, wait_for_ready=False)
                self.sent += 1
            except grpc.RpcError as exc:
                code = exc.code() if isinstance(exc, grpc.Call) else None
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    log.info(
                        "the server does not take stall reports (an older server): not sending them"
                    )
                    self.unsupported = True
                    return
                log.debug("a stall report failed (%s): the next one follows", code)

    def close(self) -> None:
        """Stops reporting (idempotent)."""
        self._stopped.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(JOIN_TIMEOUT)


def _message(
    loader: str,
    consumer: pb.Consumer,
    epoch: int,
    reporter: int,
    figures: Figures,
    recent: Figures,
) -> pb.StallReport:
    return pb.StallReport(
        loader=loader,
        consumer=consumer,
        reporter=reporter,
        epoch=epoch,
        window_seconds=figures.window,
        wait_fraction=figures.wait_fraction,
        workers=figures.stages[WORKERS],
        in_flight=figures.stages[IN_FLIGHT],
        copy=figures.stages[COPY],
        stage=figures.stage,
        batches_per_second=figures.batches_per_second,
        recent_wait_fraction=recent.wait_fraction,
        recent_stage=recent.stage,
    )
