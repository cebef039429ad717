"""The PromQL name extraction the asset checks rely on: metric names only, whatever surrounds."""

from __future__ import annotations

import pytest

from tests.observability.promql import alert_queries, dashboard_queries, metric_names_in


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("fleetshift_placement_efficiency < 0.8", {"fleetshift_placement_efficiency"}),
        (
            'sum(rate(fleetshift_rpc_refused_total{code=~"PERMISSION_DENIED|x"}[5m])) > 0.1',
            {"fleetshift_rpc_refused_total"},
        ),
        (
            "histogram_quantile(0.99, sum by (le, kind) (rate(a_bucket[$__rate_interval])))",
            {"a_bucket"},
        ),
        ('up{job="fleetshiftd"} == 0', {"up"}),
        ("a / on(job) group_left(node) b_info * 1e3 offset 5m", {"a", "b_info"}),
        ('sum without (instance) (x) unless y and bool z{le="+Inf"}', {"x", "y", "z"}),
        ("max_over_time(c[1h:5m]) or vector(0)", {"c"}),
        ('label_replace(d, "dst", "$1", "src", "fleetshift_(.*)")', {"d"}),
    ],
)
def test_metric_names_are_found_and_nothing_else(expr: str, names: set[str]) -> None:
    assert metric_names_in(expr) == names


def test_every_shipped_query_names_at_least_one_series() -> None:
    queries = [*dashboard_queries(), *alert_queries().values()]
    assert len(queries) >= 30
    assert all(metric_names_in(q) for q in queries)
