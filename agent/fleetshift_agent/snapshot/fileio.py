"""Write and read files while hashing them, in one pass over the bytes.

Snapshots of a worker are gigabytes; hashing after writing (or before reading) would read
everything twice. Instead each chunk is hashed on a helper thread while the same chunk is
written (or the next one read): ``hashlib`` and ``os.write``/``readinto`` both release the GIL,
so on two cores the hash costs almost no wall time. Writes and reads use large chunks
straight from/into the caller's buffers, so no extra copy of a tensor is made.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

CHUNK = 8 << 20
_INLINE = 1 << 20  # below this, hashing on the calling thread is cheaper than a hand-off


class FileProblem(Exception):
    """A file is not as expected; ``problem`` is a sentence naming what is wrong."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


class HashingWriter:
    """Writes a new file (never overwrites) and computes its SHA-256 on the way."""

    def __init__(self, path: Path, pool: ThreadPoolExecutor) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._sha = hashlib.sha256()
        self._pool = pool
        self.size = 0

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        if len(view) < _INLINE:
            self._sha.update(view)
            _write_all(self._fd, view)
        else:
            for start in range(0, len(view), CHUNK):
                piece = view[start : start + CHUNK]
                hashed = self._pool.submit(self._sha.update, piece)
                _write_all(self._fd, piece)
                hashed.result()
        self.size += len(view)

    def close(self) -> tuple[int, str]:
        """fsync and close; returns (size, sha256 hex)."""
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
        return self.size, self._sha.hexdigest()

    def abort(self) -> None:
        os.close(self._fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _size_problem(actual: int, expected: int) -> str:
    if actual < expected:
        return f"truncated: {actual} bytes on disk, manifest says {expected}"
    return f"size mismatch: {actual} bytes on disk, manifest says {expected}"


# (device, inode, size, mtime, ctime): any write to the file, or a replacement, changes it
Identity = tuple[int, int, int, int, int]


def _open_checked(path: Path, expected_size: int) -> tuple[int, Identity]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise FileProblem("missing: listed in the manifest but absent on disk") from None
    except OSError as exc:
        raise FileProblem(f"cannot be opened: {exc.strerror}") from None
    st = os.fstat(fd)
    if st.st_size != expected_size:
        os.close(fd)
        raise FileProblem(_size_problem(st.st_size, expected_size))
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    return fd, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _check_digest(sha: Any, expected_sha: str) -> None:
    got = sha.hexdigest()
    if got != expected_sha:
        raise FileProblem(
            f"SHA-256 mismatch: content hashes to {got[:16]}..., manifest says "
            f"{expected_sha[:16]}... (flipped or replaced bytes)"
        )


def _readinto_exact(fd: int, view: memoryview, expected_size: int, done: int) -> None:
    while view:
        n = os.readv(fd, [view])
        if n == 0:
            raise FileProblem(_size_problem(done, expected_size) + " (shrank while reading)")
        view = view[n:]
        done += n


def _pipelined(
    fd: int, expected_size: int, pool: ThreadPoolExecutor, slot: Callable[[int, int], memoryview]
) -> Any:
    """Read the file chunk by chunk into ``slot(start, length)``; hash chunk k during read k+1."""
    sha = hashlib.sha256()
    pending: Future[None] | None = None
    for start in range(0, expected_size, CHUNK):
        view = slot(start, min(CHUNK, expected_size - start))
        _readinto_exact(fd, view, expected_size, start)
        if pending is not None:
            pending.result()
        pending = pool.submit(sha.update, view)
    if pending is not None:
        pending.result()
    if os.read(fd, 1):
        raise FileProblem(f"grew while reading: more than the {expected_size} bytes expected")
    return sha


def read_verified(path: Path, expected_size: int, expected_sha: str, into: memoryview) -> None:
    """Fill ``into`` (exactly ``expected_size`` bytes) from the file, checking size and digest."""
    fd, _ = _open_checked(path, expected_size)
    try:
        with ThreadPoolExecutor(1) as pool:
            sha = _pipelined(fd, expected_size, pool, lambda s, n: into[s : s + n])
    finally:
        os.close(fd)
    _check_digest(sha, expected_sha)


def hash_verified(path: Path, expected_size: int, expected_sha: str) -> Identity:
    """Check size and digest of a file without copying its bytes (hashed through a read-only
    mapping); returns the identity of the file that was checked."""
    fd, identity = _open_checked(path, expected_size)
    try:
        if expected_size == 0:
            _check_digest(hashlib.sha256(), expected_sha)
            return identity
        with mmap.mmap(fd, expected_size, access=mmap.ACCESS_READ) as mapping:
            mapping.madvise(mmap.MADV_WILLNEED)
            view = memoryview(mapping)
            try:
                _hash_mapping(view, expected_sha)
            finally:
                view.release()
    finally:
        os.close(fd)
    return identity


def _hash_mapping(view: memoryview, expected_sha: str) -> None:
    sha = hashlib.sha256()
    for start in range(0, len(view), CHUNK):
        sha.update(view[start : start + CHUNK])
    _check_digest(sha, expected_sha)


def map_verified(
    path: Path, expected_size: int, expected_sha: str, verified: Identity | None = None
) -> tuple[np.ndarray, Identity]:
    """Map the file copy-on-write, hash it through the mapping, return it as a uint8 array.

    The bytes are not copied into anonymous memory: pages come from the page cache (the
    kernel reads ahead while the hash runs), and writing to the returned array (or to
    tensors viewing it) copies only the touched pages, never the file. The caller must keep
    snapshot files immutable while mapped (the store never rewrites or truncates them).
    If ``verified`` is the identity of this very file as an earlier check saw it (same inode,
    size, mtime and ctime: nothing has written to it since), the hash is not repeated.
    """
    fd, identity = _open_checked(path, expected_size)
    try:
        if expected_size == 0:
            _check_digest(hashlib.sha256(), expected_sha)
            return np.empty(0, dtype=np.uint8), identity
        mapping = mmap.mmap(fd, expected_size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    mapping.madvise(mmap.MADV_WILLNEED)
    array = np.frombuffer(mapping, dtype=np.uint8)
    if identity != verified:
        _hash_mapping(memoryview(array), expected_sha)
    return array, identity


def read_small_verified(path: Path, expected_size: int, expected_sha: str) -> bytes:
    buf = bytearray(expected_size)
    read_verified(path, expected_size, expected_sha, memoryview(buf))
    return bytes(buf)
