"""The Ray pool's bridge: a child process of the server that is its only Ray driver.

NOTE [ Ray bridge ]

Why a process of its own: a Ray driver lives only as long as its connection to the cluster. When
the cluster's control store (GCS) or the local raylet goes away, Ray ends the driver's process
(measured here: `ray stop` on the head ended a driver with exit code 1 about 2 s later), and
`ray.init` to an address nobody answers retries without end. In the server that would take down
every stream of every loader. So the server never imports Ray: this process connects, owns the
worker actors, and hands each batch over as a worker process does (a Result naming a
shared-memory slot, server/worker/loop.py). If Ray ends it, the server sees a child exit, fails the
Run with an error naming ray_address and replaces the pool at the next epoch.

Protocol (one Pipe each way, its messages in server/engine/ray/messages.py; RayBackend in
server/engine/ray/backend.py is the other end, driven by the pool core of server/engine/pool.py,
which decides everything a worker's life involves):
  server -> bridge  Send(worker_id, EpochStart | Task) | Spawn(worker_id, num_workers,
                    incarnation) | Kill(worker_id) | Retire() | None (stop)
  bridge -> server  Started(nodes, attached) once connected and actors 0..n-1 are placed
                    (incarnations 0..n-1), or StartFailed(message) and exit; then a Result
                    (server/worker/loop.py) per task, Lost(worker_id, incarnation, reason, making)
                    when an actor died (the core replaces it with a Spawn and re-issues its
                    tasks; also when Ray failed a spawned actor's start), Shortfall(worker_id,
                    incarnation, message) when a spawned actor has not started within
                    REPLACE_PATIENCE for want of CPUs, or within SLOW_START_PATIENCE at all
                    (NOTE [ Capacity lost ] in server/engine/supervisor.py), and
                    ActorStarted(worker_id, incarnation, attached) once it has (NOTE [ Every start
                    ends ] in server/engine/ray/starts.py). `attached`: the actor attached a
                    direct lane to the server
                    (NOTE [ Ray direct lane ] in server/engine/ray/lane.py); the server sends the
                    tasks of an actor whose lane it took down the lane, never here.
How the bridge ends with the server: NOTE [ Ray bridge lifecycle ] in server/engine/ray/connect.py.
A result of an actor already replaced (an older incarnation) is dropped here: the server
re-issued the task. Each incarnation has slots of its own (as a worker process does), so the
server forgets a dead actor's slots with it, and a Result's times are re-stamped on this host's
clock (the actor's node has its own; only the time the batch took carries over). Where a
batch's bytes go: NOTE [ Ray data path ] in server/engine/ray/backend.py.

Which task a death costs, and when Lost is said: server/engine/ray/calls.py.

Placement: actors are created with the SPREAD strategy (one per node before two on any), so a
lost node costs as few workers as it can, and each asks `ray_num_cpus` CPUs.

"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
from concurrent.futures import Future
from typing import Any

from remote_loader.server.batch.messages import EpochStart, Result, Task
from remote_loader.server.engine.ray.actor import RayWorker
from remote_loader.server.engine.ray.calls import OpenCalls
from remote_loader.server.engine.ray.connect import (
    connect,
    die_with_parent,
    wait_for_capacity,
    watch_server,
)
from remote_loader.server.engine.ray.messages import (
    ActorStarted,
    BridgeConfig,
    Kill,
    Lost,
    Retire,
    Send,
    Spawn,
    Started,
    StartFailed,
)
from remote_loader.server.engine.ray.starts import ActorStarts
from remote_loader.server.errors import CapturedError
from remote_loader.server.worker.collating import WorkerSlots

# How long the bridge waits for its actors to be placed and built before it gives up.
ACTOR_START_TIMEOUT = 120.0

# In the bridge's queue of finished calls, in place of a Task: an actor's start-up, and
# REPLACE_PATIENCE passed since one was asked.
_STARTED = "started"
_OVERDUE = "overdue"


class _Bridge:
    def __init__(self, cfg: BridgeConfig, inbox: queue.SimpleQueue[Any]) -> None:
        import ray

        self.ray = ray
        self.cfg = cfg
        self.inbox = inbox  # the server's commands, from the watcher (server/engine/ray/connect.py)
        spec = cfg.spec
        self.actor_class = ray.remote(RayWorker).options(
            num_cpus=spec.parts.pool.ray_num_cpus,
            scheduling_strategy="SPREAD",
            max_restarts=0,  # replaced by the server's pool core, which re-issues its tasks
            max_task_retries=0,
        )
        # Per worker id: its actor and that actor's incarnation. Written by the command thread
        # only; read by the main loop (a list item read is atomic).
        self.actors: list[Any] = []
        self.incarnations: list[int] = []
        # Per incarnation: its slots (server/worker/collating.py), as a worker process has its own.
        self.slots: dict[int, WorkerSlots] = {}
        # Per incarnation: the tasks sent to it and not answered, and its death (calls.py).
        self.calls = OpenCalls()
        # Finished calls, put by Ray's callback threads, taken by serve(). Bounded by the calls
        # in flight: the server keeps at most prefetch_factor * num_workers tasks out, plus
        # one start-up (and its patience timer) per actor spawned.
        self.done: queue.SimpleQueue[tuple[int, int, Task | str | None, Future[Any]]] = (
            queue.SimpleQueue()
        )
        # Spawned actors not yet started, and the starts Ray failed (NOTE [ Every start ends ] in
        # server/engine/ray/starts.py).
        self.starts = ActorStarts(
            ray,
            spec.parts.pool.ray_num_cpus,
            lambda w, incarnation: self.done.put((w, incarnation, _OVERDUE, Future())),
        )
        # Guards the slots and the calls: released and sent by the command thread, taken and
        # answered by the main loop.
        self.lock = threading.Lock()
        # The dataset's pickle, put in Ray's object store once: every actor, a replacement's
        # too, is handed this reference (Ray passes an actor the object itself), not a copy.
        pickled = cfg.dataset.array()
        self.dataset = None if pickled is None else ray.put(pickled)

    def new_actor(self, worker_id: int, num_workers: int, incarnation: int) -> Any:
        cfg = self.cfg
        return self.actor_class.remote(
            cfg.spec,
            cfg.batching,
            worker_id,
            num_workers,
            cfg.max_batch_bytes,
            incarnation,
            cfg.lane,
            self.dataset,
        )

    def start(self) -> Started:
        n = self.cfg.spec.parts.pool.num_workers
        self.actors = [self.new_actor(w, n, w) for w in range(n)]
        self.incarnations = list(range(n))
        self.slots = {w: WorkerSlots() for w in range(n)}
        for w in range(n):
            self.calls.open(w)
        placed = self.ray.get([a.node.remote() for a in self.actors], timeout=ACTOR_START_TIMEOUT)
        return Started(
            nodes=len({node for node, _ in placed}),
            attached=tuple(attached for _, attached in placed),
        )

    def spawn(self, command: Spawn) -> None:
        w, incarnation = command.worker_id, command.incarnation
        actor = self.new_actor(w, command.num_workers, incarnation)
        with self.lock:
            if w < len(self.actors):
                self.forget(self.incarnations[w])  # the server forgot its slots too
                self.actors[w], self.incarnations[w] = actor, incarnation
            else:
                self.actors.append(actor)
                self.incarnations.append(incarnation)
            self.slots[incarnation] = WorkerSlots()
            self.calls.open(incarnation)
        self.starts.spawned(w, incarnation)
        # Placing an actor and starting its process takes seconds: the server's `timeout` for
        # its tasks counts from when it has started (ActorStarted), not from the spawn.
        actor.node.remote().future().add_done_callback(
            lambda f: self.done.put((w, incarnation, _STARTED, f))
        )
        self.starts.watch(w, incarnation)

    def forget(self, incarnation: int) -> None:
        """An actor replaced or retired: nothing of it is read again (under the lock)."""
        self.slots.pop(incarnation, None)
        self.calls.forget(incarnation)

    def started(self, worker_id: int, incarnation: int, future: Future[Any]) -> Any:
        """A spawned actor's start ended (NOTE [ Every start ends ] in starts.py): ActorStarted,
        or Lost when Ray failed it; None for an actor replaced meanwhile."""
        self.starts.ended(worker_id, incarnation)
        if not self.current(worker_id, incarnation):
            return None
        error = future.exception()
        if error is None:
            self.starts.succeeded(worker_id)
            _, attached = future.result()
            return ActorStarted(worker_id, incarnation, attached)
        # Its creation failed (placed on a node that died before Ray declared it dead, killed
        # while pending, its constructor failed): the server replaces it and re-issues its
        # tasks, charging none of them (it made nothing).
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        why = (
            f"DataLoader worker {worker_id}'s Ray actor failed to start "
            f"({type(error).__name__}: {first})"
        )
        with self.lock:
            if not self.calls.never_started(incarnation, why):
                return None  # replaced meanwhile
            self.starts.failed_once(worker_id)
        return self.lost(worker_id, incarnation)

    def send(self, worker_id: int, message: EpochStart | Task) -> None:
        actor, incarnation = self.actors[worker_id], self.incarnations[worker_id]
        if isinstance(message, EpochStart):
            # `fresh`: torch's new worker processes of an epoch without persistent_workers.
            fresh = not self.cfg.spec.parts.pool.persistent_workers
            actor.begin_epoch.remote(message, fresh)
            return
        task = message
        with self.lock:
            self.slots[incarnation].release(task.released)
            self.calls.sent(incarnation, task.task_id)
        future = actor.make.remote(task.epoch_key, task.indices, task.seed).future()
        future.add_done_callback(lambda f: self.done.put((worker_id, incarnation, task, f)))

    def retire(self) -> None:
        with self.lock:
            self.forget(self.incarnations.pop())
            actor = self.actors.pop()
        self.ray.kill(actor, no_restart=True)

    def current(self, worker_id: int, incarnation: int) -> bool:
        """The call was made on the actor that now holds this worker id."""
        incarnations = self.incarnations
        return worker_id < len(incarnations) and incarnations[worker_id] == incarnation

    def reply(self, worker_id: int, incarnation: int, task: Task, future: Future[Any]) -> Any:
        """The message for one finished call; None when there is nothing to say."""
        if not self.current(worker_id, incarnation):
            return None  # an actor already replaced: its tasks were re-issued
        try:
            fields, started, finished = future.result()
        except self.ray.exceptions.RayActorError as exc:
            return self.died(worker_id, incarnation, task, exc)
        except Exception as exc:  # the call itself failed: an error at this task's position
            fields = {
                "error": CapturedError.capture(f"in DataLoader worker {worker_id} (Ray)", exc)
            }
            started = finished = 0.0
        with self.lock:
            if not self.calls.answered(incarnation, task.task_id):
                return None  # replaced meanwhile
            dead = self.calls.death(incarnation)
        fields = self.in_slot(incarnation, fields)
        if fields is None:
            return None  # replaced meanwhile
        now = time.monotonic()
        result = Result(
            worker_id,
            task.epoch_key,
            task.task_id,
            incarnation=incarnation,
            started_at=now - (finished - started),
            finished_at=now,
            **fields,
        )
        if dead is None:
            return result
        # The actor is dead, and this was the answer its death was waiting for.
        self.cfg.results.send(result)
        return self.lost(worker_id, incarnation)

    def died(self, worker_id: int, incarnation: int, task: Task, error: Exception) -> Any:
        """A call failed with its actor's death: Lost, once every call has come back."""
        why = f"DataLoader worker {worker_id} (a Ray actor) died: {error}"
        with self.lock:
            if not self.calls.failed(incarnation, task.task_id, why):
                return None
        return self.lost(worker_id, incarnation)

    def lost(self, worker_id: int, incarnation: int) -> Lost | None:
        """Lost for a dead incarnation whose calls have all come back, once; else None."""
        with self.lock:
            return self.calls.lost(
                worker_id, incarnation, lambda: self.starts.failed_in_a_row(worker_id)
            )

    def in_slot(self, incarnation: int, fields: dict[str, Any]) -> dict[str, Any] | None:
        """A batch's fields as the server reads them: the encoded batch (`blob`, out of Ray's
        object store) copied into one of this process's slots. None: the incarnation was
        replaced meanwhile."""
        blob = fields.pop("blob", None)
        if blob is None:
            return fields
        with self.lock:
            slots = self.slots.get(incarnation)
            if slots is None:
                return None
            taken = slots.take(len(blob))
        # Out of Ray's object store into the slot the server reads (the object goes back to
        # Ray when `blob` is dropped).
        taken.blob(len(blob)).numpy()[:] = blob
        with self.lock:
            slots.written(taken)
            new_buffer, dropped = slots.announce(taken.slot)
        return {
            **fields,
            "slot": taken.slot,
            "total_nbytes": len(blob),
            "new_buffer": new_buffer,
            "dropped": dropped,
            "generation": taken.generation,
        }

    def read_commands(self) -> None:
        """The command thread: carries out the server's commands in order; ends on None."""
        while True:
            command = self.inbox.get()
            if command is None:
                self.done.put((-1, -1, None, Future()))  # wakes the main loop to stop
                return
            if isinstance(command, Send):
                self.send(command.worker_id, command.message)
            elif isinstance(command, Spawn):
                self.spawn(command)
            elif isinstance(command, Kill):
                self.ray.kill(self.actors[command.worker_id], no_restart=True)
            elif isinstance(command, Retire):
                self.retire()

    def serve(self) -> None:
        threading.Thread(target=self.read_commands, name="rl-ray-commands", daemon=True).start()
        while True:
            worker_id, incarnation, task, future = self.done.get()
            if task is None:
                return
            if task == _OVERDUE:
                short = self.starts.overdue(worker_id, incarnation)
                if short is not None:
                    self.cfg.results.send(short)
                continue
            if isinstance(task, str):  # _STARTED
                message = self.started(worker_id, incarnation, future)
            else:
                message = self.reply(worker_id, incarnation, task, future)
            if message is not None:
                self.cfg.results.send(message)
            del future, message


