"""The Ray pool's bridge: a child process of the server that is its only Ray driver.

NOTE [ Ray bridge ]

Why a process of its own: a Ray driver lives only as long as its connection to the cluster. When
the cluster's control store (GCS) or the local raylet goes away, Ray ends the driver's process
(measured here: `ray stop` on the head ended a driver with exit code 1 about 2 s later), and
`ray.init` to an address nobody answers retries without end. In the server that would take down
every stream of every loader. So the server never imports Ray: this process connects, owns the
worker actors, and hands each batch over as a worker process does (a Result naming a
shared-memory slot, server/worker.py). If Ray ends it, the server sees a child exit, fails the
Run with an error naming ray_address and replaces the pool at the next epoch.

Protocol (one Pipe each way; RayPool in server/ray_pool.py is the other end):
  server -> bridge  Begin(epoch_key, base_seed) | Send(worker_id, Task) | Kill(worker_id, why)
                    | None (stop)
  bridge -> server  Started(nodes, actors) once connected, or StartFailed(message) and exit;
                    then a Result (server/worker.py) per task, Lost(worker_id, reason) when
                    an actor died and was replaced (its tasks are the server's to re-issue),
                    Shortfall(worker_id, message) when that replacement has not started
                    within REPLACE_PATIENCE (NOTE [ Ray capacity lost ] in ray_pool.py), and
                    Replaced(worker_id) once it has started.
How the bridge ends with the server: NOTE [ Ray bridge lifecycle ] in server/ray_connect.py.
A result of a dead actor (an older generation) is dropped here: the server re-issues the task.

Placement: actors are created with the SPREAD strategy (one per node before two on any), so a
lost node costs as few workers as it can, and each asks `ray_num_cpus` CPUs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import queue
import signal
import threading
from concurrent.futures import Future
from typing import Any

from remote_loader.server.collating import WorkerSlots
from remote_loader.server.ray_actor import BATCH, ERROR, EXHAUSTED, FATAL, RayWorker
from remote_loader.server.ray_connect import (
    capacity,
    connect,
    die_with_parent,
    wait_for_capacity,
    watch_server,
)
from remote_loader.server.sampling import Batching
from remote_loader.server.spec import LoaderSpec
from remote_loader.server.worker import RemoteError, Result, Task

# How long the bridge waits for its actors to be placed and built before it gives up.
ACTOR_START_TIMEOUT = 120.0
# How long a replacement actor may take to start before the bridge tells the server it is
# short of it (Shortfall), so that its tasks go to the actors that remain.
REPLACE_PATIENCE = 5.0


@dataclasses.dataclass(frozen=True)
class BridgeConfig:
    spec: LoaderSpec
    batching: Batching
    max_batch_bytes: int
    address: str | None  # None: start a local Ray instance
    commands: Any  # reading end of the server's pipe
    results: Any  # writing end of the bridge's pipe


@dataclasses.dataclass(frozen=True)
class Begin:
    epoch_key: int
    base_seed: int
    compression: str = ""
    # The dataset and worker_init_fn afresh, as torch's new worker processes of an epoch
    # without persistent_workers (NOTE [ Ray pool reuse ] in server/ray_pool.py).
    fresh: bool = False

    def args(self) -> tuple[int, int, str, bool]:
        """RayWorker.begin_epoch's arguments."""
        return (self.epoch_key, self.base_seed, self.compression, self.fresh)


@dataclasses.dataclass(frozen=True)
class Send:
    worker_id: int
    task: Task


@dataclasses.dataclass(frozen=True)
class Kill:
    worker_id: int
    why: str


@dataclasses.dataclass(frozen=True)
class Resize:
    """num_workers = "auto": make the pool `workers` actors (new ones begin the current epoch;
    the server removes only a last actor that holds no task)."""

    workers: int


@dataclasses.dataclass(frozen=True)
class Started:
    nodes: int
    actors: int


@dataclasses.dataclass(frozen=True)
class StartFailed:
    message: str


@dataclasses.dataclass(frozen=True)
class Lost:
    worker_id: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Replaced:
    """A replacement actor has started (its dataset built, its epoch begun)."""

    worker_id: int


@dataclasses.dataclass(frozen=True)
class Shortfall:
    """A replacement actor has not started within REPLACE_PATIENCE (`message`: the CPUs it
    asks and those free): the server gives its tasks to the other actors until its Replaced
    comes."""

    worker_id: int
    message: str


