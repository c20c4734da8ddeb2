"""A loader worker as a Ray actor: worker `w` of `num_workers`, on whichever node Ray placed it.

It does what a worker process does (server/worker/loop.py), with the same pieces: it starts from the
loader's one dataset (its pickle, out of Ray's object store: NOTE [ One dataset per loader ] in
server/worker/dataset.py), seeds random, torch and numpy as torch seeds worker `w`, sets
`get_worker_info()`, runs the epoch hooks every epoch and `worker_init_fn` once, so an
IterableDataset shards itself as under a local DataLoader. Ray runs an actor's calls one at
a time in the order one caller made them (the pool's bridge is the only caller), so a
worker's tasks are made in the order they were sent, as from a worker's index queue.

How a batch leaves (NOTE [ Ray data path ] in server/engine/ray/backend.py): an actor on the
server's own host attaches a direct lane (NOTE [ Ray direct lane ] in server/engine/ray/lane.py)
and serves its tasks there, from a thread of its own, into shared-memory slots the server maps; any
other actor answers the bridge's calls with the encoded batch as a numpy array, which Ray moves
without pickling its data.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any

import numpy as np
import torch

from remote_loader.server.batch.messages import EpochStart, Result
from remote_loader.server.config.sampling import Batching
from remote_loader.server.config.spec import LoaderSpec
from remote_loader.server.engine.ray.lane import (
    ActorProbe,
    DirectLane,
    LaneAddress,
    SlotSize,
    attach,
    proc_fd,
)
from remote_loader.server.engine.ray.node import NodeServer, Remake
from remote_loader.server.errors import CapturedError
from remote_loader.server.worker.allocator import settle_allocator
from remote_loader.server.worker.collating import WorkerSlots, use_collate_buffers
from remote_loader.server.worker.dataset import SharedDataset
from remote_loader.server.worker.loop import WorkerState, fill_slot, make_batch


class RayWorker:
    """Worker `worker_id` of `num_workers` (made a Ray actor class by
    server/engine/ray/bridge.py)."""

    def __init__(
        self,
        spec: LoaderSpec,
        batching: Batching,
        worker_id: int,
        num_workers: int,
        max_batch_bytes: int,
        incarnation: int = 0,
        lane: LaneAddress | None = None,
        dataset: np.ndarray | None = None,
    ) -> None:
        """`dataset`: the loader's dataset pickled (Ray hands the actor the object the bridge
        put); None: the actor builds its own from the factory."""
        torch.set_num_threads(1)  # as torch's workers do: parallelism comes from the workers
        settle_allocator()  # NOTE [ Worker allocator ] in server/worker/allocator.py
        # NOTE [ Collating in process memory ] in server/worker/collating.py: a batch leaves as a
        # blob.
        use_collate_buffers()
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.max_batch_bytes = max_batch_bytes
        # `fresh`: torch's new worker processes of an epoch without persistent_workers.
        self.fresh = not spec.parts.pool.persistent_workers
        self.epoch_key = -1
        where = f"in DataLoader worker {worker_id} (Ray actor, pid {os.getpid()})"
        # The same dataset, seeding and worker_init_fn as a worker process (server/worker/loop.py).
        self._new_state = functools.partial(
            WorkerState, spec, batching, worker_id, num_workers, where, SharedDataset(dataset)
        )
        self.state = self._new_state()
        self.epochs = 0  # begun by this actor
        self.attached = False
        if lane is not None:
            self._probe = ActorProbe()  # kept for the actor's life
            taken = attach(lane, incarnation, self._probe)
            if taken is not None:
                self.attached = True
                threading.Thread(
                    target=self._serve_lane, args=(taken,), name="rl-lane", daemon=True
                ).start()

    def node(self) -> tuple[str, bool]:
        """The id of the node this actor runs on (for Describe and the metrics), and whether
        it attached a lane (the server may still refuse it: its batches then come by call)."""
        import ray

        return str(ray.get_runtime_context().get_node_id()), self.attached

    def begin_epoch(self, start: EpochStart, fresh: bool = False) -> None:
        """Reseeds and restarts iteration, as a worker process does on EpochStart; `fresh`:
        with a new copy of the dataset and worker_init_fn run again, as torch's new worker
        processes of an epoch without persistent_workers (NOTE [ Ray pool reuse ] in
        server/engine/ray/backend.py)."""
        self.epoch_key = start.epoch_key
        if fresh and self.epochs > 0:
            self.state = self._new_state()  # a new copy of the dataset; worker_init_fn again
        self.epochs += 1
        self.state.begin_epoch(start)

    def make(self, epoch_key: int, indices: Any, seed: int | None) -> tuple[Any, ...]:
        """One task by call: the Result's fields (the batch as a numpy array, `blob`), and
        when the actor began and ended it."""
        if epoch_key != self.epoch_key:
            raise RuntimeError(f"task of epoch {epoch_key} sent to a worker in {self.epoch_key}")
        started = time.monotonic()
        state = self.state
        fields: dict[str, Any]
        if state.init_error is not None:
            fields = {"error": state.init_error, "fatal": True}
        else:
            assert state.fetcher is not None
            made = make_batch(
                state.fetcher, indices, seed, self.max_batch_bytes, state.where, state.compressor
            )
            if made.error is not None:
                fields = {"error": made.error}
            elif made.encoded is None:
                fields = {"exhausted": True}
            else:
                encoded = made.encoded
                # Returned as an array (out of band: Ray stores it without pickling its data).
                blob = np.empty(encoded.total_nbytes, dtype=np.uint8)
                encoded.write_blob(torch.from_numpy(blob))
                fields = {"blob": blob, "header_nbytes": len(encoded.header)}
        return fields, started, time.monotonic()

    def _serve_lane(self, lane: DirectLane) -> None:
        """The lane's thread: EpochStart and Task in, a Result per Task out, as a worker
        process's loop (server/worker/loop.py), into slots of the actor's own: the server maps them
        (SLOTS), or each batch follows its Result on the lane (COPY), its slot free again once
        sent, or the batch stays in its slot for trainers to fetch from this node's data server
        until the server releases it (KEEP, NOTE [ Node data connection ] in protos/node.py).
        Ends when the server closes the lane."""
        slots = WorkerSlots()
        conn = lane.conn
        data = None
        if lane.keep:
            import ray

            # The address Ray knows its node by (its --node-ip-address): trainers reach the
            # node there, as the cluster's other nodes do.
            node_ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
            data = NodeServer(node_ip, lane.key, slots)
        with conn:
            try:
                self._lane_loop(lane, slots, data)
            finally:
                if data is not None:
                    data.close()

    def _remake(self, message: Remake) -> tuple[np.ndarray | None, int]:
        """A batch a lost actor had kept, made again here (NOTE [ Node lost ] in
        server/batch/node_directory.py): its encoded bytes and header size; None for one that cannot
        be (of another epoch, or it failed: the server says so at its position)."""
        state = self.state
        if message.epoch_key != self.epoch_key or state.fetcher is None or state.init_error:
            return None, 0
        try:
            made = make_batch(
                state.fetcher,
                message.indices,
                message.seed,
                self.max_batch_bytes,
                state.where,
                state.compressor,
            )
        except Exception:
            return None, 0
        if made.encoded is None:
            return None, 0
        blob = np.empty(made.encoded.total_nbytes, dtype=np.uint8)
        made.encoded.write_blob(torch.from_numpy(blob))
        return blob, len(made.encoded.header)

    def _lane_loop(self, lane: DirectLane, slots: WorkerSlots, data: NodeServer | None) -> None:
        conn = lane.conn
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                return
            if message is None:
                return
            if isinstance(message, EpochStart):
                self.begin_epoch(message, self.fresh)
                continue
            if isinstance(message, Remake):
                if data is not None:
                    data.remade(message.remake_id, *self._remake(message))
                continue
            slots.release(message.released)
            started = time.monotonic()
            try:
                fields = fill_slot(
                    self.state, slots, message.indices, message.seed, self.max_batch_bytes
                )
            except Exception as exc:  # not the dataset's (fill_slot keeps those): ours
                fields = {"error": CapturedError.capture(self.state.where, exc)}
            blob = None
            if lane.copy and "slot" in fields:
                # The server has none of this actor's slots: the bytes go on the lane.
                slot, start = fields.pop("slot"), fields.pop("offset")
                blob = slots.view(slot)[start : start + fields["total_nbytes"]]
                del fields["new_buffer"], fields["dropped"], fields["generation"]
            elif data is not None and "slot" in fields:
                # The batch stays here: the Result says where it is to be fetched.
                fields["node"] = data.address
                if fields["new_buffer"] is not None:
                    fields["new_buffer"] = SlotSize(fields["new_buffer"].numel())
            elif fields.get("new_buffer") is not None:
                fields["new_buffer"] = proc_fd(fields["new_buffer"])  # the server maps it
            result = Result(
                self.worker_id,
                message.epoch_key,
                message.task_id,
                incarnation=self.incarnation,
                started_at=started,
                finished_at=time.monotonic(),
                **fields,
            )
            try:
                conn.send(result)
                if blob is not None:
                    conn.send_bytes(blob)
            except OSError:
                return
            if blob is not None:
                del blob
                slots.release((slot,))
            del result, fields