def bridge_main(cfg: BridgeConfig) -> None:
    """Entry point of the bridge process. See NOTE [ Ray bridge lifecycle ] in
    server/engine/ray/connect.py for how it ends with the server."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's, which stops us
    die_with_parent()
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
    connected = threading.Event()
    threading.Thread(
        target=watch_server,
        args=(cfg.commands, connected, inbox.put),
        name="rl-ray-watch",
        daemon=True,
    ).start()
    try:
        spec = cfg.spec
        code = [spec.parts.dataset.factory, spec.sampler, spec.batch_sampler, spec.collate_fn]
        connect(
            cfg.address,
            spec.parts.pool.ray_runtime_env,
            [p for p in (*code, spec.parts.pool.worker_init_fn) if p],
            lambda why: cfg.results.send(StartFailed(why)),
        )
        bridge = _Bridge(cfg, inbox)
        pool = cfg.spec.parts.pool
        wait_for_capacity(bridge.ray, pool.num_workers, pool.ray_num_cpus)
        started = bridge.start()
    except Exception as exc:
        cfg.results.send(StartFailed(f"{type(exc).__name__}: {exc}"))
        return
    connected.set()
    cfg.results.send(started)
    with contextlib.suppress(BrokenPipeError, OSError):  # the server is gone
        bridge.serve()
