"""Hold-out (c): fit the performance model on one reference model's profile, predict another's.

Both profiles come from ``fleetshift profile`` against real workers on this machine's CPU (see
``bench/profile_cost.py``). The CPU is the "hardware kind": its peak compute and bandwidth are
the ones the profiler measured (a timed matmul and copy, in the fitted profile's sidecar). The
factors are fitted on the FIT profile only (the tuning column) and then predict the CHECK
profile, a model of another shape (the held-out column); each direction is reported, per phase,
as median and p90 absolute error and signed median bias, beside the in-sample error.

    .venv/bin/python bench/profile_holdout.py A.csv:A/config.json B.csv:B/config.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from fleetshift_daemon.core.archs import ModelArch
from fleetshift_daemon.core.model_calibrations import (
    cpu_kind,
    fit_errors,
    fit_kind,
    measurements,
    parse_profile,
)


def load(spec: str) -> tuple[str, Path, ModelArch, dict[str, object]]:
    csv_part, _, config_part = spec.partition(":")
    csv_path = Path(csv_part)
    config = Path(config_part or csv_path.with_suffix(""))
    config = config / "config.json" if config.is_dir() else config
    arch = ModelArch.from_hf_config(csv_path.stem, json.loads(config.read_text()))
    sidecar = json.loads(csv_path.with_suffix(".json").read_text())
    return csv_path.read_text(), csv_path, arch, sidecar


def row(label: str, column: str, median: float, phases: tuple) -> list[str]:  # type: ignore[type-arg]
    out = []
    for e in phases:
        out.append(
            f"| {label} | {column} | {e.phase} | {e.points} | {e.median_abs_pct:.1f} | "
            f"{e.p90_abs_pct:.1f} | {e.median_bias_pct:+.1f} |"
        )
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    profiles = [load(spec) for spec in argv]
    print("| fitted on → predicts | column | phase | points | median abs % | p90 abs % | bias % |")
    print("|---|---|---|---|---|---|---|")
    for fit_on, check in ((profiles[0], profiles[1]), (profiles[1], profiles[0])):
        text, path, arch, sidecar = fit_on
        host = sidecar["host"]  # type: ignore[index]
        peaks = host["measured_peaks"]  # type: ignore[index]
        dtype = str(sidecar["worker"]["dtype"])  # type: ignore[index]
        memory = float(host.get("memory_gb", 24.0))  # type: ignore[union-attr]
        kind = cpu_kind(str(sidecar["hardware"]), peaks, memory, dtype)
        rows = parse_profile(text)
        data = measurements(rows, kind)
        factors = fit_kind(data, arch, kind)
        median, phases = fit_errors(factors, data, arch, kind)
        name = f"{path.stem} → {check[1].stem}"
        for line in row(name, f"tuning ({path.stem}, in-sample)", median, phases):
            print(line)
        check_rows = parse_profile(check[0])
        if check_rows[0].hardware != rows[0].hardware:
            raise SystemExit(
                f"{check[1]} was measured on {check_rows[0].hardware}, not {kind.name}"
            )
        held = measurements(check_rows, kind)
        median, phases = fit_errors(factors, held, check[2], kind)
        for line in row(name, f"held out ({check[1].stem})", median, phases):
            print(line)
        print(
            f"<!-- {name}: kind {kind.name}: {kind.bf16_tflops * 1e3:.1f} GFLOP/s float32, "
            f"{kind.hbm_tbps * 1e3:.1f} GB/s copy; factors {factors.to_dict()} -->"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
