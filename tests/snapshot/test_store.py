from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fleetshift_agent.snapshot import (
    RetentionPolicy,
    SnapshotInUse,
    SnapshotNotFound,
    SnapshotStore,
)

from ..clock import ManualClock
from .helpers import make_key


def _write(store: SnapshotStore, sid: str, model: str = "m1", mb: float = 0.0) -> None:
    n = int(mb * (1 << 20)) // 2
    store.write(
        sid,
        key=make_key(model_id=model),
        spec={"id": sid},
        tensor_groups={"weights": {"w": torch.zeros(max(n, 1), dtype=torch.bfloat16)}},
        json_parts={"sessions": []},
    )


def _ids(store: SnapshotStore) -> list[str]:
    return [s.snapshot_id for s in store.list()]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1_000_000.0)


@pytest.fixture
def store(tmp_path: Path, clock: ManualClock) -> SnapshotStore:
    return SnapshotStore(tmp_path / "store", clock)


def test_list_get_delete(store: SnapshotStore, clock: ManualClock) -> None:
    _write(store, "a")
    clock.t += 10
    _write(store, "b", model="m2")
    listed = store.list()
    assert [s.snapshot_id for s in listed] == ["a", "b"]
    assert listed[0].created_at == 1_000_000.0 and listed[1].created_at == 1_000_010.0
    assert listed[1].key.model_id == "m2" and "m2" in listed[1].key_summary
    on_disk = sum(p.stat().st_size for p in (store.root / "b").rglob("*") if p.is_file())
    assert listed[1].size_bytes == on_disk
    store.get("a").verify()
    store.delete("a")
    assert _ids(store) == ["b"]
    assert not (store.root / "a").exists()
    with pytest.raises(SnapshotNotFound, match="'a'"):
        store.get("a")
    with pytest.raises(SnapshotNotFound):
        store.delete("a")


def test_unreadable_snapshot_is_not_listed(store: SnapshotStore) -> None:
    _write(store, "good")
    _write(store, "bad")
    (store.root / "bad" / "manifest.json").write_text("nope")
    (store.root / "lost+found").mkdir()
    (store.root / "stray.txt").write_text("x")
    assert _ids(store) == ["good"]


def test_pinned_and_in_use_snapshots_cannot_be_deleted(store: SnapshotStore) -> None:
    _write(store, "a")
    store.pin("a")
    with pytest.raises(SnapshotInUse, match="pinned"):
        store.delete("a")
    assert SnapshotStore(store.root).list()[0].pinned  # the pin survives a restart
    store.unpin("a")
    with store.using("a") as snap:
        assert snap.snapshot_id == "a"
        assert store.list()[0].in_use
        with pytest.raises(SnapshotInUse, match="in use"):
            store.delete("a")
    store.delete("a")
    assert _ids(store) == []


def test_leftover_tmp_directories_are_removed_at_start(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = SnapshotStore(root)
    _write(store, "a")
    (root / ".tmp-b-1234").mkdir()
    (root / ".tmp-b-1234" / "tensors").mkdir()
    (root / ".tmp-b-1234" / "tensors" / "w.safetensors").write_bytes(b"half")
    (root / ".incoming-c").mkdir()  # a resumable transfer is kept
    reopened = SnapshotStore(root)
    assert reopened.removed_at_start == [".tmp-b-1234"]
    assert sorted(p.name for p in root.iterdir()) == [".incoming-c", ".pins", "a"]
    assert _ids(reopened) == ["a"]


def test_retention_keeps_last_n_per_model(store: SnapshotStore, clock: ManualClock) -> None:
    for i in range(4):
        _write(store, f"m1-{i}", model="m1")
        _write(store, f"m2-{i}", model="m2")
        clock.t += 60
    store.pin("m1-0")
    deleted = store.apply_retention(RetentionPolicy(keep_last_per_model=2))
    assert deleted == ["m2-0", "m1-1", "m2-1"]
    assert _ids(store) == ["m1-0", "m1-2", "m2-2", "m1-3", "m2-3"]


def test_retention_by_age(store: SnapshotStore, clock: ManualClock) -> None:
    for i in range(3):
        _write(store, f"s{i}")
        clock.t += 3600
    with store.using("s0"):
        assert store.apply_retention(RetentionPolicy(max_age_s=2 * 3600 - 1)) == ["s1"]
    assert _ids(store) == ["s0", "s2"]
    assert store.apply_retention(RetentionPolicy(max_age_s=2 * 3600 - 1)) == ["s0"]


def test_retention_by_total_bytes_deletes_oldest_first(
    store: SnapshotStore, clock: ManualClock
) -> None:
    for i in range(4):
        _write(store, f"s{i}", mb=1)
        clock.t += 1
    sizes = {s.snapshot_id: s.size_bytes for s in store.list()}
    store.pin("s0")
    limit = sizes["s0"] + sizes["s3"] + 10
    assert store.apply_retention(RetentionPolicy(max_total_bytes=limit)) == ["s1", "s2"]
    assert _ids(store) == ["s0", "s3"]
    assert sum(s.size_bytes for s in store.list()) <= limit


def test_retention_policies_combine(store: SnapshotStore, clock: ManualClock) -> None:
    for i in range(3):
        _write(store, f"s{i}")
        clock.t += 100
    policy = RetentionPolicy(keep_last_per_model=2, max_age_s=150)
    assert store.apply_retention(policy) == ["s0", "s1"]
    assert _ids(store) == ["s2"]
    assert store.apply_retention(RetentionPolicy()) == []
