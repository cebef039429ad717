"""The disk connector's store does not grow forever (no vLLM needed; the vLLM tier checks the
same with real servers: tests/vllm/test_vllm_kv_moves.py).

Each export's KV is a folder of its own, named by the export's id; the importing worker
deletes it once vLLM has loaded it, and every worker with the store deletes what nobody
imported after the TTL. Only FleetShift's folders are touched, and the requests that write
and read them say so in vLLM's kv_transfer_params (no other request uses the store).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fleetshift_agent.vllm_worker import kv_store
from fleetshift_agent.vllm_worker.server import DISK_CONNECTOR
from fleetshift_agent.vllm_worker.sessions import Carried, KvRef, SessionSpec, kv_params
from fleetshift_common.config import ConfigError, EngineArgs

NOW = 1_800_000_000.0


def export(store: Path, export_id: str, age_s: float, digest: str = "a" * 32) -> Path:
    folder = store / f"fs-{export_id}-{digest}"
    folder.mkdir(parents=True)
    (folder / "model.layers.0.self_attn.attn.safetensors").write_bytes(b"kv")
    os.utime(folder, (NOW - age_s, NOW - age_s))
    return folder


def test_the_sweep_deletes_only_fleetshifts_exports_older_than_the_ttl(tmp_path: Path) -> None:
    old, fresh = kv_store.new_id(), kv_store.new_id()
    export(tmp_path, old, age_s=601)
    export(tmp_path, fresh, age_s=599)
    foreign = tmp_path / "0123abcd"  # upstream ExampleConnector's folders are not ours
    foreign.mkdir()
    os.utime(foreign, (NOW - 10_000, NOW - 10_000))

    assert kv_store.sweep(tmp_path, ttl_s=600, now=NOW) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"fs-{fresh}-{'a' * 32}", "0123abcd"]
    )
    assert kv_store.sweep(tmp_path / "missing", ttl_s=600, now=NOW) == 0


def test_an_import_removes_exactly_its_exports_folder(tmp_path: Path) -> None:
    mine, other = kv_store.new_id(), kv_store.new_id()
    export(tmp_path, mine, age_s=1)
    export(tmp_path, other, age_s=1)
    assert kv_store.age_s(tmp_path, mine, NOW) == pytest.approx(1)

    assert kv_store.remove(tmp_path, mine) == 1
    assert [p.name.split("-")[1] for p in tmp_path.iterdir()] == [other]
    assert kv_store.age_s(tmp_path, mine, NOW) is None
    assert kv_store.remove(tmp_path, mine) == 0  # once
    assert kv_store.remove(tmp_path, "*") == 0  # never a pattern
    assert kv_store.remove(tmp_path, "../x") == 0


def test_only_the_export_and_its_import_name_the_store() -> None:
    spec = SessionSpec("s", (1, 2, 3), 10, 0.0, 1.0, 42)
    export_id = kv_store.new_id()
    store = spec.kv_completion([4], kv_params("store", export_id)).body("m")
    assert store["kv_transfer_params"] == {"fleetshift_kv": "store", "fleetshift_kv_id": export_id}
    ref = KvRef(DISK_CONNECTOR, "/kv", 128, {"dtype": "float32"}, export_id)
    load = spec.completion([4], kv=ref).body("m")
    # The load names the export's token count: after a pre-copy the loading request is longer.
    assert load["kv_transfer_params"] == {
        "fleetshift_kv": "load", "fleetshift_kv_id": export_id, "fleetshift_kv_tokens": 128
    }  # fmt: skip
    assert "kv_transfer_params" not in spec.completion([4]).body("m")  # any other request
    assert Carried.from_blob(spec.to_blob([4], kv=ref)).kv == ref


def test_the_ttl_must_be_positive_and_is_named() -> None:
    assert EngineArgs.from_json('{"kv_store_ttl_s": 30}').kv_store_ttl_s == 30
    with pytest.raises(ConfigError) as err:
        EngineArgs.from_json('{"kv_store_ttl_s": 0}')
    assert err.value.field == "engine_args.kv_store_ttl_s"
