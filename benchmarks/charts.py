"""What the benchmarks' charts share (matplotlib, the `bench` extra): pyplot without a display,
and bars grouped by series at each position of the x axis."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend: no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grouped_bars(
    ax: Any,
    series: Mapping[str, Sequence[float]],
    colors: Mapping[str, str],
    *,
    fmt: str | None = None,
    spread: Mapping[str, tuple[Sequence[float], Sequence[float]]] | None = None,
) -> list[float]:
    """For each label of `series`, a bar at each x position 0, 1, ... (its values), the labels'
    bars side by side; `fmt` writes each value above its bar, `spread` draws whiskers (the
    distances below and above each value). Returns every value drawn."""
    width = 0.8 / len(series)
    drawn: list[float] = []
    for i, (label, values) in enumerate(series.items()):
        offset = (i - (len(series) - 1) / 2) * width
        whiskers = None if spread is None else [list(side) for side in spread[label]]
        bars = ax.bar(
            [x + offset for x in range(len(values))], values, width=width,
            color=colors.get(label), label=label, yerr=whiskers, capsize=3,
        )  # fmt: skip
        if fmt is not None:
            ax.bar_label(bars, labels=[format(v, fmt) for v in values], padding=2, fontsize=8)
        drawn += values
    return drawn
