"""The gateway's Prometheus series, on their own registry and port."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


@dataclass(frozen=True)
class ModelSeries:
    """One model's per-token series, resolved once: ``labels()`` takes a lock and a lookup,
    which every streamed token would otherwise pay twice."""

    ttft: Histogram
    tbt: Histogram
    tokens: Counter


class GatewayMetrics:
    def __init__(self) -> None:
        self._by_model: dict[str, ModelSeries] = {}
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "fleetshift_gateway_requests",
            "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.errors = Counter(
            "fleetshift_gateway_errors",
            "refused or failed requests, by cause (the OpenAI error code)",
            ["cause"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "fleetshift_gateway_ttft_seconds",
            "request arrival to its first token leaving the gateway",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tbt = Histogram(
            "fleetshift_gateway_tbt_seconds",
            "time between consecutive tokens of one stream",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "fleetshift_gateway_output_tokens",
            "generated tokens sent to clients",
            ["model"],
            registry=self.registry,
        )

        self.split_fallbacks = Counter(
            "fleetshift_gateway_split_fallbacks",
            "split hand-overs a worker refused (by its gRPC status), the session served elsewhere",
            ["code"],
            registry=self.registry,
        )
        self.route_answers = Counter(
            "fleetshift_gateway_route_answers",
            "where requests' routes came from: daemon (its own Route call), kept (a recent "
            "answer; the request's counted Route call sent after its first token), "
            "count_failed (such a counted call failed: the model's kept answers dropped)",
            ["source"],
            registry=self.registry,
        )
        self._route_answers = {
            s: self.route_answers.labels(s) for s in ("daemon", "kept", "count_failed")
        }

    def route_answer(self, source: str) -> None:
        self._route_answers[source].inc()

    def of_model(self, model: str) -> ModelSeries:
        series = self._by_model.get(model)
        if series is None:
            series = self._by_model[model] = ModelSeries(
                self.ttft.labels(model), self.tbt.labels(model), self.tokens.labels(model)
            )
        return series
