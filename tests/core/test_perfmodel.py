from __future__ import annotations

import dataclasses

import pytest

from fleetshift_common.errors import FleetShiftError
from fleetshift_daemon.core.corrections import CorrectionTable, Phase
from fleetshift_daemon.core.errors import InvalidModelArch, UnsupportedDeployment
from fleetshift_daemon.core.gpus import A100_SXM_80GB, H100_SXM, H200_SXM, L40S
from fleetshift_daemon.core.perf_factors import EfficiencyFactors, KindFactors
from fleetshift_daemon.core.perfmodel import Deployment, Dtype, ModelArch, PerfModel, llama2_70b

LLAMA2_70B_HF = {
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}


def test_llama2_70b_from_hf_config_matches_the_published_parameter_count() -> None:
    arch = ModelArch.from_hf_config("llama2-70b", LLAMA2_70B_HF)
    assert arch == llama2_70b()
    # Hugging Face reports 68,976,648,192 parameters for Llama-2-70b-hf.
    assert arch.param_count() == 68_976_648_192


def test_explicit_head_dim_and_gpt_neox_keys() -> None:
    qwen = ModelArch.from_hf_config(
        "q",
        {
            "model_type": "qwen2",
            "hidden_size": 2048,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 256,
            "num_hidden_layers": 2,
            "intermediate_size": 4096,
            "vocab_size": 1000,
        },
    )
    assert qwen.head_dim == 256 and qwen.attn_dim == 4096
    neox = ModelArch.from_hf_config(
        "n",
        {
            "model_type": "gpt_neox",
            "hidden_size": 512,
            "num_attention_heads": 8,
            "num_hidden_layers": 2,
            "intermediate_size": 2048,
            "vocab_size": 1000,
            "hidden_act": "gelu",
        },
    )
    assert not neox.gated_mlp and neox.n_kv_heads == 8


@pytest.mark.parametrize(
    ("cfg", "field"),
    [
        ({k: v for k, v in LLAMA2_70B_HF.items() if k != "vocab_size"}, "vocab_size"),
        ({**LLAMA2_70B_HF, "num_key_value_heads": 7}, "num_key_value_heads"),
        ({**LLAMA2_70B_HF, "num_hidden_layers": 0}, "num_hidden_layers"),
        ({**LLAMA2_70B_HF, "hidden_size": "big"}, "hidden_size"),
    ],
)
def test_bad_hf_config_names_the_field(cfg: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidModelArch) as exc:
        ModelArch.from_hf_config("x", cfg)
    assert exc.value.field == field


def test_kv_bytes_count_grouped_query_heads() -> None:
    dep = Deployment(llama2_70b(), H100_SXM, 4)
    # 2 (K,V) x 80 layers x 8 KV heads x 128 dims x 2 bytes
    assert PerfModel().kv_bytes_per_token(dep) == 327_680


def test_capacity_follows_memory_and_dtype() -> None:
    m, arch = PerfModel(), llama2_70b()
    h100, h200 = Deployment(arch, H100_SXM, 2), Deployment(arch, H200_SXM, 2)
    assert m.kv_capacity_tokens(h200) > 5 * m.kv_capacity_tokens(h100) > 0
    fp8 = Deployment(arch, H100_SXM, 2, Dtype.FP8)
    int4 = Deployment(arch, H100_SXM, 2, Dtype.INT4_W)
    assert m.weight_bytes(fp8) < 0.55 * m.weight_bytes(h100)
    assert m.weight_bytes(int4) < 0.3 * m.weight_bytes(h100)
    assert m.kv_capacity_tokens(int4) > m.kv_capacity_tokens(fp8) > m.kv_capacity_tokens(h100)
    assert m.kv_capacity_tokens(h100, reserve_fraction=0.0) > m.kv_capacity_tokens(h100)


@pytest.mark.parametrize(
    ("dep", "field"),
    [
        (Deployment(llama2_70b(), H100_SXM, 1), "tp"),  # 138 GB of weights on one 80 GB GPU
        (Deployment(llama2_70b(), L40S, 2), "tp"),
        (Deployment(llama2_70b(), H100_SXM, 3), "tp"),  # 3 does not divide 64 heads
        (Deployment(llama2_70b(), A100_SXM_80GB, 4, Dtype.FP8), "dtype"),
    ],
)
def test_unsupported_deployments_raise_typed_errors(dep: Deployment, field: str) -> None:
    m = PerfModel()
    assert not m.fits(dep)
    with pytest.raises(UnsupportedDeployment) as exc:
        m.decode_step_time_s(dep, 1, 100)
    assert exc.value.field == field
    assert isinstance(exc.value, FleetShiftError)


