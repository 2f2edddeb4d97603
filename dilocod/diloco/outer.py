"""The outer loop of DiLoCo: θ_global, pseudo-gradients and the outer step (SGD with Nesterov momentum, or
the adaptive FedAdam and FedYogi of Reddi et al. 2021). Pure tensor code.

Every peer of a group applies the same averaged pseudo-gradient to the same θ_global and must end
with the same bits. So each update is a chain of plain elementwise ops, one rounding each: no
`alpha=` fused multiply-adds, whose rounding can differ between a vectorised and a scalar kernel
(and so between two peers' CPUs).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# Bytes of θ_global and momentum an outer step replaces between two calls of its `release`.
RELEASE_BYTES = 256 << 20

OVERLAP_MODES = ("none", "delayed", "streaming")
OUTER_OPTIMIZERS = ("sgd", "fedadam", "fedyogi")
SGD_LR = 1.0  # outer.lr = 0 with sgd: the replicas' weighted average (with no momentum)
# outer.lr = 0 with sgd and the sparse codec: the sparse mean divides a coordinate that few members sent by
# every member's weight, and the error feedback fades; 3 was the best of 1–5 at M = 4 and 8 and within 1 %
# of the best (2) at M = 2 in the study's quick look (docs/benchmarks.md)
SPARSE_SGD_LR = 3.0
# outer.lr = 0 with fedadam / fedyogi: the best of 1e-3, 3e-3 and 1e-2 in the study's quick look
ADAPTIVE_LR = 3e-3
MAX_ADAPTIVE_LR = 0.1  # above it an adaptive step moves each value farther than any inner step would
# Progress made against a θ_global a few outer steps old is still worth sending (a `delayed` round's is
# one step old by design); from far behind (a restart from an old checkpoint) it is not. 4 leaves room
# for a straggler whose failed matchmaking took a few of the others' rounds.
REBASE_MAX_GAP = 4


@dataclass(frozen=True)
class OuterConfig:
    """The `[outer]` section: the outer optimizer (SGD with Nesterov momentum, FedAdam or FedYogi)."""

    # sgd: θ ← θ − lr·(Δ + μ·m) (Nesterov) with m ← μ·m + Δ. fedadam / fedyogi (Reddi et al. 2021, "Adaptive
    # Federated Optimization"): m ← β1·m + (1 − β1)·Δ with β1 = `momentum`, a second moment v ← β2·v + (1 − β2)·Δ²
    # (Adam) or v ← v − (1 − β2)·Δ²·sign(v − Δ²) (Yogi: v moves toward Δ² by at most that much), and
    # θ ← θ − lr·m / (√v + τ); no bias correction, as in the paper. They keep one more buffer (4 bytes a
    # parameter, served to joiners and checkpointed with θ_global and m).
    optimizer: str = "sgd"
    # The outer step's learning rate; 0: the optimizer's own, 1.0 for sgd (3.0 with averaging.compression =
    # topk) and ADAPTIVE_LR for fedadam and fedyogi (their step moves each value by about lr, not by lr × Δ). sgd with lr 1 and no momentum:
    # θ_global becomes the replicas' weighted average, 6–16 % below DiLoCo's published step (lr 0.7, Nesterov
    # momentum 0.9) at H = 10 and 50 in every seed of the tiny preset's convergence study
    # (docs/benchmarks.md); configs/small|124m|1b.toml keep the latter.
    lr: float = 0.0
    momentum: float = 0.0  # the outer SGD's momentum (fedadam, fedyogi: β1), in [0, 1)
    nesterov: bool = True  # Nesterov momentum (with momentum > 0; sgd only)
    beta2: float = 0.99  # fedadam / fedyogi: the second moment's decay
    tau: float = 1e-3  # fedadam / fedyogi: the adaptivity τ added to √v (keeps a near-zero v from blowing up)
    # none: inner steps wait for each round; delayed: a round's all-reduce runs while the next round trains
    # and its outer step lands one round late (dilocod/rounds/pipeline.py); streaming: one fragment of the
    # parameters syncs every H / fragments inner steps, overlapped with them (docs/architecture.md)
    overlap: str = "none"
    fragments: int = 4  # streaming: how many fragments the parameters are split into
    # streaming: a synced fragment's working copy becomes mix_alpha·local + (1 − mix_alpha)·θ_global
    # (0.5: the value Streaming DiLoCo uses, arXiv:2501.18512; 0: replace it by θ_global)
    mix_alpha: float = 0.5
    # true: a peer that re-syncs to a θ_global at most 4 (REBASE_MAX_GAP) outer steps ahead of its own (a
    # missed round, a peer the run's clock left behind, the losing side of a split) keeps its inner
    # progress not yet averaged, rebased onto the new θ_global, and sends it (with its tokens) in its next
    # round: every peer's tokens count. false: that progress is dropped (and the log says how many tokens)
    rebase_on_resync: bool = True

    @property
    def step_lr(self) -> float:
        """The learning rate the step uses: `lr`, or the optimizer's own when it is 0."""
        return self.lr or (ADAPTIVE_LR if self.adaptive else SGD_LR)

    def for_sparse(self) -> OuterConfig:
        """These settings for a run whose pseudo-gradients are sparse (`topk`): sgd's own rate is
        SPARSE_SGD_LR there (an `lr` that is set stays as set)."""
        if self.lr or self.adaptive:
            return self
        return dataclasses.replace(self, lr=SPARSE_SGD_LR)

    @property
    def adaptive(self) -> bool:
        """Whether the step keeps a second moment (fedadam, fedyogi)."""
        return self.optimizer != "sgd"

    def validate(self) -> None:
        if self.optimizer not in OUTER_OPTIMIZERS:
            raise ValueError(
                f"outer.optimizer must be one of {', '.join(OUTER_OPTIMIZERS)}, got '{self.optimizer}'"
            )
        if not (math.isfinite(self.beta2) and 0 < self.beta2 < 1):
            raise ValueError(f"outer.beta2 must be in (0, 1), got {self.beta2}")
        if not (math.isfinite(self.tau) and self.tau > 0):
            raise ValueError(f"outer.tau must be > 0, got {self.tau}")
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise ValueError(f"outer.lr must be >= 0 (0: the optimizer's own), got {self.lr}")
        if self.adaptive and self.lr > MAX_ADAPTIVE_LR:
            raise ValueError(
                f"outer.lr {self.lr:g} is an sgd rate: {self.optimizer} moves each value by about lr; "
                f"leave it 0 ({ADAPTIVE_LR:g}) or set at most {MAX_ADAPTIVE_LR:g}"
            )
        if not 0 <= self.momentum < 1:
            raise ValueError(f"outer.momentum must be in [0, 1), got {self.momentum}")
        if self.overlap not in OVERLAP_MODES:
            raise ValueError(f"outer.overlap must be one of {', '.join(OVERLAP_MODES)}, got '{self.overlap}'")
        if self.fragments < 1:
            raise ValueError(f"outer.fragments must be >= 1, got {self.fragments}")
        if not 0 <= self.mix_alpha <= 1:
            raise ValueError(f"outer.mix_alpha must be in [0, 1], got {self.mix_alpha}")


