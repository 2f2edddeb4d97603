"""Prometheus metrics of one node (prefix `dilocod_`, base units, `_total` counters, no peer-id labels).

docs/observability.md lists every metric with its meaning; `configs/grafana/dilocod.json` charts them
(tests/test_grafana.py checks that it names no metric missing here).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

from dilocod import __version__

ROUND_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """One registry per process-level node, so tests can run several nodes in one interpreter."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        # This node's own work.
        self.tokens_per_second = Gauge(
            "dilocod_tokens_per_second", "Training throughput (tokens/s)", registry=r
        )
        self.mfu = Gauge(
            "dilocod_mfu",
            "Model FLOPs utilization: model FLOP/s over the devices' peak (0-1); NaN when the peak is unknown",
            registry=r,
        )
        self.mfu.set(math.nan)  # unknown until measured, and for good on a CPU without trainer.peak_flops
        self.tokens = Counter("dilocod_tokens", "Tokens trained on", registry=r)
        self.tokens_contributed = Counter(
            "dilocod_tokens_contributed",
            "Tokens of this peer whose progress reached θ_global (with the weight its groups gave them)",
            registry=r,
        )
        self.contribution_share = Gauge(
            "dilocod_contribution_share",
            "Tokens that reached θ_global divided by tokens trained (0-1; NaN before the first step)",
            registry=r,
        )
        self.contribution_share.set(math.nan)
        self.inner_steps = Counter("dilocod_inner_steps", "Inner optimizer steps taken", registry=r)
        self.inner_step_seconds = Histogram(
            "dilocod_inner_step_seconds", "Wall time of one inner step", buckets=STEP_BUCKETS, registry=r
        )
        self.train_loss = Gauge("dilocod_train_loss", "Train loss of the latest inner step", registry=r)
        self.eval_loss = Gauge("dilocod_eval_loss", "Held-out loss of θ_global", registry=r)
        self.eval_bits_per_byte = Gauge(
            "dilocod_eval_bits_per_byte", "Held-out loss of θ_global in bits per byte of text", registry=r
        )
        self.data_fetch_bytes = Counter(
            "dilocod_data_fetch_bytes", "Bytes of the run's dataset downloaded from other peers", registry=r
        )
        self.data_served_bytes = Counter(
            "dilocod_data_served_bytes", "Bytes of dataset files served to other peers", registry=r
        )
        self.outer_step = Gauge("dilocod_outer_step", "Completed outer rounds", registry=r)
        self.round_phase_seconds = Histogram(
            "dilocod_round_phase_seconds",
            "Seconds between two stretches of inner steps, by phase of the round in between",
            ["phase"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
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
        # Contribution scoring (dilocod/node/scorer.py).
        self.scores_computed = Counter(
            "dilocod_scores_computed",
            "Contributions this peer scored (fetched and measured, or failed)",
            registry=r,
        )
        self.scoring_seconds = Counter(
            "dilocod_scoring_seconds", "Seconds spent scoring contributions, fetches included", registry=r
        )
        self.peers_gated = Gauge(
            "dilocod_peers_gated", "Peers this peer rates below the scoring gate (weight 0)", registry=r
        )
        self.invalid_records = Counter(
            "dilocod_invalid_records", "Malformed records from the DHT that were dropped", registry=r
        )
        self.checkpoint_seconds = Histogram(
            "dilocod_checkpoint_seconds", "Time to write one checkpoint", buckets=STEP_BUCKETS, registry=r
        )
        self.compute_utilization = Gauge(
            "dilocod_compute_utilization", "Time in inner steps divided by wall time (0-1)", registry=r
        )
        # Traffic and trust: incremented by the averaging layer that moves and screens the tensors
        # (they stay at 0 on a node whose averaging layer does not report them).
        self.bytes_sent = Counter(
            "dilocod_bytes_sent",
            "Bytes of tensors sent to other peers (averaging, state sharing)",
            registry=r,
        )
        self.bytes_received = Counter(
            "dilocod_bytes_received",
            "Bytes of tensors received from other peers (averaging, state downloads)",
            registry=r,
        )
        self.rejected_contributions = Counter(
            "dilocod_rejected_contributions",
            "Contributions of other peers screened out of an average (bad shape, non-finite, outlier)",
            registry=r,
        )
        self.bans = Counter("dilocod_bans", "Peers this node banned from its averaging groups", registry=r)
        # The run as this node sees it in the DHT (every node exports these; the bootstrap's are the run's).
        self.run_peers = Gauge(
            "dilocod_run_peers", "Training peers of the run with a live status record", registry=r
        )
        self.run_tokens_per_second = Gauge(
            "dilocod_run_tokens_per_second", "Sum of the tokens/s the run's live peers report", registry=r
        )
        self.run_outer_step = Gauge(
            "dilocod_run_outer_step", "Highest outer step a live peer of the run reports", registry=r
        )
        self.build_info = Gauge(
            "dilocod_build_info", "Always 1; labelled with the version", ["version"], registry=r
        )
        self.build_info.labels(version=__version__).set(1)
        # process_cpu_seconds_total, process_resident_memory_bytes, process_start_time_seconds, …
        ProcessCollector(registry=r)

    def observe_run(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Update the run-wide gauges from the live status records of the run (see `runview.read_run`)."""
        peers = [r for r in records if r.get("role") == "peer"]
        self.run_peers.set(len(peers))
        self.run_tokens_per_second.set(sum(_finite(r.get("tokens_per_second")) for r in peers))
        self.run_outer_step.set(max((int(r.get("outer_step") or 0) for r in peers), default=0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _finite(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else 0.0
