"""Fault campaign: a server and two trainers on their own network namespaces, one fault at a time.

    python benchmarks/campaign.py            # every scenario, transports tcp and grpc (root)
    python benchmarks/campaign.py --quick    # a subset, a couple of minutes
    python benchmarks/campaign.py --scenarios loss10,server-kill --transports tcp

Layout. Three namespaces ("cmpTAG-srv", "cmpTAG-t0", "cmpTAG-t1") on one bridge
(benchmarks/bridge.py), each command in them with a private /dev/shm. The server is a
`remote-loader serve` process in the server namespace (gRPC on port 50051, data connections on
50052); each trainer is a process of this script (`trainer`) in its namespace, rank 0 or 1 of
a partition job, reading EPOCHS epochs and printing one JSON line per batch: its sample ids,
whether every sample's bytes were the dataset's, and `state_dict()` after it.

Scenarios (each on a fresh job name, so no production is shared with an earlier one):
  none          no fault
  loss1/loss10  nftables in the server namespace drops 1% / 10% of packets each way, from the
                start (`numgen random mod 100 < N drop`; this kernel has no netem)
  delay         25 ms each way: nftables DNATs the trainers' connections to a relay process
                (benchmarks/relay.py) in the server namespace that holds each chunk 25 ms
  partition     the server's veth goes down for 5 s mid-epoch, then up
  server-kill   the server's process group gets SIGKILL mid-epoch and is started again at once
  server-dead   the same, never restarted: the trainers should fail with a typed error
  client-kill   trainer 0 gets SIGKILL mid-epoch; a new one resumes from its last state_dict
A trainer that fails with a typed error (RemoteLoaderError) is started again from its last
state, while the server runs (server-dead: never), at most RESUMES times.

Outcome per scenario: "exact" (each rank got exactly its expected batches, in order: those of
a local DistributedSampler over the same dataset and seed, every sample's bytes intact),
"typed error, resumed exact" (so, after a resume), "typed error" (server-dead, as it should),
"hang" (no batch for HANG_SECONDS, or past the scenario's deadline: the processes are killed),
or "wrong" (missing, extra or corrupt batches). "twice" counts batches a training loop
received more than once.

Cleanup: namespaces, bridge, veths and every process started here go at the end, on an
exception, at exit (atexit) and on SIGTERM / SIGINT (raised as exceptions, so finally runs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root onto the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bridge import Topology, kill_group
from benchmarks.campaign_job import BATCH, EPOCHS, SAMPLE_BYTES, SAMPLES, SEED, WORLD
from benchmarks.campaign_trainer import trainer
from benchmarks.campaign_verdict import Row, judge, print_row
from benchmarks.netns import NetnsError, _run
from benchmarks.processes import read_banner

GRPC_PORT, DATA_PORT = 50051, 50052
RELAY_OFFSET = 10000  # the relay listens on port + this
DELAY = 0.025
FAULT_AT = 5  # the fault comes when rank 0 has received this many batches
PARTITION_SECONDS = 5.0
HANG_SECONDS = 90.0  # no batch from a running trainer for this long: a hang
DEADLINE = 300.0  # a scenario's whole time
RESUMES = 3
SCENARIOS = (
    "none", "loss1", "loss10", "delay", "partition", "server-kill", "server-dead", "client-kill",
)  # fmt: skip
QUICK = (("none", "tcp"), ("client-kill", "tcp"), ("server-kill", "grpc"))


class Campaign:
    """Runs scenarios on one topology and one server (started again when a scenario killed it)."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.server: subprocess.Popen[str] | None = None
        self.server_up = threading.Event()
        self.host = topo.ip["srv"]
        self.fault_error = ""
        self.notes: list[str] = []  # what a scenario's undo saw (nftables' counters)

    def start_server(self) -> None:
        argv = [
            sys.executable, "-m", "remote_loader.server.cli.main", "serve",
            "--address", f"{self.host}:{GRPC_PORT}", "--data-address", f"{self.host}:{DATA_PORT}",
            "--log-level", "ERROR", "--name", "campaign",
            "--dataset", "benchmarks.campaign_job:Tagged", "--batch-size", str(BATCH),
            "--shuffle", "--num-workers", "2", "--seed", str(SEED),
        ]  # fmt: skip
        self.server = self.topo.start("srv", argv)
        read_banner(self.server, "remote-loader serve")
        self.server_up.set()

    def kill_server(self) -> None:
        self.server_up.clear()
        if self.server is not None:
            kill_group(self.server)

    def run(self, name: str, transport: str) -> Row:
        if self.server is None or self.server.poll() is not None:
            self.start_server()
        self.notes = []
        undo = self._before(name)
        try:
            row = self._run(name, transport)
        finally:
            undo()
        row.detail = "; ".join([row.detail, *self.notes])
        return row

    def _before(self, name: str) -> Any:
        """Sets up a scenario's standing fault; returns what undoes it."""
        topo = self.topo
        if name in ("loss1", "loss10"):
            n = name[4:]
            topo.nft(
                "srv",
                "add table inet cmploss",
                "add chain inet cmploss in { type filter hook input priority 0 ; }",
                "add chain inet cmploss out { type filter hook output priority 0 ; }",
                f"add rule inet cmploss in iifname != lo numgen random mod 100 < {n} counter drop",
                f"add rule inet cmploss out oifname != lo numgen random mod 100 < {n} counter drop",
            )

            def unloss() -> None:
                rules = _run(["ip", "netns", "exec", topo.ns["srv"], "nft", "list", "ruleset"])
                dropped = sum(int(m) for m in re.findall(r"counter packets (\d+)", rules))
                self.notes.append(f"{dropped} packets dropped")
                topo.nft("srv", "delete table inet cmploss")

            return unloss
        if name == "delay":
            pairs = [f"{p + RELAY_OFFSET}:{p}" for p in (GRPC_PORT, DATA_PORT)]
            argv = [sys.executable, "-m", "benchmarks.relay", self.host, str(DELAY), *pairs]
            proc = topo.start("srv", argv)
            read_banner(proc, "relay")
            for node in ("t0", "t1"):
                topo.nft(
                    node,
                    "add table ip cmpdelay",
                    "add chain ip cmpdelay out { type nat hook output priority -100 ; }",
                    *(
                        f"add rule ip cmpdelay out ip daddr {self.host} tcp dport {port} "
                        f"counter dnat to {self.host}:{port + RELAY_OFFSET}"
                        for port in (GRPC_PORT, DATA_PORT)
                    ),
                )

            def undo() -> None:
                # NAT sees a connection's first packet only: the counters count connections.
                relayed = 0
                for node in ("t0", "t1"):
                    rules = _run(["ip", "netns", "exec", topo.ns[node], "nft", "list", "ruleset"])
                    relayed += sum(int(m) for m in re.findall(r"counter packets (\d+)", rules))
                    topo.nft(node, "delete table ip cmpdelay")
                self.notes.append(f"{relayed} connections through the relay")
                kill_group(proc)

            return undo
        return lambda: None

    def _fault(self, name: str, trainers: dict[int, subprocess.Popen[str]]) -> None:
        """The mid-epoch fault of `name`, in a thread of its own (the loop goes on reading); a
        failure of its own (a server that would not restart) goes into the row's errors."""
        try:
            self._inject(name, trainers)
        except Exception as exc:
            self.fault_error = f"fault failed: {type(exc).__name__}: {exc}"

    def _inject(self, name: str, trainers: dict[int, subprocess.Popen[str]]) -> None:
        if name == "partition":
            self.topo.link("srv", False)
            time.sleep(PARTITION_SECONDS)
            self.topo.link("srv", True)
        elif name in ("server-kill", "server-dead"):
            self.kill_server()
            if name == "server-kill":
                self.start_server()
        elif name == "client-kill":
            kill_group(trainers[0])

    def _trainer(
        self, rank: int, transport: str, job: str, state: str, events: queue.Queue[Any], gen: int
    ) -> subprocess.Popen[str]:
        argv = [
            sys.executable, "-m", "benchmarks.campaign", "trainer",
            f"{self.host}:{GRPC_PORT}", str(rank), transport, job, state,
        ]  # fmt: skip
        proc = self.topo.start(f"t{rank}", argv)

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                with contextlib.suppress(ValueError):
                    events.put((rank, gen, json.loads(line)))
            events.put((rank, gen, {"event": "exit", "rc": proc.wait()}))

        threading.Thread(target=read, daemon=True).start()
        return proc

    def _run(self, name: str, transport: str) -> Row:
        job = f"{name}-{transport}-{secrets.token_hex(2)}"
        events: queue.Queue[Any] = queue.Queue()  # unbounded: at most 2 x 32 batches + a few
        gen = {0: 0, 1: 0}
        trainers = {r: self._trainer(r, transport, job, "", events, 0) for r in range(WORLD)}
        received: dict[int, list[tuple[int, tuple[int, ...]]]] = {0: [], 1: []}
        state = {0: "", 1: ""}
        errors: list[str] = []
        via: set[str] = set()
        bad, resumes = 0, 0
        done: set[int] = set()
        pending: set[int] = set()  # ranks to start again once the server is up
        fault: threading.Thread | None = None
        started = last = time.monotonic()
        hang = ""
        self.fault_error = ""
        try:
            while len(done) < WORLD:
                now = time.monotonic()
                if now - last > HANG_SECONDS or now - started > DEADLINE:
                    hang = f"no batch for {now - last:.0f} s" if now - last > HANG_SECONDS else ""
                    hang = hang or f"past the {DEADLINE:.0f} s deadline"
                    break
                for rank in sorted(pending):
                    if self.server_up.is_set() and (fault is None or not fault.is_alive()):
                        pending.discard(rank)
                        resumes += 1
                        gen[rank] += 1
                        trainers[rank] = self._trainer(
                            rank, transport, job, state[rank], events, gen[rank]
                        )
                        last = time.monotonic()  # a new process imports torch first
                try:
                    rank, g, event = events.get(timeout=0.5)
                except queue.Empty:
                    continue
                if g != gen[rank]:
                    continue
                kind = event["event"]
                if kind == "batch":
                    received[rank].append((event["epoch"], tuple(event["ids"])))
                    bad += not event["ok"]
                    via.add(str(event["via"]))
                    state[rank] = json.dumps(event["state"])
                    last = time.monotonic()
                    if fault is None and rank == 0 and len(received[0]) >= FAULT_AT:
                        fault = threading.Thread(target=self._fault, args=(name, trainers))
                        fault.start()
                elif kind == "error":
                    errors.append(f"rank {rank}: {event['type']}")
                elif kind == "exit":
                    if event["rc"] == 0 or name == "server-dead" or resumes >= RESUMES:
                        done.add(rank)
                    else:
                        pending.add(rank)  # a typed error, or our SIGKILL: resume from state
        finally:
            if fault is not None:
                fault.join()
            for proc in trainers.values():
                kill_group(proc)
        seconds = time.monotonic() - started
        errors += [self.fault_error] if self.fault_error else []
        return judge(name, transport, received, bad, errors, resumes, via, hang, seconds)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["trainer"]:
        address, rank, transport, job, state = args[1:6]
        return trainer(address, int(rank), transport, job, state)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help=f"only {QUICK}")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--transports", default="tcp,grpc")
    opts = parser.parse_args(args)
    if opts.quick:
        plan = list(QUICK)
    else:
        names = [s for s in opts.scenarios.split(",") if s]
        unknown = [s for s in names if s not in SCENARIOS]
        transports = [t for t in opts.transports.split(",") if t]
        if unknown or not set(transports) <= {"tcp", "grpc"}:
            parser.error(f"scenarios are {', '.join(SCENARIOS)}; transports tcp, grpc")
        plan = [(s, t) for s in names for t in transports]
    # SIGTERM / SIGINT as exceptions, so that the finally below removes the namespaces.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        topo = Topology(["srv", "t0", "t1"])
    except NetnsError as exc:  # not root, or a tool missing: say which, no traceback
        raise SystemExit(f"campaign.py: {exc}") from None
    rows: list[Row] = []
    started = time.monotonic()
    try:
        print(
            f"fault campaign: server {topo.ip['srv']} ({topo.ns['srv']}), trainers "
            f"{topo.ip['t0']}, {topo.ip['t1']}; {SAMPLES} samples of {SAMPLE_BYTES} B, batches "
            f"of {BATCH}, {EPOCHS} epochs, 2 ranks; fault after rank 0's batch {FAULT_AT}",
            flush=True,
        )
        campaign = Campaign(topo)
        campaign.start_server()
        head = ("scenario", "transport", "outcome", "twice", "wall s", "detail")
        print_row(Row(*head[:3], 0, 0.0, head[5]), head)
        for name, transport in plan:
            rows.append(campaign.run(name, transport))
            print_row(rows[-1])
    finally:
        topo.close()
    print(f"{len(rows)} scenarios in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
