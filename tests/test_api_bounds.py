"""The bounds table covers every number of every request, and the docs list every bound."""

from __future__ import annotations

from pathlib import Path

from google.protobuf.descriptor import Descriptor

from fleetshift.v1 import (
    agent_pb2,
    fleet_pb2,
    operations_pb2,
    placement_pb2,
    snapshot_pb2,
    worker_pb2,
)
from fleetshift_common.bounds import BOUNDS, MAX_REPEATED
from fleetshift_rpc.validation import is_bounded_number

MODULES = (agent_pb2, fleet_pb2, operations_pb2, placement_pb2, snapshot_pb2, worker_pb2)
DOC = Path(__file__).resolve().parents[1] / "docs" / "api-bounds.md"


def request_messages() -> dict[str, Descriptor]:
    """Every message a caller can send, nested ones included."""
    found: dict[str, Descriptor] = {}

    def walk(d: Descriptor) -> None:
        if d.full_name in found or d.full_name.startswith("google."):
            return
        found[d.full_name] = d
        for f in d.fields:
            if f.message_type is not None:
                walk(f.message_type)

    for module in MODULES:
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                walk(method.input_type)
    return found


def test_every_number_a_caller_sends_has_a_bound() -> None:
    missing = [
        f.full_name
        for d in request_messages().values()
        for f in d.fields
        if is_bounded_number(f) and f.full_name not in BOUNDS
    ]
    assert missing == []


def test_every_bound_names_a_real_request_field() -> None:
    fields = {f.full_name for d in request_messages().values() for f in d.fields}
    assert sorted(set(BOUNDS) - fields) == [] and sorted(set(MAX_REPEATED) - fields) == []


def test_docs_list_every_bound() -> None:
    text = DOC.read_text()
    absent = [name for name in BOUNDS if f"`{name.removeprefix('fleetshift.v1.')}`" not in text]
    assert absent == []
