"""The Ray bridge's open calls: per actor incarnation, the tasks sent to it and not answered,
and when it died, the one Lost that says so once every call has come back.

Which task a death costs: Ray runs an actor's calls in the order they were sent, so the one it
was making is the first of its unanswered calls. But the answers come back through Ray's
callback threads in no set order: a batch the actor finished just before it died may be
answered after the failures of the calls queued behind it. So Lost is said once every call of
the dead incarnation has come back, naming the first that failed in the order sent. One case
is left: an actor's reply is sent by Ray's threads after its call returns, and dies unsent when
the next call ends the process at once; that batch is then charged (seen once in five runs of
the poison-sample test). A direct lane has no such case: a result is in the kernel's socket
buffer before the next task starts.
"""

from __future__ import annotations

from collections.abc import Callable

from remote_loader.server.engine.ray.messages import Lost


class OpenCalls:
    """Per incarnation, the tasks sent to it and not answered, and its death, until it is said.
    Not locked: the bridge calls it under its own lock, with the slots."""

    def __init__(self) -> None:
        # Per incarnation: the tasks sent to it and not answered, in the order sent, each
        # False until its call failed with the actor's death.
        self.calls: dict[int, dict[int, bool]] = {}
        # Incarnations that died (a call failed so, or their start did): one Lost each, once
        # all calls came back.
        self.dead: dict[int, str] = {}
        # ... of them, those that never started (Ray failed their creation): making nothing.
        self.unstarted: set[int] = set()

    def open(self, incarnation: int) -> None:
        self.calls[incarnation] = {}

    def forget(self, incarnation: int) -> None:
        """An actor replaced or retired: nothing of it is read again."""
        self.calls.pop(incarnation, None)
        self.dead.pop(incarnation, None)
        self.unstarted.discard(incarnation)

    def sent(self, incarnation: int, task_id: int) -> None:
        self.calls[incarnation][task_id] = False

    def answered(self, incarnation: int, task_id: int) -> bool:
        """A call came back with its answer; False when the incarnation was replaced."""
        calls = self.calls.get(incarnation)
        if calls is None:
            return False
        calls.pop(task_id, None)
        return True

    def death(self, incarnation: int) -> str | None:
        """Why the incarnation died, while its Lost waits for its calls; None: alive."""
        return self.dead.get(incarnation)

    def failed(self, incarnation: int, task_id: int, why: str) -> bool:
        """A call failed with its actor's death (`why`); False when the incarnation was
        replaced."""
        calls = self.calls.get(incarnation)
        if calls is None:
            return False
        calls[task_id] = True  # failed (it may have been answered: see `answered`)
        self.dead.setdefault(incarnation, why)
        return True

    def never_started(self, incarnation: int, why: str) -> bool:
        """Ray failed the incarnation's start (`why`): its calls fail unmade; False when it
        was replaced."""
        if incarnation not in self.calls:
            return False
        self.unstarted.add(incarnation)
        self.dead.setdefault(incarnation, why)
        return True

    def lost(
        self, worker_id: int, incarnation: int, failed_starts: Callable[[], int]
    ) -> Lost | None:
        """Lost for a dead incarnation whose calls have all come back, once; else None.
        `failed_starts()`: how many starts in a row Ray failed, for one that never started."""
        calls = self.calls.get(incarnation)
        if calls is None or not all(calls.values()):
            return None
        making = next(iter(calls), -1)  # the first that failed, in the order sent
        failed = 0
        if incarnation in self.unstarted:
            making = -1  # it never started: its calls failed unmade
            failed = failed_starts()
        calls.clear()
        why = self.dead.pop(incarnation)
        return Lost(worker_id, incarnation, why, making=making, failed_starts=failed)
