"""Adversary modes for testing the defenses (`[adversary] mode`, off by default).

Every mode lives here and reaches the daemon through the hook points of `trust/hooks.py` (`Tampering`),
which `Adversary` implements.

An adversary lies only through the protocol, as a stranger could: it sends a crafted pseudo-gradient,
returns garbage for the parts it reduces, or serves poisoned state to peers that download from it.
Otherwise it behaves like an honest peer (it applies the group's outer step), so that it stays in
the group's majority and keeps getting the chance to attack.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dilocod.trust.hooks import HONEST, Tampering

ADVERSARY_MODES = (
    "none", "sign_flip", "random_direction", "scale", "nan", "stale", "alie", "bad_reducer", "bad_donor",
    "inflate_tokens", "freeride", "copy_update", "wrong_data", "concentrate", "copy_support",
)  # fmt: skip


@dataclass(frozen=True)
class AdversaryConfig:
    """`[adversary]`: make this peer attack the run, through the protocol only. For testing defenses."""

    # none | sign_flip | random_direction | scale | nan | stale | alie | bad_reducer | bad_donor |
    # inflate_tokens | freeride | copy_update | wrong_data | concentrate | copy_support: attack the run, for
    # testing defences only (docs/trust.md)
    mode: str = "none"
    alie_z: float = 1.0  # ALIE: send mean − z·std of what this peer can observe
    stale_rounds: int = 10  # stale: send the pseudo-gradient from this many rounds ago

    def validate(self) -> None:
        if self.mode not in ADVERSARY_MODES:
            raise ValueError(f"adversary.mode must be one of {', '.join(ADVERSARY_MODES)}, got '{self.mode}'")
        if self.stale_rounds < 1:
            raise ValueError(f"adversary.stale_rounds must be >= 1, got {self.stale_rounds}")


ALIE_WINDOW = 10
INFLATE_FACTOR = 10  # inflate_tokens: how much more than the truth it claims
FREERIDE_NOISE = 1e-3  # freeride: the noise's norm ÷ the honest Δ's (tiny: it did no work)
WRONG_DATA_WINDOWS = 64  # wrong_data: the windows at the stream's start it trains over and over
# concentrate: a tensor's whole push on its CONCENTRATE_COORDS largest coordinates, against their sign, with
# CONCENTRATE_FACTOR × the honest norm (under the reducers' 10× screen: it wants to be averaged, not banned)
CONCENTRATE_COORDS = 4
CONCENTRATE_FACTOR = 5.0


class Adversary:
    def __init__(self, cfg: AdversaryConfig, seed: int) -> None:
        self.mode = cfg.mode
        self.z = cfg.alie_z
        self.stale_rounds = cfg.stale_rounds
        self._generator = torch.Generator().manual_seed(seed + 7919)
        self._history: deque[list[torch.Tensor]] = deque(maxlen=max(cfg.stale_rounds, ALIE_WINDOW) + 1)
        self._direction: list[torch.Tensor] | None = None
        self._global: list[torch.Tensor] | None = None  # copy_update: θ_global at our last contribution
        self._update: list[torch.Tensor] | None = None  # ... and the run's last outer update seen

    @property
    def active(self) -> bool:
        return self.mode != "none"

    @property
    def corrupt_reductions(self) -> bool:
        return self.mode == "bad_reducer"

    # ---- the hook points (trust/hooks.py) -------------------------------------------------------------
    def sent(
        self, delta: list[torch.Tensor], indices: list[int] | None, global_params: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        if not self.active:
            return delta
        self.observe_global(global_params)
        if indices is None:
            return self.corrupt_delta(delta)
        # the modes keep per-parameter history: give them whole, zero-padded lists
        whole = [torch.zeros_like(p) for p in global_params]
        for i, d in zip(indices, delta):
            whole[i] = d
        corrupted = self.corrupt_delta(whole)
        return [corrupted[i] for i in indices]

    def claimed(self, tokens: int, tokens_per_second: float) -> tuple[int, float]:
        return self.claim(tokens, tokens_per_second)

    def served_state(self, step: int, tensors: list[torch.Tensor]) -> tuple[int, list[torch.Tensor]]:
        return self.declared_state_step(step), self.poison_state(tensors)

    def reply_part(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return garbage_like if self.corrupt_reductions else None

    def training_windows(self, seq_len: int) -> Callable[[list[int]], list[int]] | None:
        return self.windows(seq_len)

    # ---- the modes ------------------------------------------------------------------------------------

    @property
    def checks_reducers(self) -> bool:
        """Whether it checks the averages it gets back against what it sent: a free-rider or copier sent a
        lie, and wants to stay in the group whatever comes back (its checks would ban every honest reducer)."""
        return self.mode not in ("freeride", "copy_update")

    def corrupt_delta(self, delta: list[torch.Tensor]) -> list[torch.Tensor]:
        """The pseudo-gradient this peer sends instead of its honest `delta`."""
        self._history.append([d.clone() for d in delta])
        if self.mode == "sign_flip":
            return [d * -1000.0 for d in delta]
        if self.mode == "scale":
            return [d * 100.0 for d in delta]
        if self.mode == "nan":
            return [torch.full_like(d, float("nan")) for d in delta]
        if self.mode == "random_direction":
            return self._random_direction(delta)
        if self.mode == "stale":
            return (
                self._history[-1 - self.stale_rounds]
                if len(self._history) > self.stale_rounds
                else [torch.zeros_like(d) for d in delta]
            )
        if self.mode == "alie":
            return self._alie(delta)
        if self.mode == "freeride":
            return self._freeride(delta)
        if self.mode == "copy_update":
            return self._copy(delta)
        if self.mode == "concentrate":
            return [_concentrated(d) for d in delta]
        if self.mode == "copy_support":
            return self._copy_support(delta)
        return delta

    def observe_global(self, params: list[torch.Tensor]) -> None:
        """θ_global as a contribution is measured from it: `copy_update` learns the run's last outer update
        (θ_global of the round before minus this one, which every peer knows) from consecutive ones."""
        if self.mode not in ("copy_update", "copy_support"):
            return
        previous = self._global
        if previous is not None and [p.shape for p in previous] == [p.shape for p in params]:
            update = [a - b for a, b in zip(previous, params)]
            if _norm(update) > 0:  # θ_global moved: a new outer step was applied
                self._update = update
        self._global = [p.detach().clone() for p in params]

    def _freeride(self, delta: list[torch.Tensor]) -> list[torch.Tensor]:
        """No work: a tiny random Δ, while the ticket claims the tokens honestly trained (or not)."""
        noise = [torch.randn(d.shape, generator=self._generator) for d in delta]
        scale = FREERIDE_NOISE * _norm(delta) / max(_norm(noise), 1e-12)
        return [n * scale for n in noise]

    def _copy(self, delta: list[torch.Tensor]) -> list[torch.Tensor]:
        """The run's last outer update, rescaled to the norm of a Δ of ours (zero before it saw one)."""
        if self._update is None or [u.shape for u in self._update] != [d.shape for d in delta]:
            return [torch.zeros_like(d) for d in delta]
        scale = _norm(delta) / max(_norm(self._update), 1e-12)
        return [u * scale for u in self._update]

    def _copy_support(self, delta: list[torch.Tensor]) -> list[torch.Tensor]:
        """Random values of an honest Δ's norm on the coordinates the run's last outer update moved (with
        topk: the union of the last round's supports, the indices other peers sent), everywhere before."""
        support = self._update if self._update is not None else delta
        noise = [
            torch.randn(d.shape, generator=self._generator) * (u != 0)
            for d, u in zip(delta, support, strict=True)
        ]
        scale = _norm(delta) / max(_norm(noise), 1e-12)
        return [n * scale for n in noise]

    def windows(self, seq_len: int) -> Callable[[list[int]], list[int]] | None:
        """`wrong_data`: where its batches really come from. It trains the same few windows at the start of
        the stream over and over, whatever its leases say (its cursor, and so its tickets, still name them)."""
        if self.mode != "wrong_data":
            return None
        taken = [0]

        def fixed(starts: list[int]) -> list[int]:
            out = [((taken[0] + i) % WRONG_DATA_WINDOWS) * seq_len for i in range(len(starts))]
            taken[0] += len(starts)
            return out

        return fixed

    def _random_direction(self, delta: list[torch.Tensor]) -> list[torch.Tensor]:
        if self._direction is None:  # fixed across rounds: a consistent push is the strongest
            self._direction = [torch.randn(d.shape, generator=self._generator) for d in delta]
        honest = _norm(delta)
        direction = _norm(self._direction)
        return [v * (1000.0 * honest / max(direction, 1e-12)) for v in self._direction]

    def _alie(self, delta: list[torch.Tensor]) -> list[torch.Tensor]:
        """'A little is enough': mean − z·std per coordinate of the pseudo-gradients it has seen."""
        window = list(self._history)[-ALIE_WINDOW:]
        out = []
        for i in range(len(delta)):
            samples = torch.stack([h[i] for h in window])
            std = samples.std(dim=0, unbiased=False) if len(window) > 1 else torch.zeros_like(delta[i])
            out.append(samples.mean(dim=0) - self.z * std)
        return out

    def claim(self, tokens: int, tokens_per_second: float) -> tuple[int, float]:
        """What this peer's ticket claims its contribution covers. `inflate_tokens` claims 10× its tokens,
        and a throughput to match, so that only the group's median bounds it (docs/trust.md)."""
        if self.mode != "inflate_tokens":
            return tokens, tokens_per_second
        return tokens * INFLATE_FACTOR, tokens_per_second * INFLATE_FACTOR

    def declared_state_step(self, outer_step: int) -> int:
        """The step this peer claims when offering its state: a bad donor claims to be far ahead."""
        return outer_step + 1_000_000 if self.mode == "bad_donor" else outer_step

    def poison_state(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """What a `bad_donor` serves: θ_global (and momentum) with large noise added."""
        if self.mode != "bad_donor":
            return tensors
        return [t + torch.randn(t.shape, generator=self._generator) for t in tensors]


def tampering_for(cfg: AdversaryConfig, seed: int) -> Tampering:
    """The daemon's hooks: an honest peer's, or this mode's."""
    return HONEST if cfg.mode == "none" else Adversary(cfg, seed)


def garbage_like(tensor: torch.Tensor) -> torch.Tensor:
    """What a lying reducer (`bad_reducer`) sends back instead of the part it reduced."""
    return torch.randn(tensor.shape) * 1000.0


def _norm(tensors: list[torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.to(torch.float64) ** 2).sum() for t in tensors)))  # type: ignore[arg-type]


def _concentrated(delta: torch.Tensor) -> torch.Tensor:
    """`concentrate`: zeros, but the tensor's largest coordinates, pushed hard against their sign."""
    flat = delta.reshape(-1)
    out = torch.zeros_like(flat)
    if not flat.numel():
        return delta
    top = torch.topk(flat.abs(), min(CONCENTRATE_COORDS, flat.numel())).indices
    size = CONCENTRATE_FACTOR * float(torch.linalg.vector_norm(flat)) / math.sqrt(top.numel())
    out[top] = -torch.sign(flat[top]) * size
    return out.view_as(delta)
