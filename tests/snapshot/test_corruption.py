"""Every way a snapshot on disk can be wrong is refused, naming the file and the problem."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fleetshift_agent.snapshot import (
    SnapshotCorrupt,
    SnapshotInfo,
    UnsafeTensorFile,
    open_snapshot,
)

WEIGHTS = "tensors/weights.safetensors"


def edit_manifest(snap: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    doc = json.loads((snap / "manifest.json").read_text())
    edit(doc)
    (snap / "manifest.json").write_text(json.dumps(doc))


def replace_consistently(snap: Path, name: str, data: bytes) -> None:
    """Replace a file AND its manifest entry, as an attacker controlling both would."""
    (snap / name).write_bytes(data)

    def edit(doc: dict[str, Any]) -> None:
        doc["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    edit_manifest(snap, edit)


def refused(snap: Path, file: str, words: str, kind: type[SnapshotCorrupt] = SnapshotCorrupt):
    with pytest.raises(kind) as exc_info:
        open_snapshot(snap).verify()
    assert exc_info.value.file == file
    assert words in exc_info.value.problem
    assert file in str(exc_info.value)
    return exc_info.value


@pytest.fixture
def snap(write_sample) -> Path:
    info: SnapshotInfo = write_sample()
    open_snapshot(info.path).verify()
    return info.path


def test_missing_file(snap: Path) -> None:
    (snap / "json" / "queue.json").unlink()
    refused(snap, "json/queue.json", "missing")


def test_extra_file_in_a_part_directory(snap: Path) -> None:
    (snap / "artifacts" / "dropped.bin").write_bytes(b"x")
    refused(snap, "artifacts/dropped.bin", "extra file")


def test_extra_file_at_top_level(snap: Path) -> None:
    (snap / "run.sh").write_text("rm -rf /")
    refused(snap, "run.sh", "extra file")


def test_symlink_is_refused(snap: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes((snap / "artifacts" / "compile_cache.bin").read_bytes())
    (snap / "artifacts" / "compile_cache.bin").unlink()
    (snap / "artifacts" / "compile_cache.bin").symlink_to(outside)
    refused(snap, "artifacts/compile_cache.bin", "symbolic link")


def test_truncated_file(snap: Path) -> None:
    size = (snap / WEIGHTS).stat().st_size
    os.truncate(snap / WEIGHTS, size - 100)
    refused(snap, WEIGHTS, "truncated")
    for copy in (False, True):
        with pytest.raises(SnapshotCorrupt, match="truncated"):
            open_snapshot(snap).load_tensors("weights", copy=copy)


def test_flipped_byte_is_caught_by_verify_and_by_load(snap: Path) -> None:
    data = bytearray((snap / WEIGHTS).read_bytes())
    data[len(data) - 7] ^= 0x01
    (snap / WEIGHTS).write_bytes(data)
    refused(snap, WEIGHTS, "SHA-256 mismatch")
    for copy in (False, True):
        with pytest.raises(SnapshotCorrupt, match="SHA-256 mismatch") as exc_info:
            open_snapshot(snap).load_tensors("weights", copy=copy)
        assert exc_info.value.file == WEIGHTS


def test_flipped_byte_in_json_part(snap: Path) -> None:
    path = snap / "json" / "sessions.json"
    path.write_bytes(path.read_bytes().replace(b"s1", b"s9"))
    with pytest.raises(SnapshotCorrupt, match="SHA-256 mismatch"):
        open_snapshot(snap).load_json("sessions")


def test_manifest_lying_about_a_size(snap: Path) -> None:
    def lie(doc: dict[str, Any]) -> None:
        doc["files"]["artifacts/compile_cache.bin"]["size"] += 1

    edit_manifest(snap, lie)
    refused(snap, "artifacts/compile_cache.bin", "manifest says")


def test_manifest_not_json(snap: Path) -> None:
    (snap / "manifest.json").write_text('{"format": "fleetshift.snapshot", ')
    with pytest.raises(SnapshotCorrupt, match="not valid JSON") as exc_info:
        open_snapshot(snap)
    assert exc_info.value.file == "manifest.json"


def test_manifest_missing(snap: Path) -> None:
    (snap / "manifest.json").unlink()
    with pytest.raises(SnapshotCorrupt, match="missing") as exc_info:
        open_snapshot(snap)
    assert exc_info.value.file == "manifest.json"


@pytest.mark.parametrize("field", ["key", "files", "snapshot_id", "created_at"])
def test_manifest_missing_a_field(snap: Path, field: str) -> None:
    edit_manifest(snap, lambda doc: doc.pop(field))
    with pytest.raises(SnapshotCorrupt, match=f"misses field.*{field}") as exc_info:
        open_snapshot(snap)
    assert exc_info.value.file == "manifest.json"


def test_manifest_key_missing_a_field(snap: Path) -> None:
    edit_manifest(snap, lambda doc: doc["key"].pop("driver_version"))
    with pytest.raises(SnapshotCorrupt, match="driver_version"):
        open_snapshot(snap)


def test_manifest_with_bad_digest_format(snap: Path) -> None:
    edit_manifest(snap, lambda doc: doc["files"][WEIGHTS].update(sha256="xyz"))
    with pytest.raises(SnapshotCorrupt, match="sha256 must be 64"):
        open_snapshot(snap)


@pytest.mark.parametrize(
    "name", ["../x", "tensors/../../x.safetensors", "/etc/passwd", "json/../manifest.json"]
)
def test_path_traversal_in_manifest(snap: Path, tmp_path: Path, name: str) -> None:
    (tmp_path / "x").write_bytes(b"secret")

    def add(doc: dict[str, Any]) -> None:
        doc["files"][name] = {"size": 6, "sha256": hashlib.sha256(b"secret").hexdigest()}

    edit_manifest(snap, add)
    with pytest.raises(SnapshotCorrupt, match="inadmissible file name") as exc_info:
        open_snapshot(snap)
    assert exc_info.value.file == name


class _Payload:
    """Unpickling this would create the marker file (open(marker, 'w'))."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def test_pickled_torch_file_renamed_safetensors_is_refused_and_never_run(
    snap: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "PWNED"
    buf = io.BytesIO()
    torch.save({"embed": _Payload(marker)}, buf)  # a zip archive holding a pickle
    replace_consistently(snap, WEIGHTS, buf.getvalue())
    err = refused(snap, WEIGHTS, "zip archive", UnsafeTensorFile)
    assert "refused without deserialising" in err.problem
    with pytest.raises(UnsafeTensorFile, match="zip archive"):
        open_snapshot(snap).load_tensors("weights")
    assert not marker.exists()


