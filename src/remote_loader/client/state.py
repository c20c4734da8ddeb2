"""A RemoteLoader's state: where a consumer is in its epochs, as plain JSON, and where a new
consumer resumes from one (NOTE [ Elastic resume ] in the server's elastic.py for a job that
resumes on another number of ranks).

A state is a dict of the keys in STATE_KEYS, plus:
- "reshard": null, or the job of another world size that began this epoch
  ({"world_size": w, "consumed": [batches per rank], "origin": null or the same again});
- "consumed" (a job state, `job_state()`): batches each rank had consumed, by rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from remote_loader.protos import loader_pb2 as pb

STATE_VERSION = 1
# The job of a consumer that names none: the server's name for it (server/sharing/membership.py), in
# its logs and metrics. States saved before the client said so have "" for it.
DEFAULT_JOB = "default"
STATE_KEYS: dict[str, type] = {
    "version": int,
    "loader": str,
    "fingerprint": str,
    "seed": int,
    "epoch": int,
    "batches": int,
    "sharing": str,
    "job": str,
    "rank": int,
    "world_size": int,
}


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where the next `iter()` starts: the epoch, the first batch of this consumer's share, and
    the earlier job this epoch's shares are dealt from (None: an ordinary epoch)."""

    seed: int
    epoch: int
    start: int
    reshard: dict[str, Any] | None


