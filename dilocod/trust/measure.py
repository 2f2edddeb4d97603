"""One score's tensor work: the losses a scorer measures for a contributor's Δ (dilocod/trust/scoring.py
turns them into a verdict). Torch only, no I/O.

The model is the scorer's own copy (never the trainer's working copy): its parameters are overwritten with
θ_global as the round started, the loss is measured on the claimed and on random sequences, then with
θ_global − step·Δ, and measured again. With `step` = 1 the second point is exactly where the contributor's
inner steps ended (Δ = θ_global − θ_local), up to the codec's rounding. With a reference Δ (the scorer's
own, trained on other chunks), the claimed sequences are measured once more at θ_global − step·s·Δ_ref,
where s = min(1, ‖Δ‖ / ‖Δ_ref‖): a contributor that ran fewer inner steps than the scorer is compared with
as long a step of the reference, and a Δ made larger than the scorer's never stretches the reference past
where its own steps ended (a lie about size earns nothing).
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


def _norm(tensors: Sequence[torch.Tensor]) -> float:
    return float(sum(float(t.float().pow(2).sum()) for t in tensors)) ** 0.5


def reference_step(delta: Sequence[torch.Tensor], reference: Sequence[torch.Tensor], step: float) -> float:
    """How far along the reference Δ its loss is measured: as far as Δ reaches, never past its own end."""
    size = _norm(reference)
    return step * min(1.0, _norm(delta) / size) if size > 0 else step


@torch.no_grad()
def measure(
    model: nn.Module,
    start: Sequence[torch.Tensor],
    delta: Sequence[torch.Tensor],
    indices: Sequence[int] | None,
    claimed: Batch,
    random: Batch | None,
    step: float = 1.0,
    reference: Sequence[torch.Tensor] | None = None,
) -> Losses:
    """The losses for Δ (over the tensors `indices`, all when None) from θ_global `start` on the claimed
    sequences, and on the random ones when given; and for the reference Δ (the same tensors) on the claimed
    sequences, when one is given."""
    params = model_params(model)
    if len(params) != len(start):
        raise ValueError(f"θ_global has {len(start)} tensors, the model {len(params)}")
    targets = list(range(len(params))) if indices is None else list(indices)
    for what in [delta] if reference is None else [delta, reference]:
        if len(targets) != len(what) or any(params[i].shape != d.shape for i, d in zip(targets, what)):
            raise ValueError("Δ does not have the model's shapes")
    was_training = model.training
    model.eval()
    try:
        _load(params, start)
        claimed_before = _loss(model, claimed)
        random_before = None if random is None else _loss(model, random)
        _move(params, targets, delta, step)
        claimed_after = _loss(model, claimed)
        random_after = None if random is None else _loss(model, random)
        reference_after = None
        if reference is not None:
            _load(params, start)
            _move(params, targets, reference, reference_step(delta, reference, step))
            reference_after = _loss(model, claimed)
    finally:
        model.train(was_training)
    return Losses(claimed_before, claimed_after, random_before, random_after, reference_after)


def _load(params: Sequence[nn.Parameter], start: Sequence[torch.Tensor]) -> None:
    """The model's parameters ← θ_global."""
    for p, s in zip(params, start):
        p.copy_(s)


def _move(
    params: Sequence[nn.Parameter], targets: Sequence[int], delta: Sequence[torch.Tensor], step: float
) -> None:
    """The model's parameters −= step·Δ (over the tensors `targets`)."""
    for i, d in zip(targets, delta):
        params[i].sub_(d.to(params[i].dtype) * step)
