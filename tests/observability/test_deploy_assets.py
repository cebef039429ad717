"""The Grafana dashboard and the Prometheus alert rules use only metrics that exist.

PyYAML is not a dependency, so the rules file is read with a small line-based reader that
relies on the file's own convention (one ``expr:`` per line); it refuses anything it does not
understand instead of skipping it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fleetshift_rpc.metrics import AgentMetrics, DaemonMetrics, metric_names
from tests.observability.promql import PROMETHEUS_OWN, metric_names_in

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "fleetshift.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
NAME = re.compile(r"\bfleetshift_[a-z0-9_]+\b")
DURATION = re.compile(r"^\d+[smhd]$")


def known_names() -> frozenset[str]:
    return metric_names(DaemonMetrics().registry) | metric_names(AgentMetrics("n").registry)


def unknown_in(expr: str) -> set[str]:
    """Series ``expr`` selects that no FleetShift registry defines (Prometheus's own aside)."""
    return metric_names_in(expr) - known_names() - PROMETHEUS_OWN


@dataclass
class Rule:
    alert: str
    fields: dict[str, str] = field(default_factory=dict)


def read_rules(text: str) -> tuple[list[str], list[Rule]]:
    """Groups and alerting rules of a Prometheus rule file written in this repo's style."""
    groups: list[str] = []
    rules: list[Rule] = []
    allowed = {"groups", "rules", "labels", "annotations"}
    keys = {"expr", "for", "severity", "summary", "description"}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, rest = line.removeprefix("- ").partition(":")
        rest = rest.strip()
        assert sep, f"alerts.yml:{number}: not a 'key: value' line: {raw!r}"
        if key == "name":
            groups.append(rest)
        elif key == "alert":
            rules.append(Rule(rest))
        elif key in keys:
            assert rules, f"alerts.yml:{number}: {key} outside a rule"
            assert rest and rest not in ("|", ">", "|-", ">-"), f"alerts.yml:{number}: empty"
            rules[-1].fields[key] = rest.strip('"')
        else:
            assert key in allowed and not rest, f"alerts.yml:{number}: unexpected {raw!r}"
    return groups, rules


def test_dashboard_parses_and_uses_only_defined_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert dashboard["uid"] == "fleetshift" and len(panels) >= 15
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    assert all(NAME.search(e) for e in exprs), "every target reads a FleetShift metric"
    unknown = {name for e in exprs for name in unknown_in(e)}
    assert unknown == set()
    used = {name for e in exprs for name in NAME.findall(e)}
    for must in (
        "fleetshift_placement_efficiency",
        "fleetshift_fleet_gpus",
        "fleetshift_traffic_prefill_decode_ratio",
        "fleetshift_route_latency_seconds_bucket",
        "fleetshift_heartbeat_lag_seconds_bucket",
        "fleetshift_operations_total",
        "fleetshift_bytes_moved_total",
        "fleetshift_agent_workers",
    ):
        assert must in used, must
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}"
        assert {"h", "w", "x", "y"} <= set(p["gridPos"])


def test_alert_rules_parse_and_use_only_defined_metrics() -> None:
    groups, rules = read_rules(ALERTS.read_text())
    assert groups and rules
    assert len({r.alert for r in rules}) == len(rules)
    for rule in rules:
        assert {"expr", "for", "severity", "summary"} <= set(rule.fields), rule.alert
        assert DURATION.match(rule.fields["for"]), rule.alert
        assert rule.fields["severity"] in ("warning", "critical"), rule.alert
        assert rule.fields["expr"].count("(") == rule.fields["expr"].count(")"), rule.alert
        assert unknown_in(rule.fields["expr"]) == set(), rule.alert
    by_name = {r.alert: r.fields for r in rules}
    inefficient = by_name["FleetShiftPlacementInefficient"]
    assert inefficient["expr"] == "fleetshift_placement_efficiency < 0.8"
    assert inefficient["for"] == "15m"
    assert "fleetshift_fleet_nodes" in by_name["FleetShiftNodesLost"]["expr"]
    assert (
        "fleetshift_heartbeat_lag_seconds_bucket" in by_name["FleetShiftHeartbeatLagHigh"]["expr"]
    )
    assert 'outcome="failed"' in by_name["FleetShiftOperationsFailing"]["expr"]
    assert "histogram_quantile(0.99" in by_name["FleetShiftRouteLatencyHigh"]["expr"]


def test_the_rule_reader_refuses_what_it_does_not_understand() -> None:
    with pytest.raises(AssertionError):
        read_rules("groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: |\n")
    with pytest.raises(AssertionError):
        read_rules("groups:\n  - name: g\n    rules:\n      - record: x\n        expr: y\n")
    assert unknown_in("rate(fleetshift_operations[5m])") == {"fleetshift_operations"}
    assert unknown_in("fleetshift_route_latency_seconds_bucket") == set()
    assert unknown_in('sum by (job) (up{job="fleetshiftd"}) > 0') == set()
    assert unknown_in("rate(node_cpu_seconds_total[5m])") == {"node_cpu_seconds_total"}
