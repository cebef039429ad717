"""Output-length estimator error on a real trace, against the naive global-mean baseline.

Replays the trace in time order through OutputLengthEstimator: each completion is first
predicted (before it is learned), then learned. Prints the estimator's MAE and median
absolute % error over the last --window predictions and over the whole trace, next to the
global-mean baseline's scored the same way. Any CSV with the columns TIMESTAMP,
ContextTokens, GeneratedTokens works.

    .venv/bin/python bench/estimator_trace.py ../shared/traces/azure_llm_2023_conv.csv
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from fleetshift_daemon.core.estimator import EstimatorConfig, OutputLengthEstimator


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", type=Path)
    ap.add_argument("--window", type=int, default=5000)
    args = ap.parse_args()
    with args.trace.open(newline="") as fh:
        rows = sorted(
            (r["TIMESTAMP"], int(r["ContextTokens"]), int(r["GeneratedTokens"]))
            for r in csv.DictReader(fh)
        )
    recent = OutputLengthEstimator(EstimatorConfig(error_window=args.window))
    whole = OutputLengthEstimator(EstimatorConfig(error_window=len(rows)))
    for _, prompt, output in rows:
        recent.observe_completion("m", max(prompt, 1), output)
        whole.observe_completion("m", max(prompt, 1), output)
    print(f"trace: {args.trace.name}, {len(rows)} requests")
    for label, est in ((f"last {args.window}", recent), ("whole trace", whole)):
        e = est.error("m")
        print(
            f"{label:>12}: estimator MAE {e.mae:6.1f} tok, median |err| {e.median_abs_pct:5.1f}% | "
            f"global-mean baseline MAE {e.baseline_mae:6.1f} tok, median |err| "
            f"{e.baseline_median_abs_pct:5.1f}% | MAE ratio {e.mae / e.baseline_mae:.2f}"
        )


if __name__ == "__main__":
    main()
