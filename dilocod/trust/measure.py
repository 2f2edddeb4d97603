"""One score's tensor work: the losses a scorer measures for a contributor's Δ (dilocod/trust/scoring.py
turns them into a verdict). Torch only, no I/O.

The model is the scorer's own copy (never the trainer's working copy): its parameters are overwritten with
θ_global as the round started, the loss is measured on the claimed and on random sequences, then with
θ_global − step·Δ, and measured again. With `step` = 1 the second point is exactly where the contributor's
inner steps ended (Δ = θ_global − θ_local), up to the codec's rounding.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dilocod.trust.scoring import Losses

Batch = tuple[torch.Tensor, torch.Tensor]  # (x, y) int64 [n, seq_len]


def pick(values: Sequence[int], n: int, seed: str) -> list[int]:
    """`n` of `values` (all of them when fewer), chosen by `seed`: the same on every machine."""
    if len(values) <= n:
        return list(values)
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "big"))
    return [values[int(i)] for i in sorted(rng.choice(len(values), size=n, replace=False))]


def random_starts(train_tokens: int, seq_len: int, n: int, seed: str) -> list[int]:
    """`n` window starts anywhere in the training stream, chosen by `seed`."""
    high = train_tokens - seq_len - 1
    if high <= 0:
        return []
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "big"))
    return [int(v) for v in rng.integers(0, high, size=n)]


def model_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters in `state_dict` order: the order of θ_global and of every Δ."""
    named = dict(model.named_parameters())
    return [named[name] for name in model.state_dict() if name in named]


@torch.no_grad()
def _loss(model: nn.Module, batch: Batch) -> float:
    x, y = batch
    logits = model(x)
    return float(F.cross_entropy(logits.float().flatten(0, 1), y.flatten()))


@torch.no_grad()
def measure(
    model: nn.Module,
    start: Sequence[torch.Tensor],
    delta: Sequence[torch.Tensor],
    indices: Sequence[int] | None,
    claimed: Batch,
    random: Batch,
    step: float = 1.0,
) -> Losses:
    """The four losses for Δ (over the tensors `indices`, all when None) from θ_global `start`."""
    params = model_params(model)
    if len(params) != len(start):
        raise ValueError(f"θ_global has {len(start)} tensors, the model {len(params)}")
    targets = list(range(len(params))) if indices is None else list(indices)
    if len(targets) != len(delta) or any(params[i].shape != d.shape for i, d in zip(targets, delta)):
        raise ValueError("Δ does not have the model's shapes")
    was_training = model.training
    model.eval()
    try:
        for p, s in zip(params, start):
            p.copy_(s)
        claimed_before, random_before = _loss(model, claimed), _loss(model, random)
        for i, d in zip(targets, delta):
            params[i].sub_(d.to(params[i].dtype) * step)
        claimed_after, random_after = _loss(model, claimed), _loss(model, random)
    finally:
        model.train(was_training)
    return Losses(claimed_before, claimed_after, random_before, random_after)
