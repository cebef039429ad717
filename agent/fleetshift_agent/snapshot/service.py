"""SnapshotService over gRPC: a thin shell converting messages and mapping errors.

All decisions live in the library (store, verification, compatibility); the servicer only
translates. Disk work runs in threads so one agent can stream a multi-gigabyte snapshot to a
peer without stalling its other RPCs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import zlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from fleetshift.v1 import snapshot_pb2, snapshot_pb2_grpc
from fleetshift_agent.snapshot.errors import SnapshotCorrupt, SnapshotPartNotFound
from fleetshift_agent.snapshot.snapshot import Snapshot
from fleetshift_agent.snapshot.store import SnapshotStore, SnapshotSummary
from fleetshift_common.bounds import check_host_port
from fleetshift_common.compat import CompatKey, CompatVerdict, compare
from fleetshift_common.errors import FleetShiftError, InvalidArgument, NotFound, Unavailable
from fleetshift_rpc.errors import peer_error, status_for
from fleetshift_rpc.server import channel

if TYPE_CHECKING:
    from fleetshift_agent.restore_compat import NodePlatform

DEFAULT_CHUNK = 2 << 20
# gRPC's default receive limit is 4 MiB per message; stay under it for any peer channel.
MAX_CHUNK = 3 << 20

T = TypeVar("T")


# -- conversions -------------------------------------------------------------------------------


def key_to_proto(key: CompatKey) -> snapshot_pb2.SnapshotCompatKey:
    return snapshot_pb2.SnapshotCompatKey(**key.to_json())


def key_from_proto(msg: snapshot_pb2.SnapshotCompatKey) -> CompatKey:
    return CompatKey(**{name: getattr(msg, name) for name in CompatKey.field_names()})


def verdict_to_proto(verdict: CompatVerdict) -> snapshot_pb2.SnapshotCompatVerdict:
    return snapshot_pb2.SnapshotCompatVerdict(
        warm_ok=verdict.warm_ok,
        weights_reusable=verdict.weights_reusable,
        compiled_ok=verdict.compiled_ok,
        differences=[
            snapshot_pb2.SnapshotFieldDifference(
                field=d.field, snapshot=d.snapshot, destination=d.destination
            )
            for d in verdict.differences
        ],
        description=verdict.describe(),
    )


def summary_to_proto(s: SnapshotSummary) -> snapshot_pb2.SnapshotSummary:
    created = Timestamp()
    created.FromNanoseconds(int(s.created_at * 1e9))
    return snapshot_pb2.SnapshotSummary(
        snapshot_id=s.snapshot_id,
        size_bytes=s.size_bytes,
        created_at=created,
        key=key_to_proto(s.key),
        key_summary=s.key_summary,
        pinned=s.pinned,
        in_use=s.in_use,
    )


def make_chunk(file: str, offset: int, data: bytes, last: bool) -> snapshot_pb2.SnapshotChunk:
    return snapshot_pb2.SnapshotChunk(
        file=file, offset=offset, data=data, crc32=zlib.crc32(data), last=last
    )


# -- servicer ----------------------------------------------------------------------------------


async def _call(context: grpc.aio.ServicerContext[Any, Any], work: Callable[[], T]) -> T:
    """Run library code in a thread; a FleetShiftError becomes the catalogue's status."""
    try:
        return await asyncio.to_thread(work)
    except FleetShiftError as exc:
        await context.abort(status_for(exc), str(exc))
        raise  # unreachable: abort raises


