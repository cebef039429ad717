"""Round 7 of hold-out (c): forms of the reference engine's per-layer step time, scored.

The quiet CPU profiles (docs/bench-perfmodel.md "Round 7") show a decode step's fixed time
growing with depth, which the shipped model charges to one per-step constant. Variants, all on
the reference engine (CPU kinds) only, each with a new factor ``layer_chunk_s`` (prior centre
0.35 ms: ~69 eager torch ops per layer and 16-row chunk at ~5 us, ``layer_row_s``'s per-op
figure):

- v0: the shipped model (no such factor);
- v1: ``layer_chunk_s`` x layers per step (prefill pass and decode step);
- v2: ``layer_chunk_s`` x layers per 16-row chunk (prefill: the pass's chunks; decode: the
  batch's);
- v4, v5: v1, v2 with ``step_overhead_s`` fixed at 0 (all fixed step time per layer);
- v6: v4 with the per-sequence decode time charged per layer (``seq_overhead_s`` x layers).

The variants need the scratch model in ``bench/profile_forms.patch`` (not shipped: none passed
the rule). ``tuning`` scores on the tuning profiles only; ``held-out`` is what was run once
after the decision::

    T=$(mktemp -d); git archive HEAD daemon common | tar -x -C $T
    (cd $T && git apply "$OLDPWD/bench/profile_forms.patch")
    PYTHONPATH=$T/daemon:$T/common .venv/bin/python bench/profile_forms.py tuning v0 v1 v2 v4 v5 v6
    PYTHONPATH=$T/daemon:$T/common .venv/bin/python bench/profile_forms.py held-out v6
    .venv/bin/python bench/profile_forms.py held-out v0   # the shipped code, no patch
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from fleetshift_daemon.cli.calibration import Profile, calibrate, read_profile
from fleetshift_daemon.core import calibration as C
from fleetshift_daemon.core import perfmodel as PM

P = "docs/profiles/"
TUNING_SETS = {"q1": ("small-r4-q1", "deep-narrow-q1"), "stored": ("small-r4", "deep-narrow")}
FITTED0 = C.FITTED
NAMES0 = C.factor_names
HELD_OUT = [  # (column, fitted on, predicted)
    ("fresh", ["small-r4-q1"], "fresh-7l"),
    ("fresh", ["deep-narrow-q1"], "fresh-7l"),
    ("fresh", ["small-r4-q1", "deep-narrow-q1"], "fresh-7l"),
    ("fresh", ["small-r4-q2"], "fresh-7l"),
    ("fresh", ["deep-narrow-q2"], "fresh-7l"),
    ("fresh", ["small-r4-q2", "deep-narrow-q2"], "fresh-7l"),
    ("retest", ["small-r4-q1"], "deep-narrow-q2"),
    ("retest", ["deep-narrow-q1"], "small-r4-q2"),
    ("retest", ["small-r4-q1"], "small-r4-q2"),
    ("retest", ["deep-narrow-q1"], "deep-narrow-q2"),
    ("retest", ["small-r4-q1", "deep-narrow-q1"], "small-r4-q2"),
    ("retest", ["small-r4-q1", "deep-narrow-q1"], "deep-narrow-q2"),
    ("set2-cross", ["small-r4-q2"], "deep-narrow-q2"),
    ("set2-cross", ["deep-narrow-q2"], "small-r4-q2"),
    ("seen", ["small-r4-q1"], "wide-gqa-q1"),
    ("seen", ["deep-narrow-q1"], "wide-gqa-q1"),
    ("seen", ["small-r4-q1", "deep-narrow-q1"], "wide-gqa-q1"),
]


def profile(name: str) -> Profile:
    return read_profile(f"{P}{name}.csv:{P}{name}.config.json")


def _no_step(kind: Any, multi_gpu: bool) -> tuple[str, ...]:
    names = NAMES0(kind, multi_gpu)
    if C.engine_shape(kind) == C.REFERENCE_CPU_ENGINE:
        names = tuple(n for n in names if n != "step_overhead_s")
    return names


def configure(variant: str) -> None:
    patched = hasattr(PM, "LAYER_FIXED_FORM")
    if variant != "v0" and not patched:
        raise SystemExit(f"{variant} needs bench/profile_forms.patch (see the module doc)")
    if not patched:
        return
    C.FITTED = tuple(n for n in FITTED0 if n != "layer_chunk_s") if variant == "v0" else FITTED0
    no_step = variant in ("v4", "v5", "v6")
    C.factor_names = _no_step if no_step else NAMES0
    C.START["step_overhead_s"] = 0.0 if no_step else 0.01
    PM.LAYER_FIXED_FORM = "step" if variant in ("v1", "v4", "v6") else "chunk"
    PM.SEQ_PER_LAYER = variant == "v6"


def figures(errors: Sequence[Any]) -> dict[str, tuple[float, float]]:
    return {e.phase.value: (e.median_abs_pct, e.p90_abs_pct) for e in errors}


def tuning(variant: str) -> dict[tuple[str, str], tuple[float, float]]:
    """Each tuning set: A and B fitted alone (in-sample, and the other predicted), and jointly."""
    configure(variant)
    out: dict[tuple[str, str], tuple[float, float]] = {}
    for a, b in TUNING_SETS.values():
        pa, pb = profile(a), profile(b)
        for x, y in ((pa, pb), (pb, pa)):
            rep = calibrate([x], y)
            xs, ys = x.csv.stem, y.csv.stem
            out |= {(f"{xs} in-sample", ph): f for ph, f in figures(rep.in_sample).items()}
            out |= {(f"{xs} -> {ys}", ph): f for ph, f in figures(rep.errors).items()}
        rep = calibrate([pa, pb], pa)
        out |= {(f"{a} + {b} in-sample", ph): f for ph, f in figures(rep.in_sample).items()}
    return out


def print_tuning_table(
    res: dict[str, dict[tuple[str, str], tuple[float, float]]], variants: Sequence[str]
) -> None:
    """One row per tuning figure, one ``median / p90`` column per variant (round 8 too)."""
    print("| tuning figure | phase | " + " | ".join(variants) + " |")
    print("|---|---|" + "---|" * len(variants))
    for k in res[variants[0]]:
        cells = " | ".join(f"{res[v][k][0]:.1f} / {res[v][k][1]:.1f}" for v in variants)
        print(f"| {k[0]} | {k[1]} | {cells} |")


def main_tuning(variants: Sequence[str]) -> None:
    res = {v: tuning(v) for v in variants}
    keys = list(res[variants[0]])
    print_tuning_table(res, variants)
    sums = {v: sum(m + p for m, p in res[v].values()) for v in variants}
    base = res.get("v0")
    for v in variants:
        line = f"{v}: sum of medians + p90s {sums[v]:.1f}"
        if base is not None:
            worst = max(max(res[v][k][i] - base[k][i] for i in (0, 1)) for k in keys)
            passed = v != "v0" and sums[v] <= 0.95 * sums["v0"] and worst <= 1.0
            line += f", x{sums[v] / sums['v0']:.3f} of v0, worst figure +{worst:.1f} pt"
            line += " PASSES the rule" if passed else ""
        print(line)


def main_held_out(variant: str) -> None:
    configure(variant)
    profiles = {n: profile(n) for _, fits, check in HELD_OUT for n in (*fits, check)}
    print("| variant | column | fitted on -> predicts | phase | points | median | p90 | bias |")
    print("|---|---|---|---|---|---|---|---|")
    for column, fits, check in HELD_OUT:
        rep = calibrate([profiles[n] for n in fits], profiles[check])
        for e in rep.errors:
            print(
                f"| {variant} | {column} | {' + '.join(fits)} -> {check} | {e.phase.value} | "
                f"{e.n} | {e.median_abs_pct:.1f} | {e.p90_abs_pct:.1f} | {e.median_bias_pct:+.1f} |"
            )


def main(argv: Sequence[str]) -> int:
    if len(argv) >= 2 and argv[0] == "tuning":
        main_tuning(list(argv[1:]))
        return 0
    if len(argv) == 2 and argv[0] == "held-out":
        main_held_out(argv[1])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
