"""Regenerates the message stubs in this folder from loader.proto.

Run `python -m remote_loader.protos.generate` (needs the `test` extra for grpcio-tools).
tests/unit/test_protos.py runs the same generation into a temporary folder and fails on any
difference.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO = "loader.proto"
# No grpc_python stubs: the server registers generic handlers and the client calls methods by
# name (wire.STREAM_METHOD), since frames travel pre-serialized (see wire.py).
OUTPUTS = ("loader_pb2.py", "loader_pb2.pyi")


def generate(out_dir: Path, proto_dir: Path = HERE) -> None:
    """Writes the stubs for proto_dir/loader.proto into out_dir."""
    from grpc_tools import protoc  # the test extra; imported here so the package never needs it

    include = str(Path(protoc.__file__).resolve().parent / "_proto")
    args = [
        "grpc_tools.protoc",
        f"-I{proto_dir}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        str(proto_dir / PROTO),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {proto_dir / PROTO}")


def stale_outputs(proto_dir: Path = HERE) -> list[str]:
    """The stubs in proto_dir that differ from a fresh generation from its loader.proto."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp), proto_dir)
        return [
            name
            for name in OUTPUTS
            if not (proto_dir / name).exists()
            or (Path(tmp) / name).read_text() != (proto_dir / name).read_text()
        ]


def main() -> int:
    # Run from a checkout (python protos/generate.py), this writes into the checkout's protos/.
    generate(HERE)
    print(f"generated {', '.join(OUTPUTS)} in {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
