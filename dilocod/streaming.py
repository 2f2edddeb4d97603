"""Streaming DiLoCo (`outer.overlap = streaming`): one fragment of the parameters syncs at a time.

Douillard et al. 2025 ("Streaming DiLoCo with overlapping communication", arXiv:2501.18512) split the
parameters into fragments that sync in staggered turns, each overlapped with the next inner steps, and
mix each fragment's new θ_global into the working copy. Here:

- the parameters are split once into `outer.fragments` fragments of whole tensors
  (`dilocod.diloco.fragments.split_fragments`: the same split on every peer);
- every H / fragments inner steps (a *slot*) one fragment round starts: the round at outer step s syncs
  fragment s mod fragments with Δ = θ_global − θ_local over that fragment's tensors only, so each
  fragment syncs once per H steps and only its bytes go on the wire (the averager averages just those
  tensors, under a group key that names them: peers only meet peers syncing the same fragment at the
  same outer step);
- the round averages in the background while the next slot trains, and is settled at the end of that
  slot (so at most one fragment round is in flight, and the overlap τ is one slot); when it was
  applied, θ_global and the outer momentum of that fragment take the Nesterov step, and the working
  copy's fragment becomes α·local + (1 − α)·θ_global (`outer.mix_alpha`), everything else untouched;
- the outer step counts fragment rounds: `outer.fragments` of them per H inner steps. θ_global (all
  fragments) changes only by agreed averages applied with the same code, so it stays bit-identical
  across the group, and its hash (tickets, status records, state downloads) works exactly as without
  fragments.

Failures need no state of their own: Δ is always measured against θ_global, so a fragment round that
was not applied (no group, a failed round) leaves its progress in the working copy, and the next round,
which syncs the same fragment again (the outer step did not move), sends it. A re-sync (state
download) rebases the working copy onto the new θ_global, keeping the progress (or drops it when far
behind), as without streaming (dilocod/catchup.py); the peer then sends the fragment of the step it
adopted at once, so that it meets the group that its donor is forming rather than arriving one slot
late again. A checkpoint needs nothing
beyond what it already holds: the outer step says which fragment is next, and progress not yet in
θ_global lives in the working copy.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

import torch

from dilocod.codecs import CodecError, ErrorFeedback, roundtrip
from dilocod.diloco.fragments import fragment_of, mix, split_fragments
from dilocod.rounds import RoundKeeper
from dilocod.trainer import StepStats
from peers.group import RoundOutcome

Pending = tuple[list[int], list[torch.Tensor], "asyncio.Task[RoundOutcome]"]

log = logging.getLogger(__name__)


class StreamingKeeper(RoundKeeper):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fragments = split_fragments([p.numel() for p in self.outer.params], self.cfg.outer.fragments)
        self._pending: Pending | None = None  # the fragment round averaging in the background
        self._settling: list[int] | None = None  # the fragment whose outcome is being acted on
        self._slots = 0
        self._slow_in_a_row = 0  # fragment rounds in a row that formed but outlasted their slot

    @property
    def sync_every(self) -> int:
        return self.cfg.trainer.inner_steps // self.cfg.outer.fragments

    @property
    def checkpoint_due(self) -> bool:
        """Once per sweep of all fragments (every H inner steps), not after every fragment round."""
        return self._slots % self.cfg.outer.fragments == 0

    async def sync(self, stats: StepStats) -> None:
        """End of a slot: settle the fragment round started a slot ago, then start the next one."""
        self.state.loss = stats.mean_loss if stats.steps else self.state.loss
        if self._pending is not None:
            indices, delta, task = self._pending
            self._pending = None
            waited = not task.done()
            if waited:
                self.state.phase = "averaging"  # the network is slower than a slot of inner steps
            self._settling = indices
            try:
                outcome = await task
                self._note_round_time(waited and outcome.found_group and outcome.complete)
                await self._settle(outcome, delta)
            finally:
                self._settling = None
        indices = self.fragments[fragment_of(self.outer.step, len(self.fragments))]
        local = await self._in_trainer(self.trainer.working_params_fp32)
        raw = [torch.sub(self.outer.params[i], local[i]) for i in indices]
        delta, task = await self._send_fragment(indices, raw)
        self._pending = (indices, delta, task)
        self.state.round_steps = 0
        self._slots += 1

    def _note_round_time(self, outlasted_slot: bool) -> None:
        # Streaming hides a fragment round only behind the next slot; once rounds (mostly matchmaking
        # time on a fast link) outlast a slot, inner steps wait every slot. Say so once, with the fix;
        # three in a row, so that the first round (waiting for the others to arrive) does not count.
        self._slow_in_a_row = self._slow_in_a_row + 1 if outlasted_slot else 0
        if self._slow_in_a_row != 3:
            return
        log.warning(
            "a fragment round outlasted a slot of %d inner steps, so inner steps wait for the network; "
            "raise trainer.inner_steps or lower outer.fragments (or averaging.min_matchmaking_time)",
            self.sync_every,
        )

    async def _send_fragment(
        self, indices: list[int], raw: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], asyncio.Task[RoundOutcome]]:
        """Start averaging a fragment's Δ (+ its error-feedback residual); returns what we sent honestly."""
        delta = raw
        if self.feedback is not None:
            view = _feedback_view(self.feedback, indices)
            delta = await self._in_trainer(functools.partial(view.compensate, raw))
        sent = delta
        if self.adversary.active:  # adversary modes keep per-parameter history: give them whole lists
            whole = [torch.zeros_like(p) for p in self.outer.params]
            for i, d in zip(indices, delta):
                whole[i] = d
            corrupted = self.adversary.corrupt_delta(whole)
            sent = [corrupted[i] for i in indices]
        average = self.group.average(self.outer.step, self._ticket(), sent, subset=indices)
        return delta, asyncio.create_task(average)

    def _apply_in_trainer(self, averaged: list[torch.Tensor], sent: list[torch.Tensor] | None) -> None:
        indices = self._settling
        assert indices is not None, "a fragment outcome is applied only while it is being settled"
        self.outer.apply(averaged, indices)
        local = self.trainer.working_params_fp32()
        for i in indices:
            local[i] = mix(local[i], self.outer.params[i], self.cfg.outer.mix_alpha)
        self.trainer.load_params(local)
        if self.feedback is None:
            return
        view = _feedback_view(self.feedback, indices)
        if sent is None or self.codec is None:  # applied in full (alone): nothing is owed any more
            view.reset()
            return
        try:
            view.update(sent, roundtrip(self.codec, sent))
        except CodecError:  # a non-finite contribution, screened out by every reducer
            view.reset()

    async def check_agreement(self) -> None:
        if self._pending is not None:  # a fragment round is under way; its tickets check θ
            return
        await super().check_agreement()

    async def drain(self, grace: float) -> None:
        """At shutdown: a fragment round exchanging tensors gets `grace` seconds to serve its parts."""
        if self._pending is None:
            return
        task = self._pending[2]
        self._pending = None
        if not task.done() and self.group.in_allreduce:
            await asyncio.wait({task}, timeout=grace)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _feedback_view(feedback: ErrorFeedback, indices: list[int]) -> ErrorFeedback:
    """The residuals of one fragment's tensors, shared with `feedback` (updates land in it)."""
    view = ErrorFeedback([])
    view.residual = [feedback.residual[i] for i in indices]
    return view
