"""Writing a snapshot so that a crash leaves all of it or none of it.

Everything goes into a hidden directory beside the final one (``.tmp-<id>-<random>``), every
file and directory is fsynced, and only then is the directory renamed into place and the
parent fsynced. A reader (or the store at agent start) therefore sees either no snapshot or
a whole one; leftover ``.tmp-*`` directories are garbage the store removes. The manifest is
written last, from digests computed while the bytes were written (one pass).
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fleetshift_agent.snapshot import tensorfile
from fleetshift_agent.snapshot.errors import SnapshotExists
from fleetshift_agent.snapshot.fileio import HashingWriter, fsync_dir
from fleetshift_agent.snapshot.manifest import FileEntry, Manifest
from fleetshift_agent.snapshot.names import (
    MANIFEST,
    TMP_PREFIX,
    artifact_file,
    check_name,
    json_file,
    tensor_file,
)
from fleetshift_common.compat import CompatKey
from fleetshift_common.errors import InvalidArgument

SHARD_BYTES = 256 << 20


@dataclass(frozen=True)
class SnapshotInfo:
    snapshot_id: str
    path: Path
    size_bytes: int  # every file, manifest included
    created_at: float
    key: CompatKey


def _plan(group: str, tensors: Mapping[str, torch.Tensor]) -> tuple[bytes, list[tensorfile.Entry]]:
    try:
        return tensorfile.plan(tensors)
    except tensorfile.TensorFileError as exc:
        raise InvalidArgument(f"tensor group {group!r}: {exc.problem}", field=group) from None


def _shards(
    group: str, tensors: Mapping[str, torch.Tensor], shard_bytes: int
) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """Pack whole tensors, in name order, into shards of at most ``shard_bytes`` (a tensor
    larger than that gets a shard of its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    filled = 0
    for name in sorted(tensors):
        t = tensors[name]
        size = t.numel() * t.element_size()
        if shards[-1] and filled + size > shard_bytes:
            shards.append({})
            filled = 0
        shards[-1][name] = t
        filled += size
    n = len(shards)
    return [(tensor_file(group, i + 1, n), shard) for i, shard in enumerate(shards)]


def _json_bytes(what: str, value: Any) -> bytes:
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{what} is not JSON-serialisable: {exc}", field=what) from None


def write_snapshot(
    root: Path,
    snapshot_id: str,
    *,
    key: CompatKey,
    spec: Mapping[str, Any],
    tensor_groups: Mapping[str, Mapping[str, torch.Tensor]],
    json_parts: Mapping[str, Any],
    artifacts: Mapping[str, bytes] | None = None,
    clock: Callable[[], float] = time.time,
    shard_bytes: int = SHARD_BYTES,
) -> SnapshotInfo:
    """Write a snapshot atomically as ``root/snapshot_id``; refuses to replace one.

    A tensor group larger than ``shard_bytes`` is split into several safetensors files
    (whole tensors each) so that restore can verify them on several cores at once.
    """
    check_name("snapshot id", snapshot_id)
    spec_doc = json.loads(_json_bytes("spec", dict(spec)))
    blobs: dict[str, bytes] = {
        json_file(p): _json_bytes(f"json part {p!r}", v) for p, v in json_parts.items()
    }
    for name, data in (artifacts or {}).items():
        blobs[artifact_file(name)] = bytes(data) if not isinstance(data, bytes) else data
    plans = {
        name: (shard, *_plan(group, shard))
        for group, tensors in tensor_groups.items()
        for name, shard in _shards(group, tensors, shard_bytes)
    }
    root = Path(root)
    final = root / snapshot_id
    if final.exists():
        raise SnapshotExists(snapshot_id)
    tmp = root / f"{TMP_PREFIX}{snapshot_id}-{secrets.token_hex(6)}"
    tmp.mkdir()
    try:
        files = _write_files(tmp, plans, blobs)
        manifest = Manifest(snapshot_id, clock(), key, spec_doc, files)
        _write_manifest(tmp, manifest)
        _publish(tmp, final, snapshot_id)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = manifest.data_bytes + (final / MANIFEST).stat().st_size
    return SnapshotInfo(snapshot_id, final, size, manifest.created_at, key)


def _write_files(
    tmp: Path,
    plans: Mapping[str, tuple[Mapping[str, torch.Tensor], bytes, list[tensorfile.Entry]]],
    blobs: Mapping[str, bytes],
) -> dict[str, FileEntry]:
    files: dict[str, FileEntry] = {}
    dirs = {name.partition("/")[0] for name in [*plans, *blobs]}
    for d in sorted(dirs):
        (tmp / d).mkdir()
    with ThreadPoolExecutor(1, thread_name_prefix="snapshot-hash") as pool:
        for name, (tensors, header, entries) in plans.items():
            writer = HashingWriter(tmp / name, pool)
            try:
                writer.write(header)
                for entry in entries:
                    for view in tensorfile.tensor_bytes(tensors[entry.name]):
                        writer.write(view)
            except BaseException:
                writer.abort()
                raise
            files[name] = FileEntry(*writer.close())
        for name, data in blobs.items():
            writer = HashingWriter(tmp / name, pool)
            writer.write(data)
            files[name] = FileEntry(*writer.close())
    for d in sorted(dirs):
        fsync_dir(tmp / d)
    return files


def _write_manifest(tmp: Path, manifest: Manifest) -> None:
    fd = os.open(tmp / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        data = memoryview(manifest.to_bytes())
        while data:
            data = data[os.write(fd, data) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(tmp)


def _publish(tmp: Path, final: Path, snapshot_id: str) -> None:
    """Rename the finished directory into place (never over an existing one), fsync parent."""
    if final.exists():
        raise SnapshotExists(snapshot_id)
    try:
        os.rename(tmp, final)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise SnapshotExists(snapshot_id) from None
        raise
    fsync_dir(final.parent)
