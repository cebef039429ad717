"""The manifest: the one file that says what a snapshot is and what its bytes must be.

It is JSON (never pickle) and it is parsed as hostile input: every field is type-checked and
every file name must be one flat, admissible name, so a manifest from another machine cannot
point outside its snapshot or lie its way past verification with a malformed entry.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from fleetshift_agent.snapshot.errors import SnapshotCorrupt
from fleetshift_agent.snapshot.names import (
    MANIFEST,
    is_safe_name,
    parse_tensor_stem,
    split_file_name,
)
from fleetshift_common.compat import CompatKey
from fleetshift_common.errors import InvalidArgument

FORMAT = "fleetshift.snapshot"
FORMAT_VERSION = 1
MAX_MANIFEST_BYTES = 64 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")
_FIELDS = ("format", "format_version", "snapshot_id", "created_at", "key", "spec", "files")


class FileEntry(NamedTuple):
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    snapshot_id: str
    created_at: float  # seconds since the epoch (UTC)
    key: CompatKey
    spec: dict[str, Any]
    files: dict[str, FileEntry]
    format_version: int = FORMAT_VERSION

    @property
    def data_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def names(self, kind: str) -> list[str]:
        """Names of the parts of one kind ('tensors', 'json', 'artifacts'), sorted."""
        out = set()
        for path in self.files:
            split = split_file_name(path)
            if split and split[0] == kind:
                out.add(split[1])
        return sorted(out)

    def tensor_files(self, group: str) -> list[str]:
        """The files holding a tensor group, in shard order (checked to be complete)."""
        found: dict[int, tuple[str, int]] = {}
        for path in self.files:
            if not path.startswith("tensors/"):
                continue
            parsed = parse_tensor_stem(path[len("tensors/") : -len(".safetensors")])
            if parsed and parsed[0] == group:
                found[parsed[1]] = (path, parsed[2])
        counts = {count for _, count in found.values()}
        if found and (len(counts) != 1 or sorted(found) != list(range(1, counts.pop() + 1))):
            raise _bad(
                self.snapshot_id,
                f"tensor group {group!r} has an inconsistent set of shards: {sorted(found)}",
            )
        return [found[i][0] for i in sorted(found)]

    def to_bytes(self) -> bytes:
        doc = {
            "format": FORMAT,
            "format_version": self.format_version,
            "snapshot_id": self.snapshot_id,
            "created_at": self.created_at,
            "key": self.key.to_json(),
            "spec": self.spec,
            "files": {
                name: {"size": e.size, "sha256": e.sha256} for name, e in sorted(self.files.items())
            },
        }
        return json.dumps(doc, indent=1, sort_keys=False, allow_nan=False).encode() + b"\n"


def _bad(snapshot: str, problem: str) -> SnapshotCorrupt:
    return SnapshotCorrupt(snapshot, MANIFEST, problem)


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """Parse and validate manifest bytes; ``where`` names the snapshot in errors."""
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(where, f"not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise _bad(where, "not a JSON object")
    missing = [f for f in _FIELDS if f not in doc]
    if missing:
        raise _bad(where, f"misses field(s): {', '.join(missing)}")
    if doc["format"] != FORMAT:
        raise _bad(where, f"format is {doc['format']!r}, expected {FORMAT!r}")
    if doc["format_version"] != FORMAT_VERSION:
        raise _bad(where, f"unsupported format_version {doc['format_version']!r}")
    sid = doc["snapshot_id"]
    if not isinstance(sid, str) or not is_safe_name(sid):
        raise _bad(where, f"invalid snapshot_id {sid!r}")
    created = doc["created_at"]
    if not isinstance(created, int | float) or isinstance(created, bool):
        raise _bad(where, f"created_at must be a number, got {created!r}")
    try:
        key = CompatKey.from_json(doc["key"])
    except InvalidArgument as exc:
        raise _bad(where, f"key: {exc}") from None
    if not isinstance(doc["spec"], dict):
        raise _bad(where, "spec must be a JSON object")
    manifest = Manifest(
        snapshot_id=sid,
        created_at=float(created),
        key=key,
        spec=doc["spec"],
        files=_parse_files(doc["files"], where),
        format_version=FORMAT_VERSION,
    )
    for group in manifest.names("tensors"):
        manifest.tensor_files(group)  # raises on an incomplete or mixed set of shards
    return manifest


def _parse_files(files: object, where: str) -> dict[str, FileEntry]:
    if not isinstance(files, dict):
        raise _bad(where, "files must be a JSON object")
    out: dict[str, FileEntry] = {}
    for name, entry in files.items():
        if split_file_name(name) is None:
            raise SnapshotCorrupt(
                where,
                name,
                "inadmissible file name in the manifest (path traversal or unknown kind)",
            )
        if not isinstance(entry, dict) or set(entry) != {"size", "sha256"}:
            raise _bad(where, f"entry for {name!r} must have exactly size and sha256")
        size, sha = entry["size"], entry["sha256"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise _bad(where, f"entry for {name!r}: size must be a non-negative integer")
        if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise _bad(where, f"entry for {name!r}: sha256 must be 64 lowercase hex digits")
        out[name] = FileEntry(size, sha)
    return out
