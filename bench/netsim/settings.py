"""What one simulated run is: the scenario (the command's flags) and the run's settings as the daemon derives
them from its config (`configs/<preset>.toml`), through the daemon's own functions."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dilocod.codecs import TopKCodec
from dilocod.config import Config, load_config
from dilocod.node.autodeadlines import model_size, resolve_deadlines
from dilocod.node.roundconfig import clock_settings, machine_settings
from dilocod.rounds.clock import ClockSettings
from dilocod.rounds.machine import MachineSettings
from peers.linkbudget import ModelSize

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# One peer of average speed, tokens/s. 124m and small: one H100, eager (bench/results/gpu_mfu.json); tiny:
# one CPU core's bare loop (docs/benchmarks.md, "29,463–34,319 tokens/s"). A scenario scales them by its
# speed distribution; what matters to the protocol is a round's compute against its communication.
BASE_TOKENS_PER_SECOND = {"tiny": 30_000.0, "small": 851_894.0, "124m": 162_496.0, "1b": 39_320.0}
SPEEDS = ("equal", "spread", "mixed")
CPU_SHARE_IN_MIX = 1 / 3  # "mixed": this share of the peers are CPUs …
CPU_SPEED_IN_MIX = 0.05  # … at this fraction of a GPU's speed


@dataclass(frozen=True)
class Scenario:
    """The command's flags: who the peers are and what happens to them."""

    peers: int = 10
    nat: float = 0.0  # share of peers behind NAT (private: client mode, reduce nothing)
    churn: float = 0.0  # % of the peers leaving per hour (half crash, half exit), each replaced by a joiner
    speeds: str = "equal"
    link_mbit: float = 100.0  # every peer's upload and download
    preset: str = "tiny"
    rounds: int = 5
    seed: int = 0
    bootstrap_mbit: float = 1000.0  # one ordinary server's link
    rtt_ms: tuple[float, float] = (20.0, 150.0)  # a peer's round trip to the median peer, drawn in this range
    train_tokens: int = 10**10  # the dataset's training split (the chunk book's size)

    def validate(self) -> None:
        if self.peers < 2:
            raise ValueError(f"--peers must be at least 2, got {self.peers}")
        if not 0.0 <= self.nat < 1.0:
            raise ValueError(f"--nat must be a share in [0, 1), got {self.nat}")
        if self.churn < 0:
            raise ValueError(f"--churn must be >= 0 (% of the peers leaving per hour), got {self.churn}")
        if self.speeds not in SPEEDS:
            raise ValueError(f"--speeds must be one of {', '.join(SPEEDS)}, got {self.speeds!r}")
        if not self.link_mbit > 0:
            raise ValueError(f"--link-mbit must be > 0, got {self.link_mbit}")
        if self.preset not in BASE_TOKENS_PER_SECOND:
            raise ValueError(
                f"--preset must be one of {', '.join(BASE_TOKENS_PER_SECOND)}, got {self.preset!r}"
            )
        if self.rounds < 1:
            raise ValueError(f"--rounds must be at least 1, got {self.rounds}")


@dataclass(frozen=True)
class RunParams:
    """The run's settings as every simulated peer holds them, each from the daemon's own derivation."""

    cfg: Config  # the preset's config with its auto (0) deadlines resolved, as `resolve_deadlines` does
    clock: ClockSettings  # dilocod.node.roundconfig.clock_settings
    public_machine: MachineSettings  # dilocod.node.roundconfig.machine_settings, a public trainer
    private_machine: MachineSettings  # … a private one
    size: ModelSize  # dilocod.node.autodeadlines.model_size: parameters, wire bytes per value
    step_tokens: int  # one inner step: batch × seq_len
    topk: bool  # relayed payloads (n − 1 a member) instead of reduced parts
    vocab_size: int

    @property
    def delta_bytes(self) -> float:
        """One pseudo-gradient on the wire. model_size scales topk's bytes per value by group_size / 2 for
        its deadlines; the payload itself is the codec's."""
        if self.topk:
            return self.size.delta_bytes / (max(2, self.cfg.averaging.group_size) / 2)
        return self.size.delta_bytes


def run_params(scenario: Scenario) -> RunParams:
    """The preset's config, every auto deadline resolved at the daemon's default prior rate (a peer that
    states no `net.bandwidth`), then the clock and machine settings built from it."""
    cfg = load_config(CONFIGS / f"{scenario.preset}.toml")
    resolved, _ = resolve_deadlines(cfg)
    return RunParams(
        cfg=resolved,
        clock=clock_settings(resolved, 1),
        public_machine=machine_settings(resolved, private=False, fragments=1),
        private_machine=machine_settings(resolved, private=True, fragments=1),
        size=model_size(resolved),
        step_tokens=resolved.trainer.batch_size * resolved.trainer.seq_len,
        topk=isinstance(resolved.averaging.wire_codec(), TopKCodec),
        vocab_size=resolved.model.spec().vocab_size,
    )