class Cursor:
    """Where a loader is in its epochs: the epoch the next iterator takes at its first next()
    (NOTE [ An iterator's epoch ] in client/epoch.py), the batch it starts from (not 0 after a
    resume), and the earlier job of another world size whose epoch it finishes (a resume's
    reshard); and the reshard of the epoch taken last, for len() and state_dict() while it is
    read."""

    def __init__(self) -> None:
        self.epoch = 0
        self.start = 0
        self.reshard: dict[str, Any] | None = None
        self.reshard_length = 0  # this consumer's share of a reshard epoch (the server's count)
        self.taken_reshard: dict[str, Any] | None = None

    def set_epoch(self, epoch: int) -> None:
        """The next epoch taken is `epoch`: the one a resume points at keeps its position,
        another starts at its beginning."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        if epoch != self.epoch:
            self.start, self.reshard = 0, None
        self.epoch = epoch

    def take(self) -> tuple[int, int, dict[str, Any] | None]:
        """An iterator takes the next epoch (epoch, first batch, reshard); the next is the one
        after, from its beginning."""
        taken = self.epoch, self.start, self.reshard
        self.taken_reshard = self.reshard
        self.epoch, self.start, self.reshard = self.epoch + 1, 0, None
        return taken

    def resume(self, point: ResumePoint, reshard_length: int) -> None:
        self.epoch, self.start, self.reshard = point.epoch, point.start, point.reshard
        self.reshard_length = reshard_length

    def resharded_length(self, reading: bool) -> int | None:
        """len() while a reshard epoch is next, or is being read (`reading`: the epoch taken
        last has not ended); None otherwise."""
        if self.reshard is not None or (self.taken_reshard is not None and reading):
            return self.reshard_length
        return None


def check(state: Any) -> None:
    """Raises ValueError when `state` is not a state at all."""
    for key, kind in STATE_KEYS.items():
        value = state.get(key) if isinstance(state, Mapping) else None
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(
                f"not a RemoteLoader state: {key!r} should be {kind.__name__}, got {value!r}"
            )
    if state["version"] != STATE_VERSION:
        raise ValueError(f"state version {state['version']} is not {STATE_VERSION}")
    if state["epoch"] < 0 or state["batches"] < 0:
        raise ValueError(f"epoch and batches must be >= 0, got {dict(state)!r}")
    consumed = state.get("consumed")
    if consumed is not None and not _counts(consumed, state["world_size"]):
        raise ValueError(
            f"a job state's 'consumed' must hold {state['world_size']} counts >= 0, one per "
            f"rank, got {consumed!r}"
        )
    _check_reshard(state.get("reshard"))


def _counts(value: Any, n: int) -> bool:
    return (
        isinstance(value, list)
        and len(value) == n
        and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in value)
    )


def _check_reshard(reshard: Any) -> None:
    while reshard is not None:
        if not (
            isinstance(reshard, Mapping)
            and isinstance(reshard.get("world_size"), int)
            and reshard["world_size"] >= 1
            and _counts(reshard.get("consumed"), reshard["world_size"])
        ):
            raise ValueError(f"not a RemoteLoader state: bad 'reshard' {reshard!r}")
        reshard = reshard.get("origin")


def resume_point(
    state: Mapping[str, Any], sharing: str, job: str, rank: int, world_size: int
) -> ResumePoint:
    """Where the consumer (sharing, job, rank, world_size) resumes from `state` (checked)."""
    saved = (state["sharing"], state["job"] or DEFAULT_JOB)
    if saved != (sharing, job or DEFAULT_JOB):
        raise ValueError(
            f"the state is of another consumer: (sharing, job) = {saved}, this RemoteLoader "
            f"is {(sharing, job)}"
        )
    consumed: list[int] | None = state.get("consumed")
    old_world = state["world_size"]
    origin = state.get("reshard")
    if old_world == world_size:
        # NOTE [ Any rank's state ]: DDP ranks are in step, so any rank's position is every
        # rank's, and frameworks rely on it: Lightning and accelerate checkpoint rank 0's loader
        # state and every rank loads that one. This rank keeps its own share; ranks that were
        # not in step pass job_state(...), which holds each rank's own count.
        start = consumed[rank] if consumed is not None else state["batches"]
        return ResumePoint(state["seed"], state["epoch"], start, origin)
    if sharing != "partition":
        raise ValueError(
            f"the state is of world_size {old_world}, this RemoteLoader has {world_size}: only "
            "partition sharing resumes on another world size (broadcast and dynamic consumers "
            "keep their own positions whatever the world size)"
        )
    if consumed is None:
        # DDP ranks are in step: every rank of the old job had consumed this many.
        consumed = [state["batches"]] * old_world
    if not any(consumed) and origin is None:
        return ResumePoint(state["seed"], state["epoch"], 0, None)  # the epoch had not begun
    reshard = {"world_size": old_world, "consumed": list(consumed), "origin": origin}
    return ResumePoint(state["seed"], state["epoch"], 0, reshard)


def job_state(states: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One state for a whole job from its ranks' states, one per rank, when they were not in
    step (DDP ranks are: any one rank's state will do): each rank of a job of another world
    size resumes from it, and together they receive exactly what the old ranks had not."""
    if not states:
        raise ValueError("job_state needs the states of every rank of the job, got none")
    for state in states:
        check(state)
    # A state saved with job "" names the default job, as newer ones say.
    states = [{**state, "job": state["job"] or DEFAULT_JOB} for state in states]
    first = states[0]
    shared = ("loader", "fingerprint", "seed", "epoch", "sharing", "job", "world_size")
    for state in states[1:]:
        differ = [k for k in (*shared, "reshard") if state.get(k) != first.get(k)]
        if differ:
            raise ValueError(
                f"the states are not of one job in one epoch: they differ in {', '.join(differ)} "
                "(a rank that finished the epoch has a state of the next: resume the ranks "
                "from states of the same epoch)"
            )
    ranks = sorted(state["rank"] for state in states)
    if ranks != list(range(first["world_size"])):
        raise ValueError(
            f"job_state needs one state per rank 0..{first['world_size'] - 1}, got ranks {ranks}"
        )
    by_rank = {state["rank"]: state["batches"] for state in states}
    return {**first, "rank": 0, "consumed": [by_rank[r] for r in range(first["world_size"])]}


def reshard_message(reshard: Mapping[str, Any]) -> pb.Reshard:
    message = pb.Reshard(world_size=reshard["world_size"], consumed=reshard["consumed"])
    if reshard.get("origin") is not None:
        message.origin.CopyFrom(reshard_message(reshard["origin"]))
    return message
