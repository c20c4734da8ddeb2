"""The libraries people train with, fed by a RemoteLoader, get what a DataLoader gives them.

Each test runs the real library (Lightning's Trainer and its DDP launcher, Hugging Face
`datasets`, WebDataset, torchdata's nodes, accelerate) against a real server on loopback, and
compares batch for batch with torch's DataLoader over the same pipeline, or with the loader's
own epochs asked for explicitly (`set_epoch`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from remote_loader.client import RemoteLoader
from remote_loader.server.config.spec import LoaderSpec
from tests.helpers import ROOT, StartServer, assert_same, subprocess_env
from tests.library_datasets import hf_ids, hf_stream, webdataset_pipeline, write_shards

SEED = 5
JOB = ROOT / "tests" / "lightning_job.py"
# Lightning's import and a DDP launch take seconds each on two busy cores.
JOB_TIMEOUT = 240


def _indexed_spec(**extra: Any) -> LoaderSpec:
    options: dict[str, Any] = {
        "name": "train",
        "dataset": "tests.library_datasets:Indexed",
        "dataset_kwargs": {"n": 32},
        "batch_size": 4,
        "shuffle": True,
        "num_workers": 1,
        "seed": SEED,
    }
    return LoaderSpec(**{**options, **extra})


def _reference(address: str, epochs: range, rank: int = 0, world_size: int = 1) -> list[Any]:
    """(epoch, indices) per batch of the loader's epochs, each asked for by number."""
    seen = []
    with RemoteLoader(address, "train", rank=rank, world_size=world_size, device="cpu") as loader:
        for epoch in epochs:
            loader.set_epoch(epoch)
            seen += [[epoch, batch["index"].tolist()] for batch in loader]
    return seen


