"""Hold-out (c): fit the performance model on one model's profile, predict another's, both ways.

A thin driver over the operator's own command, ``fleetshift calibration --fit A --check B``
(``fleetshift_daemon.cli.calibration``): the same reading of each ``CSV:config.json``, the
same fit and the same report, run in both directions and printed as one markdown table whose
tuning rows (in-sample: the profile the factors were fitted on) and held-out rows (the other
model, never seen by the fit) are kept apart. Both profiles come from ``fleetshift profile``
against real workers on this machine's CPU; the CPU kind's peaks are the ones each profile's
sidecar measured (``core.measurements.cpu_kind``).

    .venv/bin/python bench/profile_holdout.py A.csv:A/config.json B.csv:B/config.json
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from fleetshift_common.errors import FleetShiftError
from fleetshift_daemon.cli.calibration import Profile, calibrate, read_profile
from fleetshift_daemon.core.calibration import FitError


def lines(label: str, column: str, errors: Sequence[FitError]) -> list[str]:
    return [
        f"| {label} | {column} | {e.phase.value} | {e.n} | {e.median_abs_pct:.1f} | "
        f"{e.p90_abs_pct:.1f} | {e.median_bias_pct:+.1f} |"
        for e in errors
    ]


def direction(fit_on: Profile, check: Profile) -> list[str]:
    rep = calibrate([fit_on], check)
    a, b = fit_on.csv.stem, check.csv.stem
    out = lines(f"{a} → {b}", f"tuning ({a}, in-sample)", rep.in_sample)
    out += lines(f"{a} → {b}", f"held out ({b})", rep.errors)
    for kind, source in rep.fitted.items():
        kf = rep.factors.for_kind(kind)
        values = ", ".join(f"{k}={v:.4g}" for k, v in kf.to_dict().items())
        pinned = ", ".join(rep.pinned(kind)) or "none"
        out.append(f"<!-- {a} → {b}: {kind} ({source}; at a bound: {pinned}): {values} -->")
    return out


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    try:
        first, second = (read_profile(spec) for spec in argv)
        rows = direction(first, second) + direction(second, first)
    except FleetShiftError as err:
        print(f"error: {err.message}", file=sys.stderr)
        return 2
    print("| fitted on → predicts | column | phase | points | median abs % | p90 abs % | bias % |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
