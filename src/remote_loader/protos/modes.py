"""The modes a stream's request names on the wire (Consumer.sharing, StreamRequest.compression),
as Literal aliases: the client's types module (client/types.py) and the server's
(server/config/types.py) both take them from here, so the two sides spell them alike."""

from __future__ import annotations

from typing import Literal, get_args

# How a job's consumers share an epoch: one policy each on the server (server/sharing/policies.py).
Sharing = Literal["partition", "broadcast", "dynamic"]
SHARING_MODES: tuple[Sharing, ...] = get_args(Sharing)

# What a consumer asks its batches' tensors to be compressed with (NOTE [ Compression ] in
# protos/compression.py); "none": not compressed.
Compression = Literal["none", "lz4", "zstd"]
