"""Hold-out validation of the performance model on the Splitwise table, beside today's model.

Per GPU kind and phase: rows, median and p90 absolute % error and the signed median bias, for

- in-sample: the shipped factors (fitted on the whole table) on the whole table;
- (a) factors refitted on the TP 2 and TP 4 rows, predicting the TP 8 rows;
- (b) factors refitted on batch sizes 1-8, predicting batch sizes 16-64;

and the spread of each fitted factor across the fits ((a), (b)'s training subsets against the
whole table): max |f_subset / f_all - 1|. The baseline, fitted and scored on the same rows in
the same run, is the model as it was before issue 12 (bench/perfmodel_v1.py). The three TP-2
batch-64 configurations that did not hold their batch (core/measurements.inconsistent) are
left out of every table for both models.

    .venv/bin/python bench/perf_holdout.py [--csv PATH] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import perfmodel_v1 as v1

from fleetshift_daemon.core.calibration import FitError, at_bounds, factor_names, fit, fit_errors
from fleetshift_daemon.core.corrections import Phase
from fleetshift_daemon.core.measurements import (
    Measurement,
    hardware_kind,
    load_measurements,
    screened,
)
from fleetshift_daemon.core.perf_factors import EfficiencyFactors, shipped_factors
from fleetshift_daemon.core.perfmodel import llama2_70b

DEFAULT_CSV = Path(__file__).resolve().parents[1] / ".." / "shared" / "reference"
DEFAULT_CSV = DEFAULT_CSV / "splitwise_perf_llama2_70b.csv"
TARGET_MEDIAN, TARGET_P90 = 10.0, 20.0

Split = tuple[str, Callable[[Measurement], bool]]  # name, "is a held-out row"
SPLITS: tuple[Split, ...] = (
    ("(a) fit TP 2+4, predict TP 8", lambda m: m.tp == 8),
    ("(b) fit batch 1-8, predict batch 16-64", lambda m: m.batch_size >= 16),
)


def v1_errors(factors: dict[str, v1.V1Factors], rows: Sequence[Measurement]) -> list[FitError]:
    arch = llama2_70b()
    errs: dict[tuple[str, Phase], list[float]] = defaultdict(list)
    for m in rows:
        errs[(m.kind.name, m.phase)].append((v1.predict(factors, arch, m) / m.seconds - 1) * 100)
    out = []
    for (k, ph), signed in sorted(errs.items(), key=lambda kv: (kv[0][0], kv[0][1].value)):
        a = [abs(e) for e in signed]
        out.append(
            FitError(
                k,
                ph,
                len(a),
                statistics.median(a),
                float(np.percentile(a, 90)),
                max(a),
                statistics.median(signed),
            )
        )
    return out


def print_table(title: str, new: list[FitError], old: list[FitError], held_out: bool) -> None:
    print(f"\n{title}  ({'held-out rows' if held_out else 'in-sample: fitting rows'})")
    print(
        f"{'kind':16s} {'phase':8s} {'rows':>4s} | {'new: med':>8s} {'p90':>6s} {'bias':>6s} "
        f"| {'today: med':>10s} {'p90':>6s} {'bias':>6s}"
    )
    old_by = {(e.kind, e.phase): e for e in old}
    for e in new:
        o = old_by[(e.kind, e.phase)]
        flag = ""
        if held_out and (e.median_abs_pct > TARGET_MEDIAN or e.p90_abs_pct > TARGET_P90):
            flag = "  misses target"
        print(
            f"{e.kind:16s} {e.phase.value:8s} {e.n:4d} | {e.median_abs_pct:8.1f} "
            f"{e.p90_abs_pct:6.1f} {e.median_bias_pct:+6.1f} | {o.median_abs_pct:10.1f} "
            f"{o.p90_abs_pct:6.1f} {o.median_bias_pct:+6.1f}{flag}"
        )


def spread(
    full: EfficiencyFactors, subsets: Sequence[EfficiencyFactors]
) -> dict[str, dict[str, float]]:
    """Per kind and factor: max relative change of a subset's fit against the full fit."""
    out: dict[str, dict[str, float]] = {}
    for kind, kf in full.per_kind.items():
        row = {}
        names = factor_names(hardware_kind(kind), multi_gpu=True)
        for name in (*names, "long_pass_tokens", "compute_scale"):
            ref = getattr(kf, name)
            vals = [getattr(s.per_kind[kind], name) for s in subsets if kind in s.per_kind]
            row[name] = max(abs(v / ref - 1) for v in vals) * 100 if ref else float("nan")
        out[kind] = row
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    args = ap.parse_args()
    t0 = time.perf_counter()
    data, aside = screened(load_measurements(args.csv))
    print(f"{args.csv}: {len(data)} median rows kept, {len(aside)} set aside (did not hold batch)")
    result: dict[str, object] = {"csv": str(args.csv)}
    shipped = shipped_factors()
    new_in = fit_errors(shipped, data)
    old_in = v1_errors(v1.SHIPPED_V1, data)
    print_table("in-sample: shipped factors on the whole table", new_in, old_in, held_out=False)
    result["in_sample"] = {"new": [asdict(e) for e in new_in], "today": [asdict(e) for e in old_in]}
    subset_fits = []
    for name, held in SPLITS:
        train = [m for m in data if not held(m)]
        test = [m for m in data if held(m)]
        new_f = fit(train)
        subset_fits.append(new_f)
        new_e = fit_errors(new_f, test)
        old_e = v1_errors(v1.fit(train), test)
        print_table(f"{name}: {len(train)} fitting rows, {len(test)} held out", new_e, old_e, True)
        for kind, kf in new_f.per_kind.items():
            pinned = ", ".join(at_bounds(kf, factor_names(hardware_kind(kind), True))) or "none"
            values = ", ".join(f"{k}={v:.4g}" for k, v in kf.to_dict().items())
            print(f"  {kind} fitted here (at a bound: {pinned}): {values}")
        result[name] = {"new": [asdict(e) for e in new_e], "today": [asdict(e) for e in old_e]}
    sp = spread(shipped, subset_fits)
    print("\nfactor spread across fits (max |subset / whole table - 1|, %), target 10 %:")
    for kind, row in sp.items():
        print(f"  {kind}: " + ", ".join(f"{k} {v:.0f}" for k, v in row.items()))
    for kind, kf in shipped.per_kind.items():
        pinned = ", ".join(at_bounds(kf, factor_names(hardware_kind(kind), True))) or "none"
        print(f"  shipped {kind}: at a bound: {pinned}")
    result["spread_pct"] = sp
    print(f"\nwall time {time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
