"""Prometheus metrics of one node (prefix `dilocod_`, base units, `_total` counters, no peer-id labels)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

ROUND_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """One registry per process-level node, so tests can run several nodes in one interpreter."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.tokens_per_second = Gauge(
            "dilocod_tokens_per_second", "Training throughput (tokens/s)", registry=r
        )
        self.tokens = Counter("dilocod_tokens", "Tokens trained on", registry=r)
        self.inner_steps = Counter("dilocod_inner_steps", "Inner optimizer steps taken", registry=r)
        self.inner_step_seconds = Histogram(
            "dilocod_inner_step_seconds", "Wall time of one inner step", buckets=STEP_BUCKETS, registry=r
        )
        self.train_loss = Gauge("dilocod_train_loss", "Mean train loss over the last round", registry=r)
        self.eval_loss = Gauge("dilocod_eval_loss", "Held-out loss of θ_global", registry=r)
        self.outer_step = Gauge("dilocod_outer_step", "Completed outer rounds", registry=r)
        self.round_seconds = Histogram(
            "dilocod_outer_round_duration_seconds",
            "Matchmaking plus all-reduce time of one outer round",
            buckets=ROUND_BUCKETS,
            registry=r,
        )
        self.group_size = Gauge("dilocod_group_size", "Members of the last averaging group", registry=r)
        self.rounds = Counter("dilocod_rounds", "Outer rounds by result", ["result"], registry=r)
        self.resyncs = Counter("dilocod_resyncs", "State downloads that replaced θ_global", registry=r)
        self.peers_known = Gauge("dilocod_peers_known", "Other live peers of this run", registry=r)
        self.invalid_records = Counter(
            "dilocod_invalid_records", "Malformed records from the DHT that were dropped", registry=r
        )
        self.checkpoint_seconds = Histogram(
            "dilocod_checkpoint_seconds", "Time to write one checkpoint", buckets=STEP_BUCKETS, registry=r
        )
        self.compute_utilization = Gauge(
            "dilocod_compute_utilization", "Time in inner steps divided by wall time (0-1)", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