def global_sha256(tensors: Sequence[torch.Tensor]) -> str:
    """sha256 of the fp32 bytes of `tensors`, in order (θ_global's parameters in state_dict order)."""
    digest = hashlib.sha256()
    for tensor in tensors:
        flat = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous().view(-1)
        digest.update(flat.numpy().tobytes())
    return digest.hexdigest()


def rebase(
    local: Sequence[torch.Tensor], old_global: Sequence[torch.Tensor], new_global: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """θ_local' = θ_global' − (θ_global − θ_local): the same pseudo-gradient, measured from the new θ_global.

    So a peer that re-syncs keeps the inner progress it has not yet averaged: its next Δ is that progress
    plus what it trains from here, instead of its work being thrown away.
    """
    if not len(local) == len(old_global) == len(new_global):
        raise ValueError(f"rebase: {len(local)}, {len(old_global)} and {len(new_global)} tensors")
    return [
        torch.sub(new, torch.sub(old, cur.detach().to(device="cpu", dtype=torch.float32)))
        for cur, old, new in zip(local, old_global, new_global)
    ]


def keeps_progress(cfg: OuterConfig, own_step: int, adopted_step: int) -> bool:
    """Whether a re-sync from `own_step` to `adopted_step` rebases our progress (see `rebase`)."""
    return cfg.rebase_on_resync and 0 <= adopted_step - own_step <= REBASE_MAX_GAP


class OuterOptimizer:
    """Holds θ_global (fp32, CPU), the outer momentum (and, adaptive, the second moment); applies one outer
    step per round."""

    def __init__(self, initial: Sequence[torch.Tensor], cfg: OuterConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.params = [t.detach().to(device="cpu", dtype=torch.float32).clone() for t in initial]
        self.momentum = [torch.zeros_like(p) for p in self.params]
        self.second = [torch.zeros_like(p) for p in self.params] if cfg.adaptive else []
        self.step = 0
        self.sha256 = global_sha256(self.params)

    def pin_memory(self) -> None:
        """Keep θ_global in page-locked memory (for a CUDA trainer): its copies to the GPU after each round
        then run as DMA without stalling it. Each tensor that replaces one of θ_global is pinned in turn
        (`_like`). The momentum never leaves the host and stays pageable."""
        self.params = [p.pin_memory() for p in self.params]

    @property
    def state_width(self) -> int:
        """State tensors per parameter tensor: θ_global and m, and v when adaptive (`state_tensors`)."""
        return 3 if self.cfg.adaptive else 2

    @property
    def num_elements(self) -> int:
        return sum(p.numel() for p in self.params)

    def pseudo_gradient(self, local: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Δ = θ_global − θ_local: how far this peer's H inner steps moved it, with the sign of a gradient."""
        self._check_shapes(local)
        return [g - t.detach().to(device="cpu", dtype=torch.float32) for g, t in zip(self.params, local)]

    def _check_shapes(
        self, tensors: Sequence[torch.Tensor], params: Sequence[torch.Tensor] | None = None
    ) -> None:
        """All-or-nothing: a mismatch found halfway through an update would leave θ half-updated."""
        params = self.params if params is None else params
        if len(tensors) != len(params):
            raise ValueError(f"expected {len(params)} tensors, got {len(tensors)}")
        for param, tensor in zip(params, tensors):
            if tensor.shape != param.shape:
                raise ValueError(f"shape mismatch: {tuple(tensor.shape)} vs {tuple(param.shape)}")

    @torch.no_grad()
    def apply(
        self,
        averaged_delta: Sequence[torch.Tensor],
        indices: Sequence[int] | None = None,
        release: Callable[[], object] | None = None,
    ) -> None:
        """θ ← θ − lr·(Δ + μ·m) with m ← μ·m + Δ (Nesterov), or θ ← θ − lr·m without Nesterov; FedAdam and
        FedYogi as in `OuterConfig`.

        With `indices` (a Streaming DiLoCo fragment), `averaged_delta` holds those tensors only, and only
        their θ and momentum move; the step counter counts such fragment rounds too.

        Each updated tensor is a new one that replaces the old in `params` and `momentum`, never an
        in-place write: whoever holds the old ones (the snapshot served to re-syncing peers, a checkpoint
        being written) keeps a consistent state without a copy of its own, and frees it when done.
        `release()`, if given, is called after every RELEASE_BYTES of replaced tensors: the caller gives
        the freed ones' pages back (`peers/heap.py`), or the new state grows beside the old in the heap.
        """
        chosen = list(range(len(self.params))) if indices is None else list(indices)
        self._check_shapes(averaged_delta, [self.params[i] for i in chosen])
        replaced = 0
        for i, delta in zip(chosen, averaged_delta):
            self._step_tensor(i, delta.to(torch.float32))
            replaced += 4 * self.state_width * delta.numel()
            if release is not None and replaced >= RELEASE_BYTES:
                release()
                replaced = 0
        if release is not None and replaced:
            release()
        self.step += 1
        self.sha256 = global_sha256(self.params)

    def _step_tensor(self, i: int, delta: torch.Tensor) -> None:
        if self.cfg.adaptive:
            self._adaptive_step(i, delta)
        else:
            self._sgd_step(i, delta)

    def _sgd_step(self, i: int, delta: torch.Tensor) -> None:
        """One tensor's outer step, in three new tensors (two kept), each op the same IEEE operation in
        the same order as m' = μ·m + Δ, d = Δ + μ·m', θ' = θ − lr·d: every member gets the same bits
        whatever its machine, and no op here is fused."""
        mu, lr = self.cfg.momentum, self.cfg.step_lr
        buf = torch.mul(self.momentum[i], mu)
        buf.add_(delta)
        if self.cfg.nesterov:
            direction = torch.mul(buf, mu)
            direction.add_(delta)  # Δ + μ·m' (addition commutes exactly)
            direction.mul_(lr)
        else:
            direction = torch.mul(buf, lr)
        self.params[i] = _like(torch.sub(self.params[i], direction), self.params[i])
        self.momentum[i] = buf

    def _adaptive_step(self, i: int, delta: torch.Tensor) -> None:
        """FedAdam / FedYogi on one tensor, as plain elementwise IEEE ops (√ and ÷ are correctly rounded, so
        these too give every member the same bits): m' = β1·m + (1 − β1)·Δ, v' as in `OuterConfig`,
        θ' = θ − lr·m' / (√v' + τ)."""
        cfg = self.cfg
        m = torch.mul(self.momentum[i], cfg.momentum)
        m.add_(torch.mul(delta, 1.0 - cfg.momentum))
        square = torch.mul(delta, delta)
        if cfg.optimizer == "fedyogi":
            step = torch.mul(square, 1.0 - cfg.beta2)
            step.mul_(torch.sign(torch.sub(self.second[i], square)))  # × ±1 or 0: exact
            v = torch.sub(self.second[i], step)
        else:
            v = torch.mul(self.second[i], cfg.beta2)
            v.add_(square.mul_(1.0 - cfg.beta2))
        denominator = torch.sqrt(v).add_(cfg.tau)
        direction = torch.div(m, denominator).mul_(cfg.step_lr)
        self.params[i] = _like(torch.sub(self.params[i], direction), self.params[i])
        self.momentum[i], self.second[i] = m, v

    def state_tensors(self) -> list[torch.Tensor]:
        """θ_global, the momentum buffers, then (adaptive) the second moments: what a peer downloads to
        re-sync."""
        return [*self.params, *self.momentum, *self.second]

    def load_state(self, step: int, tensors: Sequence[torch.Tensor]) -> None:
        """Adopt θ_global, momentum and (adaptive) second moments (as from `state_tensors`) at outer step
        `step`."""
        n = len(self.params)
        if len(tensors) != self.state_width * n:
            raise ValueError(
                f"expected {self.state_width * n} state tensors, got {len(tensors)} "
                f"(the run's outer step is {self.cfg.optimizer})"
            )
        for own, new in zip(self.state_tensors(), tensors):
            if own.shape != new.shape:
                raise ValueError(f"state shape mismatch: {tuple(new.shape)} vs {tuple(own.shape)}")
        # Taken, not copied into ours (for the reason in `apply`): nothing writes them in place afterwards.
        params, momentum, second = tensors[:n], tensors[n : 2 * n], tensors[2 * n :]
        self.params[:] = [_like(_fp32(t), own) for t, own in zip(params, self.params)]
        self.momentum[:] = [_fp32(t) for t in momentum]
        self.second[:] = [_fp32(t) for t in second]
        self.step = int(step)
        self.sha256 = global_sha256(self.params)


def _fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to(device="cpu", dtype=torch.float32).contiguous()


def _like(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """`new` in page-locked memory if the θ_global tensor it replaces was (`pin_memory`)."""
    return new.pin_memory() if old.is_pinned() else new
