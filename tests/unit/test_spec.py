"""Loader specs: TOML and flags, and every option conflict torch rejects, with torch's message."""

from __future__ import annotations

import argparse
import multiprocessing
import re
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from remote_loader.server.config.file import load_config
from remote_loader.server.config.flags import add_spec_arguments, spec_from_args
from remote_loader.server.config.spec import ConfigError, LoaderSpec, resolve
from remote_loader.server.sharing.host import LoaderHost
from tests import datasets


def test_toml_config(tmp_path: Path) -> None:
    path = tmp_path / "loaders.toml"
    path.write_text(
        """
[loaders.train]
dataset = "tests.datasets:Squares"
dataset_kwargs = { n = 30 }
batch_size = 8
shuffle = true
num_workers = 2
timeout = 5

[loaders.eval]
dataset = "tests.datasets:Squares"
batch_size = "none"
"""
    )
    specs = load_config(path)
    assert list(specs) == ["train", "eval"]
    train = specs["train"]
    assert train.dataset_kwargs == {"n": 30} and train.batch_size == 8 and train.shuffle is True
    assert train.timeout == 5.0 and train.num_workers == 2
    assert specs["eval"].batch_size is None


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('[loaders.a]\ndataset = "m:f"\nbatchsize = 3', "unknown option.*batchsize.*allowed"),
        ("[loaders.a]\nbatch_size = 3", "'dataset' is required"),
        ('[loaders.a]\ndataset = "m:f"\nbatch_size = "all"', "integer or 'none'"),
        ('[loaders.a]\ndataset = "m:f"\nshuffle = "yes"', "true or false"),
        ('[loaders.a]\ndataset = "m:f"\nnum_workers = 1.5', "must be an integer"),
        ('[loaders.a]\ndataset = "m:f"\ndataset_kwargs = 3', "table of keyword arguments"),
        ('[loaders.a]\ndataset = "m:f"\nsharing = "broadcast"', "must be a list of modes"),
        (
            '[loaders.a]\ndataset = "m:f"\nsharing = ["gossip"]',
            "sharing must list one or more of partition, broadcast, dynamic, got \\['gossip'\\]",
        ),
        ('[loaders.a]\ndataset = "m:f"\nsharing = []', "sharing must list one or more"),
        (
            '[loaders.a]\ndataset = "m:f"\nseeding = "batch"',
            "seeding must be one of worker, per_batch",
        ),
        (
            '[loaders.a]\ndataset = "m:f"\nbroadcast_window = 0',
            "broadcast_window must be at least 1",
        ),
        ('[loaders.a]\ndataset = "m:f"\ndetach_timeout = 0', "detach_timeout must be a positive"),
        (
            '[loaders.a]\ndataset = "m:f"\nmultiprocessing_context = 1',
            "multiprocessing_context' must be a start method's name",
        ),
        ("[server]\nx = 1", "defines no loader"),
        ("[loaders.a\n", "not valid TOML"),
    ],
)
def test_config_errors(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(body)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("tests.datasets", "not an import path"),
        ("tests.nope:X", "cannot import module 'tests.nope'"),
        ("tests.datasets:Nope", "has no attribute 'Nope'"),
        ("tests.datasets:INIT_CALLS", "is not callable"),
    ],
)
def test_resolve_errors(path: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve(path)


def test_flags() -> None:
    parser = argparse.ArgumentParser()
    add_spec_arguments(parser)
    args = parser.parse_args(
        [
            "--dataset",
            "tests.datasets:Squares",
            "--batch-size",
            "none",
            "--shuffle",
            "--dataset-kwargs",
            '{"n": 5}',
            "--num-workers",
            "2",
        ]
    )
    spec = spec_from_args(args)
    assert spec == LoaderSpec(
        name="default",
        dataset="tests.datasets:Squares",
        batch_size=None,
        shuffle=True,
        dataset_kwargs={"n": 5},
        num_workers=2,
    )


def test_fingerprint_tracks_what_decides_the_batches() -> None:
    a = LoaderSpec(name="a", dataset="tests.datasets:Squares", batch_size=4)
    assert (
        a.fingerprint()
        == LoaderSpec(
            name="b", dataset="tests.datasets:Squares", batch_size=4, num_workers=3
        ).fingerprint()
    )
    assert (
        a.fingerprint()
        != LoaderSpec(name="a", dataset="tests.datasets:Squares", batch_size=5).fingerprint()
    )
    # Who may attach and how long they may lag does not change the data; how shares are cut and
    # how batches are seeded does.
    same: dict[str, Any] = {
        "sharing": ("broadcast",),
        "broadcast_window": 2,
        "detach_timeout": 1.0,
        "multiprocessing_context": "spawn",  # the workers start the same way whatever it says
    }
    other: list[dict[str, Any]] = [{"partition_drop_last": True}, {"seeding": "per_batch"}]
    spec: dict[str, Any] = {"name": "a", "dataset": "tests.datasets:Squares", "batch_size": 4}
    assert LoaderSpec(**spec, **same).fingerprint() == a.fingerprint()
    for options in other:
        assert LoaderSpec(**spec, **options).fingerprint() != a.fingerprint()


# Each conflict torch's DataLoader rejects: (spec options, the dataset).
CONFLICTS: list[tuple[dict[str, Any], str]] = [
    ({"num_workers": -1}, "Squares"),
    ({"timeout": -1.0}, "Squares"),
    ({"prefetch_factor": 2}, "Squares"),
    ({"num_workers": 1, "prefetch_factor": -1}, "Squares"),
    ({"persistent_workers": True}, "Squares"),
    ({"shuffle": True}, "Sharded"),
    ({"sampler": "tests.datasets:Reversed"}, "Sharded"),
    ({"batch_sampler": "tests.datasets:GrowingBatches"}, "Sharded"),
    ({"sampler": "tests.datasets:Reversed", "shuffle": True}, "Squares"),
    ({"batch_sampler": "tests.datasets:GrowingBatches", "batch_size": 4}, "Squares"),
    ({"batch_sampler": "tests.datasets:GrowingBatches", "shuffle": True}, "Squares"),
    ({"batch_sampler": "tests.datasets:GrowingBatches", "drop_last": True}, "Squares"),
    (
        {"batch_sampler": "tests.datasets:GrowingBatches", "sampler": "tests.datasets:Reversed"},
        "Squares",
    ),
    ({"batch_size": None, "drop_last": True}, "Squares"),
    ({"batch_size": 0}, "Squares"),
    # torch's start methods are fork, spawn and forkserver, and only with workers.
    ({"num_workers": 1, "multiprocessing_context": "threads"}, "Squares"),
    ({"multiprocessing_context": "spawn"}, "Squares"),
]


@pytest.mark.parametrize(("options", "dataset"), CONFLICTS)
def test_option_conflicts_fail_at_start_with_torchs_message(
    options: dict[str, Any], dataset: str
) -> None:
    ds = getattr(datasets, dataset)()
    torch_kwargs = {
        k: (resolve(v)(ds) if k in ("sampler", "batch_sampler") else v) for k, v in options.items()
    }
    with pytest.raises(Exception) as torch_error:
        DataLoader(ds, **torch_kwargs)
    spec = LoaderSpec(name="x", dataset=f"tests.datasets:{dataset}", **options)
    with pytest.raises(type(torch_error.value)) as ours:
        LoaderHost(spec, multiprocessing.get_context("forkserver"))
    assert type(ours.value) is type(torch_error.value)

    def without_addresses(text: str) -> str:  # messages that print a sampler show its id
        return re.sub(r"0x[0-9a-f]+", "0x?", text)

    assert without_addresses(str(ours.value)) == without_addresses(str(torch_error.value))


def test_dataset_factory_error_fails_at_start() -> None:
    spec = LoaderSpec(name="x", dataset="tests.datasets:Squares", dataset_kwargs={"m": 1})
    with pytest.raises(TypeError, match="unexpected keyword argument 'm'"):
        LoaderHost(spec, multiprocessing.get_context("forkserver"))


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1])
def test_a_seed_outside_int64_is_refused(seed: int) -> None:
    # `--seed` takes any integer; LoaderInfo.seed, which tells clients the seed, is an int64.
    with pytest.raises(ConfigError, match=rf"seed must be between .* \(int64\), got {seed}$"):
        LoaderSpec(name="a", dataset="m:f", seed=seed)
