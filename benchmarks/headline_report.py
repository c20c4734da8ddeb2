"""What benchmarks/headline.py measured and how it shows it: one counted window of one loader's
trainers (`Window`), the medians over rounds (`Row`), the Markdown table and the plot."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks.charts import grouped_bars, pyplot

# The stall a loader that keeps up may show (issue 41's target for remote-loader).
STALL_TARGET = 0.05
COLORS = {"local": "tab:orange", "remote": "tab:blue"}


@dataclasses.dataclass(frozen=True)
class Window:
    """One loader's counted window at one trainer count: the trainers' reports
    (benchmarks/headline_trainer.py's `window`), the cores the hosts used meanwhile (cgroup
    cpuacct), the cores the machine spent outside this run's hosts (/proc/stat: other people's
    processes) and the 1-minute load average as it started."""

    trainers: int
    loader: str  # "local" or "remote"
    step_s: float
    reports: list[dict[str, Any]]
    trainer_cores: float
    server_cores: float
    other_cores: float
    throttled: int  # periods in which the trainers' host hit its cap
    load: float

    @property
    def steps_per_s(self) -> float:
        """Steps/s per trainer, the mean over trainers."""
        return statistics.fmean(r["steps"] / r["seconds"] for r in self.reports)

    @property
    def stall(self) -> float:
        """The share of the window spent waiting in next(), the mean over trainers."""
        return statistics.fmean(r["wait"] / r["seconds"] for r in self.reports)

    @property
    def longest_wait(self) -> float:
        return float(max(r["longest"] for r in self.reports))

    @property
    def transports(self) -> set[str]:
        return {r["transport"] for r in self.reports if r["transport"] is not None}

    def line(self, round_: int) -> str:
        """What the window measured, as it is printed when it ends."""
        return (
            f"  {self.trainers} x {self.loader:6s} round {round_}: {self.steps_per_s:6.2f} steps/s"
            f" per trainer, stall {self.stall:6.1%} (longest wait {self.longest_wait * 1e3:4.0f}"
            f" ms); cores: trainers {self.trainer_cores:.2f} (throttled {self.throttled}), "
            f"server {self.server_cores:.2f}, others {self.other_cores:.2f}; load {self.load:.2f}"
        )


@dataclasses.dataclass(frozen=True)
class Row:
    """One loader at one trainer count: medians over its rounds."""

    trainers: int
    loader: str
    step_s: float
    steps_per_s: float
    stall: float
    ratios: list[float]  # remote / local steps/s, round by round (local rows only)
    trainer_cores: float
    server_cores: float
    other_cores: float
    loads: list[float]


def summarize(windows: Sequence[Window]) -> list[Row]:
    """A row per (count, loader), in the order they first appear; the ratios pair round r of
    remote with round r of local."""
    rows = []
    for n, loader in dict.fromkeys((w.trainers, w.loader) for w in windows):
        mine = [w for w in windows if (w.trainers, w.loader) == (n, loader)]
        remote = [w for w in windows if (w.trainers, w.loader) == (n, "remote")]
        ratios = []
        if loader != "remote":
            ratios = [
                r.steps_per_s / max(m.steps_per_s, 1e-9) for r, m in zip(remote, mine, strict=True)
            ]
        rows.append(
            Row(
                trainers=n, loader=loader, step_s=mine[0].step_s,
                steps_per_s=statistics.median(w.steps_per_s for w in mine),
                stall=statistics.median(w.stall for w in mine), ratios=ratios,
                trainer_cores=statistics.median(w.trainer_cores for w in mine),
                server_cores=statistics.median(w.server_cores for w in mine),
                other_cores=statistics.median(w.other_cores for w in mine),
                loads=[w.load for w in mine],
            )
        )  # fmt: skip
    return rows


def table(rows: Sequence[Row], quota: float) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| trainers | loader | step ms | steps/s per trainer | job steps/s | stall | remote / "
        f"local (rounds) | trainers' host cores (cap {quota:g}) | server cores | other cores | "
        "load |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = ""
        if row.ratios:
            ratio = (
                f"**{statistics.median(row.ratios):.2f}x** ({min(row.ratios):.2f}-"
                f"{max(row.ratios):.2f})"
            )
        lines.append(
            f"| {row.trainers} | {row.loader} | {row.step_s * 1e3:.0f} | {row.steps_per_s:.2f} | "
            f"{row.steps_per_s * row.trainers:.2f} | {row.stall:.1%} | {ratio} | "
            f"{row.trainer_cores:.2f} | {row.server_cores:.2f} | {row.other_cores:.2f} | "
            f"{min(row.loads):.1f}-{max(row.loads):.1f} |"
        )
    return "\n".join(lines)


def plot(windows: Sequence[Window], path: str, title: str) -> None:
    """Steps/s per trainer (against the step's ceiling, 1 / step) and stall at each count:
    medians over rounds, whiskers their range."""
    plt = pyplot()
    counts = sorted({w.trainers for w in windows})
    loaders = list(dict.fromkeys(w.loader for w in windows))
    fig, (rate, stall) = plt.subplots(1, 2, figsize=(11, 4.6))
    for ax, value, fmt in ((rate, "steps", ".1f"), (stall, "stall", ".0f")):
        series: dict[str, list[float]] = {}
        spread: dict[str, tuple[list[float], list[float]]] = {}
        for loader in loaders:
            per_count = [
                [w.steps_per_s if value == "steps" else w.stall * 100 for w in windows
                 if (w.trainers, w.loader) == (n, loader)]
                for n in counts
            ]  # fmt: skip
            series[loader] = [statistics.median(v) for v in per_count]
            spread[loader] = (
                [m - min(v) for m, v in zip(series[loader], per_count, strict=True)],
                [max(v) - m for m, v in zip(series[loader], per_count, strict=True)],
            )
        grouped_bars(ax, series, COLORS, fmt=fmt, spread=spread)
    for i, n in enumerate(counts):
        step = next(w.step_s for w in windows if w.trainers == n)
        rate.hlines(1 / step, i - 0.45, i + 0.45, colors="grey", linestyles="dashed")
    rate.plot([], [], color="grey", linestyle="dashed", label="1 / step (the ceiling)")
    stall.axhline(STALL_TARGET * 100, color="grey", linestyle="dotted", label="5 %")
    for ax, label in ((rate, "steps/s per trainer"), (stall, "stall: % of the time in next()")):
        ax.set_xticks(range(len(counts)), [f"{n} trainer{'s' * (n > 1)}" for n in counts])
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    stall.set_ylim(0, 100)
    fig.suptitle(title, fontsize=8, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
