"""Configuration: frozen dataclasses, loaded from TOML with `--set section.key=value` overrides.

Each component owns the dataclass of its own section (the trainer's next to the trainer, the outer
optimizer's next to it); this module assembles and validates them, and `dilocod.configtoml` reads the
file and the overrides and checks types strictly. The first problem is reported as one line that names
the key.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dilocod import DEFAULT_RUN_ID
from dilocod.aggregation import ReducerSettings, ScreeningSettings
from dilocod.codecs import (
    CODEC_NAMES,
    FEEDBACK_CODECS,
    TOPK_VALUE_BITS,
    Codec,
    ErrorFeedback,
    TopKCodec,
    make_codec,
    topk_per_chunk,
)
from dilocod.configtoml import ConfigError, apply_override, build, read_toml
from dilocod.diloco.outer import OuterConfig
from dilocod.rounds.clock import RoundConfig
from dilocod.statesync.checkpoint import CheckpointConfig
from dilocod.trainer.batches import DataConfig
from dilocod.trainer.hfmodel import HFConfigError
from dilocod.trainer.lm import lm_skeleton, model_name
from dilocod.trainer.model import PRESETS, ModelConfig
from dilocod.trainer.settings import TrainerConfig
from dilocod.trust.adversary import AdversaryConfig

if TYPE_CHECKING:
    from peers.auth import RunAuth

_RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class RunConfig:
    """`[run]`: which run this peer belongs to. Peers only ever meet peers with the same id."""

    id: str = DEFAULT_RUN_ID  # the run: peers only meet peers with the same id (letters, digits, '-', '_')
    seed: int = 0  # the initial θ (the same on every peer) and the data order
    # Who may take part (peers/auth.py): a shared secret of >= 16 characters, or "file:<path>" naming a
    # file of allowed peer ids; unset = an open run. A secret: never printed (no repr, redacted in describe).
    key: str | None = field(default=None, repr=False)

    def auth(self) -> RunAuth | None:
        if self.key is None:  # an open run: nothing to parse (and no need for the crypto library)
            return None
        from peers.auth import parse_run_key
        from peers.errors import PeersError

        try:
            return parse_run_key(self.key)
        except PeersError as e:
            raise ValueError(str(e)) from None

    def validate(self) -> None:
        if not _RUN_ID.match(self.id):
            raise ValueError(
                f"run.id must be 1-64 characters of letters, digits, '-' or '_', got '{self.id}'"
            )
        self.auth()  # an empty secret, an unreadable file or a malformed line fails here, as one line


RESIDUAL_DTYPES = ("bfloat16", "float32")
COMPRESSIONS = (*CODEC_NAMES, "topk")
DEFAULT_TOPK_EF_DECAY = 0.95  # SparseLoCo's


@dataclass(frozen=True)
class AveragingConfig:
    """`[averaging]`: how groups form and how long each phase may take."""

    # the most trainers of a group that reduce (a share of the parts each); a group holds every live trainer
    # of the run, so more peers than this still make one θ_global a round
    group_size: int = 8
    min_group_size: int = 2  # smallest group worth forming, in trainers (auxiliary reducers do not count)
    min_matchmaking_time: float = 5.0  # how long a group's leader waits for more peers to join
    # give up looking for a group after this long; 0 = auto: from the model's size and the group
    # (peers/linkbudget.py), at least 15 s
    matchmaking_timeout: float = 0.0
    # give up a started all-reduce after this long; 0 = auto: from |Δ| (parameters × the codec's bytes), the
    # group and this node's measured bandwidth, at least 60 s (peers/linkbudget.py)
    allreduce_timeout: float = 0.0
    request_timeout: float = 3.0  # one matchmaking request; keep it below min_matchmaking_time
    # one state download (re-sync) attempt; 0 = auto: from the state's size and this node's measured
    # bandwidth, at least 60 s (peers/linkbudget.py)
    state_timeout: float = 0.0
    # mean (undefended) | trimmed_mean | median | centered_clip: how a part's contributions are combined
    # (topk has its own rule: docs/trust.md)
    reducer: str = "centered_clip"
    trim_fraction: float = 0.2  # trimmed_mean: share cut from each side
    clip_tau: float | None = None  # centered_clip radius; unset = derived from the data
    clip_iters: int = 20  # centered_clip: most iterations of clipped averaging
    clip_tol: float = 1e-6  # centered_clip: stop iterating once the centre moves less than this
    screen_norm_ratio: float = 10.0  # drop contributions whose norm exceeds this × the group median
    ban_seconds: float = 3600.0  # how long a peer caught lying stays banned
    # none | fp16 | int8 | int4 | int2 | topk: how pseudo-gradient parts and averages travel (bytes a value:
    # 4, 2, 1.008, 0.53, 0.28; blockwise with a scale a block; int4, int2 and topk with error feedback). int4: within
    # 0.2 % of fp32 parts' loss with 1/7.5 of the bytes in the convergence study (docs/benchmarks.md)
    compression: str = "int4"
    # topk: the share of each chunk's values sent, its largest |values| (k = round(density × chunk), at least
    # 1). The default, SparseLoCo's 64 of 4,096 at 2 bits, is 0.020 bytes a value (1/200 of fp32, 1/26.5 of
    # int4); the group's reducers relay the members' payloads rather than reduce them (docs/protocol.md)
    topk_density: float = 64 / 4096
    # topk: values a chunk (a power of two, 16 to 65536); each kept value's index takes about
    # 2 + log2(1 / density) bits (Elias–Fano)
    topk_chunk: int = 4096
    # topk: bits of each kept value, 2 | 4 | 8, with one bf16 scale a chunk
    topk_value_bits: int = 2
    # the error-feedback buffer's decay β (e ← β·e + Δ, send C(e), e ← e − C(e)), in (0, 1]; unset: 0.95
    # with topk (SparseLoCo's), 1 (nothing fades) with int4 and int2
    ef_decay: float | None = None
    # float32 | bfloat16: how this node keeps its error-feedback residual (int4, int2, topk). bfloat16 halves it (2
    # bytes a parameter less) and drops at most 2^-8 of the residual a round (int4: ~1/240 of what the codec
    # itself drops, and that is carried)
    residual_dtype: str = "bfloat16"
    # Deadlines follow recent rounds: factor × the longest of the last 8 successful ones, between a floor
    # and the timeouts above (the ceilings). See peers/deadlines.py.
    adaptive_deadlines: bool = True
    deadline_factor: float = 3.0  # how much longer than recent rounds a phase may take
    min_allreduce_timeout: float = 5.0  # floor of the adaptive all-reduce deadline

    def reducer_settings(self) -> ReducerSettings:
        return ReducerSettings(
            self.reducer, self.trim_fraction, self.clip_tau, self.clip_iters, self.clip_tol
        )

    def screening_settings(self) -> ScreeningSettings:
        return ScreeningSettings(self.screen_norm_ratio)

    def wire_codec(self) -> Codec | None:
        """The codec parts travel with; None for `none` (exact fp32 messages, as before codecs existed)."""
        if self.compression == "topk":
            k = topk_per_chunk(self.topk_density, self.topk_chunk)
            return TopKCodec(self.topk_chunk, k, self.topk_value_bits)
        return None if self.compression == "none" else make_codec(self.compression)

    def feedback_decay(self) -> float:
        """β of the error feedback: `ef_decay`, or the codec's default when unset."""
        if self.ef_decay is not None:
            return self.ef_decay
        return DEFAULT_TOPK_EF_DECAY if self.compression == "topk" else 1.0

    def error_feedback(self, shapes: Sequence[torch.Size | Sequence[int]]) -> ErrorFeedback | None:
        """A zero residual for the codecs that carry one (int4, int2, topk), kept in `residual_dtype`."""
        if self.compression not in FEEDBACK_CODECS and self.compression != "topk":
            return None
        return ErrorFeedback(shapes, dtype=getattr(torch, self.residual_dtype), decay=self.feedback_decay())

    def validate(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"averaging.group_size must be >= 1, got {self.group_size}")
        if self.min_group_size < 2:
            raise ValueError(f"averaging.min_group_size must be >= 2, got {self.min_group_size}")
        if self.group_size < self.min_group_size:
            raise ValueError(
                "averaging.group_size must be >= averaging.min_group_size "
                f"({self.group_size} < {self.min_group_size})"
            )
        for name in ("min_matchmaking_time", "request_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"averaging.{name} must be > 0, got {getattr(self, name)}")
        for name in ("matchmaking_timeout", "allreduce_timeout", "state_timeout"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(
                    f"averaging.{name} must be >= 0 seconds (0 = auto), got {getattr(self, name)}"
                )
        if 0 < self.matchmaking_timeout <= self.min_matchmaking_time:
            raise ValueError(
                "averaging.matchmaking_timeout must be greater than averaging.min_matchmaking_time "
                f"({self.matchmaking_timeout} <= {self.min_matchmaking_time})"
            )
        if not self.deadline_factor >= 1:
            raise ValueError(f"averaging.deadline_factor must be >= 1, got {self.deadline_factor}")
        if not self.min_allreduce_timeout > 0 or 0 < self.allreduce_timeout < self.min_allreduce_timeout:
            raise ValueError(
                "averaging.min_allreduce_timeout must be > 0 and <= averaging.allreduce_timeout "
                f"({self.min_allreduce_timeout} vs {self.allreduce_timeout})"
            )
        if not self.ban_seconds > 0:
            raise ValueError(f"averaging.ban_seconds must be > 0, got {self.ban_seconds}")
        if self.compression not in COMPRESSIONS:
            raise ValueError(
                f"averaging.compression must be one of {', '.join(COMPRESSIONS)}, got '{self.compression}'"
            )
        self._validate_topk()
        if self.residual_dtype not in RESIDUAL_DTYPES:
            raise ValueError(
                f"averaging.residual_dtype must be one of {', '.join(RESIDUAL_DTYPES)}, got '{self.residual_dtype}'"
            )
        self.reducer_settings().validate()
        self.screening_settings().validate()

    def _validate_topk(self) -> None:
        chunk = self.topk_chunk
        if not 16 <= chunk <= 65536 or chunk & (chunk - 1):
            # a power of two divides the all-reduce's parts of 131072 values (peers/allreduce.py)
            raise ValueError(f"averaging.topk_chunk must be a power of two from 16 to 65536, got {chunk}")
        if not (math.isfinite(self.topk_density) and 0 < self.topk_density <= 1):
            raise ValueError(f"averaging.topk_density must be a fraction in (0, 1], got {self.topk_density}")
        if self.topk_value_bits not in TOPK_VALUE_BITS:
            raise ValueError(
                f"averaging.topk_value_bits must be one of {', '.join(map(str, TOPK_VALUE_BITS))}, "
                f"got {self.topk_value_bits}"
            )
        if self.ef_decay is not None and not 0 < self.ef_decay <= 1:
            raise ValueError(f"averaging.ef_decay must be in (0, 1], got {self.ef_decay}")


@dataclass(frozen=True)
class NetConfig:
    """`[net]`: where this peer listens and how it presents itself."""

    host: str = "0.0.0.0"  # the address this peer listens on (`--host`)
    port: int = 0  # the port it listens on (`--port`); 0 = any free port
    announce: tuple[str, ...] = ()  # multiaddrs to advertise (port-forwarded hosts)
    # auto (a dial-back through the bootstrap decides at each start) | public | private (client mode: no
    # inbound connections; needs a public reducer or a relay, docs/networking.md)
    reachability: str = "auto"
    status_interval: float = 5.0  # seconds between this peer's status records in the DHT
    # Download bandwidth in Mbit/s. Reducers get shares of the parts in proportion (hivemind's load
    # balancing); unset = the mean of the group's stated values, or equal shares when nobody states one.
    # Also the link the auto deadlines assume until this node has measured its own (unset: 10 Mbit/s).
    bandwidth: float | None = None

    def validate(self) -> None:
        if self.bandwidth is not None and not 0 < self.bandwidth < 1e7:
            raise ValueError(f"net.bandwidth must be a positive number of Mbit/s, got {self.bandwidth}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"net.port must be in 0..65535, got {self.port}")
        if self.reachability not in ("auto", "public", "private"):
            raise ValueError(f"net.reachability must be auto, public or private, got '{self.reachability}'")
        if not self.status_interval > 0:
            raise ValueError(f"net.status_interval must be > 0, got {self.status_interval}")


@dataclass(frozen=True)
class ScoringConfig:
    """`[scoring]`: who really trained: every round, full nodes score each other's Δ on the data its ticket
    claims (dilocod/trust/scoring.py, docs/trust.md)."""

    enabled: bool = False  # score contributions and give peers rated below the gate weight 0
    sequences: int = 8  # claimed sequences per score (and as many random ones without a reference Δ)
    step: float = 1.0  # the step along Δ the loss is measured after (1: where the contributor's steps ended)

    def validate(self) -> None:
        if not 1 <= self.sequences <= 1024:
            raise ValueError(f"scoring.sequences must be in 1..1024, got {self.sequences}")
        if not 0 < self.step <= 4:
            raise ValueError(f"scoring.step must be in (0, 4], got {self.step}")


@dataclass(frozen=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    round: RoundConfig = field(default_factory=RoundConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    averaging: AveragingConfig = field(default_factory=AveragingConfig)
    net: NetConfig = field(default_factory=NetConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    adversary: AdversaryConfig = field(default_factory=AdversaryConfig)
    scoring: ScoringConfig = field(default_factory=ScoringConfig)

    def outer_settings(self) -> OuterConfig:
        """The outer step as the run takes it: `[outer]`, with sgd's own rate for sparse pseudo-gradients when
        `outer.lr` is 0 (`OuterConfig.for_sparse`)."""
        return self.outer.for_sparse() if self.averaging.compression == "topk" else self.outer

    def validate(self) -> None:
        if self.model.preset not in PRESETS:
            raise ValueError(f"model.preset must be one of {', '.join(PRESETS)}, got '{self.model.preset}'")
        for section in dataclasses.fields(self):
            validate = getattr(getattr(self, section.name), "validate", None)
            if validate is not None:
                validate()
        if self.outer.overlap == "streaming":
            self._validate_streaming()

    def _validate_streaming(self) -> None:
        """Fragments are whole parameter tensors. (Each takes its turn in a round of the run's clock that
        holds 1/fragments of the round's tokens, so H need not be a multiple of them.)"""
        fragments = self.outer.fragments
        tensors = num_parameter_tensors(self.model)
        if fragments > tensors:
            raise ValueError(
                f"outer.fragments must be <= the {tensors} parameter tensors of the model "
                f"({model_name(self.model)}), got {fragments}"
            )


def num_parameter_tensors(model: ModelConfig) -> int:
    """How many parameter tensors the run's model has (built on the meta device: no memory; the
    vocabulary changes no tensor's existence)."""
    try:
        return len(list(lm_skeleton(model).parameters()))
    except HFConfigError as e:
        raise ValueError(str(e)) from None


def load_config(path: str | Path | None, overrides: typing.Sequence[str] = ()) -> Config:
    """Read `path` (or the defaults), apply `section.key=value` overrides, type-check and validate."""
    return config_from_raw(read_raw(path, overrides))


def read_raw(path: str | Path | None, overrides: typing.Sequence[str] = ()) -> dict[str, Any]:
    """The keys `path` and the overrides set, as read (not yet type-checked): what the user chose."""
    raw: dict[str, Any] = {}
    if path is not None:
        raw = read_toml(Path(path))
    for item in overrides:
        apply_override(raw, item)
    return raw


def config_from_raw(raw: dict[str, Any], *, validate: bool = True) -> Config:
    """Type-check `raw` (defaults for what it leaves out) and, unless told not to, validate the whole."""
    config: Config = build(Config, raw, prefix="")
    if validate:
        try:
            config.validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return config


def describe(config: Config) -> dict[str, dict[str, Any]]:
    """The effective config as plain data (for logs and the status API)."""
    described = {f.name: dataclasses.asdict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if config.run.key is not None and not config.run.key.strip().startswith("file:"):
        described["run"]["key"] = "(secret)"
    return described