def test_decode_prefers_bandwidth_and_prefill_prefers_compute() -> None:
    m, arch = PerfModel(), llama2_70b()
    a100, h100, h200 = (Deployment(arch, g, 4) for g in (A100_SXM_80GB, H100_SXM, H200_SXM))
    # Same compute: prefill within a few % on H100 and H200; A100 is ~3x slower.
    p100, p200, pa = (m.prefill_time_s(d, [2048]) for d in (h100, h200, a100))
    assert abs(p200 / p100 - 1) < 0.05
    assert pa > 1.8 * p100
    # Decode where streaming weights + KV is most of the step (TP 2: 69 GB of weights per
    # GPU, a batch that fills H100's KV space): H200's 4.8 TB/s beats H100's 3.35.
    h100_2, h200_2 = Deployment(arch, H100_SXM, 2), Deployment(arch, H200_SXM, 2)
    assert m.kv_capacity_tokens(h100_2) >= 16 * 2048
    d100 = m.decode_step_time_s(h100_2, 16, 16 * 2048)
    d200 = m.decode_step_time_s(h200_2, 16, 16 * 2048)
    assert d200 < 0.9 * d100


def test_times_grow_with_work_and_dtype_changes_rates() -> None:
    m, arch = PerfModel(), llama2_70b()
    dep = Deployment(arch, H100_SXM, 4)
    assert m.prefill_time_s(dep, [4096]) > m.prefill_time_s(dep, [2048]) > 0
    # same tokens, one long sequence costs more attention than several short ones
    assert m.prefill_time_s(dep, [8192]) > m.prefill_time_s(dep, [1024] * 8)
    assert m.decode_step_time_s(dep, 32, 32_000) > m.decode_step_time_s(dep, 1, 1000)
    # dtypes at TP 2, where the GEMMs are most of a pass (at TP 4 the engine's fixed and
    # per-token costs, which no dtype changes, are a third of it)
    dep = Deployment(arch, H100_SXM, 2)
    fp8 = Deployment(arch, H100_SXM, 2, Dtype.FP8)
    int4 = Deployment(arch, H100_SXM, 2, Dtype.INT4_W)
    assert m.prefill_time_s(fp8, [4096]) < 0.7 * m.prefill_time_s(dep, [4096])
    # INT4 weight-only computes at BF16 rate but streams a quarter of the weight bytes
    assert m.prefill_time_s(int4, [4096]) == pytest.approx(m.prefill_time_s(dep, [4096]), 0.1)
    assert m.decode_step_time_s(int4, 1, 1000) < 0.8 * m.decode_step_time_s(dep, 1, 1000)


def test_online_correction_scales_predictions_within_bounds() -> None:
    table = CorrectionTable()
    m = PerfModel(corrections=table)
    dep = Deployment(llama2_70b(), H100_SXM, 4)
    base = m.decode_step_time_s(dep, 8, 8000)
    for _ in range(200):
        table.observe("H100-SXM", Phase.DECODE, observed_s=1.3 * base, predicted_s=base)
    assert m.decode_step_time_s(dep, 8, 8000) == pytest.approx(1.3 * base, rel=0.01)
    assert m.prefill_time_s(dep, [512]) == PerfModel().prefill_time_s(dep, [512])
    for _ in range(200):
        table.observe("H100-SXM", Phase.PREFILL, observed_s=100.0, predicted_s=0.001)
    assert table.factor("H100-SXM", Phase.PREFILL) == 2.0  # bounded


def test_one_noisy_observation_moves_the_correction_only_a_little() -> None:
    table = CorrectionTable()
    table.observe("A100-SXM-80GB", Phase.DECODE, 1.0, 1.0)
    table.observe("A100-SXM-80GB", Phase.DECODE, 1.9, 1.0)
    assert 1.0 < table.factor("A100-SXM-80GB", Phase.DECODE) < 1.1


