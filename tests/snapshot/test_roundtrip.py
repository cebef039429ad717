from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fleetshift_agent.snapshot import (
    InvalidSnapshotName,
    SnapshotExists,
    SnapshotPartNotFound,
    open_snapshot,
)
from fleetshift_common.errors import InvalidArgument

from .helpers import ARTIFACTS, JSON_PARTS, make_key, sample_tensors


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a_bytes = a.contiguous().reshape(-1).view(torch.uint8)
    b_bytes = b.contiguous().reshape(-1).view(torch.uint8)
    return torch.equal(a_bytes, b_bytes)


@pytest.mark.parametrize("copy", [False, True], ids=["mapped", "copied"])
def test_round_trip_is_bitwise_and_verifies(tmp_path: Path, write_sample, copy: bool) -> None:
    info = write_sample("snap-1", clock=lambda: 1_700_000_000.5)
    assert info.path == tmp_path / "snap-1"
    assert info.created_at == 1_700_000_000.5
    assert info.size_bytes == sum(p.stat().st_size for p in info.path.rglob("*") if p.is_file())

    snap = open_snapshot(info.path)
    snap.verify()
    assert snap.manifest.key == make_key()
    assert snap.manifest.spec == {"model": "tiny-llama", "max_batch": 4}
    assert snap.manifest.created_at == 1_700_000_000.5
    assert snap.tensor_groups == ["kv", "weights"]
    expected = sample_tensors()
    for group, tensors in expected.items():
        loaded = snap.load_tensors(group, copy=copy)
        assert set(loaded) == set(tensors)
        for name, t in tensors.items():
            assert _bitwise_equal(loaded[name], t), (group, name)
    assert snap.load_json("sessions") == JSON_PARTS["sessions"]
    assert snap.load_json("queue") == []
    assert snap.load_artifact("compile_cache.bin") == ARTIFACTS["compile_cache.bin"]
    # every other file is listed with its size and digest; nothing is left behind
    assert set(snap.manifest.files) == {
        "tensors/weights.safetensors",
        "tensors/kv.safetensors",
        "json/sessions.json",
        "json/queue.json",
        "artifacts/compile_cache.bin",
    }
    assert [p.name for p in tmp_path.iterdir()] == ["snap-1"]


def test_tensor_files_are_standard_safetensors(write_sample) -> None:
    info = write_sample()
    expected = sample_tensors()["weights"]
    with safe_open(str(info.path / "tensors" / "weights.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(expected)
        for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            assert _bitwise_equal(f.get_tensor(name), expected[name])


def test_nan_and_special_values_survive(write_sample) -> None:
    special = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40], dtype=torch.float32)
    info = write_sample(tensor_groups={"w": {"x": special, "y": special.to(torch.bfloat16)}})
    loaded = open_snapshot(info.path).load_tensors("w")
    assert _bitwise_equal(loaded["x"], special)
    assert _bitwise_equal(loaded["y"], special.to(torch.bfloat16))


@pytest.mark.parametrize("copy", [False, True], ids=["mapped", "copied"])
def test_loaded_tensors_are_writable_and_never_change_the_file(write_sample, copy: bool) -> None:
    info = write_sample()
    snap = open_snapshot(info.path)
    loaded = snap.load_tensors("weights", copy=copy)
    loaded["norm"].add_(1.0)  # writable, in memory only
    loaded["embed"].zero_()
    snap.verify()
    again = snap.load_tensors("weights")
    assert _bitwise_equal(again["norm"], sample_tensors()["weights"]["norm"])
    assert _bitwise_equal(again["embed"], sample_tensors()["weights"]["embed"])


def test_existing_snapshot_is_never_replaced(write_sample) -> None:
    write_sample("snap-1")
    with pytest.raises(SnapshotExists, match="snap-1"):
        write_sample("snap-1")


@pytest.mark.parametrize("bad", ["../evil", "a/b", ".hidden", "", "x" * 200])
def test_unsafe_snapshot_ids_are_refused(write_sample, bad: str) -> None:
    with pytest.raises(InvalidSnapshotName):
        write_sample(bad)


def test_unsafe_part_names_are_refused(tmp_path: Path, write_sample) -> None:
    with pytest.raises(InvalidSnapshotName, match="tensor group"):
        write_sample(tensor_groups={"../w": {"x": torch.zeros(1)}})
    with pytest.raises(InvalidSnapshotName, match="artifact"):
        write_sample(artifacts={"../../x": b""})
    assert list(tmp_path.iterdir()) == []


def test_unknown_part_is_not_found(write_sample) -> None:
    snap = open_snapshot(write_sample().path)
    with pytest.raises(SnapshotPartNotFound, match="optimizer"):
        snap.load_tensors("optimizer")
    with pytest.raises(SnapshotPartNotFound, match="nope"):
        snap.load_json("nope")


def test_large_groups_are_sharded_and_load_whole(write_sample) -> None:
    info = write_sample(shard_bytes=1500)
    snap = open_snapshot(info.path)
    shards = snap.manifest.tensor_files("kv")
    assert len(shards) > 1
    assert shards[0] == f"tensors/kv@1-of-{len(shards)}.safetensors"
    assert snap.tensor_groups == ["kv", "weights"]
    snap.verify()
    expected = sample_tensors()
    for group in ("kv", "weights"):
        loaded = snap.load_tensors(group)
        assert set(loaded) == set(expected[group])
        assert all(_bitwise_equal(loaded[n], t) for n, t in expected[group].items())
    seen: set[str] = set()
    for shard in shards:  # each shard is a standard safetensors file of whole tensors
        with safe_open(str(info.path / shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                assert _bitwise_equal(f.get_tensor(name), expected["kv"][name])
                seen.add(name)
    assert seen == set(expected["kv"])


def test_unsupported_dtype_is_refused_before_anything_is_written(
    tmp_path: Path, write_sample
) -> None:
    with pytest.raises(InvalidArgument, match=r"'kv'.*complex64"):
        write_sample(tensor_groups={"kv": {"z": torch.zeros(2, dtype=torch.complex64)}})
    assert list(tmp_path.iterdir()) == []
