"""Reading a snapshot: verify every byte before anything reaches a running worker.

``verify`` checks the directory against its manifest (missing, extra, truncated, altered
files, symlinks, unsafe tensor headers). The loaders check the SHA-256 of exactly the bytes
they hand out before a single tensor is built. By default a tensor file is mapped
copy-on-write and hashed through the mapping: no private copy of the model, no page zeroing,
and a GPU restore copies straight from the page cache. The mapped bytes stay the verified ones
because snapshot files are never rewritten or truncated (every write is a new file; deletion
unlinks, which leaves mappings intact). ``copy=True`` reads into private memory while hashing
instead, for callers that want no dependency on the files at all after loading.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from fleetshift_agent.snapshot import tensorfile
from fleetshift_agent.snapshot.errors import (
    SnapshotCorrupt,
    SnapshotIncompatible,
    SnapshotNotFound,
    SnapshotPartNotFound,
    UnsafeTensorFile,
)
from fleetshift_agent.snapshot.fileio import (
    FileProblem,
    Identity,
    hash_verified,
    map_verified,
    read_small_verified,
    read_verified,
)
from fleetshift_agent.snapshot.manifest import (
    MAX_MANIFEST_BYTES,
    FileEntry,
    Manifest,
    parse_manifest,
)
from fleetshift_agent.snapshot.names import (
    KINDS,
    MANIFEST,
    artifact_file,
    check_name,
    json_file,
)
from fleetshift_common.compat import CompatKey, CompatVerdict, compare

MAX_PARALLEL_FILES = 8
T = TypeVar("T")


def open_snapshot(path: Path) -> Snapshot:
    """Open a snapshot directory and parse its manifest (no data is read yet)."""
    path = Path(path)
    where = path.name
    if not path.is_dir():
        raise SnapshotNotFound(where, f"no directory at {path}")
    try:
        fd = os.open(path / MANIFEST, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise SnapshotCorrupt(where, MANIFEST, "missing") from None
    except OSError as exc:
        raise SnapshotCorrupt(where, MANIFEST, f"cannot be opened: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise SnapshotCorrupt(where, MANIFEST, f"larger than {MAX_MANIFEST_BYTES} bytes")
    return Snapshot(path, parse_manifest(raw, where))


class Snapshot:
    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest
        # files whose digest this object checked, by identity: a mapped load of an unchanged
        # file after verify() does not hash it a second time
        self._verified: dict[str, Identity] = {}

    @property
    def snapshot_id(self) -> str:
        return self.manifest.snapshot_id

    @property
    def key(self) -> CompatKey:
        return self.manifest.key

    @property
    def tensor_groups(self) -> list[str]:
        return self.manifest.names("tensors")

    @property
    def json_parts(self) -> list[str]:
        return self.manifest.names("json")

    @property
    def artifacts(self) -> list[str]:
        return self.manifest.names("artifacts")

    def _corrupt(self, file: str, problem: str) -> SnapshotCorrupt:
        return SnapshotCorrupt(self.snapshot_id, file, problem)

    # -- verification -----------------------------------------------------------------------

    def verify(self) -> None:
        """Check every file's presence, size and SHA-256, and every tensor header.

        Raises SnapshotCorrupt naming the first file found wrong; cheap checks (structure,
        sizes) all run before any file is hashed.
        """
        self._check_structure()
        _parallel(self._verify_file, sorted(self.manifest.files))

    def _verify_file(self, name: str) -> None:
        entry = self.manifest.files[name]
        self._verified.pop(name, None)
        try:
            identity = hash_verified(self.path / name, entry.size, entry.sha256)
        except FileProblem as exc:
            raise self._corrupt(name, exc.problem) from None
        if name.startswith("tensors/"):
            self._check_tensor_header(name, entry)
        self._verified[name] = identity

    def check_listing(self) -> None:
        """Refuse a directory that holds anything the manifest does not list (an added
        ``tensors/evil.py``), a link, a missing file or a size that differs: cheap (no file is
        hashed), so every restore runs it before reading a byte; the loaders then check the
        SHA-256 of what they read."""
        self._check_structure()

    def _check_structure(self) -> None:
        listed = self.manifest.files
        for entry in sorted(os.scandir(self.path), key=lambda e: e.name):
            if entry.is_symlink():
                raise self._corrupt(entry.name, "is a symbolic link; snapshots hold plain files")
            if entry.name == MANIFEST:
                continue
            if not entry.is_dir() or entry.name not in KINDS:
                raise self._corrupt(entry.name, "extra file not listed in the manifest")
            for sub in sorted(os.scandir(entry.path), key=lambda e: e.name):
                rel = f"{entry.name}/{sub.name}"
                if sub.is_symlink():
                    raise self._corrupt(rel, "is a symbolic link; snapshots hold plain files")
                if rel not in listed:
                    raise self._corrupt(rel, "extra file not listed in the manifest")
        for name, fe in sorted(listed.items()):
            try:
                st = os.lstat(self.path / name)
            except FileNotFoundError:
                raise self._corrupt(name, "missing: listed in the manifest but absent") from None
            if not os.path.isfile(self.path / name):
                raise self._corrupt(name, "is not a regular file")
            if st.st_size != fe.size:
                kind = "truncated" if st.st_size < fe.size else "size mismatch"
                raise self._corrupt(
                    name, f"{kind}: {st.st_size} bytes on disk, manifest says {fe.size}"
                )

    def _check_tensor_header(self, name: str, entry: FileEntry) -> None:
        with open(self.path / name, "rb") as f:
            head = f.read(8)
            if len(head) == 8 and int.from_bytes(head, "little") <= tensorfile.MAX_HEADER:
                head += f.read(int.from_bytes(head, "little"))
        try:
            tensorfile.parse_header(head, entry.size)
        except tensorfile.TensorFileError as exc:
            raise UnsafeTensorFile(self.snapshot_id, name, exc.problem) from None

    # -- compatibility ----------------------------------------------------------------------

    def check_compat(self, destination: CompatKey) -> CompatVerdict:
        return compare(self.manifest.key, destination)

    def require_warm(self, destination: CompatKey) -> CompatVerdict:
        """The verdict if a warm restore is allowed; SnapshotIncompatible naming every field."""
        verdict = self.check_compat(destination)
        if not verdict.warm_ok:
            raise SnapshotIncompatible(self.snapshot_id, verdict)
        return verdict

    # -- loading ----------------------------------------------------------------------------

    def _entry(self, name: str, part: str) -> FileEntry:
        entry = self.manifest.files.get(name)
        if entry is None:
            raise SnapshotPartNotFound(self.snapshot_id, part)
        return entry

    def load_tensors(
        self, group: str, device: str = "cpu", *, copy: bool = False
    ) -> dict[str, torch.Tensor]:
        """The group's tensors, from bytes whose SHA-256 was checked before any tensor exists.

        Shards are hashed in parallel. By default each shard file is mapped copy-on-write and
        hashed through the mapping: CPU tensors are views of the page cache (pages written
        to are copied privately, the file never changes) and moving them to a GPU copies
        straight from it, so restore holds no second copy of the model. ``copy=True`` reads
        each shard into private memory instead (hashing while reading), for callers that
        need the tensors to stay valid whatever later happens to the files.
        """
        names = self.manifest.tensor_files(check_name("tensor group", group))
        if not names:
            raise SnapshotPartNotFound(self.snapshot_id, f"tensor group {group!r}")
        out: dict[str, torch.Tensor] = {}
        loader = self._read_file if copy else self._map_file
        for name, tensors in zip(names, _parallel(loader, names), strict=True):
            clash = out.keys() & tensors.keys()
            if clash:
                raise self._corrupt(name, f"repeats tensor(s) of another shard: {sorted(clash)}")
            out.update(tensors)
        return {k: v if device == "cpu" else v.to(device) for k, v in out.items()}

    def _read_file(self, name: str) -> dict[str, torch.Tensor]:
        entry = self.manifest.files[name]
        buffer = np.empty(entry.size, dtype=np.uint8)
        try:
            read_verified(self.path / name, entry.size, entry.sha256, memoryview(buffer))
        except FileProblem as exc:
            raise self._corrupt(name, exc.problem) from None
        return self._tensors_of(name, buffer)

    def _map_file(self, name: str) -> dict[str, torch.Tensor]:
        entry = self.manifest.files[name]
        try:
            buffer, self._verified[name] = map_verified(
                self.path / name, entry.size, entry.sha256, self._verified.get(name)
            )
        except FileProblem as exc:
            raise self._corrupt(name, exc.problem) from None
        return self._tensors_of(name, buffer)

    def _tensors_of(self, name: str, buffer: np.ndarray) -> dict[str, torch.Tensor]:
        entry = self.manifest.files[name]
        try:
            start, entries = tensorfile.parse_header(_head(buffer), entry.size)
        except tensorfile.TensorFileError as exc:
            raise UnsafeTensorFile(self.snapshot_id, name, exc.problem) from None
        return tensorfile.build_tensors(buffer, start, entries, "cpu")

    def load_json(self, part: str) -> Any:
        name = json_file(part)
        data = self._read_small(name, f"json part {part!r}")
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise self._corrupt(name, f"not valid JSON: {exc}") from None

    def load_artifact(self, name: str) -> bytes:
        return self._read_small(artifact_file(name), f"artifact {name!r}")

    def _read_small(self, name: str, part: str) -> bytes:
        entry = self._entry(name, part)
        try:
            return read_small_verified(self.path / name, entry.size, entry.sha256)
        except FileProblem as exc:
            raise self._corrupt(name, exc.problem) from None


def _parallel(work: Callable[[str], T], names: list[str]) -> list[T]:
    """``work`` on every file, several at once (SHA-256 is one core per file); the first
    failure in file order is raised."""
    workers = min(len(names), os.cpu_count() or 1, MAX_PARALLEL_FILES)
    if workers <= 1:
        return [work(n) for n in names]
    with ThreadPoolExecutor(workers, thread_name_prefix="snapshot-verify") as pool:
        futures = [pool.submit(work, n) for n in names]
        return [f.result() for f in futures]


def _head(buffer: np.ndarray) -> bytes:
    n = int.from_bytes(buffer[:8].tobytes(), "little")
    return buffer[: 8 + min(n, tensorfile.MAX_HEADER)].tobytes()