def test_worker_measurements_correct_the_model_per_kind_and_phase() -> None:
    m = PerfModel(corrections=CorrectionTable())
    dep = Deployment(llama2_70b(), H200_SXM, 2)
    predicted = m.decode_step_time_s(dep, 16, 16 * 1500)
    for _ in range(100):
        m.record_decode_step(dep, 16, 16 * 1500, observed_s=0.8 * predicted)
    assert m.decode_step_time_s(dep, 16, 16 * 1500) == pytest.approx(0.8 * predicted, rel=0.01)
    other = Deployment(llama2_70b(), H100_SXM, 2)
    assert m.decode_step_time_s(other, 16, 16 * 1500) == PerfModel().decode_step_time_s(
        other, 16, 16 * 1500
    )
    factor = m.record_prefill(dep, [1000, 2000], observed_s=10.0)
    assert 1.0 < factor <= 2.0


def test_a_calibration_of_the_model_on_its_kind_takes_precedence_and_says_measured() -> None:
    from dataclasses import replace

    from fleetshift_daemon.core.perf_factors import shipped_factors

    arch = llama2_70b()
    h100, a100 = Deployment(arch, H100_SXM, 4), Deployment(arch, A100_SXM_80GB, 4)
    slower = replace(shipped_factors().for_kind("H100-SXM"), bw_eff=0.35)
    m = PerfModel(calibrations={(arch.name, "H100-SXM"): slower})
    base = PerfModel()
    assert m.is_measured(h100) and not m.is_measured(a100)
    assert not base.is_measured(h100)
    assert m.factors_for(h100) == slower
    assert m.decode_step_time_s(h100, 1, 1000) > 1.2 * base.decode_step_time_s(h100, 1, 1000)
    # another model on the same kind, and the same model on another kind, are untouched
    other = Deployment(replace(arch, name="llama2-70b-copy"), H100_SXM, 4)
    assert not m.is_measured(other)
    assert m.decode_step_time_s(other, 1, 1000) == base.decode_step_time_s(h100, 1, 1000)
    assert m.decode_step_time_s(a100, 1, 1000) == base.decode_step_time_s(a100, 1, 1000)


def test_factors_round_trip_through_plain_numbers_and_bad_ones_are_named() -> None:
    from fleetshift_daemon.core.perf_factors import KindFactors, shipped_factors

    kf = shipped_factors().for_kind("A100-SXM-80GB")
    assert KindFactors.from_mapping(kf.to_dict()) == kf
    bad = {**kf.to_dict(), "bw_eff": "fast"}
    with pytest.raises(FleetShiftError) as exc:
        KindFactors.from_mapping(bad)
    assert exc.value.field == "bw_eff"
    with pytest.raises(FleetShiftError) as exc:
        KindFactors.from_mapping({**kf.to_dict(), "warp_speed": 1.0})
    assert exc.value.field == "warp_speed"


def test_a_mixture_of_experts_computes_with_its_active_parameters_and_stores_all() -> None:
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class RoutedHalf(ModelArch):
        """Llama-2-70B's shapes, but each token multiplied through half its linear weights,
        and a cache of a quarter of its KV (as an MoE and an MLA-style latent would say)."""

        def active_param_count(self) -> int:
            linear = self.param_count() - self.embedding_params - self.hidden
            return self.param_count() - linear // 2

        def kv_cache_elems_per_token(self) -> int:
            return super().kv_cache_elems_per_token() // 4

    dense = llama2_70b()
    moe = RoutedHalf(**{f: getattr(dense, f) for f in dense.__dataclass_fields__})
    m = PerfModel()
    d_dep, m_dep = Deployment(dense, H100_SXM, 8), Deployment(moe, H100_SXM, 8)
    assert m.weight_bytes(m_dep) == m.weight_bytes(d_dep)  # every expert is in memory
    assert m.kv_bytes_per_token(m_dep) == m.kv_bytes_per_token(d_dep) // 4
    dense_c, moe_c = m.coefficients(d_dep), m.coefficients(m_dep)
    # the per-token GEMM work halves; the engine's and the link's share does not
    assert 0.5 * dense_c.p_tok < moe_c.p_tok < 0.8 * dense_c.p_tok
    assert moe_c.d0 == dense_c.d0  # a decode step still streams every weight
    assert m.prefill_time_s(m_dep, [4096]) < 0.85 * m.prefill_time_s(d_dep, [4096])


