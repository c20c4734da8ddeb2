"""One trainer of benchmarks/campaign.py, run inside a trainer namespace (`campaign.py trainer
ADDRESS RANK TRANSPORT JOB STATE`): reads the job's epochs, one JSON line per batch on stdout.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, cast

import torch

from benchmarks.campaign_job import EPOCHS, WORLD, payload
from remote_loader.client.types import Transport

PACE = 0.05  # seconds a trainer "trains" per batch, so that faults land mid-epoch


def trainer(address: str, rank: int, transport: str, job: str, state: str) -> int:
    """Rank `rank` of `job` from `state` (a state_dict as JSON, or ""): prints the events
    "started", one "batch" per batch (epoch, ids, ok, via, state), then "done" (exit status 0)
    or "error" (a RemoteLoaderError: 3)."""
    from remote_loader.client import RemoteLoader, RemoteLoaderError

    def emit(**event: Any) -> None:
        sys.stdout.write(json.dumps(event) + "\n")  # one write: a killed trainer cuts no line
        sys.stdout.flush()

    try:
        with RemoteLoader(
            address,
            rank=rank,
            world_size=WORLD,
            job=job,
            transport=cast("Transport", transport),  # from argv: RemoteLoader checks it
            device="cpu",
        ) as loader:
            if state:
                loader.load_state_dict(json.loads(state))
            emit(event="started")
            while loader.epoch < EPOCHS:
                epoch = loader.epoch
                for data, ids in loader:
                    ok = all(
                        torch.equal(row, payload(int(i))) for row, i in zip(data, ids, strict=True)
                    )
                    emit(
                        event="batch", epoch=epoch, ids=ids.tolist(), ok=ok,
                        via=loader.last_transport, state=loader.state_dict(),
                    )  # fmt: skip
                    time.sleep(PACE)
    except RemoteLoaderError as exc:
        emit(event="error", type=type(exc).__name__, message=str(exc)[:300])
        return 3
    emit(event="done")
    return 0
