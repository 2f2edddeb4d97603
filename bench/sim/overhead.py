"""How close the simulator runs to M × a bare training loop: one replica's trainer alone, same steps.

The reference is the daemon's `InnerTrainer.train_steps` with no rounds (it runs at the speed of a plain
torch loop: docs/benchmarks.md, "Throughput"). Whatever the simulator spends beyond M times that is
its per-round work: pseudo-gradients, the all-reduce, M outer steps and their hashes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from dilocod.trainer import InnerTrainer

from .diloco import RunResult
from .settings import run_budget
from .variants import Runner, Variant


@dataclass(frozen=True)
class Overhead:
    simulator_seconds_per_step: float  # training and rounds, per replica step
    bare_seconds_per_step: float

    @property
    def ratio(self) -> float:
        """Simulator time ÷ M × the bare loop's, at equal steps (1 = no overhead)."""
        return self.simulator_seconds_per_step / self.bare_seconds_per_step


def measure(runner: Runner, variant: Variant, seed: int, result: RunResult) -> Overhead:
    """Time one replica's trainer alone for the budget's steps, against `result` (that variant's run)."""
    cfg = runner.config(variant, seed)
    steps = run_budget(cfg, runner.options.tokens, variant.replicas)
    trainer = InnerTrainer(
        cfg.model,
        cfg.data,
        cfg.trainer,
        seed=cfg.run.seed,
        peer_key=runner.keys(variant.replicas)[0],
        corpus=runner.corpus(cfg.data),
    )
    started = time.perf_counter()
    trainer.train_steps(steps)
    bare = (time.perf_counter() - started) / steps
    replica_steps = result.tokens / trainer.tokens_per_step
    return Overhead(result.train_seconds / replica_steps, bare)
