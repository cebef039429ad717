"""Which KV a vLLM worker takes, and what it says when it does not (no vLLM needed).

The compatibility key decides: KV written by a worker whose key differs in any field (GPU
product, TP degree, dtype, vLLM version...) is never read as raw tensors; the destination
recomputes and names the fields. A blob carries where its KV waits, and survives the trip.
"""

from __future__ import annotations

from fleetshift.v1 import worker_pb2
from fleetshift_agent.vllm_worker.kv import carried_tokens, key_fields, kv_refusal
from fleetshift_agent.vllm_worker.server import DISK_CONNECTOR
from fleetshift_agent.vllm_worker.sessions import Carried, KvRef, SessionSpec

KEY = key_fields(
    worker_pb2.WorkerCompatKey(
        gpu_product="NVIDIA H100 80GB HBM3", gpu_count=1, engine_name="vllm",
        engine_version="0.32.0", model_id="m", dtype="float32", tensor_parallel=1,
    )
)  # fmt: skip


def ref(**key: str | int) -> KvRef:
    return KvRef(DISK_CONNECTOR, "/kv", 256, {**KEY, **key})


def test_kv_travels_only_where_the_key_and_the_store_agree() -> None:
    assert kv_refusal(ref(), DISK_CONNECTOR, "/kv", KEY) == ""
    for field, value in [
        ("gpu_product", "NVIDIA A100-SXM4-80GB"),
        ("tensor_parallel", 2),
        ("dtype", "bfloat16"),
        ("engine_version", "0.33.0"),
    ]:
        note = kv_refusal(ref(**{field: value}), DISK_CONNECTOR, "/kv", KEY)
        assert note == f"KV recomputed: the compatibility key differs in {field}"
    assert "reads '/other'" in kv_refusal(ref(), DISK_CONNECTOR, "/other", KEY)
    assert "no disk KV connector" in kv_refusal(ref(), "", "", KEY)
    assert "no disk KV connector" in kv_refusal(ref(), "ExampleConnector", "/kv", KEY)
    assert "offered no KV" in kv_refusal(None, DISK_CONNECTOR, "/kv", KEY)


def test_only_whole_blocks_before_the_last_token_travel() -> None:
    assert [carried_tokens(n, 128) for n in (1, 128, 129, 130, 256, 257, 300)] == [
        0, 0, 128, 128, 128, 256, 256,
    ]  # fmt: skip
    assert carried_tokens(300, 0) == 0


def test_a_blob_carries_its_kv_reference() -> None:
    spec = SessionSpec("s", (1, 2, 3), 10, 0.7, 1.0, 42, (9,))
    carried = Carried.from_blob(spec.to_blob([4, 5], kv=ref()))
    assert carried.spec == spec and carried.generated == [4, 5] and carried.kv == ref()
    assert Carried.from_blob(spec.to_blob([4])).kv is None
    # One session, several vLLM requests (pause, move): never one request id twice.
    assert spec.completion([4]).request_id != spec.completion([4]).request_id
    assert spec.kv_completion([4, 5], "0" * 32).prompt == (1, 2, 3, 4, 5)
