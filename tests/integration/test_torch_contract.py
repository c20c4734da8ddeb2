"""The server's half of torch's DataLoader contract, each part against torch's own DataLoader
in the same test: a worker's exception named by its class on the wire (a batch's error Frame,
and a broken loader's trailer), in_order = false dispatching only to workers with room, the
start methods torch accepts, and torch's warnings for a loader handed to trainers by Describe.

The unit tests (no server, no process, no Ray): tests/unit/test_torch_contract.py.
"""

from __future__ import annotations

import gc
import os
import warnings
from pathlib import Path
from typing import Any

import grpc
import pytest
from torch.utils.data import DataLoader

from remote_loader.client import RemoteLoader
from remote_loader.protos import loader_pb2 as pb
from remote_loader.protos import reasons
from remote_loader.server.config.spec import LoaderSpec, resolve
from tests import datasets
from tests.helpers import SEED, WORKER_0, ServeLoaders, assert_same, local_batches, raw_stream


def _raised_by_torch(loader: DataLoader[Any]) -> BaseException:
    """What iterating `loader` to its end raises in this process."""
    with pytest.raises(Exception) as raised:
        list(loader)
    error = raised.value
    # NOTE: the traceback holds torch's iterator (its frames' `self`) in a cycle that only the
    # cyclic GC frees: at some later allocation, on whatever thread makes it, where the
    # iterator's __del__ then shuts its workers down, joining for seconds. In a gRPC server
    # thread of the next test's in-process server, that held its calls past the client's
    # connect_timeout (twice in CI). Freed here, on this thread.
    error.__traceback__ = None
    del raised
    gc.collect()
    return error


# --- a worker's exception, named by its class ------------------------------------------------


@pytest.mark.parametrize(
    ("dataset", "module", "qualname"),
    [("Failing", "builtins", "ValueError"), ("FailingOwn", "tests.datasets", "FailingOwn.Corrupt")],
)
def test_an_error_frame_names_the_class_torch_raises(
    serve_loaders: ServeLoaders, dataset: str, module: str, qualname: str
) -> None:
    spec = LoaderSpec(name="failing", dataset=f"tests.datasets:{dataset}", num_workers=1)
    local = DataLoader(resolve(spec.dataset)(), num_workers=1, multiprocessing_context="forkserver")
    torch_error = _raised_by_torch(local)
    served = serve_loaders(spec)
    channel, call = raw_stream(served.address, pb.StreamRequest(loader=spec.name))
    with channel:
        errors = [frame.error for frame in call if frame.HasField("error")]
    assert len(errors) == 1
    error = errors[0]
    kind = type(torch_error)
    assert (error.module, error.qualname, error.type) == (module, qualname, kind.__name__)
    assert (kind.__module__, kind.__qualname__) == (module, qualname)
    assert error.where == WORKER_0
    assert str(torch_error).startswith(f"Caught {error.type} {error.where}.")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("init", ["failing_init", "failing_init_at_length"])
def test_a_broken_loader_sends_its_exception_in_the_trailer(
    serve_loaders: ServeLoaders, init: str
) -> None:
    """worker_init_fn raising: torch re-raises its exception as its type in the trainer; the
    server ends the stream with LOADER_BROKEN and that exception under ERROR_KEY, within
    gRPC's metadata limit even when its message is 20 KB."""
    spec = LoaderSpec(
        name="broken",
        dataset="tests.datasets:Squares",
        num_workers=1,
        worker_init_fn=f"tests.datasets:{init}",
    )
    local = DataLoader(
        datasets.Squares(),
        num_workers=1,
        worker_init_fn=resolve(spec.worker_init_fn or ""),
        multiprocessing_context="forkserver",
    )
    kind = type(_raised_by_torch(local))
    served = serve_loaders(spec)
    channel, call = raw_stream(served.address, pb.StreamRequest(loader=spec.name))
    with channel, pytest.raises(grpc.RpcError) as info:
        list(call)
    failed = info.value
    assert isinstance(failed, grpc.Call)
    assert failed.code() == grpc.StatusCode.FAILED_PRECONDITION, failed.details()
    trailing = failed.trailing_metadata()
    assert reasons.reason_of(trailing) == reasons.LOADER_BROKEN
    error = reasons.captured_error_of(trailing)
    assert error is not None
    assert (
        (error.module, error.qualname)
        == ("builtins", "RuntimeError")
        == (
            kind.__module__,
            kind.__qualname__,
        )
    )
    assert error.where == WORKER_0
    assert error.traceback.startswith("Traceback (most recent call last):")
    assert f"in {init}" in error.traceback  # the frame that raised is kept
    assert "cannot start" in error.message or "fails on purpose" in error.message
    assert "worker 0" in (failed.details() or "")


