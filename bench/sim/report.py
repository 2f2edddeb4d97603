"""One row per variant over its seeds: eval loss mean ± sd, against its dp baseline, bytes per token."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .diloco import RunResult
from .variants import Variant


@dataclass(frozen=True)
class Outcome:
    """A variant's runs, one per seed."""

    variant: Variant
    name: str
    inner_steps: int | None  # H it ran with (the config's unless the variant set it); None for dp
    runs: Sequence[RunResult]

    @property
    def losses(self) -> list[float]:
        return [run.eval_loss for run in self.runs]

    @property
    def bytes_per_token(self) -> float:
        return sum(r.bytes_sent for r in self.runs) / max(1, sum(r.tokens for r in self.runs))


def rows(outcomes: Sequence[Outcome]) -> list[dict[str, Any]]:
    """The JSON objects, in the order of `outcomes`; each is compared with its own dp baseline."""
    baselines: Mapping[Variant, Outcome] = {o.variant: o for o in outcomes if o.variant.dp}
    return [_row(o, baselines.get(o.variant.baseline)) for o in outcomes]


def _row(outcome: Outcome, baseline: Outcome | None) -> dict[str, Any]:
    losses, runs = outcome.losses, outcome.runs
    mean = statistics.fmean(losses)
    ratio = bytes_ratio = None
    if baseline is not None:
        # Ratio of the means: every variant of a seed shares its data and eval batches with its baseline.
        ratio = mean / statistics.fmean(baseline.losses)
        bytes_ratio = outcome.bytes_per_token / baseline.bytes_per_token
    return {
        "variant": outcome.name,
        "replicas": outcome.variant.replicas,
        "inner_steps": outcome.inner_steps,
        "seeds": len(runs),
        "tokens": round(statistics.fmean(r.tokens for r in runs)),
        "eval_loss_mean": mean,
        "eval_loss_sd": statistics.stdev(losses) if len(losses) > 1 else None,
        "ratio_to_dp": ratio,
        "bytes_per_token_ratio": bytes_ratio,
        "eval_losses": losses,
        "outer_steps": len(runs[0].rounds),
        "train_seconds_mean": statistics.fmean(r.train_seconds for r in runs),
        "round_seconds_mean": statistics.fmean(r.round_seconds for r in runs),
    }


def table(data: Sequence[Mapping[str, Any]]) -> str:
    """The rows as a fixed-width text table."""
    head = f"{'variant':<58} {'M':>2} {'H':>4} {'seeds':>5} {'tokens':>9} {'eval loss':>17} {'vs dp':>7} {'bytes/token vs dp':>18} {'s/run':>7}"
    lines = [head, "-" * len(head)]
    for row in data:
        sd = row["eval_loss_sd"]
        loss = f"{row['eval_loss_mean']:.4f}" + (f" ± {sd:.4f}" if sd is not None else "")
        h = "-" if row["inner_steps"] is None else str(row["inner_steps"])
        lines.append(
            f"{row['variant']:<58} {row['replicas']:>2} {h:>4} {row['seeds']:>5} {row['tokens']:>9} "
            f"{loss:>17} {_ratio(row['ratio_to_dp']):>7} {_bytes(row['bytes_per_token_ratio']):>18} "
            f"{row['train_seconds_mean']:>7.1f}"
        )
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    return f"{value:.3g} (1/{1 / value:,.0f})" if value < 1 else f"{value:.3g}"