def test_the_time_a_step_gains_with_tp_is_per_worker_not_per_layer() -> None:
    """Issue 12: the step's fixed time grows with TP on the measured stacks because the engine
    drives every worker each step; it must not be charged per layer (a model twice as deep
    would inherit twice the growth). With the shipped factors, a 40- and an 80-layer model
    gain the same fixed time from TP 2 to TP 8, within the (1 us per hop) link latency."""
    perf = PerfModel()
    deep = llama2_70b()
    shallow = ModelArch(**{**deep.__dict__, "name": "half", "n_layers": 40})

    def growth(arch: ModelArch) -> float:
        d0 = [perf.coefficients(Deployment(arch, A100_SXM_80GB, tp)).d0 for tp in (2, 8)]
        weights = [perf.weight_bytes(Deployment(arch, A100_SXM_80GB, tp)) for tp in (2, 8)]
        kf = perf.factors_for(Deployment(arch, A100_SXM_80GB, 2))
        rate = A100_SXM_80GB.hbm_tbps * 1e12 * kf.bw_eff
        return (d0[1] - weights[1] / (8 * rate)) - (d0[0] - weights[0] / (2 * rate))

    kf = perf.factors.for_kind(A100_SXM_80GB.name)
    per_worker = 6 * kf.worker_overhead_s
    assert per_worker > 0.01  # the measured growth: ~2.5 ms per extra worker per step
    link = 2 * 40 * 2 * (8 - 2) * kf.link_latency_s  # 40 layers' extra ring hops
    assert growth(shallow) == pytest.approx(per_worker, abs=1.5 * link)
    assert growth(deep) - growth(shallow) == pytest.approx(link, rel=1e-6)
    assert link < 0.1 * per_worker


def test_a_cpu_kind_is_the_reference_engine_one_query_row_at_a_time() -> None:
    """On a CPU kind the reference engine attends one query row at a time, so a prefill re-reads
    the KV prefix per row (time that grows with the square of the prompt) and nothing is
    padded to tensor-core tiles (a decode step's one query row is not 33 rows)."""
    from fleetshift_daemon.core.measurements import cpu_kind

    cpu = cpu_kind("cpu-amd-epyc", {"matmul_tflops": 0.09, "copy_gbps": 24.0}, 24.0)
    small = ModelArch("small", 4, 512, 8, 4, 1408, 8000, 64)
    on_cpu = PerfModel().coefficients(Deployment(small, cpu, 1, Dtype.FP32))
    kv_bytes = 4 * 2 * 4 * 64 * 4  # layers x (K, V) x KV heads x head dim x float32
    kf = PerfModel().factors.for_kind(cpu.name)
    rate = 24e9 * kf.bw_eff
    assert on_cpu.p_sq >= kv_bytes / rate / 2  # query i reads i keys' K and V
    as_gpu = dataclasses.replace(cpu, name="GPU-like")  # same figures, a GPU engine's shape
    on_gpu = PerfModel().coefficients(Deployment(small, as_gpu, 1, Dtype.FP32))
    assert on_gpu.p_sq < on_cpu.p_sq and on_gpu.d_ctx > 2 * on_cpu.d_ctx


def test_a_prefill_pass_pays_eager_launches_per_layer_and_a_decode_step_does_not() -> None:
    """GPU serving stacks replay decode steps from a CUDA graph but run prefill eagerly, so a
    prefill pass launches every layer's kernels: a time per layer that decode lacks. The host
    launches while the device works, so the launches are a floor under a short pass (as the
    weights' streaming is) and vanish under a long pass's device work."""
    h100 = PerfModel().factors.for_kind(H100_SXM.name)
    assert h100.prefill_layer_s > 0  # fitted on the reference table: ~0.4 ms per layer
    none = dataclasses.replace(h100, prefill_layer_s=0.0, step_overhead_s=0.0)
    launches = dataclasses.replace(none, prefill_layer_s=h100.prefill_layer_s)
    for layers in (40, 80):
        arch = dataclasses.replace(llama2_70b(), n_layers=layers)
        dep = Deployment(arch, H100_SXM, 8)
        with_launch = PerfModel(EfficiencyFactors({H100_SXM.name: launches}))
        without = PerfModel(EfficiencyFactors({H100_SXM.name: none}))
        short_with, short_without = (m.prefill_time_s(dep, [16]) for m in (with_launch, without))
        assert short_with >= layers * h100.prefill_layer_s > short_without
        long_with, long_without = (m.prefill_time_s(dep, [8192]) for m in (with_launch, without))
        assert long_with == pytest.approx(long_without)  # hidden under the device's work
        a, b = with_launch.coefficients(dep), without.coefficients(dep)
        assert a.d0 == b.d0 and a.d_seq == b.d_seq


