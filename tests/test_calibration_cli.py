"""``fleetshift calibration`` on real files: fit on some rows, report the held-out error."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from fleetshift_daemon.cli.calibration import main

LLAMA2_70B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
}


def subset(src: Path, dst: Path, keep: Callable[[dict[str, str]], bool]) -> Path:
    with src.open(newline="") as fh:
        reader = csv.DictReader(fh)
        rows = [r for r in reader if keep(r)]
        fields = reader.fieldnames or []
    with dst.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    return dst


@pytest.fixture(scope="module")
def perf_csv() -> Path:
    return (
        Path(__file__).resolve().parents[1]
        / ".."
        / "shared"
        / "reference"
        / ("splitwise_perf_llama2_70b.csv")
    )


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "llama2-70b" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(LLAMA2_70B, indent=2))
    return path


def test_fit_on_tp_2_and_4_reports_tp_8_per_kind_and_phase_as_json(
    perf_csv: Path, tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a100 = {"a100-80gb"}
    fit = subset(
        perf_csv,
        tmp_path / "fit.csv",
        lambda r: r["hardware"] in a100 and r["tensor_parallel"] != "8",
    )
    check = subset(
        perf_csv,
        tmp_path / "check.csv",
        lambda r: r["hardware"] in a100 and r["tensor_parallel"] == "8",
    )
    assert main(["--fit", f"{fit}:{config}", "--check", f"{check}:{config}", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(e["hardware"], e["phase"]) for e in out["errors"]] == [
        ("a100-80gb", "decode"),
        ("a100-80gb", "prefill"),
    ]
    decode, prefill = out["errors"]
    assert decode["rows"] == 19 and prefill["rows"] == 13  # TP 8's medians, nothing set aside
    for e in out["errors"]:
        assert e["factors"] == "fit"
        assert 0 <= e["median_abs_pct"] <= e["p90_abs_pct"]
        assert abs(e["median_bias_pct"]) <= e["p90_abs_pct"]
    # the tuning rows' error is reported apart from the held-out one, on the rows fitted
    tuning = {e["phase"]: e for e in out["in_sample"]}
    assert tuning["decode"]["rows"] == 37 and tuning["prefill"]["rows"] == 25  # TP 2 and 4's
    assert tuning["decode"]["median_abs_pct"] < decode["median_abs_pct"]
    assert out["fit"][0]["model"] == "llama2-70b" and out["fit"][0]["dtype"] == "bf16"
    factors = out["factors"]["A100-SXM-80GB"]
    assert factors["source"] == "fit" and 0 < factors["gemm_eff"] <= 1


def test_without_fit_the_shipped_factors_are_checked_and_the_set_aside_rows_listed(
    perf_csv: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--check", f"{perf_csv}:{config}", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {e["hardware"] for e in out["errors"]} == {"a100-80gb", "h100-80gb", "h100-80gb-pcap"}
    assert all(e["factors"].startswith("shipped:") for e in out["errors"])
    assert {(s["hardware"], s["tp"], s["batch"]) for s in out["set_aside"]} == {
        ("a100-80gb", 2, 64),
        ("h100-80gb", 2, 64),
        ("h100-80gb-pcap", 2, 64),
    }
    # the shipped factors were fitted on this very table: in-sample, decode within 3 %
    decode = [e for e in out["errors"] if e["phase"] == "decode"]
    assert all(e["median_abs_pct"] <= 3.0 for e in decode)


@pytest.mark.parametrize(
    ("break_it", "expected"),
    [
        (lambda cfg, csvp: cfg.write_text('{\n  "hidden_size": 8192,\n  oops\n}'), ":3: not JSON"),
        (
            lambda cfg, csvp: cfg.write_text(
                json.dumps({k: v for k, v in LLAMA2_70B.items() if k != "vocab_size"})
            ),
            "config.json:1: vocab_size:",
        ),
        (
            lambda cfg, csvp: cfg.write_text(
                json.dumps({**LLAMA2_70B, "torch_dtype": "int3"}, indent=1)
            ),
            "torch_dtype: 'int3'",
        ),
        (
            lambda cfg, csvp: csvp.write_text(
                csvp.read_text().replace("a100-80gb", "a100-40gb", 1)
            ),
            ".csv:2: unknown hardware 'a100-40gb'",
        ),
    ],
)
def test_bad_input_names_file_line_and_field_and_exits_2(
    perf_csv: Path,
    tmp_path: Path,
    config: Path,
    capsys: pytest.CaptureFixture[str],
    break_it: Callable[[Path, Path], object],
    expected: str,
) -> None:
    check = subset(perf_csv, tmp_path / "check.csv", lambda r: r["tensor_parallel"] == "8")
    break_it(config, check)
    assert main(["--check", f"{check}:{config}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err


def test_the_console_script_runs_it(perf_csv: Path, tmp_path: Path, config: Path) -> None:
    check = subset(perf_csv, tmp_path / "check.csv", lambda r: r["hardware"] == "h100-80gb")
    exe = Path(sys.executable).with_name("fleetshift")
    result = subprocess.run(
        [str(exe), "calibration", "--check", f"{check}:{config}"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "160"},
    )
    assert result.returncode == 0, result.stderr
    assert "h100-80gb (H100-SXM)" in result.stdout and "prefill" in result.stdout


def test_a_cpu_profile_of_another_host_is_predicted_from_the_fitted_cpu_factors(
    tmp_path: Path,
) -> None:
    """A CPU checked against a fit on another CPU takes the fitted reference-engine factors
    (stated at an idle core; each profile's own measured peaks carry its host's speed),
    never the GPU kinds' shipped ones."""
    from fleetshift_daemon.cli.calibration import calibrate, read_profile

    profiles = Path(__file__).resolve().parents[1] / "docs" / "profiles"
    other = (profiles / "small-deep.csv").read_text()
    (tmp_path / "other.csv").write_text(other.replace("cpu-amd-epyc", "cpu-other-host"))
    sidecar = json.loads((profiles / "small-deep.json").read_text())
    sidecar["host"]["measured_peaks"]["matmul_tflops"] *= 2  # a host twice as fast
    (tmp_path / "other.json").write_text(json.dumps(sidecar))
    fit_on = read_profile(f"{profiles / 'small.csv'}:{profiles / 'small.config.json'}")
    check = read_profile(f"{tmp_path / 'other.csv'}:{profiles / 'small-deep.config.json'}")
    same = read_profile(f"{profiles / 'small-deep.csv'}:{profiles / 'small-deep.config.json'}")
    report = calibrate([fit_on], check)
    assert report.fitted == {"cpu-other-host": "fit:cpu-amd-epyc"}
    assert report.factors.for_kind("cpu-other-host") == report.factors.for_kind("cpu-amd-epyc")
    # the same times on a host measured twice as fast are predicted faster: bias falls
    slower = {e.phase: e.median_bias_pct for e in calibrate([fit_on], same).errors}
    faster = {e.phase: e.median_bias_pct for e in report.errors}
    assert all(faster[p] < slower[p] - 20 for p in slower)
