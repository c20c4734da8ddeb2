"""`remote-loader top`: a live view of a running server, as htop is of a host. Its loaders
(workers, how busy, the host's CPU, batches and bytes out, time per batch per stage) and each
trainer's stall, the stage holding it, rate, lag and ready batches, with the last minute as
sparklines. It asks the Status RPC over the trainers' own address, token and TLS.

`--once` prints one plain-text snapshot (scripts, tests); otherwise curses redraws it every
`--interval` s until q or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import curses
import locale
import sys
import time
from collections.abc import Sequence

import grpc

from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import wire
from remote_loader.server.cli.channel import open_channel, tls_from_args, token_from
from remote_loader.server.config.spec import ConfigError

STATUS_METHOD = f"/{wire.SERVICE_NAME}/Status"
SPARKS = "▁▂▃▄▅▆▇█"
ASCII_SPARKS = "_.-:=+*#"
# Characters of each sparkline: the last minute (a sample a second), 3 samples a character.
SPARK_WIDTH = 20
# How often the live view looks at the keyboard while it waits for the next refresh.
KEY_POLL_MS = 100

# A line of the view, and how it is drawn: "title", "head" (column names), "hot" (a trainer
# stalled on something), or "" (plain).
Line = tuple[str, str]


def fetch(channel: grpc.Channel, timeout: float) -> pb.ServerStatus:
    status: pb.ServerStatus = channel.unary_unary(
        STATUS_METHOD,
        request_serializer=pb.StatusRequest.SerializeToString,
        response_deserializer=pb.ServerStatus.FromString,
    )(pb.StatusRequest(), timeout=timeout)
    return status


def sparkline(values: Sequence[float], top: float, width: int, chars: str = SPARKS) -> str:
    """`values` (oldest first) as `width` characters at most, each the mean of its share of
    them, scaled to `top` (the values' own maximum when larger); right-aligned."""
    if not values or width <= 0:
        return ""
    per = max(1, -(-len(values) // width))
    means = [
        sum(values[i : i + per]) / len(values[i : i + per]) for i in range(0, len(values), per)
    ]
    scale = max(top, *means, 1e-9)
    last = len(chars) - 1
    return "".join(chars[min(last, round(last * max(0.0, m) / scale))] for m in means)


def render(
    status: pb.ServerStatus, address: str, chars: str = SPARKS, live: bool = False
) -> list[Line]:
    """The view of `status` as lines (the same in the live view, `live`, and with --once)."""
    clock = time.strftime("%H:%M:%S")
    hint = "  (q quits)" if live else ""
    lines: list[Line] = [(f"remote-loader top  {address}  {clock}{hint}", "title")]
    for loader in status.loaders:
        lines.append(("", ""))
        lines.append(
            (
                f"loader {loader.name}  {loader.backend}  {loader.workers} workers "
                f"{loader.busy:4.0%} busy  CPU {loader.cpu_cores_used:.1f}/{loader.cores} "
                f"cores  {loader.batches_per_second:.1f} batches/s  "
                f"{loader.bytes_per_second / 1e6:.1f} MB/s out",
                "title",
            )
        )
        lines.append(
            (
                f"  per batch: make {loader.make_seconds * 1e3:.1f} ms  stream wait "
                f"{loader.stream_wait_seconds * 1e3:.1f} ms  send "
                f"{loader.send_seconds * 1e3:.1f} ms   busy "
                f"{sparkline(list(loader.busy_history), 1.0, SPARK_WIDTH, chars)}",
                "",
            )
        )
        head = (
            f"  {'JOB':<12} {'RANK':>6} {'SHARING':<9} {'EPOCH':>5} {'STALL':>5} "
            f"{'STAGE':<9} {'BATCH/S':>7} {'LAG':>4} {'READY':>5}  "
            f"{'STALL, 1 MIN':<{SPARK_WIDTH}}  RATE, 1 MIN"
        )
        lines.append((head, "head"))
        if not loader.consumers:
            lines.append(("  (no trainer attached or reporting)", ""))
        for c in loader.consumers:
            lines.append(_consumer_line(c, chars))
    return lines


def _consumer_line(c: pb.ConsumerStatus, chars: str) -> Line:
    who = c.consumer
    stall = f"{c.wait_fraction:5.0%}" if c.reported else "    ?"
    stage = (c.stage or "-") if c.reported else "(old)"
    lag = f"{c.lag:>4} {c.ready:>5}" if c.attached else f"{'-':>4} {'-':>5}"
    text = (
        f"  {who.job[:12]:<12} {f'{who.rank}/{who.world_size}':>6} {who.sharing[:9]:<9} "
        f"{c.epoch:>5} {stall} {stage:<9} {c.batches_per_second:>7.1f} {lag}  "
        f"{sparkline(list(c.wait_history), 1.0, SPARK_WIDTH, chars):<{SPARK_WIDTH}}  "
        f"{sparkline(list(c.rate_history), 0.0, SPARK_WIDTH, chars)}"
    )
    return text, "hot" if c.reported and c.wait_fraction >= 0.5 else ""


def run_top(args: argparse.Namespace) -> int:
    """The `top` command: 0 when it quits (q, Ctrl-C, or --once shown), 2 when it cannot ask."""
    try:
        channel = open_channel(args.address, tls_from_args(args), token_from(args.token_file))
    except ConfigError as exc:
        print(f"remote-loader: error: {exc}", file=sys.stderr)
        return 2
    with channel:
        if args.once:
            try:
                status = fetch(channel, args.timeout)
            except grpc.RpcError as exc:
                print(f"remote-loader: {args.address}: {_why(exc)}", file=sys.stderr)
                return 2
            chars = SPARKS if _unicode(sys.stdout.encoding) else ASCII_SPARKS
            print("\n".join(text for text, _ in render(status, args.address, chars)))
            return 0
        locale.setlocale(locale.LC_ALL, "")  # curses draws UTF-8 only with the locale's
        with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C: curses put the terminal back
            curses.wrapper(_live, channel, args)
        return 0


def _why(exc: grpc.RpcError) -> str:
    if isinstance(exc, grpc.Call):
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            return "this server predates the Status call (upgrade it to use top)"
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)


def _live(screen: curses.window, channel: grpc.Channel, args: argparse.Namespace) -> None:
    """Redraws every `args.interval` s; returns on q."""
    with contextlib.suppress(curses.error):  # a terminal without an invisible cursor
        curses.curs_set(0)
    styles = _styles()
    chars = SPARKS if _unicode(locale.getpreferredencoding(False)) else ASCII_SPARKS
    screen.timeout(KEY_POLL_MS)
    lines: list[Line] = []
    due = 0.0
    while True:
        if time.monotonic() >= due:
            try:
                lines = render(fetch(channel, args.timeout), args.address, chars, live=True)
            except grpc.RpcError as exc:
                lines = [(f"remote-loader top  {args.address}: {_why(exc)}", "hot")]
            due = time.monotonic() + args.interval
            _draw(screen, lines, styles)
        key = screen.getch()
        if key in (ord("q"), ord("Q")):
            return
        if key == curses.KEY_RESIZE:
            _draw(screen, lines, styles)


def _styles() -> dict[str, int]:
    styles = {"title": curses.A_BOLD, "head": curses.A_REVERSE, "hot": curses.A_BOLD, "": 0}
    if curses.has_colors():
        curses.start_color()
        curses.use_default_colors()
        curses.init_pair(1, curses.COLOR_RED, -1)
        styles["hot"] = curses.color_pair(1) | curses.A_BOLD
    return styles


def _draw(screen: curses.window, lines: list[Line], styles: dict[str, int]) -> None:
    screen.erase()
    height, width = screen.getmaxyx()
    for row, (text, style) in enumerate(lines[:height]):
        # curses.error: the bottom-right cell, or a terminal shrinking under us.
        with contextlib.suppress(curses.error):
            screen.addnstr(row, 0, text, max(0, width - 1), styles.get(style, 0))
    screen.refresh()


def _unicode(encoding: str | None) -> bool:
    return (encoding or "").lower().replace("-", "") in ("utf8", "utf_8")
