"""Hold-out (c): fit the performance model on one model's profile, predict another's, both ways.

A thin driver over the operator's own command, ``fleetshift calibration --fit A --check B``
(``fleetshift_daemon.cli.calibration``): the same reading of each ``CSV:config.json``, the
same fit and the same report, run in both directions and printed as one markdown table whose
tuning rows (in-sample: the profile the factors were fitted on) and held-out rows (the other
model, never seen by the fit) are kept apart. Both profiles come from ``fleetshift profile``
against real workers on this machine's CPU; the CPU kind's peaks are the ones each profile's
sidecar measured (``core.measurements.cpu_kind``).

    .venv/bin/python bench/profile_holdout.py A.csv:A/config.json B.csv:B/config.json \
        [C.csv:C/config.json]

C, when given, is a fresh hold-out: a third model that no fit ever sees (nor any choice of the
model's form), predicted from A's fit, B's fit and the joint fit of A and B. It may have been
profiled on another CPU: each profile's own sidecar peaks are its kind's figures, and the
fitted reference-engine factors are stated at an idle core, so they carry to it.
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


def direction(fit_on: Sequence[Profile], check: Profile, fresh: bool = False) -> list[str]:
    rep = calibrate(fit_on, check)
    a, b = " + ".join(p.csv.stem for p in fit_on), check.csv.stem
    out = lines(f"{a} → {b}", f"tuning ({a}, in-sample)", rep.in_sample)
    held = f"fresh hold-out ({b})" if fresh else f"held out ({b})"
    out += lines(f"{a} → {b}", held, rep.errors)
    for kind, source in rep.fitted.items():
        kf = rep.factors.for_kind(kind)
        values = ", ".join(f"{k}={v:.4g}" for k, v in kf.to_dict().items())
        pinned = ", ".join(rep.pinned(kind)) or "none"
        out.append(f"<!-- {a} → {b}: {kind} ({source}; at a bound: {pinned}): {values} -->")
    return out


def main(argv: Sequence[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        first, second, *fresh = (read_profile(spec) for spec in argv)
        rows = direction([first], second) + direction([second], first)
        for third in fresh:
            for fit_on in ([first], [second], [first, second]):
                rows += direction(fit_on, third, fresh=True)
    except FleetShiftError as err:
        print(f"error: {err.message}", file=sys.stderr)
        return 2
    print("| fitted on → predicts | column | phase | points | median abs % | p90 abs % | bias % |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
