"""The pure parts of per-(model, GPU kind) calibrations: reading a profile, refusing one of the
wrong hardware, and a CPU as a hardware kind from its measured peaks."""

from __future__ import annotations

import pytest

from fleetshift_common.errors import InvalidArgument
from fleetshift_daemon.core.gpus import A100_SXM_80GB, H100_SXM
from fleetshift_daemon.core.measurements import cpu_kind
from fleetshift_daemon.core.model_calibrations import check_hardware, parse_profile
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