# --- in_order = false: tasks only to workers with room ---------------------------------------


@pytest.mark.timeout(120)
def test_in_order_false_passes_a_stragglers_worker_over_as_torch_does(
    serve_loaders: ServeLoaders, tmp_path: Path
) -> None:
    """Sample 0 straggles on worker 0: torch gives the next tasks to worker 1, which has room,
    and yields 0 and 2 (worker 0's) last; round-robin would queue every other task behind
    sample 0 (which then waits out its patience)."""
    options: dict[str, Any] = {
        "batch_size": 1,
        "num_workers": 2,
        "prefetch_factor": 2,
        "in_order": False,
    }
    local = DataLoader(
        datasets.Straggler(str(tmp_path / "torch.log")),
        multiprocessing_context="forkserver",
        **options,
    )
    expected = [int(batch) for batch in local]
    assert expected != sorted(expected)  # the straggler did hold its batches back
    spec = LoaderSpec(
        name="straggler",
        dataset="tests.datasets:Straggler",
        dataset_kwargs={"log": str(tmp_path / "served.log")},
        **options,
    )
    served = serve_loaders(spec)
    with RemoteLoader(served.address) as loader:
        assert [int(batch) for batch in loader] == expected


# --- multiprocessing_context ------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_each_start_method_is_served_with_torchs_batches(
    serve_loaders: ServeLoaders, context: str
) -> None:
    spec = LoaderSpec(
        name=f"aug-{context}",
        dataset="tests.datasets:RandomAug",
        dataset_kwargs={"n": 16},
        batch_size=4,
        shuffle=True,
        num_workers=2,
        multiprocessing_context=context,
    )
    # torch's first, with that start method: before this test's server runs gRPC threads.
    expected = local_batches(spec, SEED, 1)
    served = serve_loaders(spec)
    with RemoteLoader(served.address, spec.name, seed=SEED) as loader:
        loader.set_epoch(1)
        remote = list(loader)
    assert len(remote) == len(expected) == 4
    assert_same(remote, expected)


# --- torch's warnings, handed on ------------------------------------------------------------


def test_torchs_warnings_for_a_loader_are_in_describe(serve_loaders: ServeLoaders) -> None:
    workers = len(os.sched_getaffinity(0)) + 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        local = DataLoader(datasets.Squares(), num_workers=workers)
        local.check_worker_number_rationality()  # what creating its iterator checks again
    expected = {(w.category.__name__, str(w.message)) for w in caught}
    assert any(message.startswith("This DataLoader will create") for _, message in expected)
    spec = LoaderSpec(name="crowded", dataset="tests.datasets:Squares", num_workers=workers)
    served = serve_loaders(spec)
    assert served.hosts["crowded"].warnings  # kept on the host, logged at start-up
    with grpc.insecure_channel(served.address) as channel:
        describe = channel.unary_unary(
            "/remote_loader.v1.Loader/Describe",
            request_serializer=pb.DescribeRequest.SerializeToString,
            response_deserializer=pb.LoaderInfo.FromString,
        )
        info = describe(pb.DescribeRequest(loader=spec.name), timeout=30)
    got = [(w.category, w.message) for w in info.warnings]
    assert len(got) == len(set(got))  # each once, though torch checked twice
    assert set(got) == expected
