"""A RemoteLoader in a trainer's place of a DataLoader (DESIGN.md, "Same data as DataLoader"),
the parts that need no server: the epoch cursor, the rank from the job's environment, and a
batch's exception raised as its own type with torch's message.

The tests that start a server, a process or Ray: tests/integration/test_dropin.py.
"""

from __future__ import annotations

import pickle
import sys

import pytest
from torch._utils import ExceptionWrapper

from remote_loader.client import DatasetError
from remote_loader.client.errors import dataset_error
from remote_loader.client.options import RankUnknown, membership
from remote_loader.client.state import Cursor
from remote_loader.protos import loader_pb2 as pb
from tests import dropin_datasets
from tests.helpers import WORKER_0

# --- 1. the epoch is the one the user or framework says ------------------------------------


def test_the_cursor_moves_only_when_an_epoch_is_taken() -> None:
    cursor = Cursor()
    assert (cursor.epoch, cursor.start) == (0, 0)
    assert cursor.take() == (0, 0, None) and cursor.epoch == 1
    cursor.set_epoch(5)
    cursor.set_epoch(5)  # again: nothing moves
    assert cursor.take()[:2] == (5, 0) and cursor.epoch == 6
    with pytest.raises(ValueError, match="non-negative integer"):
        cursor.set_epoch(-1)


# --- 2. the rank comes from the job ---------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, (0, 1)),
        ({"WORLD_SIZE": "1"}, (0, 1)),
        ({"RANK": "1", "WORLD_SIZE": "2"}, (1, 2)),
        # Lightning's DDP launcher on one node: LOCAL_RANK is the rank.
        ({"LOCAL_RANK": "1", "WORLD_SIZE": "2"}, (1, 2)),
        ({"LOCAL_RANK": "1", "WORLD_SIZE": "2", "NODE_RANK": "0"}, (1, 2)),
        ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}, (1, 2)),
        # Another node's local rank is not its rank: no guess.
        ({"LOCAL_RANK": "1", "WORLD_SIZE": "4", "NODE_RANK": "1"}, None),
        ({"LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, None),
        ({"WORLD_SIZE": "2"}, None),
    ],
)
def test_the_rank_from_the_environment(
    job_env: pytest.MonkeyPatch, env: dict[str, str], expected: tuple[int, int] | None
) -> None:
    for name, value in env.items():
        job_env.setenv(name, value)
    if expected is not None:
        assert membership(None, None) == expected
        return
    with pytest.raises(RankUnknown, match=r"Pass rank=\.\.\..*or set RANK") as info:
        membership(None, None)
    assert isinstance(info.value, ValueError)
    if "LOCAL_RANK" in env:
        assert "LOCAL_RANK=1 is the rank on this node" in str(info.value)
    # An explicit world of several ranks without a rank is no different.
    job_env.delenv("WORLD_SIZE")
    with pytest.raises(RankUnknown):
        membership(None, 3)


# --- 4. a batch's exception is raised as its own type ---------------------------------------


def _raised(kind: type[Exception]) -> Exception:
    """An instance of `kind` raised and caught here, as a dataset would raise it."""
    try:
        if kind is dropin_datasets.NeedsTwo:
            raise dropin_datasets.NeedsTwo("a.jpg", "unreadable")
        if kind is UnicodeDecodeError:
            b"\xff".decode()
        raise kind("sample 3 failed")
    except Exception as exc:
        return exc


def _by_torch(exc: Exception) -> Exception:
    """What torch's DataLoader raises in the trainer for a worker's `exc`."""
    wrapper = ExceptionWrapper((type(exc), exc, exc.__traceback__), where=WORKER_0)
    with pytest.raises(Exception) as info:
        wrapper.reraise()
    return info.value


def _frame_error(exc: Exception) -> pb.CapturedError:
    """The error Frame's CapturedError a server sends for `exc` (server/worker/loop.py)."""
    wrapper = ExceptionWrapper((type(exc), exc, exc.__traceback__), where=WORKER_0)
    kind = type(exc)
    return pb.CapturedError(
        where=WORKER_0,
        type=kind.__name__,
        message=str(exc),
        traceback=wrapper.exc_msg,
        module=kind.__module__,
        qualname=kind.__qualname__,
    )


@pytest.mark.parametrize(
    "kind",
    [
        ValueError,
        KeyError,
        IndexError,
        FileNotFoundError,
        UnicodeDecodeError,  # takes five arguments: RuntimeError, as torch
        dropin_datasets.Corrupt,
        dropin_datasets.NeedsTwo,
    ],
    ids=lambda kind: kind.__name__,
)
def test_an_error_is_raised_as_torch_raises_it(kind: type[Exception]) -> None:
    exc = _raised(kind)
    expected = _by_torch(exc)
    error = dataset_error(3, _frame_error(exc))
    assert isinstance(error, type(expected)) and isinstance(error, DatasetError)
    assert str(error) == str(expected)  # torch's message, KeyError's unquoted
    assert type(error).__name__ == type(expected).__name__
    assert (error.position, error.where, error.remote_type) == (3, WORKER_0, kind.__name__)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)
    assert again.position == 3


@pytest.mark.parametrize(
    ("module", "qualname"),
    [("", ""), ("no_such_module_here", "Error"), ("builtins", "NoSuchError"), ("os", "path")],
)
def test_an_error_of_a_type_not_found_here_is_a_plain_dataset_error(
    module: str, qualname: str
) -> None:
    sent = pb.CapturedError(
        where=WORKER_0, type="Error", message="m", traceback="t", module=module, qualname=qualname
    )
    error = dataset_error(3, sent)
    assert type(error) is DatasetError  # as before the type was sent
    assert str(error).startswith(f"Error at batch 3 {WORKER_0}.")
    assert "no_such_module_here" not in sys.modules


def test_a_stop_iteration_is_not_raised_as_one() -> None:
    # Raised from next(), it would end the training loop's `for` as if the epoch had ended.
    error = dataset_error(0, _frame_error(_raised(StopIteration)))
    assert isinstance(error, RuntimeError) and not isinstance(error, StopIteration)
