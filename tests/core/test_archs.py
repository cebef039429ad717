from __future__ import annotations

from fleetshift_daemon.core.archs import ModelArch
from fleetshift_daemon.core.perfmodel import ModelArch as ReexportedModelArch
from fleetshift_daemon.core.perfmodel import llama2_70b


def test_perfmodel_still_exports_the_same_class() -> None:
    assert ReexportedModelArch is ModelArch


def test_a_dense_model_touches_every_parameter_per_token() -> None:
    arch = llama2_70b()
    assert arch.active_param_count() == arch.param_count() == 68_976_648_192


def test_kv_cache_per_token_per_layer_counts_k_and_v_of_each_kv_head() -> None:
    # Llama-2-70B: 8 KV heads x 128 dims, K and V
    assert llama2_70b().kv_cache_elems_per_token() == 2 * 8 * 128
