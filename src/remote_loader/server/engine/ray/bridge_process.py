"""The Ray bridge as the server runs it: a child process with a pipe each way, started and
waited for, told and heard, and stopped (NOTE [ Ray bridge ] in server/engine/ray/bridge.py).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
from collections.abc import Callable, Iterator
from typing import Any

from remote_loader.server.engine.ray.bridge import ACTOR_START_TIMEOUT, bridge_main
from remote_loader.server.engine.ray.messages import BridgeConfig, Started, StartFailed
from remote_loader.server.engine.seam import WorkerDiedError, WorkerInitError
from remote_loader.server.errors import CapturedError

# How long start() waits for the bridge to connect and place its actors: ray.init to an address
# nobody answers retries without end, and the actors' placement waits for free CPUs.
START_TIMEOUT = ACTOR_START_TIMEOUT + 30.0
# How long stop waits for the bridge (and, with it, the actors it owns) to go.
BRIDGE_JOIN_TIMEOUT = 10.0


class BridgeProcess:
    """The bridge process of the loader `loader`, whose Ray is `where` (for its errors)."""

    def __init__(self, ctx: multiprocessing.context.BaseContext, loader: str, where: str) -> None:
        self._ctx = ctx
        self._loader = loader
        self._where = where
        self._bridge: multiprocessing.process.BaseProcess | None = None
        self._commands: Any = None
        self._results: multiprocessing.connection.Connection | None = None

    @property
    def pid(self) -> int | None:
        return None if self._bridge is None else self._bridge.pid

    def start(self, config: Callable[[Any, Any], BridgeConfig]) -> Started:
        """Starts the bridge on the BridgeConfig that `config` makes of the ends of its pipes
        (commands read, results written), and waits for it to connect and place its actors;
        WorkerInitError, naming ray_address, when that fails or takes longer than START_TIMEOUT
        (the caller stops it)."""
        commands_reader, self._commands = self._ctx.Pipe(duplex=False)
        self._results, results_writer = self._ctx.Pipe(duplex=False)
        cfg = config(commands_reader, results_writer)
        self._bridge = bridge = self._ctx.Process(  # type: ignore[attr-defined]
            target=bridge_main, args=(cfg,), name=f"remote-loader-ray-{self._loader}"
        )
        bridge.start()
        commands_reader.close()
        results_writer.close()
        ready = multiprocessing.connection.wait([self._results, bridge.sentinel], START_TIMEOUT)
        if self._results in ready:
            try:
                message = self._results.recv()
            except (EOFError, OSError):
                message = StartFailed("its Ray driver process exited while connecting")
            if isinstance(message, Started):
                return message
            problem = message.message if isinstance(message, StartFailed) else repr(message)
        elif not ready:
            problem = f"no answer within {START_TIMEOUT:g} s"
        else:
            problem = f"its Ray driver process exited (code {bridge.exitcode})"
        raise WorkerInitError(
            CapturedError(
                where="starting the loader's Ray pool",
                type="RayUnavailable",
                message=(
                    f'loader {self._loader!r} (pool = "ray") cannot use {self._where}: '
                    f"{problem}. Check ray_address (REMOTE_LOADER_RAY_ADDRESS, serve "
                    "--ray-address) and that the cluster has ray_num_cpus free per worker"
                ),
                traceback="",
            )
        )

    def waitables(self) -> list[Any]:
        """What to wait on (multiprocessing.connection.wait) for the bridge's messages."""
        assert self._bridge is not None and self._results is not None
        return [self._results, self._bridge.sentinel]

    def exited(self, ready: list[Any]) -> None:
        """Raises the bridge's exit (WorkerDiedError) when `ready` says it has exited."""
        assert self._bridge is not None
        if self._bridge.sentinel in ready:
            raise self.gone()

    def messages(self, ready: list[Any]) -> Iterator[object]:
        """The bridge's messages waiting, when `ready` says some are. One at a time: one the
        caller does not take stays in the pipe for its next look."""
        assert self._results is not None
        if self._results not in ready:
            return
        while self._results.poll():
            try:
                message = self._results.recv()
            except (EOFError, OSError) as exc:
                raise self.gone() from exc
            yield message

    def command(self, message: object) -> None:
        try:
            self._commands.send(message)
        except (BrokenPipeError, OSError) as exc:
            raise self.gone() from exc

    def gone(self) -> WorkerDiedError:
        code = None if self._bridge is None else self._bridge.exitcode
        return WorkerDiedError(
            f"the loader's Ray driver process exited (code {code}): {self._where} is unreachable "
            "or ended it (check ray_address and `ray status`); the pool is replaced for the "
            "next epoch"
        )

    def stop(self) -> None:
        """Stops the bridge; the actors it owns end with it (Ray ties an actor to its owner)."""
        if self._commands is not None:
            with contextlib.suppress(BrokenPipeError, OSError):
                self._commands.send(None)
        if self._bridge is not None and self._bridge.pid is not None:
            self._bridge.join(BRIDGE_JOIN_TIMEOUT)
            if self._bridge.is_alive():
                self._bridge.kill()
                self._bridge.join(1.0)
        for end in (self._commands, self._results):
            if end is not None:
                end.close()
        self._commands = self._results = None
