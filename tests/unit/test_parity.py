"""collate_tensors keeps torch's own errors for batches it cannot collate.

The tests that start a server, a process or Ray: tests/integration/test_parity.py.
"""

from __future__ import annotations

import pytest
import torch

from remote_loader.server.worker.collating import collate_tensors
from tests.helpers import assert_same


def test_collate_tensors_keeps_torchs_errors() -> None:
    sparse = torch.eye(2).to_sparse()
    with pytest.raises(RuntimeError, match="sparse tensors are not currently supported"):
        collate_tensors([sparse, sparse])
    pair = [torch.arange(3), torch.arange(3) + 3]
    assert_same(collate_tensors(pair), torch.stack(pair))
