"""Stepping back: how a run of private peers gets over a round that only some of them applied.

A peer behind NAT runs as a client and serves no state. When a round completes for one member and
fails for another (its last parts arrived after its deadline: a slow or lossy link), the one that
failed stays at outer step k − 1 and can download θ_global from nobody, while the one that applied
step k looks for a group at k that never forms: the two would stay apart for good. A peer in that
position — private, alone at its step, every other peer one step behind and holding the θ_global it
held before its last round — goes back to that θ_global and momentum (it kept a copy), so that the next
round has everyone again. Its inner progress since is kept on top (the working copy is not touched),
the undone round is marked `undone` in its history and the step back is recorded as `stepped_back`.

Where each part lives: the condition is `rounds.facts.behind_on_previous` (every other peer behind, most of
them at our previous step and θ_global) held for `rounds.machine.STRANDED_ROUNDS` rounds without a group;
the copy is kept and restored by `rounds.pipeline.RoundPipeline` (`keep_previous`, `step_back`).

Only with `outer.overlap = none` (with overlap, a round's outcome lands a round late and the working
copy is measured from it), and only for private peers (a public one is a state donor: those behind
re-sync from it). A run with a public peer or a `--relay` bootstrap never needs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Previous:
    """θ_global and momentum before our last applied outer step."""

    step: int
    sha256: str
    tensors: list[torch.Tensor]