def test_the_long_pass_slowdown_rides_on_the_all_reduces_and_is_absent_on_one_gpu() -> None:
    """The slowdown of a pass beyond ``long_pass_tokens`` is stated at TP 2 and scales with the
    bytes a ring all-reduce moves per GPU, 2 (t-1) / t: x1.5 at TP 4, x1.75 at TP 8, none on
    one GPU (no all-reduce)."""
    kf = PerfModel().factors.for_kind(A100_SXM_80GB.name)
    assert kf.long_pass_token_s > 0 and kf.long_pass_tokens > 0
    small = ModelArch("small", 16, 2048, 16, 8, 5632, 32000, 128)
    perf = PerfModel()
    co = {t: perf.coefficients(Deployment(small, A100_SXM_80GB, t)) for t in (1, 2, 4, 8)}
    assert co[1].p_knee == 0.0
    assert co[2].p_knee == pytest.approx(kf.long_pass_token_s)
    assert co[4].p_knee / co[2].p_knee == pytest.approx(1.5)
    assert co[8].p_knee / co[2].p_knee == pytest.approx(1.75)
    n = kf.long_pass_tokens + 1024  # a pass well past the threshold
    for t, extra in ((1, 0.0), (2, 512 * kf.long_pass_token_s)):
        c = co[t]
        step = c.prefill_s(n + 512, 0.0, 1) - c.prefill_s(n, 0.0, 1)
        assert step == pytest.approx(512 * c.p_tok + extra)


def test_a_contended_cpu_runs_the_reference_engine_python_as_much_slower_as_its_matmuls() -> None:
    """On a CPU kind the engine's own times run on the core that does the matmuls: a host whose
    measured matmul rate is half (another process holds half the core) takes twice as long
    per step, per sequence and per layer row; streaming bytes is unchanged."""
    from fleetshift_daemon.core.measurements import cpu_kind

    small = ModelArch("small", 4, 512, 8, 4, 1408, 8000, 64)
    quiet = cpu_kind("cpu-amd-epyc", {"matmul_tflops": 0.08, "copy_gbps": 24.0}, 24.0)
    busy = cpu_kind("cpu-amd-epyc", {"matmul_tflops": 0.04, "copy_gbps": 24.0}, 24.0)
    kf = KindFactors(
        gemm_eff=0.7, bw_eff=0.85, link_latency_s=1e-6, link_eff=0.7, step_overhead_s=0.01,
        seq_overhead_s=1e-3, prefill_seq_overhead_s=1e-3, layer_row_s=1e-4,
    )  # fmt: skip
    perf = PerfModel(EfficiencyFactors({quiet.name: kf}))
    fast, slow = (perf.coefficients(Deployment(small, k, 1, Dtype.FP32)) for k in (quiet, busy))
    weights = perf.weight_bytes(Deployment(small, quiet, 1, Dtype.FP32)) / (24e9 * kf.bw_eff)
    assert slow.d0 - weights == pytest.approx(2 * (fast.d0 - weights))
    assert slow.d_seq == pytest.approx(2 * fast.d_seq)  # rows, per-sequence time and GEMMs
    assert slow.p_seq == pytest.approx(2 * fast.p_seq)
    # the factors are stated at an idle core: 86 GFLOP/s float32 (0.172 in the FP32 convention)
    idle = cpu_kind("cpu-amd-epyc", {"matmul_tflops": 0.086, "copy_gbps": 24.0}, 24.0)
    at_idle = perf.coefficients(Deployment(small, idle, 1, Dtype.FP32))
    idle_weights = perf.weight_bytes(Deployment(small, idle, 1, Dtype.FP32)) / (24e9 * kf.bw_eff)
    assert at_idle.d0 - idle_weights == pytest.approx(kf.step_overhead_s)


