from __future__ import annotations

from pathlib import Path

from fleetshift_daemon.core.calibration import fit, fit_calibrations, fit_errors, load_measurements
from fleetshift_daemon.core.corrections import Phase
from fleetshift_daemon.core.perf_factors import shipped_factors

TARGET_PCT = 15.0


def test_medians_are_taken_over_repeats(perf_csv: Path) -> None:
    data = load_measurements(perf_csv)
    kinds = {m.kind.name for m in data}
    assert kinds == {"A100-SXM-80GB", "H100-SXM", "H100-SXM-PCAP70"}
    # 171 distinct (hardware, tp, prompt, batch, output) configurations in the file
    assert sum(m.phase is Phase.DECODE for m in data) == 171
    assert sum(m.phase is Phase.PREFILL for m in data) == 117


def test_refit_from_the_reference_file_meets_the_error_target(perf_csv: Path) -> None:
    data = load_measurements(perf_csv)
    errors = fit_errors(fit(data), data)
    assert len(errors) == 6  # 3 kinds x 2 phases
    for e in errors:
        assert e.median_abs_pct <= TARGET_PCT, e


def test_shipped_factors_meet_the_error_target(perf_csv: Path) -> None:
    data = load_measurements(perf_csv)
    errors = fit_errors(shipped_factors(), data)
    assert len(errors) == 6
    for e in errors:
        assert e.median_abs_pct <= TARGET_PCT, e
    # the power cap slows compute only: its shipped scale is well below 1
    assert shipped_factors().for_kind("H100-SXM-PCAP70").compute_scale < 0.85


def test_h200_borrows_h100_factors_and_unknown_kinds_get_a_prior() -> None:
    f = shipped_factors()
    assert f.for_kind("H200-SXM") == f.for_kind("H100-SXM")
    prior = f.for_kind("L40S")
    assert not f.is_calibrated("L40S")
    assert 0 < prior.compute_eff <= 1 and prior.compute_scale == 1.0


def test_calibrations_are_keyed_by_model_and_measured_kind(perf_csv: Path) -> None:
    from fleetshift_daemon.core.gpus import A100_SXM_80GB
    from fleetshift_daemon.core.perfmodel import Deployment, PerfModel, llama2_70b

    arch = llama2_70b()
    a100_rows = [m for m in load_measurements(perf_csv) if m.hardware == "a100-80gb"]
    cal = fit_calibrations(a100_rows, arch)
    assert set(cal) == {("llama2-70b", "A100-SXM-80GB")}
    model = PerfModel(calibrations=cal)
    assert model.is_measured(Deployment(arch, A100_SXM_80GB, 8))
    errors = fit_errors(shipped_factors(), a100_rows, arch, calibrations=cal)
    assert {e.kind for e in errors} == {"A100-SXM-80GB"}
    for e in errors:
        assert e.median_abs_pct <= TARGET_PCT, e
        assert abs(e.median_bias_pct) <= e.median_abs_pct
