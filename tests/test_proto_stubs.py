"""The committed gRPC stubs are exactly what scripts/protogen.py makes from the .proto files."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "protogen.py"), str(REPO / "proto"), str(tmp_path)],
        check=True,
    )
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2*.py*"))
    assert fresh, "protoc generated nothing"
    committed = REPO / "proto"
    stale = [p for p in fresh if (committed / p).read_bytes() != (tmp_path / p).read_bytes()]
    assert not stale, f"stale stubs (run scripts/gen-proto): {stale}"
    stubs = committed.rglob("*_pb2*.py*")  # a checkout that ran Python holds __pycache__: not stubs
    extra = {p.relative_to(committed) for p in stubs if "__pycache__" not in p.parts} - set(fresh)
    assert not extra, f"stubs without a .proto: {extra}"


def test_dependency_floors_cover_what_the_stubs_check() -> None:
    """pyproject's floors must be at least the versions the generated code demands."""
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {d.split(">=")[0]: d.split(">=")[1] for d in deps if ">=" in d}
    grpc_stub = (REPO / "proto/fleetshift/v1/fleet_pb2_grpc.py").read_text()
    generated_grpc = grpc_stub.split("GRPC_GENERATED_VERSION = '")[1].split("'")[0]
    assert _v(floors["grpcio"]) >= _v(generated_grpc)
    pb_stub = (REPO / "proto/fleetshift/v1/fleet_pb2.py").read_text()
    generated_pb = pb_stub.split("# Protobuf Python Version: ")[1].split()[0]
    assert _v(floors["protobuf"]) >= _v(generated_pb)
    assert importlib.util.find_spec("fleetshift.v1.fleet_pb2") is not None


def _v(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(".")[:3])