def test_the_reference_engine_computes_whole_16_row_chunks() -> None:
    """The reference engine multiplies in fixed 16-row chunks (a token's numbers must not
    depend on its batch): a decode step of 1 to 16 sequences computes 16 rows of every GEMM
    and of the LM head, and the 17th sequence costs another 16 rows."""
    from fleetshift_daemon.core.measurements import cpu_kind

    cpu = cpu_kind("cpu-amd-epyc", {"matmul_tflops": 0.09, "copy_gbps": 24.0}, 24.0)
    small = ModelArch("small", 4, 512, 8, 4, 1408, 8000, 64)
    perf = PerfModel()
    dep = Deployment(small, cpu, 1, Dtype.FP32)
    c = perf.coefficients(dep)
    assert c.row_chunk == 16 and c.d_row > 0
    step = [perf.decode_step_time_s(dep, b, 0) for b in (1, 16, 17)]
    assert step[1] - step[0] == pytest.approx(15 * c.d_seq)  # bookkeeping only, no GEMM rows
    assert step[2] - step[1] == pytest.approx(c.d_seq + 16 * c.d_row)
    gpu = perf.coefficients(Deployment(small, H100_SXM, 1))
    assert gpu.row_chunk == 0 and gpu.d_row == gpu.p_row == gpu.p_head == 0.0


def test_weights_larger_than_the_cores_cache_stream_in_again_for_every_chunk() -> None:
    """The reference engine multiplies each layer's weights once per 16-row chunk. A weight
    group larger than the core's own cache is read from memory again by every chunk, under the
    multiply: a chunk takes the longer of the two. On a host with fast matmuls and slow memory
    that is a stall per chunk; a group that fits the cache, or a GPU engine, has none."""
    from fleetshift_daemon.core.measurements import cpu_kind

    mid = ModelArch("mid", 6, 768, 12, 3, 2048, 8000, 64)
    slow_memory = cpu_kind("cpu-x", {"matmul_tflops": 0.1, "copy_gbps": 2.0}, 24.0)
    kf = KindFactors(
        gemm_eff=0.5, bw_eff=0.8, link_latency_s=1e-6, link_eff=0.7, step_overhead_s=0.01,
        seq_overhead_s=1e-3, prefill_seq_overhead_s=1e-3, layer_row_s=1e-4,
    )  # fmt: skip
    perf = PerfModel(EfficiencyFactors({slow_memory.name: kf}))
    dep = Deployment(mid, slow_memory, 1, Dtype.FP32)
    c = perf.coefficients(dep)
    gemm, mem = 0.1e12 * kf.gemm_eff, 2e9 * kf.bw_eff
    qkv = 768 * (12 + 2 * 3) * 64
    post = 768 * 768 + 3 * 768 * 2048  # output projection, gate, up, down
    expect = sum(max(0.0, 4 * nk / mem - 32 * nk / gemm) for nk in (qkv, post))
    assert c.p_stall == pytest.approx(6 * expect) and c.p_stall > 0
    assert c.p_head_stall == pytest.approx(max(0.0, 4 * 8000 * 768 / mem - 32 * 8000 * 768 / gemm))
    one, two = (perf.prefill_time_s(dep, [n]) for n in (160, 161))  # an 11th chunk
    assert two - one == pytest.approx(16 * c.p_row + c.p_stall + c.p_tok + 321 * c.p_sq)
    # decode streams all weights once anyway: only a second chunk of sequences stalls
    steps = [perf.decode_step_time_s(dep, b, 0) for b in (1, 16, 17)]
    assert steps[1] - steps[0] == pytest.approx(15 * c.d_seq)
    assert steps[2] - steps[1] == pytest.approx(c.d_seq + 16 * c.d_row + c.d_stall)
    # the same host with a cache that holds every group, or with memory fast enough: no stall
    cached = dataclasses.replace(slow_memory, core_cache_mb=64.0)
    fast = cpu_kind("cpu-x", {"matmul_tflops": 0.1, "copy_gbps": 200.0}, 24.0)
    for kind in (cached, fast):
        other = PerfModel(EfficiencyFactors({kind.name: kf}))
        co = other.coefficients(Deployment(mid, kind, 1, Dtype.FP32))
        assert co.p_stall == co.p_head_stall == co.d_stall == 0.0
    gpu = PerfModel().coefficients(Deployment(mid, H100_SXM, 1))
    assert gpu.p_stall == gpu.p_head_stall == gpu.d_stall == 0.0
