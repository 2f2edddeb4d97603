"""The tensor side of a round, for every `outer.overlap` mode: what a peer sends and how it applies.

One pipeline, three settings rather than three classes:

- `none`: Δ = θ_global − θ_local over all tensors; an applied average becomes θ_global and the working
  copy restarts from it.
- `delayed`: the round averages while the next one trains. The working copy always equals θ_global −
  (progress not yet in θ_global); a round sends the progress made since the last one was launched (plus
  a launched round's progress that was not applied), and when an average lands a round late the
  working copy becomes θ_global' − (progress since that launch). θ_global changes only by agreed
  averages, so it stays bit-identical across the group.
- `streaming` (Streaming DiLoCo, arXiv:2501.18512): the parameters are split into `outer.fragments`
  fragments of whole tensors; the round at outer step s syncs fragment s mod fragments (Δ over its tensors
  only, so only its bytes go on the wire) and averages while the next slot trains; an applied fragment
  takes the Nesterov step and the working copy's fragment becomes α·local + (1 − α)·θ_global.

With error feedback (int4/int2, topk: Δ + β·e) a peer sends Δ + e and after an applied round keeps
e ← (Δ + e) − decode(encode(Δ + e)) (per fragment with streaming); a round that was not applied leaves e
as it was (the next Δ includes this one); applying alone pays e back in full; adopting another peer's
θ_global forgets it. A private peer without overlap keeps θ_global and the momentum from before its last
outer step, to step back to (`statesync/stepback.py`).

Every method runs in the trainer thread (the driver sees to it); none does I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from dilocod.codecs import CodecError, ErrorFeedback
from dilocod.codecs.base import Codec
from dilocod.diloco import OuterOptimizer
from dilocod.diloco.fragments import fragment_of, mix, split_fragments
from dilocod.statesync.stepback import Previous
from dilocod.trainer import InnerTrainer
from dilocod.trust.hooks import Tampering


@dataclass(frozen=True)
class PipelineSettings:
    overlap: str = "none"  # none | delayed | streaming
    fragments: int = 1  # streaming: how many fragments take turns
    mix_alpha: float = 0.5  # streaming: weight of the local copy when a fragment's θ_global lands
    keep_previous: bool = False  # keep θ_global before each outer step (private peers, no overlap)
    keep_own_work: bool = False  # scoring: each contribution carries the round's own Δ (`Contribution.own`)


@dataclass(frozen=True)
class Contribution:
    """One round's pseudo-gradient as it leaves the peer."""

    step: int  # the outer step it is measured from (the group key)
    fragment: int  # which fragment (0 without streaming)
    indices: list[int] | None  # the fragment's tensors (None: all)
    delta: list[torch.Tensor]  # what we send honestly: Δ (+ the error-feedback residual)
    sent: list[torch.Tensor]  # what goes on the wire (an adversary's lie, or `delta`)
    progress: list[torch.Tensor] | None = None  # delayed: the round's raw progress, resent if not applied
    # With `keep_own_work`: `sent` less the error feedback it carries, what scorers judge (the work of this
    # round on the data its ticket claims; a sparse codec's feedback holds many rounds of other data).
    own: list[torch.Tensor] | None = None