def _run_job(address: str, out: Path, *args: str) -> dict[int, dict[str, Any]]:
    """Runs tests/lightning_job.py; each rank's record by rank."""
    out.mkdir(parents=True, exist_ok=True)
    env = subprocess_env()
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    proc = subprocess.Popen(
        [sys.executable, str(JOB), "--address", address, "--out", str(out), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # so a timeout stops the ranks Lightning launched too
    )
    try:
        output, _ = proc.communicate(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the Lightning job ran past {JOB_TIMEOUT} s:\n{output}")
    assert proc.returncode == 0, output
    records = {}
    for path in out.glob("rank*.json"):
        records[int(path.stem[4:])] = json.loads(path.read_text())
    return records


# --- Lightning ----------------------------------------------------------------------------


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_lightning_epochs_are_the_loaders_epochs(start_server: StartServer, tmp_path: Path) -> None:
    # Trainer.fit calls iter() on a loader that is not a DataLoader to check it is iterable,
    # and sets the epoch through loader.sampler.set_epoch: neither may move the loader ahead.
    address = start_server(_indexed_spec())
    records = _run_job(address, tmp_path, "--epochs", "3")
    assert list(records) == [0]
    assert records[0]["seen"] == _reference(address, range(3))


@pytest.mark.timeout(JOB_TIMEOUT + 60)
@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn", "ddp_notebook"])
def test_lightning_ddp_ranks_get_disjoint_shares(
    start_server: StartServer, tmp_path: Path, strategy: str
) -> None:
    # Lightning's launcher sets WORLD_SIZE and LOCAL_RANK, not RANK, and the loader is made in
    # the DataModule's __init__, before torch.distributed is initialized. ddp_spawn pickles the
    # DataModule, loader and all, to the processes it starts (NOTE [ A pickled loader ]: it
    # could not be pickled); ddp_notebook forks them.
    address = start_server(_indexed_spec())
    records = _run_job(address, tmp_path, "--epochs", "2", "--devices", "2", "--strategy", strategy)
    assert sorted(records) == [0, 1]
    for rank, record in records.items():
        assert (record["rank"], record["world_size"]) == (rank, 2)
        assert record["seen"] == _reference(address, range(2), rank, 2)
    for epoch in range(2):
        shares = [
            [i for e, batch in records[r]["seen"] if e == epoch for i in batch] for r in (0, 1)
        ]
        assert len(shares[0]) == len(shares[1]) == 16
        assert sorted(shares[0] + shares[1]) == list(range(32))


@pytest.mark.timeout(3 * JOB_TIMEOUT + 60)
@pytest.mark.parametrize("devices", [1, 2])
def test_lightning_resumes_mid_epoch_and_at_an_epochs_end(
    start_server: StartServer, tmp_path: Path, devices: int
) -> None:
    # Under DDP the checkpoint holds rank 0's loader state and every rank loads it (NOTE [ Any
    # rank's state ] in client/state.py): rank 1 refused it, and the resumed job died.
    address = start_server(_indexed_spec())
    steps = 8 // devices  # an epoch's steps on each rank
    # A checkpoint every half epoch and one at each epoch's end: step 1.5 * steps is mid-epoch
    # 1, step `steps` is after epoch 0's last batch, end-epoch=0 after its end hooks.
    ddp = ["--devices", str(devices)]
    whole = _run_job(
        address, tmp_path / "whole", "--epochs", "3", "--checkpoint-every", str(steps // 2), *ddp
    )
    assert sorted(whole) == list(range(devices))
    for rank, record in whole.items():
        assert record["seen"] == _reference(address, range(3), rank, devices)
    checkpoints = tmp_path / "whole" / "checkpoints"
    mid = 3 * steps // 2
    for name, step in ((f"epoch=1-step={mid}", mid), ("end-epoch=0", steps)):
        resumed = _run_job(
            address,
            tmp_path / name,
            "--epochs",
            "3",
            "--resume",
            str(checkpoints / f"{name}.ckpt"),
            *ddp,
        )
        assert sorted(resumed) == list(range(devices))
        for rank, record in resumed.items():
            assert record["seen"] == whole[rank]["seen"][step:], f"rank {rank} from {name}"


# --- Hugging Face datasets ------------------------------------------------------------------


def _ids(batches: list[Any]) -> list[list[int]]:
    return [batch["id"].tolist() for batch in batches]


def test_hf_map_style_equals_dataloader(start_server: StartServer) -> None:
    spec = LoaderSpec(
        name="train",
        dataset="tests.library_datasets:hf_ids",
        batch_size=8,
        shuffle=True,
        num_workers=2,
        seed=SEED,
    )
    address = start_server(spec)
    dataset = hf_ids()
    with RemoteLoader(address, device="cpu") as loader:
        assert len(loader.dataset) == len(dataset) == 64
        for epoch in range(2):
            generator = torch.Generator().manual_seed(SEED + epoch)
            local = list(DataLoader(dataset, batch_size=8, shuffle=True, generator=generator))
            loader.set_epoch(epoch)
            assert_same(list(loader), local)


def test_hf_iterable_seeded_shuffle_reshuffles_per_epoch(start_server: StartServer) -> None:
    # Users call ds.set_epoch(epoch) on their copy; the server calls it on the workers' copies.
    spec = LoaderSpec(
        name="train", dataset="tests.library_datasets:hf_stream", batch_size=4, num_workers=2
    )
    address = start_server(spec)
    dataset = hf_stream()
    epochs = []
    with RemoteLoader(address, device="cpu") as loader:
        for epoch in range(2):
            dataset.set_epoch(epoch)
            local = _ids(list(DataLoader(dataset, batch_size=4, num_workers=2)))
            served = _ids(list(loader))
            assert served == local, f"epoch {epoch}"
            epochs.append(served)
    assert epochs[0] != epochs[1]


def test_hf_unseeded_shuffle_buffer_gives_every_id_once(start_server: StartServer) -> None:
    # The shuffle's seed is drawn when the dataset is built: built once per loader, every
    # worker shuffles its shards with the same seed, so no id is lost or doubled.
    spec = LoaderSpec(
        name="train",
        dataset="tests.library_datasets:hf_stream",
        dataset_kwargs={"seed": None},
        batch_size=4,
        num_workers=2,
    )
    address = start_server(spec)
    with RemoteLoader(address, device="cpu") as loader:
        for epoch in range(4):
            ids = [i for batch in _ids(list(loader)) for i in batch]
            assert sorted(ids) == list(range(64)), f"epoch {epoch}: {Counter(ids)}"


def test_hf_partition_between_two_ranks(start_server: StartServer) -> None:
    spec = LoaderSpec(
        name="train",
        dataset="tests.library_datasets:hf_ids",
        batch_size=4,
        shuffle=True,
        num_workers=2,
        seed=SEED,
    )
    address = start_server(spec)
    shares = []
    for rank in (0, 1):
        with RemoteLoader(address, rank=rank, world_size=2, device="cpu") as loader:
            shares.append([i for batch in _ids(list(loader)) for i in batch])
    assert len(shares[0]) == len(shares[1]) == 32
    assert sorted(shares[0] + shares[1]) == list(range(64))


# --- WebDataset -----------------------------------------------------------------------------


def test_webdataset_shards_equal_dataloader(start_server: StartServer, tmp_path: Path) -> None:
    root = str(tmp_path / "shards")
    write_shards(root)
    spec = LoaderSpec(
        name="train",
        dataset="tests.library_datasets:webdataset_pipeline",
        dataset_kwargs={"root": root},
        batch_size=4,
        num_workers=2,
    )
    address = start_server(spec)
    local = list(DataLoader(webdataset_pipeline(root), batch_size=4, num_workers=2))
    with RemoteLoader(address, device="cpu") as loader:
        for _ in range(2):
            assert_same(list(loader), local)
    labels = sorted(int(i) for _, batch in local for i in batch)
    assert labels == list(range(64))


# --- torchdata nodes and accelerate ---------------------------------------------------------


def test_torchdata_nodes_resume_mid_epoch_exactly(start_server: StartServer) -> None:
    from torchdata.nodes import IterableWrapper, Loader

    address = start_server(_indexed_spec())
    with RemoteLoader(address, device="cpu") as remote:
        whole = [batch["index"].tolist() for batch in Loader(IterableWrapper(remote))]
        remote.set_epoch(0)
        node = Loader(IterableWrapper(remote))
        it = iter(node)
        first = [next(it)["index"].tolist() for _ in range(3)]
        state = node.state_dict()
    assert first == whole[:3]
    with RemoteLoader(address, device="cpu") as remote:
        node = Loader(IterableWrapper(remote))
        node.load_state_dict(state)
        rest = [batch["index"].tolist() for batch in node]
    assert first + rest == whole


def test_accelerate_prepare_and_skip_first_batches(start_server: StartServer) -> None:
    import accelerate

    address = start_server(_indexed_spec())
    accelerator = accelerate.Accelerator(cpu=True)
    with RemoteLoader(address, device="cpu") as remote:
        loader = accelerator.prepare(remote)
        whole = [batch["index"].tolist() for batch in loader]
        assert whole == [b for _, b in _reference(address, range(1))]
        remote.set_epoch(0)
        try:
            skipped = accelerate.skip_first_batches(loader, 3)
        except TypeError as exc:  # refused: it must name the way that works
            assert "load_state_dict" in str(exc)
        else:
            assert [batch["index"].tolist() for batch in skipped] == whole[3:]


def test_accelerate_save_state_and_load_state_resume_mid_epoch(
    start_server: StartServer, tmp_path: Path
) -> None:
    import accelerate

    address = start_server(_indexed_spec())
    whole = [b for _, b in _reference(address, range(1))]
    with RemoteLoader(address, device="cpu") as remote:
        accelerator = accelerate.Accelerator(cpu=True)
        loader = accelerator.prepare(remote)
        accelerator.register_for_checkpointing(remote)
        it = iter(loader)
        first = [next(it)["index"].tolist() for _ in range(3)]
        accelerator.save_state(str(tmp_path))
    with RemoteLoader(address, device="cpu") as remote:
        accelerator = accelerate.Accelerator(cpu=True)
        loader = accelerator.prepare(remote)
        accelerator.register_for_checkpointing(remote)
        accelerator.load_state(str(tmp_path))
        rest = [batch["index"].tolist() for batch in loader]
    assert first + rest == whole
