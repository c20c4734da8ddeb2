"""What one scenario of benchmarks/campaign.py came to: its batches judged against what each rank
was due (exact, resumed exact, typed error, hang or wrong), and its row of the printed table.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from benchmarks.campaign_job import EPOCHS, WORLD, expected


@dataclasses.dataclass
class Row:
    """One scenario's line of the table."""

    scenario: str
    transport: str
    outcome: str
    twice: int
    seconds: float
    detail: str


def judge(
    name: str,
    transport: str,
    received: dict[int, list[tuple[int, tuple[int, ...]]]],
    bad: int,
    errors: list[str],
    resumes: int,
    via: set[str],
    hang: str,
    seconds: float,
) -> Row:
    """The row of scenario `name` from what its trainers' training loops received (module
    doc of benchmarks/campaign.py, "Outcome")."""
    want = {r: [b for e in range(EPOCHS) for b in expected(r, e)] for r in range(WORLD)}
    twice = sum(c - 1 for r in range(WORLD) for c in collections.Counter(received[r]).values())
    missing = sum(
        sum((collections.Counter(want[r]) - collections.Counter(received[r])).values())
        for r in range(WORLD)
    )
    exact = bad == 0 and all(received[r] == want[r] for r in range(WORLD))
    # server-dead: what arrived must be a prefix of what was due, then a typed error each.
    prefix = bad == 0 and all(received[r] == want[r][: len(received[r])] for r in range(WORLD))
    notes = [f"{sum(map(len, received.values()))}/{sum(map(len, want.values()))} batches"]
    notes += [f"via {','.join(sorted(via))}"] if via else []
    notes += [f"{missing} missing"] if missing and name != "server-dead" else []
    notes += [f"{bad} corrupt"] if bad else []
    notes += [f"{resumes} resumed"] if resumes else []
    notes += sorted(set(errors))
    if hang:
        outcome = "hang"
        notes.append(hang)
    elif name == "server-dead":
        typed = len({e.split(":")[0] for e in errors}) == WORLD
        outcome = "typed error" if typed and prefix else "wrong"
    elif exact:
        outcome = "typed error, resumed exact" if errors else "exact"
        if name == "client-kill" and not errors:
            outcome = "killed, resumed exact"
    else:
        outcome = "wrong"
    return Row(name, transport, outcome, twice, seconds, "; ".join(notes))


def print_row(row: Row, head: Sequence[str] | None = None) -> None:
    twice, seconds = (head[3], head[4]) if head else (str(row.twice), f"{row.seconds:.1f}")
    print(
        f"{row.scenario:<12} {row.transport:<9} {row.outcome:<27} {twice:>5} {seconds:>7}  "
        f"{row.detail}",
        flush=True,
    )
