"""Generate the Python gRPC stubs for proto/fleetshift/v1/*.proto.

The stubs are committed so that an install needs no code generator; this script is the one way
they are made, and the test suite runs it into a temporary folder to prove they are current.
"""

from __future__ import annotations

import sys
from importlib.resources import files
from pathlib import Path

from grpc_tools import protoc


def generate(proto_root: Path, out_dir: Path) -> None:
    sources = sorted(p.relative_to(proto_root) for p in proto_root.glob("fleetshift/v1/*.proto"))
    include = str(files("grpc_tools").joinpath("_proto"))
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{proto_root}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(s) for s in sources],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "proto")
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else root
    generate(root, out)
