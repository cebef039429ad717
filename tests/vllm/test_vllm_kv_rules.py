"""Which KV a vLLM worker takes, and what it says when it does not (no vLLM needed).

The compatibility key decides: KV written by a worker whose key differs in any field (GPU
product, TP degree, dtype, vLLM version...) is never read as raw tensors; the destination
recomputes and names the fields. A blob carries where its KV waits, and survives the trip.
"""

from __future__ import annotations

import json

from fleetshift.v1 import worker_pb2
from fleetshift_agent.vllm_worker.app import nixl_host
from fleetshift_agent.vllm_worker.kv import (
    TAIL_TOKENS,
    carried_tokens,
    export_carries_kv,
    key_fields,
    kv_refusal,
    nixl_tokens,
)
from fleetshift_agent.vllm_worker.server import (
    DISK_CONNECTOR,
    NIXL_CONNECTOR,
    ServerSpec,
    kv_transfer_config,
    server_env,
)
from fleetshift_agent.vllm_worker.sessions import Carried, KvRef, SessionSpec
from fleetshift_common.config import EngineArgs

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
    assert spec.kv_completion([4, 5], {"do_remote_decode": True}).prompt == (1, 2, 3, 4, 5)


NIXL_PARAMS: dict[str, object] = {
    "do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "e-1", "remote_host": "10.0.0.7", "remote_port": 5701, "tp_size": 1,
    "remote_num_tokens": 300,
}  # fmt: skip


def nixl_ref(**key: str | int) -> KvRef:
    return KvRef(NIXL_CONNECTOR, "10.0.0.7:5701", 300, {**KEY, **key}, "", NIXL_PARAMS)


def test_nixl_kv_travels_between_nixl_workers_whose_keys_agree() -> None:
    assert kv_refusal(nixl_ref(), NIXL_CONNECTOR, "", KEY) == ""
    note = kv_refusal(nixl_ref(dtype="bfloat16"), NIXL_CONNECTOR, "", KEY)
    assert note == "KV recomputed: the compatibility key differs in dtype"
    # one side without NIXL: the other cannot pull from it, nor read a disk store
    assert "this worker runs FleetShiftDiskConnector" in kv_refusal(
        nixl_ref(), DISK_CONNECTOR, "/kv", KEY
    )
    assert "this worker runs no KV connector" in kv_refusal(nixl_ref(), "", "", KEY)
    assert "this worker runs NIXL" in kv_refusal(ref(), NIXL_CONNECTOR, "", KEY)
    bare = KvRef(NIXL_CONNECTOR, "10.0.0.7:5701", 300, KEY, "", {})
    assert "no transfer parameters" in kv_refusal(bare, NIXL_CONNECTOR, "", KEY)


def test_a_nixl_blob_carries_vllms_parameters_to_the_destinations_request() -> None:
    spec = SessionSpec("s", (1, 2, 3), 10, 0.0, 1.0, 42)
    carried = Carried.from_blob(spec.to_blob([4], kv=nixl_ref()))
    assert carried.kv == nixl_ref()
    body = spec.completion([4], kv=carried.kv).body("m")
    assert body["kv_transfer_params"] == NIXL_PARAMS  # exactly what the source's vLLM said
    assert nixl_tokens(NIXL_PARAMS, 310) == 300 and nixl_tokens({}, 310) == 310
    assert nixl_tokens({"remote_num_tokens": 400}, 310) == 310  # never past the context


def test_a_nixl_worker_advertises_its_side_channel_on_its_own_address() -> None:
    """Another host's vLLM pulls the KV through the source's side channel, so it binds the
    address the worker listens on (the node's), on a port of its own per worker."""
    nixl = EngineArgs.from_json('{"kv_connector": "NixlConnector"}')
    spec = ServerSpec("py", "/m", "m", nixl, nixl_host="10.0.0.7", nixl_port=5701)
    env = server_env(spec, {})
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.7"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5701"
    config = json.loads(kv_transfer_config(nixl))
    assert config["kv_connector"] == NIXL_CONNECTOR and config["kv_buffer_device"] == "cpu"
    # a failed pull recomputes (the session goes on); the source keeps blocks for the TTL
    assert config["kv_load_failure_policy"] == "recompute"
    assert config["kv_connector_extra_config"] == {"kv_lease_duration": 600}
    disk = EngineArgs.from_json('{"kv_connector": "FleetShiftDiskConnector"}')
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in server_env(ServerSpec("py", "/m", "m", disk), {})
    assert nixl_host("10.0.0.7:0") == "10.0.0.7" and nixl_host("[fd00::7]:0") == "fd00::7"
    assert nixl_host("0.0.0.0:0") == "127.0.0.1" and nixl_host("127.0.0.1:0") == "127.0.0.1"


def test_a_precopy_stores_the_kv_once_and_its_deltas_carry_tokens() -> None:
    """Disk: the base export (while the session decodes) writes the KV, a delta after it
    none unless its session ran on more than TAIL_TOKENS past it (then the destination would
    compute them all inside the pause), so the pause before the last delta does not grow
    with the context. NIXL: an offer only once the session stands still (paused, or
    leaving), never a pre-copy's."""
    disk, n = DISK_CONNECTOR, 8192
    assert export_carries_kv(disk, 0, release=False, paused=False, context=n)  # pre-copy
    assert export_carries_kv(disk, 0, release=False, paused=True, context=n)  # stop-and-copy
    assert not export_carries_kv(disk, n, release=False, paused=True, context=n + 30)  # delta
    assert not export_carries_kv(disk, n, release=True, paused=True, context=n + TAIL_TOKENS)
    assert export_carries_kv(disk, n, release=False, paused=False, context=n + TAIL_TOKENS + 1)
    nixl = NIXL_CONNECTOR
    assert not export_carries_kv(nixl, 0, release=False, paused=False, context=n)
    assert export_carries_kv(nixl, n, release=False, paused=True, context=n + 30)
    assert export_carries_kv(nixl, 0, release=True, paused=False, context=n)


def test_a_delta_without_kv_loads_the_precopied_blocks_and_computes_the_rest() -> None:
    """The load names the export's token count, so a request longer than the pre-copied
    context loads exactly the export's blocks."""
    spec = SessionSpec("s", tuple(range(3, 303)), 200, 0.0, 1.0, 0)
    base = KvRef(DISK_CONNECTOR, "/kv", carried_tokens(300 + 5, 128), KEY, "a" * 32)
    request = spec.completion(list(range(40)), kv=base)  # 40 generated since: 340 tokens
    assert request.kv_transfer_params == {
        "fleetshift_kv": "load", "fleetshift_kv_id": "a" * 32, "fleetshift_kv_tokens": 256
    }  # fmt: skip
