"""The run settings the round components read, and nothing else of the config.

The node that wires a peer (`dilocod/node/peer.py`) builds them from its `Config`: the round protocol
never imports the config (it sits below it, docs/architecture.md), and a test builds them in one line.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoundSettings:
    status_interval: float  # net.status_interval: how often the run's records change
    matchmaking_timeout: float  # averaging.*: the matchmaking's own deadlines
    min_matchmaking_time: float
    request_timeout: float
    state_timeout: float  # averaging.state_timeout: how long a state download may take
    eval_every: int  # trainer.eval_every: evaluate θ_global after every n-th outer step
    sample_every: int  # trainer.sample_every: a sample of text every n-th outer step (0: never)