def test_raw_pickle_renamed_safetensors_is_refused_and_never_run(
    snap: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "PWNED"
    replace_consistently(snap, WEIGHTS, pickle.dumps(_Payload(marker), protocol=4))
    refused(snap, WEIGHTS, "pickle stream", UnsafeTensorFile)
    with pytest.raises(UnsafeTensorFile):
        open_snapshot(snap).load_tensors("weights")
    assert not marker.exists()


def _safetensors(header: dict[str, Any], data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data


@pytest.mark.parametrize(
    ("header", "data", "words"),
    [
        (
            {
                "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
            },
            bytes(24),
            "overlaps",
        ),
        (
            {"a": {"dtype": "F32", "shape": [1024], "data_offsets": [0, 4096]}},
            bytes(16),
            "beyond",
        ),
        (
            {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}},
            bytes(8),
            "do not hold",
        ),
        (
            {"a": {"dtype": "PICKLE", "shape": [4], "data_offsets": [0, 16]}},
            bytes(16),
            "unknown dtype",
        ),
        (
            {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
            bytes(64),
            "trailing bytes",
        ),
    ],
)
def test_lying_safetensors_header_is_refused(
    snap: Path, header: dict[str, Any], data: bytes, words: str
) -> None:
    replace_consistently(snap, WEIGHTS, _safetensors(header, data))
    refused(snap, WEIGHTS, words, UnsafeTensorFile)
    for copy in (False, True):
        with pytest.raises(UnsafeTensorFile, match=words):
            open_snapshot(snap).load_tensors("weights", copy=copy)


def test_absurd_header_length_is_refused(snap: Path) -> None:
    replace_consistently(snap, WEIGHTS, (1 << 62).to_bytes(8, "little") + b"{}" + bytes(30))
    refused(snap, WEIGHTS, "absurd header length", UnsafeTensorFile)
    with pytest.raises(UnsafeTensorFile, match="absurd header length"):
        open_snapshot(snap).load_tensors("weights")


def test_manifest_dropping_a_shard_is_refused(write_sample) -> None:
    snap = write_sample(shard_bytes=1500).path
    shards = sorted(
        n
        for n in json.loads((snap / "manifest.json").read_text())["files"]
        if n.startswith("tensors/kv@")
    )
    assert len(shards) >= 3
    (snap / shards[1]).unlink()
    edit_manifest(snap, lambda doc: doc["files"].pop(shards[1]))
    with pytest.raises(SnapshotCorrupt, match=r"tensor group 'kv'.*shards") as exc_info:
        open_snapshot(snap)
    assert exc_info.value.file == "manifest.json"


def test_file_changed_after_verify_is_caught_by_load(snap: Path) -> None:
    opened = open_snapshot(snap)
    opened.verify()
    assert set(opened.load_tensors("weights")) == {
        "embed",
        "layers.0.attn.q",
        "layers.0.mlp.up",
        "norm",
        "scale",
    }
    time.sleep(0.02)  # past the filesystem's timestamp granularity
    with open(snap / WEIGHTS, "r+b") as f:  # rewritten in place, same size
        f.seek(-5, os.SEEK_END)
        byte = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(SnapshotCorrupt, match="SHA-256 mismatch"):
        opened.load_tensors("weights")
