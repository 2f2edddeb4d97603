"""The hook points where a test-only adversary mode reaches the daemon's production code.

The defences are tested by peers that lie through the protocol (`[adversary] mode`, `trust/adversary.py`,
docs/trust.md). Everything such a peer does differently goes through the five hooks of `Tampering` below,
which the production code calls at the points named; an honest peer's hooks (`HONEST`) hand back what
they are given. Nothing else in the daemon knows the modes, and the networking layer (`peers/`) knows
none of it: a reducer's reply hook reaches it as a plain function (`peers.partreduce.PartReply`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

Windows = Callable[
    [list[int]], list[int]
]  # the windows a trainer's batch really takes, given its leased ones


class Tampering(Protocol):
    @property
    def active(self) -> bool:
        """Whether this peer attacks the run at all (the daemon warns once)."""
        ...

    @property
    def checks_reducers(self) -> bool:
        """Whether the averages we get back are checked against what we sent (the group's options)."""
        ...

    def sent(
        self, delta: list[torch.Tensor], indices: list[int] | None, global_params: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """`rounds/pipeline.py`: the pseudo-gradient that goes on the wire, given ours (`indices`: the
        fragment's parameters, None: all) and θ_global it is measured from."""
        ...

    def claimed(self, tokens: int, tokens_per_second: float) -> tuple[int, float]:
        """`rounds/exchange.py`: what our ticket (and the scoring's record) claims the contribution covers."""
        ...

    def served_state(self, step: int, tensors: list[torch.Tensor]) -> tuple[int, list[torch.Tensor]]:
        """`statesync/catchup.py`: the outer step and the tensors we offer to peers that download our state."""
        ...

    def reply_part(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """`node/netstart.py` → `peers/allreduce.py`: what we send back for a part we reduced (None: it)."""
        ...

    def training_windows(self, seq_len: int) -> Windows | None:
        """`node/peer.py`: where the trainer's batches really come from (None: the leased windows)."""
        ...


class Honest:
    """Every hook hands back what it is given."""

    active = False
    checks_reducers = True

    def sent(
        self, delta: list[torch.Tensor], indices: list[int] | None, global_params: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        return delta

    def claimed(self, tokens: int, tokens_per_second: float) -> tuple[int, float]:
        return tokens, tokens_per_second

    def served_state(self, step: int, tensors: list[torch.Tensor]) -> tuple[int, list[torch.Tensor]]:
        return step, tensors

    def reply_part(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        return None

    def training_windows(self, seq_len: int) -> Windows | None:
        return None


HONEST: Tampering = Honest()
