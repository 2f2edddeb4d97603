"""The config's auto deadlines (0) made concrete for this node, before anything uses them.

The rule is `peers/linkbudget.py`; this module only feeds it the run's model (its parameter count, built
on the meta device: no memory), the codec's bytes per value, the group and this node's prior rate (its
`net.bandwidth`, else the conservative default). A value the operator set is kept as set. The all-reduce
and state deadlines are refined later from measured transfers (`peers.group.GroupAverager`); these are
the values a node starts with.
"""

from __future__ import annotations

import dataclasses
import logging

from dilocod.codecs import TopKCodec, bytes_per_element
from dilocod.config import Config
from dilocod.trainer.lm import lm_skeleton
from dilocod.trainer.model import count_params
from peers.linkbudget import Deadlines, LinkRule, ModelSize, deadlines, prior_rate

log = logging.getLogger("dilocod.deadlines")


def model_size(cfg: Config) -> ModelSize:
    """The run's model as the link rule sees it."""
    elements = count_params(lm_skeleton(cfg.model))
    codec = cfg.averaging.wire_codec()
    per_element = 4.0 if codec is None else bytes_per_element(codec)
    if isinstance(codec, TopKCodec):
        # Relayed (peers/partrelay.py): n − 1 payloads a member, against ~2 for a reduced codec's parts.
        per_element *= max(2, cfg.averaging.group_size) / 2
    # θ_global and the momentum, the second moment with an adaptive outer step, and with overlap the round
    # a donor has in flight (one more model-sized tensor set).
    state_tensors = (3 if cfg.outer.adaptive else 2) + (cfg.outer.overlap != "none")
    return ModelSize(elements, per_element, state_tensors)


def auto_keys(cfg: Config) -> list[str]:
    """The deadlines this config leaves to the rule."""
    avg = cfg.averaging
    keys = [f"averaging.{k}" for k in ("matchmaking_timeout", "allreduce_timeout", "state_timeout")]
    values = [avg.matchmaking_timeout, avg.allreduce_timeout, avg.state_timeout]
    auto = [key for key, value in zip(keys, values, strict=True) if value == 0]
    return [*auto, "round.max_seconds"] if cfg.round.max_seconds == 0 else auto


def rule_deadlines(cfg: Config, size: ModelSize | None = None) -> Deadlines:
    """The rule's deadlines for this config, at this node's prior rate."""
    avg = cfg.averaging
    group = avg.group_size + 1  # the trainers that reduce, and an auxiliary reducer
    return deadlines(
        size or model_size(cfg), group, prior_rate(cfg.net.bandwidth),
        min_window=avg.min_matchmaking_time, request_timeout=avg.request_timeout,
    )  # fmt: skip


def resolve_deadlines(cfg: Config) -> tuple[Config, LinkRule | None]:
    """`cfg` with every auto (0) deadline replaced by the rule's value (the rest as set), and what the
    averager needs to keep the auto all-reduce and state deadlines following the measured link."""
    auto = auto_keys(cfg)
    if not auto:
        return cfg, None
    size = model_size(cfg)
    rule = rule_deadlines(cfg, size)
    avg, rnd = cfg.averaging, cfg.round
    averaging = dataclasses.replace(
        avg,
        matchmaking_timeout=avg.matchmaking_timeout or rule.matchmaking,
        allreduce_timeout=avg.allreduce_timeout or rule.allreduce,
        state_timeout=avg.state_timeout or rule.state,
    )
    round_cfg = dataclasses.replace(rnd, max_seconds=rnd.max_seconds or rule.round_max)
    resolved = dataclasses.replace(cfg, averaging=averaging, round=round_cfg)
    log.info(
        "deadlines from the model and the link (%s): matchmaking %.0f s, all-reduce %.0f s, state %.0f s, "
        "round at most %.0f s", ", ".join(auto), averaging.matchmaking_timeout, averaging.allreduce_timeout,
        averaging.state_timeout, round_cfg.max_seconds,
    )  # fmt: skip
    link = LinkRule(
        size, prior_rate(cfg.net.bandwidth),
        allreduce=avg.allreduce_timeout == 0, state=avg.state_timeout == 0,
    )  # fmt: skip
    return resolved, link
