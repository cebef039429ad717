"""``fleetshift calibration``: fit the performance model on some models' profiles, check another.

The question an operator asks of a performance model is whether it predicts *their* model on
*their* GPUs. This answers it on their own data, out of sample: the hardware factors are
fitted on one or more CSVs of the reference table's shape (each with its model's Hugging Face
``config.json``), then the model predicts a CSV of another model that took no part in the fit,
and the error is reported per hardware kind and phase: rows, median and p90 absolute % error,
and the signed median bias (> 0: predicted slower than measured)::

    fleetshift calibration --fit A.csv:a/config.json [--fit ...] --check B.csv:b/config.json
    fleetshift calibration --check B.csv:b/config.json     # the shipped factors, no refit

Bad input (a missing column, unknown hardware, a config ``from_hf_config`` refuses) is refused
with the file, line and field named, and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fleetshift_common.errors import FleetShiftError, InvalidArgument
from fleetshift_daemon.core.calibration import (
    FitError,
    Row,
    at_bounds,
    fit_rows,
    fitted_names,
    signed_errors,
    summarize,
)
from fleetshift_daemon.core.measurements import Measurement, load_measurements, screened
from fleetshift_daemon.core.perf_factors import (
    SHIPPED_ALIASES,
    EfficiencyFactors,
    shipped_factors,
)
from fleetshift_daemon.core.perfmodel import (
    Dtype,
    ModelArch,
    PerfModel,
    dtype_of_config,
    is_cpu_kind,
)


@dataclass(frozen=True)
class Profile:
    """One ``CSV:config.json`` argument, read and validated."""

    csv: Path
    config: Path
    arch: ModelArch
    dtype: Dtype
    rows: list[Measurement]

    def as_rows(self, data: Sequence[Measurement] | None = None) -> list[Row]:
        return [Row(m, self.arch, self.dtype) for m in (self.rows if data is None else data)]


def _line_of(text: str, key: str) -> int:
    """The line a key first appears on in a JSON text (1 when it does not appear)."""
    needle = f'"{key}"'
    for number, line in enumerate(text.splitlines(), start=1):
        if needle in line:
            return number
    return 1


def read_config(path: Path) -> tuple[dict[str, Any], str]:
    try:
        text = path.read_text()
    except OSError as err:
        raise InvalidArgument(f"{path}: cannot read ({err.strerror})", field="config") from None
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as err:
        raise InvalidArgument(
            f"{path}:{err.lineno}: not JSON ({err.msg})", field="config"
        ) from None
    if not isinstance(cfg, dict):
        raise InvalidArgument(f"{path}:1: config must be a JSON object", field="config")
    return cfg, text


def read_profile(spec: str) -> Profile:
    csv_part, sep, config_part = spec.rpartition(":")
    if not sep or not csv_part or not config_part:
        raise InvalidArgument(f"{spec!r}: expected CSV:CONFIG_JSON", field="spec")
    csv_path, config_path = Path(csv_part), Path(config_part)
    rows = load_measurements(csv_path)
    cfg, text = read_config(config_path)
    name = rows[0].model or config_path.parent.name
    try:
        arch = ModelArch.from_hf_config(name, cfg)
    except FleetShiftError as err:
        key = err.field or "config"
        raise InvalidArgument(
            f"{config_path}:{_line_of(text, key)}: {key}: {err.message}", field=key
        ) from None
    try:
        dtype = dtype_of_config(cfg)
    except FleetShiftError as err:
        key = err.field or "torch_dtype"
        raise InvalidArgument(
            f"{config_path}:{_line_of(text, key)}: {err.message}", field=key
        ) from None
    return Profile(csv_path, config_path, arch, dtype, rows)


@dataclass(frozen=True)
class Report:
    factors: EfficiencyFactors
    fitted: dict[str, str]  # kind -> "fit" or the kind whose shipped factors it used
    errors: list[FitError]  # held out: the check profile, which took no part in the fit
    hardware: dict[str, str]  # kind -> the hardware name the check file used
    set_aside: list[Measurement]
    in_sample: list[FitError]  # the same factors on the rows they were fitted on (tuning)
    moved: dict[str, tuple[str, ...]]  # fitted kind -> the factors its rows could move

    def pinned(self, kind: str) -> list[str]:
        """Fitted factors of ``kind`` that ended on a physical bound (none for shipped ones)."""
        if kind not in self.moved:
            return []
        return at_bounds(self.factors.for_kind(kind), self.moved[kind])


def _cpu_aliases(fitted: Mapping[str, object], check_kinds: Iterable[str]) -> dict[str, str]:
    """A CPU kind checked but not fitted -> the first fitted CPU kind: on a CPU the factors are
    the reference engine's, stated at an idle core (``perfmodel.EngineShape.host_tflops``),
    and each profile's own measured peaks carry its host's speed; GPU factors never apply."""
    cpus = [k for k in fitted if is_cpu_kind(k)]
    if not cpus:
        return {}
    return {k: cpus[0] for k in check_kinds if is_cpu_kind(k) and k not in fitted}


def calibrate(fits: Sequence[Profile], check: Profile) -> Report:
    """Fit on ``fits`` (none: the shipped factors), predict ``check``; the use case."""
    shipped = shipped_factors()
    fitted = fit_rows([r for p in fits for r in p.as_rows()]).per_kind if fits else {}
    kinds = {m.kind.name: m.hardware for m in check.rows}
    cpus = _cpu_aliases(fitted, kinds)
    factors = EfficiencyFactors(
        per_kind={**shipped.per_kind, **fitted}, aliases={**SHIPPED_ALIASES, **cpus}
    )
    model = PerfModel(factors)
    kept, aside = screened(check.rows)
    errors = summarize(signed_errors(model, check.as_rows(kept)))
    tuning = [r for p in fits for r in p.as_rows(screened(p.rows)[0])]
    in_sample = summarize(signed_errors(model, tuning)) if tuning else []
    source = {k: "fit" if k in fitted else f"shipped:{shipped.source_of(k)}" for k in kinds}
    source |= {k: f"fit:{base}" for k, base in cpus.items()}
    moved = {
        k: fitted_names([r for r in tuning if r.m.kind.name == k])
        for k in {r.m.kind.name for r in tuning}
    }
    return Report(factors, source, errors, kinds, aside, in_sample, moved)


def report_json(fits: Sequence[Profile], check: Profile, rep: Report) -> dict[str, Any]:
    def profile(p: Profile) -> dict[str, Any]:
        return {
            "csv": str(p.csv),
            "config": str(p.config),
            "model": p.arch.name,
            "dtype": p.dtype.value,
            "rows": len(p.rows),
        }

    def rows(errors: Sequence[FitError]) -> list[dict[str, Any]]:
        return [
            {
                "hardware": rep.hardware.get(e.kind, e.kind),
                "kind": e.kind,
                "phase": e.phase.value,
                "rows": e.n,
                "median_abs_pct": round(e.median_abs_pct, 2),
                "p90_abs_pct": round(e.p90_abs_pct, 2),
                "median_bias_pct": round(e.median_bias_pct, 2),
                "factors": rep.fitted.get(e.kind, "fit"),
            }
            for e in errors
        ]

    return {
        "fit": [profile(p) for p in fits],
        "check": profile(check),
        "set_aside": [
            {"hardware": m.hardware, "tp": m.tp, "prompt": m.prompt_size, "batch": m.batch_size}
            for m in rep.set_aside
            if m.phase.value == "prefill"
        ],
        "errors": rows(rep.errors),
        "in_sample": rows(rep.in_sample),
        "factors": {
            kind: {**rep.factors.for_kind(kind).to_dict(), "source": rep.fitted[kind]}
            for kind in rep.hardware
        },
    }


def _error_table(title: str, errors: Sequence[FitError], hardware: dict[str, str]) -> Table:
    table = Table(title=title)
    for column in ("hardware", "phase", "rows", "median |err| %", "p90 |err| %", "bias %"):
        numeric = "%" in column or column == "rows"
        table.add_column(column, justify="right" if numeric else "default")
    for e in errors:
        table.add_row(
            f"{hardware.get(e.kind, e.kind)} ({e.kind})",
            e.phase.value,
            str(e.n),
            f"{e.median_abs_pct:.1f}",
            f"{e.p90_abs_pct:.1f}",
            f"{e.median_bias_pct:+.1f}",
        )
    return table


def render(console: Console, fits: Sequence[Profile], check: Profile, rep: Report) -> None:
    fitted_on = ", ".join(f"{p.csv} ({p.arch.name})" for p in fits) or "the shipped factors"
    title = f"held out: {check.csv} ({check.arch.name}) predicted from {fitted_on}"
    console.print(_error_table(title, rep.errors, rep.hardware))
    if rep.in_sample:
        tuning = f"in-sample (tuning rows): {fitted_on} predicted from its own fit"
        console.print(_error_table(tuning, rep.in_sample, {}))
    for kind, source in rep.fitted.items():
        kf = rep.factors.for_kind(kind)
        values = ", ".join(f"{k}={v:.4g}" for k, v in kf.to_dict().items())
        pinned = rep.pinned(kind)
        note = f"; at a bound: {', '.join(pinned)}" if pinned else ""
        console.print(f"{kind} factors ({source}{note}): {values}")
    for m in rep.set_aside:
        if m.phase.value == "prefill":
            console.print(
                f"set aside (did not hold its batch): {m.hardware} tp={m.tp} "
                f"prompt={m.prompt_size} batch={m.batch_size}"
            )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleetshift calibration",
        description="Fit the performance model on profiles, report its error on another.",
    )
    parser.add_argument(
        "--fit",
        action="append",
        default=[],
        metavar="CSV:CONFIG",
        help="a profile to fit on (repeatable); none: check the shipped factors",
    )
    parser.add_argument("--check", required=True, metavar="CSV:CONFIG", help="profile to predict")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    console = Console()
    try:
        fits = [read_profile(spec) for spec in args.fit]
        check = read_profile(args.check)
        rep = calibrate(fits, check)
    except FleetShiftError as err:
        print(f"error: {err.message}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report_json(fits, check, rep), indent=2))
    else:
        render(console, fits, check, rep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
