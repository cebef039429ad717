"""Agent-to-agent transfer over real gRPC on loopback between two stores."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch

from fleetshift.v1 import snapshot_pb2, snapshot_pb2_grpc
from fleetshift_agent.snapshot import (
    SnapshotCorrupt,
    SnapshotInUse,
    SnapshotNotFound,
    SnapshotStore,
    TransferFailed,
)
from fleetshift_agent.snapshot.service import SnapshotServicer, key_to_proto, make_chunk
from fleetshift_agent.snapshot.transfer import fetch_snapshot

from .helpers import make_key

CHUNK = 64 << 10
SID = "worker-7-gen-3"


def _tensors() -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return {
        "weights": {"w": torch.randn(1024, 1024, generator=g).to(torch.bfloat16)},  # 2 MiB
        "kv": {"pool": torch.randn(256, 1024, generator=g).to(torch.bfloat16)},  # 512 KiB
    }


class RecordingServicer(SnapshotServicer):
    """The real servicer, recording what it was asked and what it sent.

    After ``pause_after`` chunks it sets ``paused`` and that stream hangs without an error;
    ``corrupt_chunk`` damages the data of that chunk number (once) after its CRC is computed.
    """

    def __init__(
        self, store: SnapshotStore, pause_after: int | None = None, corrupt_chunk: int | None = None
    ) -> None:
        super().__init__(store)
        self.requests: list[tuple[str, int]] = []
        self.chunks_sent = 0
        self.bytes_sent = 0
        self.pause_after = pause_after
        self.corrupt_chunk = corrupt_chunk
        self.paused = asyncio.Event()

    async def ReadSnapshot(self, request, context):  # type: ignore[no-untyped-def]
        self.requests.append((request.file, request.offset))
        async for chunk in super().ReadSnapshot(request, context):
            if self.pause_after is not None and self.chunks_sent >= self.pause_after:
                self.pause_after = None  # once
                self.paused.set()
                await asyncio.Event().wait()  # hang (until the server is stopped)
            self.chunks_sent += 1
            self.bytes_sent += len(chunk.data)
            yield chunk

    def _chunk(self, file: str, offset: int, data: bytes, last: bool) -> snapshot_pb2.SnapshotChunk:
        chunk = make_chunk(file, offset, data, last)
        if self.corrupt_chunk is not None and self.chunks_sent == self.corrupt_chunk:
            self.corrupt_chunk = None
            damaged = bytearray(data)
            damaged[len(damaged) // 2] ^= 0x40
            chunk.data = bytes(damaged)  # the CRC still describes the original bytes
        return chunk


async def _serve(servicer: SnapshotServicer, port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    snapshot_pb2_grpc.add_SnapshotServiceServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound


@pytest.fixture
def source(tmp_path: Path) -> SnapshotStore:
    store = SnapshotStore(tmp_path / "source")
    store.write(
        SID,
        key=make_key(),
        spec={"model": "tiny"},
        tensor_groups=_tensors(),
        json_parts={"sessions": [{"id": "a", "tokens": [5, 6, 7]}]},
        artifacts={"compile_cache.bin": b"\x07" * 100_000},
    )
    return store


@pytest.fixture
def dest(tmp_path: Path) -> SnapshotStore:
    return SnapshotStore(tmp_path / "dest")


def _total(store: SnapshotStore) -> int:
    return store.get(SID).manifest.data_bytes


def _assert_arrived_intact(dest: SnapshotStore) -> None:
    assert [s.snapshot_id for s in dest.list()] == [SID]
    snap = dest.get(SID)
    snap.verify()
    for group, tensors in _tensors().items():
        loaded = snap.load_tensors(group)
        assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert snap.load_json("sessions") == [{"id": "a", "tokens": [5, 6, 7]}]
    assert not dest.incoming_dir(SID).exists()


def _held_bytes(dest: SnapshotStore) -> int:
    incoming = dest.incoming_dir(SID)
    return sum(
        p.stat().st_size for p in incoming.rglob("*") if p.is_file() and p.parent != incoming
    )


async def _settled_held_bytes(dest: SnapshotStore) -> int:
    """Bytes the destination holds once it has stopped growing (the client is retrying)."""
    last = -1
    for _ in range(100):
        await asyncio.sleep(0.2)
        held = _held_bytes(dest)
        if held == last:
            return held
        last = held
    raise AssertionError("the partial transfer never settled")


async def test_fetch_arrives_verified(source: SnapshotStore, dest: SnapshotStore) -> None:
    servicer = RecordingServicer(source)
    server, port = await _serve(servicer)
    try:
        report = await fetch_snapshot(f"127.0.0.1:{port}", SID, dest, chunk_size=CHUNK)
    finally:
        await server.stop(None)
    _assert_arrived_intact(dest)
    assert report.bytes_total == _total(source)
    assert report.bytes_received == report.bytes_total == servicer.bytes_sent
    assert report.reconnects == 0 and report.chunks_rejected == 0
    assert all(offset == 0 for _, offset in servicer.requests)
    assert servicer.chunks_sent > 40  # really chunked
    # the snapshot's manifest arrived byte for byte
    assert (dest.path(SID) / "manifest.json").read_bytes() == (
        source.path(SID) / "manifest.json"
    ).read_bytes()


async def test_broken_connection_resumes_from_the_verified_offset(
    source: SnapshotStore, dest: SnapshotStore
) -> None:
    first = RecordingServicer(source, pause_after=30)
    server, port = await _serve(first)
    fetch = asyncio.create_task(
        fetch_snapshot(
            f"127.0.0.1:{port}", SID, dest, chunk_size=CHUNK, max_attempts=30, retry_delay_s=0.05
        )
    )
    await asyncio.wait_for(first.paused.wait(), 20)
    await server.stop(None)  # the source goes away mid-transfer
    held = await _settled_held_bytes(dest)
    assert 0 < held <= first.bytes_sent
    assert dest.list() == []  # not listed until it has arrived and been verified
    with pytest.raises(SnapshotNotFound):
        dest.get(SID)

    second = RecordingServicer(source)
    server, _ = await _serve(second, port)  # the source comes back on the same address
    try:
        report = await asyncio.wait_for(fetch, 30)
    finally:
        await server.stop(None)
    _assert_arrived_intact(dest)
    total = _total(source)
    file, offset = second.requests[0]
    assert offset > 0, f"{file} was fetched again from zero"
    assert second.bytes_sent == total - held  # nothing already verified was sent again
    assert report.bytes_received == total
    assert report.reconnects >= 1
    resent = first.bytes_sent + second.bytes_sent - total
    assert resent <= first.bytes_sent - held


async def test_stalled_stream_is_abandoned_and_resumed(
    source: SnapshotStore, dest: SnapshotStore
) -> None:
    servicer = RecordingServicer(source, pause_after=20)  # the link goes silent, no error
    server, port = await _serve(servicer)
    try:
        report = await fetch_snapshot(
            f"127.0.0.1:{port}", SID, dest, chunk_size=CHUNK, stall_timeout_s=0.5
        )
    finally:
        await server.stop(None)
    _assert_arrived_intact(dest)
    assert servicer.paused.is_set()
    assert report.reconnects == 1
    resumed = [(f, o) for f, o in servicer.requests if o > 0]
    assert len(resumed) == 1
    assert servicer.bytes_sent == report.bytes_received == _total(source)


async def test_corrupted_chunk_is_detected_and_refetched(
    source: SnapshotStore, dest: SnapshotStore
) -> None:
    servicer = RecordingServicer(source, corrupt_chunk=10)
    server, port = await _serve(servicer)
    try:
        report = await fetch_snapshot(
            f"127.0.0.1:{port}", SID, dest, chunk_size=CHUNK, retry_delay_s=0.01
        )
    finally:
        await server.stop(None)
    _assert_arrived_intact(dest)
    assert report.chunks_rejected == 1
    assert report.reconnects == 1
    resumed = [(f, o) for f, o in servicer.requests if o > 0]
    assert len(resumed) == 1 and resumed[0][1] % CHUNK == 0  # from the bad chunk, not from zero


async def test_source_copy_not_matching_its_manifest_is_refused(
    source: SnapshotStore, dest: SnapshotStore
) -> None:
    path = source.path(SID) / "tensors" / "weights.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(data)
    server, port = await _serve(SnapshotServicer(source))
    try:
        with pytest.raises(SnapshotCorrupt, match="SHA-256") as exc_info:
            await fetch_snapshot(f"127.0.0.1:{port}", SID, dest, chunk_size=CHUNK)
    finally:
        await server.stop(None)
    assert exc_info.value.file == "tensors/weights.safetensors"
    assert dest.list() == []
    assert not dest.incoming_dir(SID).exists()
    assert not dest.path(SID).exists()


async def test_transfer_resumes_after_the_destination_agent_restarts(
    source: SnapshotStore, dest: SnapshotStore
) -> None:
    first = RecordingServicer(source, pause_after=20)
    server, port = await _serve(first)
    fetch = asyncio.create_task(
        fetch_snapshot(f"127.0.0.1:{port}", SID, dest, chunk_size=CHUNK, max_attempts=2)
    )
    await asyncio.wait_for(first.paused.wait(), 20)
    with pytest.raises(SnapshotInUse, match="already being received"):
        await fetch_snapshot(f"127.0.0.1:{port}", SID, dest)  # a second transfer of the same id
    await server.stop(None)
    with pytest.raises(TransferFailed):
        await asyncio.wait_for(fetch, 30)
    held = _held_bytes(dest)
    assert held > 0 and dest.list() == []

    restarted = SnapshotStore(dest.root)  # a new agent process opens the same store
    second = RecordingServicer(source)
    server, port = await _serve(second)
    try:
        report = await fetch_snapshot(f"127.0.0.1:{port}", SID, restarted, chunk_size=CHUNK)
    finally:
        await server.stop(None)
    _assert_arrived_intact(restarted)
    assert report.bytes_resumed == held - sum(
        e.size for n, e in source.get(SID).manifest.files.items() if n < second.requests[0][0]
    )
    assert second.bytes_sent == _total(source) - held


async def test_missing_snapshot_at_the_source(dest: SnapshotStore, source: SnapshotStore) -> None:
    server, port = await _serve(SnapshotServicer(source))
    try:
        with pytest.raises(SnapshotNotFound, match="nope"):
            await fetch_snapshot(f"127.0.0.1:{port}", "nope", dest)
    finally:
        await server.stop(None)


async def test_list_get_check_delete_over_grpc(source: SnapshotStore) -> None:
    server, port = await _serve(SnapshotServicer(source))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = snapshot_pb2_grpc.SnapshotServiceStub(channel)
            listed = await stub.ListSnapshots(snapshot_pb2.ListSnapshotsRequest())
            assert [s.snapshot_id for s in listed.snapshots] == [SID]
            assert listed.snapshots[0].key.model_id == "tiny-llama"
            assert listed.snapshots[0].size_bytes == source.list()[0].size_bytes
            other = await stub.ListSnapshots(snapshot_pb2.ListSnapshotsRequest(model_id="x"))
            assert list(other.snapshots) == []

            detail = await stub.GetSnapshot(snapshot_pb2.GetSnapshotRequest(snapshot_id=SID))
            assert {f.name for f in detail.files} == set(source.get(SID).manifest.files)

            verdict = await stub.CheckCompatibility(
                snapshot_pb2.CheckCompatibilityRequest(
                    snapshot_id=SID,
                    destination=key_to_proto(
                        make_key(gpu_product="NVIDIA A100-SXM4-80GB", engine_version="9")
                    ),
                )
            )
            assert [d.field for d in verdict.differences] == ["gpu_product", "engine_version"]
            assert verdict.weights_reusable and not verdict.compiled_ok and not verdict.warm_ok
            assert "gpu_product" in verdict.description

            async def code_of(call) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
                with pytest.raises(grpc.aio.AioRpcError) as exc_info:
                    await call
                return exc_info.value.code()

            bad_key = key_to_proto(make_key())
            bad_key.tensor_parallel = 0
            req = snapshot_pb2.CheckCompatibilityRequest(snapshot_id=SID, destination=bad_key)
            assert await code_of(stub.CheckCompatibility(req)) == grpc.StatusCode.INVALID_ARGUMENT
            missing = snapshot_pb2.GetSnapshotRequest(snapshot_id="missing")
            assert await code_of(stub.GetSnapshot(missing)) == grpc.StatusCode.NOT_FOUND
            traversal = snapshot_pb2.ReadSnapshotRequest(snapshot_id=SID, file="../../etc/passwd")
            stream = stub.ReadSnapshot(traversal)
            assert await code_of(stream.read()) == grpc.StatusCode.NOT_FOUND

            source.pin(SID)
            delete = snapshot_pb2.DeleteSnapshotRequest(snapshot_id=SID)
            assert await code_of(stub.DeleteSnapshot(delete)) == grpc.StatusCode.FAILED_PRECONDITION
            source.unpin(SID)
            await stub.DeleteSnapshot(delete)
            assert source.list() == []
            assert await code_of(stub.DeleteSnapshot(delete)) == grpc.StatusCode.NOT_FOUND
    finally:
        await server.stop(None)