class RoundPipeline:
    def __init__(
        self,
        settings: PipelineSettings,
        trainer: InnerTrainer,
        outer: OuterOptimizer,
        feedback: ErrorFeedback | None,
        tampering: Tampering,
        codec: Codec | None,
        release: Callable[[], object] | None = None,
    ) -> None:
        self.settings, self.trainer, self.outer = settings, trainer, outer
        self.feedback, self.tampering, self.codec = feedback, tampering, codec
        # Gives freed memory back to the system during the outer step (the daemon's: `peers/heap.py`).
        self.release = release
        streaming = settings.overlap == "streaming"
        sizes = [p.numel() for p in outer.params]
        self.fragments = split_fragments(sizes, settings.fragments) if streaming else None
        self._start: list[torch.Tensor] | None = None  # delayed: working copy at the last launch
        self._kept: list[torch.Tensor] | None = None  # delayed: a launched round's progress, not applied
        self.previous: Previous | None = None

    @property
    def fragment_count(self) -> int:
        return 1 if self.fragments is None else len(self.fragments)

    def fragment_at(self, step: int) -> tuple[int, list[int] | None]:
        if self.fragments is None:
            return 0, None
        index = fragment_of(step, len(self.fragments))
        return index, self.fragments[index]

    # ---- sending -----------------------------------------------------------------------------------------
    def contribution(self) -> Contribution:
        """This round's pseudo-gradient at our outer step."""
        fragment, indices = self.fragment_at(self.outer.step)
        progress = None
        if self.settings.overlap == "delayed":
            local = self.trainer.working_params_fp32()  # kept: the next round is measured from it
            start = self._start if self._start is not None else self.outer.params
            raw = progress = [s - t for s, t in zip(start, local)]
            if self._kept is not None:  # a launched round that was not applied goes out again with this one
                raw = progress = [p + k for p, k in zip(progress, self._kept)]
                self._kept = None
            self._start = local
        else:
            # Read from the live parameters (we run on the trainer's thread, between steps): a copy of the
            # working copy here would be one more model's worth of memory at every round's close. On a
            # device, the host copy is what we read anyway (queued DMA into pinned memory, one wait).
            live: list[torch.Tensor] = list(self.trainer.params())
            if live and live[0].device.type != "cpu":
                live = self.trainer.working_params_fp32()
            if indices is not None:
                raw = [torch.sub(self.outer.params[i], _cpu_fp32(live[i])) for i in indices]
            else:
                raw = self.outer.pseudo_gradient(live)
        # `raw` is ours alone except with delayed overlap (it is also `progress`): add the residual in place.
        in_place = progress is None
        delta = raw if self.feedback is None else self._feedback(indices).compensate(raw, in_place=in_place)
        sent = self.tampering.sent(delta, indices, self.outer.params)  # `delta` itself, for an honest peer
        own = None
        if self.settings.keep_own_work:
            own = sent if self.feedback is None else self._feedback(indices).uncompensated(sent)
        return Contribution(self.outer.step, fragment, indices, delta, sent, progress, own)

    def caught_up(self, averaged: list[torch.Tensor]) -> Contribution | None:
        """Overlap, right after a re-sync: the donor's round in flight at our new outer step, as a
        contribution of ours that sent nothing, to apply at the next close as the round's members do (None
        if its shapes are not that round's). Our progress is measured from the adopted θ_global, so it all
        goes out in the round launched then."""
        fragment, indices = self.fragment_at(self.outer.step)
        expected = [self.outer.params[i] for i in indices] if indices is not None else self.outer.params
        if len(averaged) != len(expected) or any(a.shape != p.shape for a, p in zip(averaged, expected)):
            return None
        if self.settings.overlap == "delayed":
            self._start = [p.clone() for p in self.outer.params]
        nothing = [torch.zeros_like(p) for p in expected]
        return Contribution(self.outer.step, fragment, indices, nothing, nothing)

    # ---- settling ----------------------------------------------------------------------------------------
    def apply(self, contribution: Contribution, averaged: list[torch.Tensor]) -> None:
        """Take the outer step with the group's average (the same bytes on every member)."""
        self._keep_previous()
        self.outer.apply(averaged, contribution.indices, self.release)
        self._merge_working_copy(contribution)
        self._settle_feedback(contribution, contribution.delta)

    def apply_alone(self, contribution: Contribution) -> None:
        """No other trainer is alive: our own Δ is the round's average; nothing is owed any more."""
        self._keep_previous()
        self.outer.apply(contribution.delta, contribution.indices, self.release)
        self._merge_working_copy(contribution)
        self._settle_feedback(contribution, None)

    def keep(self, contribution: Contribution) -> None:
        """The round was not applied: its progress is still ours (Δ is measured from the same θ_global)."""
        if self.settings.overlap == "delayed":
            self._kept = contribution.progress

    def adopted(self) -> None:
        """θ_global was replaced by a download (the working copy rebased or reset by the state sync)."""
        self._start = self._kept = None
        self.previous = None
        if self.feedback is not None:  # the residual belonged to the θ_global we left
            self.feedback.reset()

    def step_back(self) -> Previous | None:
        """Go back to the θ_global and momentum held before our last outer step; the working copy is left
        as it is, so the progress made since goes out with the next round. Returns what we went back to."""
        previous, self.previous = self.previous, None
        if previous is None:
            return None
        self.outer.load_state(previous.step, previous.tensors)
        if self.feedback is not None:  # the residual was measured against the step we undid
            self.feedback.reset()
        return previous

    # ---- internals ---------------------------------------------------------------------------------------
    def _keep_previous(self) -> None:
        if not self.settings.keep_previous:
            return
        # The tensors themselves, not clones: the outer step replaces θ_global and the momentum with new
        # tensors and never writes these (`OuterOptimizer.apply`).
        self.previous = Previous(self.outer.step, self.outer.sha256, self.outer.state_tensors())

    def _merge_working_copy(self, contribution: Contribution) -> None:
        overlap = self.settings.overlap
        if overlap == "none":
            self.trainer.load_params(self.outer.params)  # the working copy restarts from θ_global
            return
        local = self.trainer.working_params_fp32()
        if overlap == "delayed":  # keep the progress made since this round was launched
            assert self._start is not None, "a delayed round is applied only after it was launched"
            since = [s - t for s, t in zip(self._start, local)]
            self._start = None  # the next round's progress is measured from θ_global
            self.trainer.load_params([g - c for g, c in zip(self.outer.params, since)])
            return
        for i in contribution.indices or ():
            local[i] = mix(local[i], self.outer.params[i], self.settings.mix_alpha)
        self.trainer.load_params(local)

    def _feedback(self, indices: list[int] | None) -> ErrorFeedback:
        assert self.feedback is not None
        if indices is None:
            return self.feedback
        # the residuals of one fragment's tensors, shared with the whole
        view = ErrorFeedback([], decay=self.feedback.decay)
        view.residual = [self.feedback.residual[i] for i in indices]
        return view

    def _settle_feedback(self, contribution: Contribution, sent: list[torch.Tensor] | None) -> None:
        if self.feedback is None:
            return
        feedback = self._feedback(contribution.indices)
        if sent is None or self.codec is None:  # applied in full: nothing is owed any more
            feedback.reset()
            return
        try:
            feedback.settle(self.codec, sent)
        except CodecError:  # a non-finite contribution, screened out by every reducer: nothing to carry
            feedback.reset()


def _cpu_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as CPU fp32 for arithmetic with θ_global: itself when it already is (no copy)."""
    return tensor.detach().to(device="cpu", dtype=torch.float32)
