"""The pure parts of per-(model, GPU kind) calibrations: reading a profile, refusing one of the
wrong hardware, and a CPU as a hardware kind from its measured peaks."""

from __future__ import annotations

import pytest

from fleetshift_common.errors import InvalidArgument
from fleetshift_daemon.core.archs import ModelArch
from fleetshift_daemon.core.gpus import A100_SXM_80GB, H100_SXM, GpuCatalogue
from fleetshift_daemon.core.measurements import cpu_kind
from fleetshift_daemon.core.model_calibrations import (
    Calibration,
    Calibrations,
    check_hardware,
    parse_profile,
)
from fleetshift_daemon.core.perf_factors import shipped_factors
from fleetshift_daemon.core.perfmodel import Deployment, Dtype, PerfModel, llama2_70b

HEADER = "model,hardware,tensor_parallel,prompt_size,batch_size,token_size,prompt_time,token_time\n"


def test_a_profile_is_read_in_seconds_and_refused_with_its_line_named() -> None:
    [row] = parse_profile(HEADER + "m,h100-80gb,2,512,4,128,250.0,40.0\n")
    assert (row.tp, row.prompt_size, row.batch_size, row.token_size) == (2, 512, 4, 128)
    assert row.prompt_s == pytest.approx(0.25) and row.token_s == pytest.approx(0.04)
    with pytest.raises(InvalidArgument, match="line 3, token_time must be > 0"):
        parse_profile(HEADER + "m,x,1,8,1,8,1.0,2.0\nm,x,1,8,1,8,1.0,-2.0\n")
    with pytest.raises(InvalidArgument, match="one hardware kind"):
        parse_profile(HEADER + "m,x,1,8,1,8,1.0,2.0\nm,y,1,8,1,8,1.0,2.0\n")
    with pytest.raises(InvalidArgument, match="no rows"):
        parse_profile(HEADER)


def test_a_profile_calibrates_only_the_kind_it_was_measured_on() -> None:
    check_hardware("h100-80gb", H100_SXM)
    check_hardware("nvidia-h100-80gb-hbm3", H100_SXM)  # the operator names the kind
    with pytest.raises(InvalidArgument, match="is H100-SXM, not gpu_kind 'A100-SXM-80GB'"):
        check_hardware("h100-80gb", A100_SXM_80GB)
    with pytest.raises(InvalidArgument, match="measured on a CPU"):
        check_hardware("cpu-amd-epyc", H100_SXM)


def test_a_cpu_kind_carries_the_measured_peaks_and_predicts_slower_than_a_gpu() -> None:
    kind = cpu_kind("cpu-amd-epyc", {"matmul_tflops": 0.09, "copy_gbps": 24.0}, 64.0)
    # one convention (the loader's and the CLI's): a float32 worker is modelled as FP32, which
    # counts 4-byte values and runs matmuls at half bf16_tflops, so the FP32 rate is doubled
    # into that field and the copy rate is the bytes/s measured
    assert kind.bf16_tflops == pytest.approx(0.18) and kind.hbm_tbps == pytest.approx(0.024)
    bf16 = cpu_kind("cpu-amd-epyc", {"matmul_tflops": 0.09, "copy_gbps": 24.0}, 24.0, "bfloat16")
    assert bf16.bf16_tflops == pytest.approx(0.09) and bf16.hbm_tbps == pytest.approx(0.024)
    with pytest.raises(InvalidArgument, match=r"measured_peaks\.copy_gbps must be a positive"):
        cpu_kind("cpu-amd-epyc", {"matmul_tflops": 0.09, "copy_gbps": "fast"}, 24.0)
    arch = llama2_70b()
    # Llama-2-7B's shape: big enough that streaming its weights, not the engine's fixed
    # per-step overhead (a serving-stack property the model carries over), sets the step time
    llama7b = arch.__class__(**{**arch.__dict__, "n_layers": 32, "hidden": 4096, "intermediate": 11008, "n_heads": 32, "n_kv_heads": 32, "head_dim": 128})  # fmt: skip
    perf = PerfModel()
    cpu = perf.decode_step_time_s(Deployment(llama7b, kind, 1, Dtype.FP32), 1, 128)
    gpu = perf.decode_step_time_s(Deployment(llama7b, H100_SXM, 1), 1, 128)
    assert cpu > 50 * gpu


LLAMA2_7B_CONFIG = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


class _Store:
    def __init__(self) -> None:
        self.kept: list[Calibration] = []

    def all(self) -> list[Calibration]:
        return list(self.kept)

    def put(self, calibration: Calibration) -> None:
        self.kept.append(calibration)


def test_an_uploaded_profile_is_fitted_at_the_dtype_its_config_declares() -> None:
    """A float32 profile streams 4 bytes per weight and KV value: fitted as BF16 (what the
    daemon did before) the same times read as half the bandwidth they took."""
    config = {**LLAMA2_7B_CONFIG, "torch_dtype": "float32"}
    arch = ModelArch.from_hf_config("llama2-7b", config)
    truth = shipped_factors().for_kind("H100-SXM")
    perf = PerfModel(shipped_factors())
    dep = Deployment(arch, H100_SXM, 1, Dtype.FP32)
    lines = [HEADER.strip()]
    for prompt in (128, 512, 2048):
        for batch in (1, 4, 16, 64):
            pre = perf.prefill_time_s(dep, [prompt] * batch) * 1e3
            dec = perf.decode_step_time_s(dep, batch, batch * (prompt + 64)) * 1e3
            lines.append(f"llama2-7b,h100-80gb,1,{prompt},{batch},128,{pre:.4f},{dec:.4f}")
    profile = "\n".join(lines) + "\n"

    def upload(torch_dtype: str) -> Calibration:
        cals = Calibrations(_Store(), GpuCatalogue([H100_SXM]), {"m": llama2_70b()}, lambda: 0.0)
        return cals.upload("m", "H100-SXM", profile, {**config, "torch_dtype": torch_dtype})

    fp32 = upload("float32")
    assert fp32.median_error_pct < 1.0
    # within its prior's pull (centre 0.85) on a profile at one TP degree
    assert fp32.factors.bw_eff == pytest.approx(truth.bw_eff, rel=0.06)
    assert fp32.factors.gemm_eff == pytest.approx(truth.gemm_eff, rel=0.03)
    as_bf16 = upload("bfloat16")  # the same times read as 2-byte values
    assert as_bf16.factors.bw_eff < 0.75 * truth.bw_eff
    assert as_bf16.factors.gemm_eff < 0.75 * truth.gemm_eff
    with pytest.raises(InvalidArgument, match="torch_dtype: 'int3' is not one of") as err:
        upload("int3")
    assert err.value.field == "model_config.torch_dtype"
