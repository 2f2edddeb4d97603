"""The run's config read once for the round protocol: the settings each round component reads.

The round components never see the whole `Config` (the layers forbid it): the daemon turns it into these
small frozen settings as it wires them (`node/peer.py`).
"""

from __future__ import annotations

from dilocod.config import Config
from dilocod.rounds.clock import ClockSettings
from dilocod.rounds.machine import MachineSettings
from dilocod.rounds.pipeline import PipelineSettings
from dilocod.rounds.settings import RoundSettings
from dilocod.statesync.catchup import SyncSettings


def round_settings(cfg: Config) -> RoundSettings:
    """What the driver, its effects, exchange, clock and joining read."""
    averaging = cfg.averaging
    return RoundSettings(
        status_interval=cfg.net.status_interval,
        matchmaking_timeout=averaging.matchmaking_timeout,
        min_matchmaking_time=averaging.min_matchmaking_time,
        request_timeout=averaging.request_timeout,
        state_timeout=averaging.state_timeout,
        eval_every=cfg.trainer.eval_every,
        sample_every=cfg.trainer.sample_every,
    )


def pipeline_settings(cfg: Config, private: bool) -> PipelineSettings:
    """The tensor pipeline's overlap mode; a private peer without overlap keeps the round before (it may
    have to step back to it); with scoring, each contribution carries the round's own Δ for the scorers."""
    overlap = cfg.outer.overlap
    return PipelineSettings(
        overlap, cfg.outer.fragments, cfg.outer.mix_alpha, private and overlap == "none", cfg.scoring.enabled
    )


def sync_settings(cfg: Config) -> SyncSettings:
    return SyncSettings(cfg.net.status_interval, cfg.averaging.state_timeout, cfg.outer)


def machine_settings(cfg: Config, private: bool, fragments: int) -> MachineSettings:
    overlap = cfg.outer.overlap
    return MachineSettings(
        overlapped=overlap != "none",
        can_step_back=private and overlap == "none",
        private=private,
        checkpoint_every=fragments,
    )


def reference_tokens(cfg: Config) -> int:
    """Tokens of H inner steps of our one-device config: a round of a peer of average speed."""
    return cfg.trainer.inner_steps * cfg.trainer.batch_size * cfg.trainer.seq_len


def clock_settings(cfg: Config, fragments: int) -> ClockSettings:
    """The run's clock; with streaming overlap each fragment's round is 1/fragments of a whole one."""
    return ClockSettings(
        target_tokens=cfg.round.tokens // fragments,
        reference_tokens=reference_tokens(cfg) // fragments,
        max_seconds=cfg.round.max_seconds / fragments,
        stale_after=max(3 * cfg.net.status_interval, 3.0),
        join_wait=cfg.averaging.state_timeout,
    )
