"""Round 8 of hold-out (c): round 7's per-layer forms (and v7, v8) on quiet profiles only.

The plan, tuning set, variants and keep rule were committed before any of this was run
(``docs/round8-plan.md``). Variants other than v0 need round 7's scratch model
(``bench/profile_forms.patch``, see ``bench/profile_forms.py``); v7 and v8 are switches of the
same patch:

- v7: v0 with the per-sequence decode time charged per layer (``seq_overhead_s`` x layers);
- v8: v1 with the per-sequence decode time charged per layer.

::

    T=$(mktemp -d); git archive HEAD daemon common | tar -x -C $T
    (cd $T && git apply "$OLDPWD/bench/profile_forms.patch")
    PYTHONPATH=$T/daemon:$T/common .venv/bin/python bench/profile_forms8.py tuning v0 v1 v2 v4 v5 v6 v7 v8
    PYTHONPATH=$T/daemon:$T/common .venv/bin/python bench/profile_forms8.py held-out v0 vN

Round 10 (docs/round10-plan.md: the sweep's quiet re-takes, fresh-12l in tuning, a 3-point
tolerance, fresh-16l held out): the same with ``--round 10`` before ``tuning`` / ``held-out``.
Round 11 (docs/round11-plan.md: v9, fresh-16l in tuning, fresh-24l held out): ``--round 11``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import profile_forms as R7

from fleetshift_daemon.cli.calibration import calibrate

W8 = ("sweep-2l", "small-r4-q1", "sweep-6l", "sweep-8l")
# Round 10 (docs/round10-plan.md): the sweep's quiet re-takes; fresh-12l is tuning data now.
W10 = ("sweep-2l-q", "small-r4-q1", "sweep-6l", "sweep-8l-q")
Entry = tuple[tuple[str, ...], str | None]  # (fitted on, predicted; None: in-sample)


def tuning_entries(w: tuple[str, ...] = W8, fresh: tuple[str, ...] = ("fresh-7l",)) -> list[Entry]:
    """The tuning figures of docs/round8-plan.md (round 10: its sweep ``w`` and fresh shapes),
    in its order, each entry once."""
    out: list[Entry] = []
    for a in w:
        out.append(((a,), None))
        out += [((a,), b) for b in w if b != a]
    out += [((w[0], w[3]), w[1]), ((w[0], w[3]), w[2])]
    out.append((w, None))
    for q in ("q1", "q2"):
        s, d, g = f"small-r4-{q}", f"deep-narrow-{q}", f"wide-gqa-{q}"
        out += [((s,), None), ((s,), d), ((d,), None), ((d,), s), ((s, d), None)]
        out += [((s,), g), ((d,), g), ((s, d), g)]
    for f in fresh:
        out += [(("small-r4-q1",), f), (("deep-narrow-q1",), f)]
        out += [(("small-r4-q1", "deep-narrow-q1"), f), (w, f)]
    return list(dict.fromkeys(out))


def held_out(w: tuple[str, ...], shape: str) -> list[tuple[tuple[str, ...], str]]:
    return [
        *(
            ((a,), shape)
            for a in ("small-r4-q1", "small-r4-q2", "deep-narrow-q1", "deep-narrow-q2")
        ),
        ((w[3],), shape),
        (("small-r4-q1", "deep-narrow-q1"), shape),
        (("small-r4-q2", "deep-narrow-q2"), shape),
        (w, shape),
    ]


# round -> (tuning entries, held-out entries, keep rule's tolerance in points): round 8's
# 1 point; rounds 10-11 relaxed it to 3 before any score (docs/round10-plan.md).
ROUNDS = {
    "8": (tuning_entries(), held_out(W8, "fresh-12l"), 1.0),
    "10": (tuning_entries(W10, ("fresh-7l", "fresh-12l")), held_out(W10, "fresh-16l"), 3.0),
    "11": (
        tuning_entries(W10, ("fresh-7l", "fresh-12l", "fresh-16l")),
        held_out(W10, "fresh-24l"),
        3.0,
    ),
}


def configure(variant: str) -> None:
    """Round 7's switches; v7 = v0 + per-layer sequence time, v8 = v1 + the same; v9 (round
    11) = v8 with the per-layer fixed time in the decode step only, none in the prefill pass."""
    base = {"v7": "v0", "v8": "v1", "v9": "v1"}.get(variant, variant)
    R7.configure(base)
    if variant in ("v7", "v8", "v9"):
        R7.PM.SEQ_PER_LAYER = True
    if variant == "v9":
        R7.PM.LAYER_FIXED_FORM = "decode"


def label(fits: Sequence[str], check: str | None) -> str:
    fitted = " + ".join(fits)
    return f"{fitted} in-sample" if check is None else f"{fitted} -> {check}"


def score(entries: Sequence[tuple[Sequence[str], str | None]]) -> dict[tuple[str, str], Any]:
    cache: dict[str, Any] = {}

    def prof(n: str) -> Any:
        return cache.setdefault(n, R7.profile(n))

    out: dict[tuple[str, str], Any] = {}
    for fits, check in entries:
        rep = calibrate([prof(n) for n in fits], prof(check or fits[0]))
        errs = rep.in_sample if check is None else rep.errors
        for e in errs:
            out[(label(fits, check), e.phase.value)] = e
    return out


def main_tuning(variants: Sequence[str], round_: str = "8") -> None:
    entries, _, tolerance = ROUNDS[round_]
    res = {}
    for v in variants:
        configure(v)
        res[v] = {k: (e.median_abs_pct, e.p90_abs_pct) for k, e in score(entries).items()}
    keys = list(res[variants[0]])
    print(f"{len(keys)} tuning entries x (median, p90)")
    R7.print_tuning_table(res, variants)
    sums = {v: sum(m + p for m, p in res[v].values()) for v in variants}
    base = res["v0"]
    for v in variants:
        worst_k = max(keys, key=lambda k: max(res[v][k][i] - base[k][i] for i in (0, 1)))
        worst = max(res[v][worst_k][i] - base[worst_k][i] for i in (0, 1))
        passed = v != "v0" and sums[v] <= 0.95 * sums["v0"] and worst <= tolerance
        n_worse = sum(1 for k in keys for i in (0, 1) if res[v][k][i] - base[k][i] > 1.0)
        print(
            f"{v}: sum {sums[v]:.1f}, x{sums[v] / sums['v0']:.3f} of v0, worst +{worst:.1f} pt "
            f"({worst_k[0]} {worst_k[1]}), {n_worse} figures worse by > 1 pt"
            + (" PASSES the rule" if passed else "")
        )


def main_held_out(variants: Sequence[str], round_: str = "8") -> None:
    rows = {}
    for v in variants:
        configure(v)
        rows[v] = score(ROUNDS[round_][1])
    print("| fitted on -> predicts | phase | points | " + " | ".join(variants) + " |")
    print("|---|---|---|" + "---|" * len(variants))
    for k, e0 in rows[variants[0]].items():
        cells = " | ".join(
            f"{rows[v][k].median_abs_pct:.1f} / {rows[v][k].p90_abs_pct:.1f} / "
            f"{rows[v][k].median_bias_pct:+.1f}"
            for v in variants
        )
        print(f"| {k[0]} | {k[1]} | {e0.n} | {cells} |")


def main(argv: Sequence[str]) -> int:
    round_ = "8"
    if len(argv) >= 2 and argv[0] == "--round":
        round_, argv = argv[1], argv[2:]
    if len(argv) >= 2 and argv[0] == "tuning":
        main_tuning(list(argv[1:]), round_)
        return 0
    if len(argv) >= 2 and argv[0] == "held-out":
        main_held_out(list(argv[1:]), round_)
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