# In the bridge's queue of finished calls, in place of a Task: a replacement's start-up, and
# REPLACE_PATIENCE passed since one was asked.
_STARTED = "started"
_OVERDUE = "overdue"


class _Bridge:
    def __init__(self, cfg: BridgeConfig, inbox: queue.SimpleQueue[Any]) -> None:
        import ray

        self.ray = ray
        self.cfg = cfg
        self.inbox = inbox  # the server's commands, from the watcher (server/ray_connect.py)
        spec = cfg.spec
        self.actor_class = ray.remote(RayWorker).options(
            num_cpus=spec.ray_num_cpus,
            scheduling_strategy="SPREAD",
            max_restarts=0,  # replaced by the bridge, which re-issues the tasks it held
            max_task_retries=0,
        )
        self.actors: list[Any] = []
        self.generations: list[int] = []
        # Replacements asked and not yet started: (worker id, generation).
        self.starting: set[tuple[int, int]] = set()
        self.slots = WorkerSlots()
        # Finished calls, put by Ray's callback threads, taken by serve(). Bounded by the calls
        # in flight: the server keeps at most prefetch_factor * num_workers tasks out, plus
        # one start-up per replaced actor.
        self.done: queue.SimpleQueue[tuple[int, int, Task | str | None, Future[Any]]] = (
            queue.SimpleQueue()
        )
        self.epoch: Begin | None = None
        # Ray runs one caller's calls to an actor in the order they were made: the lock makes
        # "new actor, then its epoch" one step against the command thread's submissions. It
        # also guards the slots, released there and taken here.
        self.lock = threading.Lock()

    def new_actor(self, worker_id: int, num_workers: int | None = None) -> Any:
        spec = self.cfg.spec
        n = num_workers if num_workers is not None else spec.num_workers
        return self.actor_class.remote(
            spec, self.cfg.batching, worker_id, n, self.cfg.max_batch_bytes
        )

    def resize(self, workers: int) -> None:
        with self.lock:
            while len(self.actors) > workers:
                self.ray.kill(self.actors.pop(), no_restart=True)
                self.generations.pop()
            while len(self.actors) < workers:
                actor = self.new_actor(len(self.actors), workers)
                if self.epoch is not None:
                    actor.begin_epoch.remote(*self.epoch.args())
                self.actors.append(actor)
                self.generations.append(0)

    def start(self) -> Started:
        n = self.cfg.spec.num_workers
        self.actors = [self.new_actor(w) for w in range(n)]
        self.generations = [0] * n
        nodes = self.ray.get([a.node.remote() for a in self.actors], timeout=ACTOR_START_TIMEOUT)
        return Started(nodes=len(set(nodes)), actors=n)

    def submit(self, worker_id: int, task: Task) -> None:
        with self.lock:
            self.slots.release(task.released)
            actor, generation = self.actors[worker_id], self.generations[worker_id]
            future = actor.make.remote(task.epoch_key, task.indices, task.seed).future()
        future.add_done_callback(lambda f: self.done.put((worker_id, generation, task, f)))

    def replace(self, worker_id: int) -> None:
        # Under the lock: a task for the new actor must not be submitted before its epoch.
        with self.lock:
            self.generations[worker_id] += 1
            actor = self.actors[worker_id] = self.new_actor(worker_id, len(self.actors))
            if self.epoch is not None:
                started = actor.begin_epoch.remote(*self.epoch.args())
            else:
                started = actor.node.remote()
            generation = self.generations[worker_id]
            self.starting.add((worker_id, generation))
            # Placing an actor and starting its process takes seconds: the server's `timeout`
            # for its tasks counts from when it is ready (Replaced), not from the death.
            started.future().add_done_callback(
                lambda f: self.done.put((worker_id, generation, _STARTED, f))
            )
            patience = threading.Timer(
                REPLACE_PATIENCE,
                lambda: self.done.put((worker_id, generation, _OVERDUE, Future())),
            )
            patience.daemon = True
            patience.start()

    def shortfall(self, worker_id: int) -> Shortfall:
        free, total = capacity(self.ray)
        cpus = self.cfg.spec.ray_num_cpus
        return Shortfall(
            worker_id,
            f"Ray worker {worker_id}'s replacement has not started within "
            f"{REPLACE_PATIENCE:g} s (it asks ray_num_cpus={cpus:g} CPUs; {free:g} free of "
            f"{total:g} in the cluster): the other workers take its tasks until it starts",
        )

    def current(self, worker_id: int, generation: int) -> bool:
        """The call was made on the actor that now holds this worker id."""
        return worker_id < len(self.generations) and generation == self.generations[worker_id]

    def reply(self, worker_id: int, generation: int, task: Task, future: Future[Any]) -> Any:
        """The message for one finished call; None when there is nothing to say."""
        if not self.current(worker_id, generation):
            return None  # an actor already replaced: its tasks were re-issued
        base = functools.partial(Result, worker_id, task.epoch_key, task.task_id)
        try:
            value = future.result()
        except self.ray.exceptions.RayActorError as exc:
            self.replace(worker_id)
            return Lost(worker_id, f"DataLoader worker {worker_id} (a Ray actor) died: {exc}")
        except Exception as exc:  # the call itself failed: an error at this task's position
            where = f"in DataLoader worker {worker_id} (Ray)"
            return base(error=RemoteError.capture(where, exc))
        kind = value[0]
        if kind == FATAL:
            return base(error=value[1], fatal=True)
        if kind == EXHAUSTED:
            return base(exhausted=True)
        if kind == ERROR:
            _, error, started, finished = value
            return base(error=error, started_at=started, finished_at=finished)
        assert kind == BATCH
        _, header_nbytes, blob, started, finished = value
        with self.lock:
            taken = self.slots.take(len(blob))
        # The one copy the bridge makes: out of Ray's object store into the slot the server
        # reads (the object goes back to Ray when `value` is dropped).
        taken.blob(len(blob)).numpy()[:] = blob
        with self.lock:
            self.slots.written(taken)
            new_buffer, dropped = self.slots.announce(taken.slot)
        return base(
            slot=taken.slot,
            header_nbytes=header_nbytes,
            total_nbytes=len(blob),
            new_buffer=new_buffer,
            dropped=dropped,
            generation=taken.generation,
            started_at=started,
            finished_at=finished,
        )

    def read_commands(self) -> None:
        """The command thread: submits the server's tasks as they come; ends on None."""
        while True:
            command = self.inbox.get()
            if command is None:
                self.done.put((-1, -1, None, Future()))  # wakes the main loop to stop
                return
            if isinstance(command, Begin):
                with self.lock:
                    self.epoch = command
                    for actor in self.actors:
                        actor.begin_epoch.remote(*command.args())
            elif isinstance(command, Send):
                self.submit(command.worker_id, command.task)
            elif isinstance(command, Resize):
                self.resize(command.workers)
            elif isinstance(command, Kill):
                self.ray.kill(self.actors[command.worker_id], no_restart=True)

    def serve(self) -> None:
        threading.Thread(target=self.read_commands, name="rl-ray-commands", daemon=True).start()
        while True:
            worker_id, generation, task, future = self.done.get()
            if task is None:
                return
            if task == _OVERDUE:
                if (worker_id, generation) in self.starting:
                    self.cfg.results.send(self.shortfall(worker_id))
                continue
            if isinstance(task, str):  # _STARTED
                self.starting.discard((worker_id, generation))
                if self.current(worker_id, generation) and future.exception() is None:
                    self.cfg.results.send(Replaced(worker_id))
                continue  # a replacement that failed to start shows in its first task
            message = self.reply(worker_id, generation, task, future)
            if message is not None:
                self.cfg.results.send(message)
            del future, message


def bridge_main(cfg: BridgeConfig) -> None:
    """Entry point of the bridge process. See NOTE [ Ray bridge lifecycle ] in
    server/ray_connect.py for how it ends with the server."""
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
        code = [spec.dataset, spec.sampler, spec.batch_sampler, spec.collate_fn]
        connect(
            cfg.address,
            spec.ray_runtime_env,
            [p for p in (*code, spec.worker_init_fn) if p],
            lambda why: cfg.results.send(StartFailed(why)),
        )
        bridge = _Bridge(cfg, inbox)
        wait_for_capacity(bridge.ray, cfg.spec.num_workers, cfg.spec.ray_num_cpus)
        started = bridge.start()
    except Exception as exc:
        cfg.results.send(StartFailed(f"{type(exc).__name__}: {exc}"))
        return
    connected.set()
    cfg.results.send(started)
    with contextlib.suppress(BrokenPipeError, OSError):  # the server is gone
        bridge.serve()
