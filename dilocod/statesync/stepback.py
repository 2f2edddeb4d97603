"""Stepping back: how a run of private peers gets over a round that only some of them applied.

A peer behind NAT runs as a client and serves no state. When a round completes for one member and
fails for another (its last parts arrived after its deadline: a slow or lossy link), the one that
failed stays at outer step k − 1 and can download θ_global from nobody, while the one that applied
step k looks for a group at k that never forms: the two would stay apart for good. A peer in that
position — private, alone at its step, every other peer one step behind and holding the θ_global it
held before its last round — goes back to that θ_global and momentum (it kept a copy), so that the next
round has everyone again. Its inner progress since is kept on top (the working copy is not touched),
the undone round is marked `undone` in its history and the step back is recorded as `stepped_back`.

Only with `outer.overlap = none` (with overlap, a round's outcome lands a round late and the working
copy is measured from it), and only for private peers (a public one is a state donor: those behind
re-sync from it). A run with a public peer or a `--relay` bootstrap never needs it.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dilocod.codecs import ErrorFeedback
from dilocod.config import Config
from dilocod.diloco import OuterOptimizer
from dilocod.metrics import Metrics
from dilocod.peerstate import PeerState, RoundRecord

log = logging.getLogger("dilocod.stepback")

STRANDED_ROUNDS = 2  # rounds without a group in that position before stepping back (records can lag)


@dataclass
class Previous:
    """θ_global and momentum before our last applied outer step."""

    step: int
    sha256: str
    tensors: list[torch.Tensor]


def should_step_back(
    own_step: int, previous: Previous | None, others: list[dict[str, Any]], stranded_rounds: int
) -> bool:
    """Whether the peers behind us can only meet us if we go back (see the module's docstring): every
    other peer is behind, most of them at exactly our previous step and θ_global, for long enough."""
    if previous is None or previous.step != own_step - 1 or not others or stranded_rounds < STRANDED_ROUNDS:
        return False
    if any(r["outer_step"] >= own_step for r in others):
        return False  # someone can meet us at our step, or is ahead and serves those behind
    at_previous = Counter(r["global_sha256"] for r in others if r["outer_step"] == previous.step)
    if not at_previous:
        return False
    top, votes = at_previous.most_common(1)[0]
    return top == previous.sha256 and 2 * votes > len(others)


class StepBack:
    """Mixed into `RoundKeeper`: keeps the previous θ_global of a private peer and steps back to it."""

    cfg: Config
    state: PeerState
    metrics: Metrics
    outer: OuterOptimizer
    feedback: ErrorFeedback | None
    _previous: Previous | None
    _stranded: int  # rounds in a row without a group while every other peer was behind

    if TYPE_CHECKING:  # defined by RoundKeeper

        @property
        def serves_no_state(self) -> bool: ...
        def _after_new_global(self) -> None: ...
        async def _in_trainer(self, fn: Any) -> Any: ...

    def _keep_previous(self) -> None:
        """Before an outer step (in the trainer thread): copy θ_global and momentum, if we may need them."""
        if not self.serves_no_state or self.cfg.outer.overlap != "none":
            self._previous = None
            return
        tensors = [t.clone() for t in self.outer.state_tensors()]
        self._previous = Previous(self.outer.step, self.outer.sha256, tensors)

    async def _maybe_step_back(self, others: list[dict[str, Any]]) -> bool:
        """After a round without a group: step back if that is the only way to meet the others again."""
        behind = bool(others) and all(r["outer_step"] < self.outer.step for r in others)
        self._stranded = self._stranded + 1 if behind else 0
        previous = self._previous
        if previous is None or not should_step_back(self.outer.step, previous, others, self._stranded):
            return False
        undone = self.outer.step
        await self._in_trainer(lambda: self._step_back_in_trainer(previous))
        for entry in self.state.history:
            if entry.outer_step == undone and entry.result in ("ok", "alone"):
                entry.result = "undone"
        self.state.history.append(RoundRecord(previous.step, "stepped_back", 0, 0.0, previous.sha256))
        self.metrics.rounds.labels(result="stepped_back").inc()
        self._after_new_global()
        log.warning(
            "every other peer is at outer step %d and none can fetch step %d from us (we are private): "
            "stepping back to outer step %d (θ %s) to average with them; our inner progress is kept",
            previous.step, undone, previous.step, previous.sha256[:12],
        )  # fmt: skip
        return True

    def _step_back_in_trainer(self, previous: Previous) -> None:
        self.outer.load_state(previous.step, previous.tensors)
        self._previous = None
        self._stranded = 0
        if self.feedback is not None:  # the residual was measured against the step we undid
            self.feedback.reset()
