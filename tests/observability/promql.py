"""The metric names a PromQL expression selects, and the queries the shipped assets make.

Not a full PromQL parser (none is packaged for Python), but a tokenizer that knows where a
metric name can stand: string literals, label matchers ``{...}``, range and subquery brackets
``[...]`` and the label lists of ``by``/``without``/``on``/``ignoring``/``group_left``/
``group_right`` are removed first; what is left is functions (a name before ``(``), keywords,
numbers and metric names. Every name is returned, not only ``fleetshift_*`` ones, so a rule on
a series nobody exports (a typo, a renamed metric) is caught whatever its prefix.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "fleetshift.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"

STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
MATCHERS = re.compile(r"\{[^{}]*\}")
BRACKETS = re.compile(r"\[[^\[\]]*\]")
LABEL_LISTS = re.compile(
    r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.IGNORECASE
)
IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"}
    | {"group_left", "group_right", "inf", "nan", "atan2"}
)
# Series Prometheus itself makes for every scrape target, not any process of ours.
PROMETHEUS_OWN = frozenset({"up", "scrape_duration_seconds", "scrape_samples_scraped"})


def metric_names_in(expr: str) -> set[str]:
    """Every metric name ``expr`` selects."""
    text = STRING.sub(" ", expr)
    for pattern in (MATCHERS, BRACKETS, LABEL_LISTS):
        while True:
            stripped = pattern.sub(" ", text)
            if stripped == text:
                break
            text = stripped
    names = set()
    for match in IDENT.finditer(text):
        name = match.group()
        follows = text[match.end() :].lstrip()[:1]
        if follows == "(" or name.lower() in KEYWORDS:
            continue  # a function or an operator
        before = text[: match.start()].rstrip()[-1:]
        if before.isdigit() or before == ".":
            continue  # the exponent or suffix of a number (1e3, 5m in a duration)
        names.add(name)
    return names


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] if p["type"] != "row" for t in p["targets"]]


def alert_queries() -> dict[str, str]:
    """Alert name -> expression (the file keeps one ``expr:`` per line after its ``alert:``)."""
    queries: dict[str, str] = {}
    alert = ""
    for raw in ALERTS.read_text().splitlines():
        line = raw.strip().removeprefix("- ")
        if line.startswith("alert:"):
            alert = line.partition(":")[2].strip()
        elif line.startswith("expr:"):
            assert alert and alert not in queries, f"expr without its own alert: {raw!r}"
            queries[alert] = line.partition(":")[2].strip()
    return queries
