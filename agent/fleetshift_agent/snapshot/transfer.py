"""Pulling a snapshot from another agent: chunked, checksummed, resumable, verified.

A migration moves gigabytes between nodes over links that drop. Starting over after every
drop would make big moves never finish, and adopting a snapshot with one bad byte would
restore a wrong model. So each chunk carries a CRC-32 and is appended to a partial file only
when it matches; after a broken connection the next attempt asks the source for the rest
from the last verified offset; each finished file is checked against the manifest's SHA-256
(a mismatch refetches it once, then refuses); and the snapshot becomes visible in the
destination store only after a full verification and an atomic rename. Partial files live in
``.incoming-<id>/`` and survive an agent restart, so a later fetch resumes them too.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from fleetshift.v1 import snapshot_pb2, snapshot_pb2_grpc
from fleetshift_agent.snapshot.errors import (
    SnapshotCorrupt,
    SnapshotExists,
    SnapshotNotFound,
    TransferFailed,
)
from fleetshift_agent.snapshot.fileio import fsync_dir
from fleetshift_agent.snapshot.manifest import FileEntry, parse_manifest
from fleetshift_agent.snapshot.names import MANIFEST
from fleetshift_agent.snapshot.service import DEFAULT_CHUNK
from fleetshift_agent.snapshot.snapshot import Snapshot
from fleetshift_agent.snapshot.store import SnapshotStore

log = logging.getLogger(__name__)
PART_SUFFIX = ".part"
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 8 << 20),
    # come back quickly when the source restarts, instead of gRPC's default 1 s+ backoff
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


@dataclass
class FetchReport:
    snapshot: Snapshot | None = None  # set once the snapshot is verified and in the store
    bytes_total: int = 0  # of all files but the manifest
    bytes_received: int = 0  # payload accepted from the network in this call
    bytes_resumed: int = 0  # already held in partial files from an earlier, broken attempt
    chunks_rejected: int = 0  # failed their CRC-32
    reconnects: int = 0
    files_refetched: list[str] = field(default_factory=list)  # whole-file digest mismatch


class _ChunkRejected(Exception):
    pass


@dataclass
class _Fetch:
    stub: snapshot_pb2_grpc.SnapshotServiceStub
    snapshot_id: str
    incoming: Path
    chunk_size: int
    max_attempts: int
    retry_delay_s: float
    stall_timeout_s: float
    report: FetchReport = field(default_factory=FetchReport)

    async def retrying(self, what: str, attempt_fn: Any) -> Any:
        """Run ``attempt_fn`` until it succeeds; retries transient failures with backoff.

        The budget counts consecutive failures without progress, so a long transfer over a
        link that drops now and then still finishes.
        """
        failures = 0
        while True:
            progress_before = self.report.bytes_received
            try:
                return await attempt_fn()
            except (grpc.aio.AioRpcError, _ChunkRejected) as exc:
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() not in RETRYABLE:
                    raise _mapped(exc, self.snapshot_id) from None
                failures = 0 if self.report.bytes_received > progress_before else failures + 1
                if failures >= self.max_attempts:
                    raise TransferFailed(
                        f"fetching {what} of snapshot {self.snapshot_id!r} failed "
                        f"{failures} times in a row: {_describe(exc)}"
                    ) from None
                self.report.reconnects += 1
                delay = min(self.retry_delay_s * 2 ** max(failures - 1, 0), 2.0)
                log.info("transfer of %s interrupted (%s); retry in %.2fs", what, exc, delay)
                await asyncio.sleep(delay)

    async def manifest(self) -> bytes:
        async def attempt() -> bytes:
            detail = await self.stub.GetSnapshot(
                snapshot_pb2.GetSnapshotRequest(snapshot_id=self.snapshot_id),
                timeout=self.stall_timeout_s,
            )
            if hashlib.sha256(detail.manifest).hexdigest() != detail.manifest_sha256:
                raise _ChunkRejected("manifest arrived damaged")
            return bytes(detail.manifest)

        raw: bytes = await self.retrying("the manifest", attempt)
        return raw

    async def file(self, name: str, entry: FileEntry) -> None:
        final = self.incoming / name
        if final.exists():
            return  # completed by an earlier attempt; the final verification re-checks it
        final.parent.mkdir(exist_ok=True)
        for round_ in range(2):
            part = final.with_name(final.name + PART_SUFFIX)
            if part.exists() and part.stat().st_size > entry.size:
                part.unlink()  # not a prefix of this file: start it over
            sha = await asyncio.to_thread(_hash_prefix, part)
            held = part.stat().st_size if part.exists() else 0
            self.report.bytes_resumed += held
            with open(part, "ab") as out:
                await self.retrying(name, lambda o=out, h=sha: self._pull(name, entry, o, h))
                out.flush()
                await asyncio.to_thread(os.fsync, out.fileno())
            if sha.hexdigest() == entry.sha256:
                os.rename(part, final)
                return
            part.unlink()
            if round_ == 0:
                self.report.files_refetched.append(name)
                log.warning(
                    "%s of %s failed its SHA-256; fetching it again", name, self.snapshot_id
                )
        raise SnapshotCorrupt(
            self.snapshot_id,
            name,
            "SHA-256 mismatch after transfer, twice: the source's copy differs from its manifest",
        )

    async def _pull(self, name: str, entry: FileEntry, out: Any, sha: Any) -> None:
        offset = out.tell()
        if offset == entry.size:
            return
        stream = self.stub.ReadSnapshot(
            snapshot_pb2.ReadSnapshotRequest(
                snapshot_id=self.snapshot_id, file=name, offset=offset, chunk_size=self.chunk_size
            )
        )
        try:
            while True:
                try:  # not wait_for: on 3.11 it can swallow a cancel and read on
                    async with asyncio.timeout(self.stall_timeout_s):
                        chunk = await stream.read()
                except TimeoutError:
                    raise _ChunkRejected(
                        f"no data for {self.stall_timeout_s:g}s from the source ({name}@{offset})"
                    ) from None
                if chunk is grpc.aio.EOF:
                    break
                if chunk.file != name or chunk.offset != offset:
                    raise _ChunkRejected(f"chunk for {chunk.file}@{chunk.offset}, wanted @{offset}")
                if zlib.crc32(chunk.data) != chunk.crc32:
                    self.report.chunks_rejected += 1
                    raise _ChunkRejected(f"chunk {name}@{offset} failed its CRC-32")
                if offset + len(chunk.data) > entry.size:
                    raise _ChunkRejected(f"source sent more than the {entry.size} bytes of {name}")
                out.write(chunk.data)
                sha.update(chunk.data)
                offset += len(chunk.data)
                self.report.bytes_received += len(chunk.data)
                if chunk.last:
                    break
        finally:
            stream.cancel()
            out.flush()
        if offset != entry.size:
            raise _ChunkRejected(f"stream of {name} ended at {offset} of {entry.size} bytes")


def _hash_prefix(part: Path) -> Any:
    sha = hashlib.sha256()
    if part.exists():
        with open(part, "rb") as f:
            while block := f.read(8 << 20):
                sha.update(block)
    return sha


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)


def _mapped(exc: grpc.aio.AioRpcError, snapshot_id: str) -> Exception:
    if exc.code() == grpc.StatusCode.NOT_FOUND:
        return SnapshotNotFound(snapshot_id, f"at the source: {exc.details()}")
    return TransferFailed(f"source refused snapshot {snapshot_id!r}: {_describe(exc)}")


def _write_manifest(incoming: Path, raw: bytes) -> None:
    """Keep the partial files only if they belong to the same manifest (same snapshot bytes)."""
    path = incoming / MANIFEST
    if path.exists() and path.read_bytes() != raw:
        for child in sorted(incoming.rglob("*"), reverse=True):
            child.rmdir() if child.is_dir() else child.unlink()
    incoming.mkdir(exist_ok=True)
    if not path.exists():
        tmp = incoming / (MANIFEST + PART_SUFFIX)
        tmp.write_bytes(raw)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.rename(tmp, path)
        fsync_dir(incoming)


async def _run(job: _Fetch, store: SnapshotStore) -> None:
    snapshot_id = job.snapshot_id
    try:
        raw = await job.manifest()
        manifest = parse_manifest(raw, snapshot_id)
        if manifest.snapshot_id != snapshot_id:
            raise SnapshotCorrupt(snapshot_id, MANIFEST, f"names {manifest.snapshot_id!r}")
        await asyncio.to_thread(_write_manifest, job.incoming, raw)
        for name, entry in sorted(manifest.files.items()):
            await job.file(name, entry)
        job.report.bytes_total = manifest.data_bytes
        job.report.snapshot = await asyncio.to_thread(store.adopt_incoming, snapshot_id)
    except SnapshotCorrupt:
        store.discard_incoming(snapshot_id)
        raise


async def fetch_snapshot(
    channel_or_address: grpc.aio.Channel | str,
    snapshot_id: str,
    store: SnapshotStore,
    *,
    chunk_size: int = DEFAULT_CHUNK,
    max_attempts: int = 8,
    retry_delay_s: float = 0.1,
    stall_timeout_s: float = 30.0,
) -> FetchReport:
    """Pull ``snapshot_id`` from the agent at ``channel_or_address`` into ``store``.

    Returns once the snapshot is verified and listed in ``store``. Raises SnapshotExists if
    the store already holds it, SnapshotNotFound if the source does not, SnapshotCorrupt if
    the source's bytes do not match its manifest, TransferFailed when retries run out (the
    partial files are kept, and the next call resumes them). A stream that delivers nothing
    for ``stall_timeout_s`` (a silently dead link) is abandoned and resumed like a broken one.
    """
    if store.path(snapshot_id).exists():
        raise SnapshotExists(snapshot_id)
    own = isinstance(channel_or_address, str)
    channel = (
        grpc.aio.insecure_channel(channel_or_address, options=CHANNEL_OPTIONS)
        if isinstance(channel_or_address, str)
        else channel_or_address
    )
    try:
        with store.receiving(snapshot_id) as incoming:
            job = _Fetch(
                snapshot_pb2_grpc.SnapshotServiceStub(channel),
                snapshot_id,
                incoming,
                chunk_size,
                max_attempts,
                retry_delay_s,
                stall_timeout_s,
            )
            await _run(job, store)
    finally:
        if own:
            await channel.close()
    return job.report
