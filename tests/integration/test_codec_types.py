"""Batch types as torch's DataLoader keeps them (NOTE [ Batch types ] in protos/batch_types.py): a
namedtuple, a dataclass or a Mapping subclass comes back as its class where the client can import
it, else as a stand-in with a warning; headers without a type decode as before.

The unit tests (no server, no process, no Ray): tests/unit/test_codec_types.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence
from torch.utils.data import DataLoader

from remote_loader.client import RemoteLoader
from remote_loader.protos import codec
from remote_loader.server.config.spec import LoaderSpec
from tests.datasets import Pair, Pairs
from tests.helpers import ServeLoaders, packed
from tests.helpers import assert_same as assert_same_batches

# Type lookups and warnings as in a fresh process, so each test sees its own warnings.
pytestmark = pytest.mark.usefixtures("fresh_types")


@pytest.mark.gpu
def test_a_packed_sequence_decoded_onto_cuda_unpacks_there() -> None:
    # `pytest -m gpu` only: without CUDA this fails rather than skip.
    sequence, padded, lengths = packed(enforce_sorted=False)
    encoded = codec.encode(sequence)
    blob = torch.zeros(encoded.total_nbytes, dtype=torch.uint8).pin_memory()
    encoded.write_blob(blob)
    payload = blob[codec.payload_offset(len(encoded.header)) :]
    got = codec.decode(encoded.header, payload, payload.to("cuda"))
    assert type(got) is PackedSequence
    assert got.data.device.type == "cuda" and got.batch_sizes.device.type == "cpu"
    unpacked, got_lengths = pad_packed_sequence(got, batch_first=True)
    assert torch.equal(unpacked.cpu(), padded)
    assert torch.equal(got_lengths, lengths)


# --- through a server -------------------------------------------------------------------------


def test_a_remote_loader_delivers_namedtuple_batches_as_torch_does(
    serve_loaders: ServeLoaders,
) -> None:
    spec = LoaderSpec(name="pairs", dataset="tests.datasets:Pairs", batch_size=4, num_workers=2)
    with RemoteLoader(serve_loaders(spec).address) as loader:
        remote = list(loader)
    local = list(DataLoader(Pairs(), batch_size=4))
    assert [type(batch) for batch in remote] == [Pair] * 3
    assert_same_batches(remote, local)
