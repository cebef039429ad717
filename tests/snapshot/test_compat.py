from __future__ import annotations

import pytest

from fleetshift_agent.snapshot import SnapshotIncompatible, open_snapshot
from fleetshift_common.compat import CompatKey, compare
from fleetshift_common.errors import ErrorKind, InvalidArgument

from .helpers import make_key

PLATFORM_CHANGES = {
    "gpu_product": "NVIDIA H200",
    "compute_capability": "8.0",
    "driver_version": "560.28.03",
    "cuda_version": "12.6",
    "torch_version": "2.14.0",
    "engine_name": "vllm",
    "engine_version": "0.2.0",
}
WEIGHTS_CHANGES = {
    "model_id": "tiny-llama-v2",
    "weights_digest": "sha256:" + "cd" * 32,
    "dtype": "float16",
    "quantization": "fp8",
    "tensor_parallel": 2,
}


def test_identical_keys_allow_a_warm_restore() -> None:
    verdict = compare(make_key(), make_key())
    assert verdict.differences == ()
    assert verdict.warm_ok and verdict.weights_reusable and verdict.compiled_ok
    assert "compatible" in verdict.describe()


@pytest.mark.parametrize(("field", "value"), PLATFORM_CHANGES.items())
def test_platform_change_keeps_weights_but_not_compiled_state(field: str, value: str) -> None:
    verdict = compare(make_key(), make_key(**{field: value}))
    assert [d.field for d in verdict.differences] == [field]
    assert verdict.differences[0].destination == str(value)
    assert not verdict.warm_ok
    assert verdict.weights_reusable
    assert not verdict.compiled_ok
    assert field in verdict.describe()


@pytest.mark.parametrize(("field", "value"), WEIGHTS_CHANGES.items())
def test_model_change_forbids_weight_reuse(field: str, value: object) -> None:
    verdict = compare(make_key(), make_key(**{field: value}))
    assert [d.field for d in verdict.differences] == [field]
    assert not verdict.warm_ok
    assert not verdict.weights_reusable
    assert verdict.compiled_ok
    assert field in verdict.describe()


def test_gpu_count_change_only_blocks_the_warm_restore() -> None:
    verdict = compare(make_key(), make_key(gpu_count=2))
    assert verdict.differing_fields == ("gpu_count",)
    assert not verdict.warm_ok and verdict.weights_reusable and verdict.compiled_ok


def test_every_differing_field_is_named() -> None:
    dest = make_key(**PLATFORM_CHANGES, **WEIGHTS_CHANGES, gpu_count=8)  # type: ignore[arg-type]
    verdict = compare(make_key(), dest)
    assert set(verdict.differing_fields) == {*PLATFORM_CHANGES, *WEIGHTS_CHANGES, "gpu_count"}
    text = verdict.describe()
    for field in verdict.differing_fields:
        assert field in text
    assert "13 field(s) differ" in text


def test_key_json_round_trip_and_validation() -> None:
    key = make_key()
    assert CompatKey.from_json(key.to_json()) == key
    doc = key.to_json()
    del doc["cuda_version"]
    with pytest.raises(InvalidArgument, match="cuda_version"):
        CompatKey.from_json(doc)
    with pytest.raises(InvalidArgument, match="bogus"):
        CompatKey.from_json({**key.to_json(), "bogus": 1})
    with pytest.raises(InvalidArgument, match="tensor_parallel"):
        CompatKey.from_json({**key.to_json(), "tensor_parallel": "2"})


def test_snapshot_refuses_a_warm_restore_on_another_platform(write_sample) -> None:
    snap = open_snapshot(write_sample().path)
    dest = make_key(gpu_product="NVIDIA A100-SXM4-80GB", driver_version="535.0", torch_version="x")
    with pytest.raises(SnapshotIncompatible) as exc_info:
        snap.require_warm(dest)
    err = exc_info.value
    assert err.kind is ErrorKind.FAILED_PRECONDITION
    assert err.verdict.differing_fields == ("gpu_product", "driver_version", "torch_version")
    assert err.verdict.weights_reusable and not err.verdict.compiled_ok
    for field in ("gpu_product", "driver_version", "torch_version"):
        assert field in str(err)
    assert snap.require_warm(make_key()).warm_ok
