"""The capacity bench and the validation runner, run as a user runs them (real processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CAPACITY = ROOT / "bench" / "sim_capacity.py"
VALIDATION = ROOT / "bench" / "sim_validation.py"


def bench(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=600
    )


def test_capacity_bench_takes_trace_scaling_kinds_and_prices(tmp_path: Path) -> None:
    out = tmp_path / "cap.json"
    run = bench(
        CAPACITY, "--minutes", "0.5", "--rates", "1,2", "--scaling", "copies", "--jobs", "1",
        "--kinds", "A100-SXM-80GB,H100-SXM", "--prices", "A100-SXM-80GB=1,H100-SXM=3",
        "--splits", "H100-SXM/A100-SXM-80GB", "--dynamic", "fleetshift-all", "--out", str(out),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    doc = json.loads(out.read_text())
    assert doc["meta"]["scaling"] == "copies" and doc["meta"]["price_map"]["H100-SXM"] == 3.0
    labels = {(s["label"], s["rate"]) for s in doc["searches"]}
    assert labels == {
        (label, rate)
        for rate in (1.0, 2.0)
        for label in ("Baseline-A100", "Baseline-H100", "Splitwise-HA",
                      "fleetshift-all on A", "fleetshift-all on H", "fleetshift-all on A+H")
    }  # fmt: skip
    for s in doc["searches"]:
        for t in s["trials"]:  # each fleet priced from the given machine-hour prices
            want = sum({"A100-SXM-80GB": 1.0, "H100-SXM": 3.0}[k] * n for k, n in t["counts"])
            assert t["usd_per_hour"] == pytest.approx(want)
        if s["best"]:
            assert s["best"]["passed"] and s["best"]["ttft_slowdown_p99"] <= 6
    ha = next(s for s in doc["searches"] if s["label"] == "Splitwise-HA" and s["best"])
    assert [k for k, _ in ha["best"]["counts"]] == ["H100-SXM", "A100-SXM-80GB"]  # prompt first
    # copies scaling doubles the requests; these settings are not Splitwise's: no comparison
    reqs = {s["rate"]: s["requests"] for s in doc["searches"]}
    assert reqs[2.0] == 2 * reqs[1.0]
    assert "not compared" in run.stdout


def test_capacity_bench_refuses_bad_options_naming_them(tmp_path: Path) -> None:
    out = tmp_path / "cap.json"
    bad_price = bench(CAPACITY, "--prices", "A100-SXM-80GB=2.21", "--out", str(out))
    assert bad_price.returncode != 0 and "no price for H100-SXM" in bad_price.stderr
    bad_split = bench(CAPACITY, "--splits", "H100-SXM/H200-SXM", "--out", str(out))
    assert bad_split.returncode != 0 and "--splits" in bad_split.stderr
    bad_kind = bench(CAPACITY, "--kinds", "A100-SXM-80GB,B300", "--out", str(out))
    assert bad_kind.returncode != 0 and "B300" in bad_kind.stderr
    assert not out.exists()


@pytest.mark.slow
def test_validation_quick_mode_writes_one_table_per_property(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("# intro\n<!-- results -->\nold\n<!-- /results -->\n## after\n")
    run = bench(
        VALIDATION, "--quick", "--traces", "azure-0-30,mooncake-then-azure", "--minutes", "1",
        "--capacity-minutes", "0.5", "--jobs", "1", "--out", str(tmp_path), "--doc", str(doc),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    text = (tmp_path / "validation.md").read_text()
    for title in ("SLO attainment vs `ll`", "$/M tokens vs `ll`", "better of `ll` and `split`",
                  "after the shift", "hindsight bound", "Capacity at x1", "Every run"):  # fmt: skip
        assert title in text, title
    assert "azure-0-30 (tuning) | ‖ | mooncake-then-azure (held out)" in text
    assert text.count("Held out: met") == 6
    data = json.loads((tmp_path / "validation.json").read_text())
    runs = {(r["trace"], r["rate"], r["policy"]) for r in data["runs"]}
    assert len(runs) == 2 * 2 * 5  # traces x rates x policies
    shifted = [r for r in data["runs"] if r["trace"] == "mooncake-then-azure"]
    assert all("goodput_after_rps" in r for r in shifted)
    rewritten = doc.read_text()
    assert rewritten.startswith("# intro\n<!-- results -->\nCommand:") and "old" not in rewritten
    assert rewritten.endswith("<!-- /results -->\n## after\n")
