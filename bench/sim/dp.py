"""The data-parallel baseline: one model, each step on the M replicas' batches together.

M data-parallel workers on the replicas' shards would each take the batch its replica takes at that
position and average their gradients every step: the same as one model on the concatenation of the M
batches (equal sizes, so the mean of the M mean losses is the mean loss of the whole). It runs in the
daemon's `InnerTrainer` (same lr schedule, clipping and inner optimizer), with M× the batch, for as many
steps as an average-speed replica takes, and is evaluated on the replicas' eval batches.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch

from dilocod.config import Config
from dilocod.trainer import Corpus, InnerTrainer, ShardSampler, count_params, eval_batches

from .diloco import RunResult

FP32_BYTES = 4


class JointSampler(ShardSampler):
    """The batches several peers' samplers draw at one position, concatenated in the given order."""

    def __init__(self, parts: Sequence[ShardSampler]) -> None:
        first = parts[0]
        # The base describes the joint batch; its own shard is never sampled (`batch` is the parts').
        super().__init__(
            first.tokens,
            seed=first.seed,
            peer_key=first.peer_key,
            num_shards=1,
            batch_size=sum(p.batch_size for p in parts),
            seq_len=first.seq_len,
        )
        self.parts = list(parts)

    def batch(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = zip(*(part.batch(position) for part in self.parts), strict=True)
        return torch.cat(xs), torch.cat(ys)


def replica_samplers(cfg: Config, keys: Sequence[str], corpus: Corpus) -> list[ShardSampler]:
    """The sampler each replica's trainer (a peer with that key) draws its batches from."""
    t = cfg.trainer
    return [
        ShardSampler(
            corpus.train,
            seed=cfg.run.seed,
            peer_key=key,
            num_shards=cfg.data.num_shards,
            batch_size=t.batch_size,
            seq_len=t.seq_len,
        )
        for key in keys
    ]


def run_dp(cfg: Config, keys: Sequence[str], steps: int, corpus: Corpus) -> RunResult:
    """`steps` data-parallel steps over the shards of `keys`; θ is evaluated at the end."""
    t = cfg.trainer
    joint = dataclasses.replace(t, batch_size=t.batch_size * len(keys))
    trainer = InnerTrainer(cfg.model, cfg.data, joint, seed=cfg.run.seed, peer_key=keys[0], corpus=corpus)
    trainer.sampler = JointSampler(replica_samplers(cfg, keys, corpus))
    # The replicas' eval batches (the trainer's own would be drawn M× as wide, hence other windows).
    trainer.eval_set = eval_batches(
        corpus.eval, seed=cfg.run.seed, n_batches=t.eval_batches, batch_size=t.batch_size, seq_len=t.seq_len
    )
    started = time.perf_counter()
    stats = trainer.train_steps(steps)
    seconds = time.perf_counter() - started
    # Each of the M workers sends its fp32 gradient once per step.
    sent = len(keys) * steps * FP32_BYTES * count_params(trainer.model)
    return RunResult(trainer.evaluate(), stats.tokens, sent, seconds)
