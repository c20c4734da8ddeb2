"""How benchmarks/compare.py shows what it measured: the table it prints and the chart it draws
(`--plot`, with matplotlib)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from benchmarks import ceilings
from benchmarks.charts import grouped_bars, pyplot

if TYPE_CHECKING:
    from benchmarks.measure import Epoch, Side, Workload

MB = 1e6


def ratios(local: Side, remote: Side) -> list[float]:
    """Remote batches/s over local batches/s, round by round."""
    return [
        r.batches_per_s / loc.batches_per_s
        for loc, r in zip(local.epochs, remote.epochs, strict=True)
    ]


def plot(results: dict[str, Workload], raw: list[float], path: str, title: str) -> None:
    """Draws the ratios remote/local, batches/s and GB/s of every loader into the image `path`."""
    plt = pyplot()
    names = list(results)
    labels = list(results[names[0]].sides)
    remote = [label for label in labels if label != "local"]
    xs = list(range(len(names)))
    colors = {"local": "tab:blue", "grpc": "tab:orange", "tcp": "tab:purple", "shm": "tab:green"}
    fig, (ax_ratio, ax_rate, ax_gb) = plt.subplots(1, 3, figsize=(16, 5.2))

    # The median as a bar per transport, each round's ratio as a dot.
    every_ratio: list[float] = []
    width = 0.8 / len(remote)
    for i, label in enumerate(remote):
        offset = (i - (len(remote) - 1) / 2) * width
        every = {
            name: ratios(results[name].sides["local"], results[name].sides[label]) for name in names
        }
        medians = [statistics.median(every[name]) for name in names]
        bars = ax_ratio.bar(
            [x + offset for x in xs], medians, width=width, color=colors[label], label=label
        )
        ax_ratio.bar_label(bars, labels=[f"{m:.2f}x" for m in medians], padding=3, fontsize=8)
        ax_ratio.plot(
            [x + offset for x, name in zip(xs, names, strict=True) for _ in every[name]],
            [r for name in names for r in every[name]],
            "k.",
            alpha=0.6,
        )
        every_ratio += [r for rs in every.values() for r in rs]
    ax_ratio.axhline(1.0, color="black", linestyle="--", linewidth=1, label="parity (1.0)")
    ax_ratio.set_ylim(0, max(1.0, *every_ratio) * 1.35)
    ax_ratio.set_title("remote / local throughput (batches/s; dots: rounds)")
    ax_ratio.legend(loc="upper left", ncols=4)

    def grouped(ax: Any, value: Callable[[Epoch], float], fmt: str) -> list[float]:
        series = {
            label: [results[name].sides[label].median(value) for name in names] for label in labels
        }
        return grouped_bars(ax, series, colors, fmt=fmt)

    rates = grouped(ax_rate, lambda e: e.batches_per_s, ".1f")
    ax_rate.set_ylim(0, max(rates) * 1.3)  # room for the labels and the legend
    ax_rate.set_title("batches/s (median)")
    ax_rate.legend(loc="upper left", ncols=4)

    gb_rates = grouped(ax_gb, lambda e: e.gb_per_s, ".2g")
    ceiling = statistics.median(raw)
    ax_gb.axhline(
        ceiling,
        color="tab:red",
        linestyle="--",
        linewidth=1,
        label=f"raw grpcio ceiling {ceiling:.2f} GB/s",
    )
    ax_gb.set_yscale("log")
    # Room above the ceiling for the legend, below the smallest bar for its base.
    ax_gb.set_ylim(min(gb_rates) / 3, max(ceiling, *gb_rates) * 60)
    ax_gb.set_title("GB/s of tensor bytes (median, log scale)")
    handles, legend = ax_gb.get_legend_handles_labels()  # the line first: put it last
    ax_gb.legend(handles[1:] + handles[:1], legend[1:] + legend[:1], loc="upper left", ncols=2)

    for ax in (ax_ratio, ax_rate, ax_gb):
        ax.set_xticks(xs, names)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- main ------------------------------------------------------------------------------------


def _gb(value: float) -> str:
    return f"{value:.3g} GB/s"


def table(results: dict[str, Workload], top: ceilings.Ceilings, rounds: int) -> str:
    header = (
        f"{'workload':<9} {'loader':<7} {'batches/s':>10} {'GB/s':>9} {'1st batch ms':>13} "
        f"{'client CPU s':>13} {'server CPU s':>13} {'client RSS MB':>14} {'server RSS MB':>14}"
    )
    lines = [header, "-" * len(header)]
    for name, result in results.items():
        sides = result.sides
        for label, side in sides.items():
            rate = side.median(lambda e: e.batches_per_s)
            gb_rate = side.median(lambda e: e.gb_per_s)
            first_ms = side.median(lambda e: e.first_batch) * 1e3
            lines.append(
                f"{name:<9} {label:<7} {rate:>10.1f} {gb_rate:>9.3g} {first_ms:>13.1f} "
                f"{side.main_cpu / rounds:>13.2f} {side.loader_cpu / rounds:>13.2f} "
                f"{side.main_rss / MB:>14.0f} {side.loader_rss / MB:>14.0f}"
            )
        for label in sides:
            if label != "local":
                ratio = statistics.median(ratios(sides["local"], sides[label]))
                lines.append(f"{name:<9} {label + '/local throughput':<35} {ratio:.2f}x")
        for label, side in sides.items():
            if label == "local":
                continue
            found = top.of(name, label)
            if found is not None:
                what, ceiling = found
                gb_rate = side.median(lambda e: e.gb_per_s)
                lines.append(
                    f"{name:<9} {label:<7} {_gb(gb_rate)} = {gb_rate / ceiling:.2g} of "
                    f"{what} {_gb(ceiling)}"
                )
        for label, side in sides.items():
            client, server = (cpu / side.batches * 1e3 for cpu in (side.main_cpu, side.loader_cpu))
            lines.append(
                f"{name:<9} {label:<7} CPU ms per batch: client {client:.2f} + server "
                f"{server:.2f} = {client + server:.2f}; cores busy {side.cores_busy:.2f}"
            )
        if result.step is not None:
            wall, cpu = result.step
            lines.append(
                f"{name:<9} train step alone ({torch.get_num_threads()} threads): "
                f"{wall * 1e3:.2f} ms wall, {cpu * 1e3:.2f} ms CPU per batch: at most "
                f"{1 / wall:.1f} batches/s"
            )
        seen = ", ".join(
            f"{label}: {'/'.join(side.transports)}"
            for label, side in sides.items()
            if label != "local"
        )
        logged = ""
        if result.logged:
            counts = ", ".join(f"{t} x{n}" for t, n in sorted(result.logged.items()))
            logged = f"; server log, streams by transport: {counts}"
        lines.append(f"{name:<9} transports (client stats): {seen}{logged}")
    lines.append(
        f"raw grpcio ceiling ({ceilings.RAW_MESSAGE_BYTES >> 20} MiB bytes messages, "
        f"{top.where}): {statistics.median(top.grpc):.3f} GB/s"
    )
    for name, nbytes in top.batch_bytes.items():
        h2d = ""
        if top.h2d is not None:
            h2d = f", pinned host-to-device {_gb(statistics.median(top.h2d[name]))}"
        lines.append(
            f"ceilings per batch of {name} ({nbytes / MB:.3g} MB): raw socket "
            f"({top.where}) {_gb(statistics.median(top.socket[name]))}, memcpy "
            f"{_gb(statistics.median(top.memcpy[name]))}{h2d}"
        )
    if top.h2d is None:
        lines.append("pinned host-to-device ceiling: skipped (torch.cuda.is_available() is False)")
    if "shm" in next(iter(results.values())).sides:
        rows = [
            "local: torch's DataLoader in this process. grpc, tcp, shm: RemoteLoader inside gRPC "
            "messages, on a TCP data",
            "connection beside the gRPC stream, and through shared memory (zero-copy from the",
            "workers' slots, or the ring).",
        ]
    else:
        rows = [
            "local: torch's DataLoader in this process. grpc, tcp: RemoteLoader inside gRPC "
            'messages, and with transport="auto",',
            "which took the TCP data connection beside the gRPC stream (no shared memory across "
            "the namespaces).",
        ]
    lines += [
        "",
        *rows,
        "client: this process, which reads the batches (all sides). server: local, the "
        "DataLoader's fork server and",
        "workers; remote, the server process, its fork server and its workers. CPU s: per "
        "epoch. RSS MB: the peak over",
        "the timed epochs, summed over the processes (memory they share is counted in each "
        "that maps it).",
        "X GB/s = F of CEILING: the row's median GB/s over the median of its transport's "
        "ceiling (benchmarks/ceilings.py).",
        "CPU ms per batch: client and server CPU over the timed epochs' batches; cores busy: "
        "(client + server CPU s)",
        "/ wall s of those epochs.",
    ]
    return "\n".join(lines)