class SnapshotServicer(snapshot_pb2_grpc.SnapshotServiceServicer):
    def __init__(
        self,
        store: SnapshotStore,
        *,
        max_chunk: int = MAX_CHUNK,
        platform: NodePlatform | None = None,
        peer_credentials: grpc.ChannelCredentials | None = None,
        max_message_bytes: int = 64 << 20,
        on_sent: Callable[[int], None] | None = None,
    ) -> None:
        self.store = store
        self.max_chunk = max_chunk
        self.platform = platform  # this node, for CheckCompatibility by node_name
        self.peer_credentials = peer_credentials  # for reading another agent's snapshot key
        self.max_message_bytes = max_message_bytes
        # Told the payload bytes of every chunk sent (the agent's transfer counter).
        self.on_sent = on_sent or (lambda size: None)

    async def ListSnapshots(
        self, request: snapshot_pb2.ListSnapshotsRequest, context: Any
    ) -> snapshot_pb2.ListSnapshotsResponse:
        snaps = await _call(context, self.store.list)
        return snapshot_pb2.ListSnapshotsResponse(
            snapshots=[
                summary_to_proto(s)
                for s in snaps
                if not request.model_id or s.key.model_id == request.model_id
            ]
        )

    async def GetSnapshot(
        self, request: snapshot_pb2.GetSnapshotRequest, context: Any
    ) -> snapshot_pb2.SnapshotDetail:
        def detail() -> snapshot_pb2.SnapshotDetail:
            snap = self.store.get(request.snapshot_id)
            manifest = (snap.path / "manifest.json").read_bytes()
            return snapshot_pb2.SnapshotDetail(
                summary=summary_to_proto(self.store.summary(request.snapshot_id)),
                files=[
                    snapshot_pb2.SnapshotFile(name=n, size_bytes=e.size, sha256=e.sha256)
                    for n, e in sorted(snap.manifest.files.items())
                ],
                manifest=manifest,
                manifest_sha256=hashlib.sha256(manifest).hexdigest(),
                spec_json=json.dumps(snap.manifest.spec),
            )

        return await _call(context, detail)

    async def DeleteSnapshot(
        self, request: snapshot_pb2.DeleteSnapshotRequest, context: Any
    ) -> snapshot_pb2.DeleteSnapshotResponse:
        await _call(context, lambda: self.store.delete(request.snapshot_id))
        return snapshot_pb2.DeleteSnapshotResponse()

    async def CheckCompatibility(
        self, request: snapshot_pb2.CheckCompatibilityRequest, context: Any
    ) -> snapshot_pb2.SnapshotCompatVerdict:
        try:
            destination = self._destination_of(request)  # refused before any remote call
            key = await self._snapshot_key(request.snapshot_id, request.source_agent_address)
            verdict = compare(key, destination(key))
        except FleetShiftError as exc:
            await context.abort(status_for(exc), str(exc))
        return verdict_to_proto(verdict)

    def _destination_of(
        self, request: snapshot_pb2.CheckCompatibilityRequest
    ) -> Callable[[CompatKey], CompatKey]:
        if request.node_name and request.HasField("destination"):
            raise InvalidArgument("give destination or node_name, not both", field="node_name")
        if request.node_name:
            platform = self.platform
            if platform is None or request.node_name != platform.node_name:
                here = platform.node_name if platform else "unknown"
                raise NotFound(
                    f"node_name {request.node_name!r} is not this agent's node ({here!r}); "
                    "ask that node's agent, with source_agent_address naming this one",
                    field="node_name",
                )
            return platform.destination
        if not request.HasField("destination"):
            raise InvalidArgument("destination key or node_name is required", field="destination")
        given = key_from_proto(request.destination)
        return lambda _snapshot: given

    async def _snapshot_key(self, snapshot_id: str, source: str) -> CompatKey:
        if not source:
            return await asyncio.to_thread(lambda: self.store.get(snapshot_id).key)
        check_host_port("source_agent_address", source)
        try:
            async with channel(source, self.max_message_bytes, self.peer_credentials) as ch:
                detail = await snapshot_pb2_grpc.SnapshotServiceStub(ch).GetSnapshot(
                    snapshot_pb2.GetSnapshotRequest(snapshot_id=snapshot_id), timeout=10
                )
        except grpc.aio.AioRpcError as err:
            raise peer_error(
                err,
                f"source agent {source}",
                passes={grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT},
                default=Unavailable,
                field="source_agent_address",
            ) from None
        return key_from_proto(detail.summary.key)

    async def ReadSnapshot(
        self, request: snapshot_pb2.ReadSnapshotRequest, context: Any
    ) -> AsyncIterator[snapshot_pb2.SnapshotChunk]:
        chunk = min(request.chunk_size or DEFAULT_CHUNK, self.max_chunk)
        try:
            with self.store.using(request.snapshot_id) as snap:  # no deletion mid-stream
                async for message in self._stream(snap, request.file, request.offset, chunk):
                    yield message
        except FleetShiftError as exc:
            await context.abort(status_for(exc), str(exc))

    async def _stream(
        self, snap: Snapshot, file: str, offset: int, chunk: int
    ) -> AsyncIterator[snapshot_pb2.SnapshotChunk]:
        entry = snap.manifest.files.get(file)
        if entry is None:
            raise SnapshotPartNotFound(snap.snapshot_id, f"file {file!r}")
        if offset > entry.size:
            raise InvalidArgument(
                f"offset {offset} beyond the {entry.size} bytes of {file!r}", field="offset"
            )
        with open(snap.path / file, "rb") as f:
            f.seek(offset)
            while True:
                data = await asyncio.to_thread(f.read, min(chunk, entry.size - offset))
                if len(data) < min(chunk, entry.size - offset):
                    raise SnapshotCorrupt(snap.snapshot_id, file, f"source file ends at {offset}")
                end = offset + len(data)
                # Counted when handed to the stream: a client that has the last chunk closes
                # the stream, and code after that final yield would never run.
                self.on_sent(len(data))
                yield self._chunk(file, offset, data, end == entry.size)
                offset = end
                if offset == entry.size:
                    return

    def _chunk(self, file: str, offset: int, data: bytes, last: bool) -> snapshot_pb2.SnapshotChunk:
        """One chunk as sent; a seam where tests can damage data in flight."""
        return make_chunk(file, offset, data, last)
