"""``fleetshift simulate`` end to end: a fleet file, a trace file, results on disk."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

from fleetshift_daemon.core.errors import UnsupportedDeployment
from fleetshift_daemon.sim.cli import main
from fleetshift_daemon.sim.fleet import load_fleet

SHARED = Path(__file__).resolve().parents[2] / ".." / "shared"
AZURE = SHARED / "traces" / "azure_llm_2023_conv.csv"
MOONCAKE = SHARED / "traces" / "mooncake_conversation_trace.jsonl"

FLEET = """
[model]
preset = "llama2-70b"

[slo]
ttft_multiple = 6
tbt_multiple = 5

[[nodes]]
gpu = "A100-SXM-80GB"
count = 1
gpus = 8
tp = 4

[[nodes]]
gpu = "H200-SXM"
count = 1
gpus = 8
tp = 8

[gpus.H200-SXM]
price_per_hour = 2.5
"""


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    lines = AZURE.read_text().splitlines()[:301]
    path = tmp_path / "head.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_simulate_writes_a_comparison(tmp_path: Path, small_trace: Path) -> None:
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(FLEET)
    out = tmp_path / "out"
    rc = main(
        [
            "--fleet", str(fleet), "--trace", str(small_trace), "--policy", "rr,ll,split",
            "--rate-scale", "2", "--time-compress", "2", "--seed", "3", "--out", str(out),
        ]
    )  # fmt: skip
    assert rc == 0
    data = json.loads((out / "summary.json").read_text())
    assert [p["policy"] for p in data["policies"]] == ["rr", "ll", "split"]
    assert data["meta"]["requests"] == 600
    for p in data["policies"]:
        assert p["finished"] + p["dropped"] == 600
        assert 0.0 <= p["slo_attainment"] <= 1.0
        assert p["ttft_s"]["p50"] <= p["ttft_s"]["p99"]
    with (out / "cdf.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert {r["metric"] for r in rows} == {"ttft", "tbt", "e2e"}
    for name in ("sim-goodput.png", "sim-cdf-ttft.png", "sim-cdf-tbt.png"):
        png = (out / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n", name
        assert len(png) > 10_000, (name, len(png))  # a drawn chart, not an empty canvas


def _without_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules makes `import matplotlib...` raise ImportError, even if a test
    # before this one imported it.
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends",
                 "matplotlib.backends.backend_agg"):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, None)


def test_plots_without_matplotlib_fail_before_the_runs_naming_the_fix(
    tmp_path: Path,
    small_trace: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _without_matplotlib(monkeypatch)
    out = tmp_path / "out"
    rc = main(["--trace", str(small_trace), "--policy", "rr", "--out", str(out)])
    assert rc == 2
    msg = capsys.readouterr().out
    assert "plots need matplotlib" in msg
    assert "fleetshift[sim]" in msg and "--no-plots" in msg
    assert not out.exists()  # refused before any run, so nothing half-written


def test_no_plots_needs_no_matplotlib(
    tmp_path: Path, small_trace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _without_matplotlib(monkeypatch)
    out = tmp_path / "out"
    rc = main(["--trace", str(small_trace), "--policy", "rr", "--out", str(out), "--no-plots"])
    assert rc == 0
    assert (out / "summary.csv").exists()
    assert not list(out.glob("*.png"))


def test_simulate_refuses_a_malformed_trace_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,10,5\n1,ten,5\n")
    assert main(["--trace", str(bad), "--policy", "rr"]) == 2
    err = capsys.readouterr().out
    assert "line 3" in err and "ContextTokens" in err


def test_fleet_file_prices_and_instances(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET)
    fleet = load_fleet(path)
    assert [g.tp for g in fleet.groups] == [4, 8]
    assert len(fleet.instance_slots()) == 3
    assert fleet.catalogue.get("H200-SXM").price_per_hour == 2.5
    assert fleet.price_per_hour() == pytest.approx(8 * 1.80 + 8 * 2.5)


def test_fleet_file_that_cannot_hold_the_model_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "fleet.toml"
    path.write_text('[[nodes]]\ngpu = "A100-SXM-80GB"\ngpus = 8\ntp = 1\n')
    with pytest.raises(UnsupportedDeployment) as err:
        load_fleet(path)
    assert "does not fit" in str(err.value)


def test_the_example_fleet_file_describes_the_benchmark_fleet_at_tp4() -> None:
    fleet = load_fleet(Path(__file__).parents[2] / "deploy" / "sim" / "fleet-tp4.toml")
    assert [(g.gpu, g.count, g.tp) for g in fleet.groups] == [
        ("A100-SXM-80GB", 4, 4),
        ("H100-SXM", 4, 4),
        ("H200-SXM", 4, 4),
    ]
    assert len(fleet.instance_slots()) == 24
    assert fleet.price_per_hour() == pytest.approx(32 * (1.80 + 3.00 + 3.80))


def test_simulate_replays_mooncake_with_the_long_context_model(tmp_path: Path) -> None:
    head = tmp_path / "kimi.jsonl"
    lines = MOONCAKE.read_text().splitlines()[:120]
    head.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    argv = ["--trace", str(head), "--policy", "ll", "--no-plots", "--out", str(out)]
    assert main([*argv, "--model", "llama31-70b", "--context-window", "model"]) == 0
    meta = json.loads((out / "summary.json").read_text())["meta"]
    assert meta["model"] == "llama31-70b" and meta["context_window"] == 131072
    assert meta["requests"] == 120 and meta["over_window"] == 0
    # the same requests on Llama-2-70B: most exceed its 4,096-token window and are refused
    assert main([*argv, "--context-window", "model"]) == 0
    meta = json.loads((out / "summary.json").read_text())["meta"]
    over = sum(json.loads(x)["input_length"] + json.loads(x)["output_length"] > 4096 for x in lines)
    assert meta["over_window"] == over > 60 and meta["requests"] == 120 - over
    # replayed anyway (the default), but still counted
    assert main(argv) == 0
    meta = json.loads((out / "summary.json").read_text())["meta"]
    assert meta["requests"] == 120 and meta["over_window"] == over
    assert not meta["over_window_refused"]


def test_simulate_builds_synthetic_arrivals_and_service_shifts(
    tmp_path: Path, small_trace: Path
) -> None:
    kimi = tmp_path / "kimi.jsonl"
    kimi.write_text("\n".join(MOONCAKE.read_text().splitlines()[:200]) + "\n")
    out = tmp_path / "out"
    common = ["--policy", "ll", "--no-plots", "--out", str(out), "--model", "llama31-70b"]
    assert main(["--trace", str(small_trace), "--arrivals", "on-off", *common]) == 0
    meta = json.loads((out / "summary.json").read_text())["meta"]
    assert meta["arrivals"] == "on-off" and meta["requests"] == 300
    assert main(["--trace", str(small_trace), "--then-trace", str(kimi), "--switch-at", "20",
                 *common]) == 0  # fmt: skip
    meta = json.loads((out / "summary.json").read_text())["meta"]
    assert meta["then_trace"] == str(kimi)
    assert main(["--trace", str(small_trace), "--context-window", "lots", *common]) == 2
    assert main(["--trace", str(small_trace), "--arrivals", "poisson", "--fleet", "x.toml",
                 "--model", "llama31-70b"]) == 2  # fmt: skip
