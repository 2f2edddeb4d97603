"""The tokens behind a peer's work: trained, behind its next contribution, and reached θ_global.

A contribution is weighted by the tokens it covers since the group's θ_global (`proto.ROUND_TICKET`),
so the peer must know exactly which tokens its pseudo-gradient holds:
- every inner step adds its tokens to the round (the clock's count) and to what is pending;
- sending a contribution moves what is pending (of its fragment) to what is sent;
- an applied round adds what was sent to `contributed` (at most the weight the group counted);
- a round that was not applied gives it back: the next contribution carries it (Δ is always measured
  from the same θ_global, so the progress really is in it);
- a re-sync that keeps our progress (rebased onto the new θ_global) keeps the tokens too; one that
  drops it drops them, and says how many (a peer whose work is discarded is never silent about it).

With Streaming DiLoCo each fragment syncs on its own turn and carries the progress of every token since
it last synced, so pending tokens are kept per fragment; a fragment round contributes 1/fragments of
its tokens to `contributed` (all fragments together carry each token once).

The parts of the run's chunks those tokens came from (dilocod/data/cursor.py) travel the same way, so a
round ticket names the data behind its contribution (`parts_sent`). Pure bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass, field

Part = tuple[int, int, int, int]  # (epoch, chunk, lo, hi) of the run's chunk schedule


def merged(parts: list[Part]) -> list[Part]:
    """`parts` with contiguous parts of one chunk joined."""
    out: list[Part] = []
    for part in parts:
        if out and out[-1][:2] == part[:2] and out[-1][3] == part[2]:
            out[-1] = (*part[:2], out[-1][2], part[3])
        else:
            out.append(part)
    return out


@dataclass
class TokenLedger:
    fragments: int = 1
    trained: int = 0  # in total (survives restarts through the checkpoint)
    contributed: float = 0.0  # of those, reached θ_global in an applied round
    round: int = 0  # trained in the round the run's clock is timing
    round_steps: int = 0  # inner steps behind `round`
    round_seconds: float = 0.0  # seconds of inner steps behind `round`
    pending: list[int] = field(default_factory=list)  # per fragment: behind progress not yet sent
    pending_seconds: list[float] = field(default_factory=list)
    sent: tuple[int, int, float] | None = None  # (fragment, tokens, seconds) of the contribution out
    pending_parts: list[list[Part]] = field(default_factory=list)  # per fragment: chunk parts behind it
    parts_sent: list[Part] = field(default_factory=list)  # the chunk parts of the contribution out

    def __post_init__(self) -> None:
        if not self.pending:
            self.pending = [0] * self.fragments
            self.pending_seconds = [0.0] * self.fragments
        if not self.pending_parts:
            self.pending_parts = [[] for _ in range(self.fragments)]

    # ---- training ---------------------------------------------------------------------------------------
    def stepped(self, tokens: int, seconds: float, parts: list[Part] | None = None) -> None:
        self.trained += tokens
        self.round += tokens
        self.round_steps += 1
        self.round_seconds += seconds
        for f in range(self.fragments):
            self.pending[f] += tokens
            self.pending_seconds[f] += seconds
            if parts:
                self.pending_parts[f] = merged(self.pending_parts[f] + parts)

    def new_round(self) -> None:
        """The run's clock opened a round: count its tokens from zero."""
        self.round = 0
        self.round_steps = 0
        self.round_seconds = 0.0

    # ---- a contribution's life ----------------------------------------------------------------------------
    def send(self, fragment: int = 0) -> tuple[int, float]:
        """What the contribution about to be sent covers: (tokens, seconds of training)."""
        tokens, seconds = self.pending[fragment], self.pending_seconds[fragment]
        self.pending[fragment], self.pending_seconds[fragment] = 0, 0.0
        self.sent = (fragment, tokens, seconds)
        self.parts_sent, self.pending_parts[fragment] = self.pending_parts[fragment], []
        return tokens, seconds

    def applied(self, counted: float | None = None) -> float:
        """Our contribution reached θ_global; `counted` is the weight the group gave it (None: all of it,
        as when applied alone). Returns the tokens that count as contributed."""
        if self.sent is None:
            return 0.0
        _, tokens, _ = self.sent
        self.sent, self.parts_sent = None, []
        reached = float(tokens) if counted is None else min(float(tokens), max(0.0, counted))
        self.contributed += reached / self.fragments
        return reached

    def kept(self) -> None:
        """Our contribution was not applied: its tokens go with the next one."""
        if self.sent is None:
            return
        fragment, tokens, seconds = self.sent
        self.sent = None
        self.pending[fragment] += tokens
        self.pending_seconds[fragment] += seconds
        self.pending_parts[fragment] = merged(self.parts_sent + self.pending_parts[fragment])
        self.parts_sent = []

    def resynced(self, kept_progress: bool) -> int:
        """We adopted another θ_global; returns the tokens whose progress was dropped (0 when kept)."""
        self.kept()
        if kept_progress:
            return 0
        dropped = max(self.pending)
        self.pending = [0] * self.fragments
        self.pending_seconds = [0.0] * self.fragments
        self.pending_parts = [[] for _ in range(self.fragments)]
        return dropped

    # ---- reporting ---------------------------------------------------------------------------------------
    @property
    def share(self) -> float | None:
        """Tokens that reached θ_global ÷ tokens trained (None before the first step)."""
        return min(1.0, self.contributed / self.trained) if self.trained else None

    def state_dict(self) -> dict[str, object]:
        """For a checkpoint. A contribution still out counts as pending: a restart loses the round, but its
        progress is in the working copy the checkpoint holds, and goes out with the next one."""
        pending, seconds = list(self.pending), list(self.pending_seconds)
        parts = [list(p) for p in self.pending_parts]
        if self.sent is not None:
            fragment, tokens, sent_seconds = self.sent
            pending[fragment] += tokens
            seconds[fragment] += sent_seconds
            parts[fragment] = merged(self.parts_sent + parts[fragment])
        return {
            "trained": self.trained,
            "contributed": self.contributed,
            "pending": pending,
            "pending_seconds": seconds,
            "pending_parts": [[list(p) for p in f] for f in parts],
        }

    def load_state_dict(self, saved: dict[str, object]) -> None:
        """Resume from a checkpoint; anything that does not fit (another fragment count) starts at zero."""
        self.trained = int(saved.get("trained", 0))  # type: ignore[call-overload]
        self.contributed = float(saved.get("contributed", 0.0))  # type: ignore[arg-type]
        pending = saved.get("pending")
        seconds = saved.get("pending_seconds")
        if isinstance(pending, list) and isinstance(seconds, list) and len(pending) == self.fragments:
            self.pending = [int(p) for p in pending]
            self.pending_seconds = [float(s) for s in seconds]
        parts = saved.get("pending_parts")
        if isinstance(parts, list) and len(parts) == self.fragments:
            self.pending_parts = [[(int(e), int(c), int(lo), int(hi)) for e, c, lo, hi in f] for f in parts]
