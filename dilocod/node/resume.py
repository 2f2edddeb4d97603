"""Building a peer's training state, from scratch or from its checkpoint, and what a checkpoint holds.

A checkpoint holds θ_global and the outer momentum (with their step), the trainer (working copy, inner
optimizer moments, lr schedule step, data position), the error-feedback residual, the token ledger
(tokens trained, contributed, and behind the progress not yet averaged, with the chunk parts they came
from), the chunk leases held with how far each is trained, and the round counters. A
restart therefore resumes mid-round: its progress and the tokens behind it still go out.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dilocod.codecs import ErrorFeedback
from dilocod.config import Config
from dilocod.data.cursor import ChunkCursor
from dilocod.data.localcopy import open_corpus
from dilocod.diloco import OuterOptimizer
from dilocod.diloco.fragments import split_fragments
from dilocod.export.errors import ExportError
from dilocod.export.initial import load_init
from dilocod.node.initweights import init_weights_file
from dilocod.observability.peerstate import RoundProgress
from dilocod.rounds.tokens import TokenLedger
from dilocod.statesync.checkpoint import CheckpointError
from dilocod.trainer import InnerTrainer
from dilocod.trainer.lm import model_name

log = logging.getLogger("dilocod.resume")

COUNTERS = ("rounds_ok", "rounds_failed", "resyncs")  # the round progress a checkpoint keeps


@dataclass
class Resumed:
    trainer: InnerTrainer
    outer: OuterOptimizer
    feedback: ErrorFeedback | None  # error-feedback residual (int4/int2 compression)
    tokens: TokenLedger
    cursor: ChunkCursor  # our place in the run's chunk schedule (leases and offsets)
    threads: int = 0  # torch threads of the trainer thread
    counters: dict[str, int] = field(default_factory=dict)  # rounds_ok, rounds_failed, resyncs (checkpoint)


def build_trainer(
    cfg: Config,
    peer_key: str,
    checkpoint: dict[str, Any] | None,
    run_dir: Path,
    *,
    partial: bool = False,
    threads: int = 0,
) -> Resumed:
    """Runs in the trainer thread: torch work stays off the event loop. `threads`: torch's threads when
    the machine's share decides them (0: `trainer.threads`, or torch's default)."""
    threads = threads or cfg.trainer.threads
    if threads > 0:
        torch.set_num_threads(threads)
    # A joiner's copy may hold only some training shards: it fetches those of its chunks as it goes.
    corpus = open_corpus(cfg.data, partial=True) if partial else None
    trainer = InnerTrainer(
        cfg.model, cfg.data, cfg.trainer, seed=cfg.run.seed, peer_key=peer_key, corpus=corpus
    )
    if checkpoint is None and cfg.model.init:
        _start_from_init(cfg, trainer)
    outer = OuterOptimizer(trainer.working_params_fp32(), cfg.outer_settings())
    if trainer.device.type == "cuda":
        outer.pin_memory()
    tokens = TokenLedger(fragments=_fragments(cfg, outer))
    cursor = ChunkCursor(cfg.trainer.seq_len, seed=cfg.data.dataset)
    counters: dict[str, int] = {}
    if checkpoint is not None:
        try:
            counters = _restore(cfg, run_dir, checkpoint, trainer, outer, tokens)
            cursor.load_state_dict(checkpoint.get("chunks") or {})
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            reason = str(e).split("\n")[0]
            raise CheckpointError(
                f"checkpoint {run_dir / 'checkpoint.pt'} cannot be resumed: {reason}"
            ) from None
    feedback = _make_feedback(cfg, outer, checkpoint)
    # torch.get_num_threads(): this thread's, the trainer's
    return Resumed(trainer, outer, feedback, tokens, cursor, torch.get_num_threads(), counters)


def _start_from_init(cfg: Config, trainer: InnerTrainer) -> None:
    """θ at outer step 0 is the run's starting weights (`--init-from`), not the seed's random init: the
    working copy takes them before θ_global is copied from it."""
    path = init_weights_file(cfg)
    if path is None:  # ensure_init ran before us: a peer never gets here without its copy
        raise CheckpointError("the run starts from pinned weights (model.init), but this node has no copy")
    try:
        trainer.load_params(load_init(path, cfg.model.spec()))
    except ExportError as e:
        raise CheckpointError(f"the run's starting weights: {e}") from None
    log.info("starting from the run's initial weights %s (%s)", cfg.model.init[:12], path)


def _fragments(cfg: Config, outer: OuterOptimizer) -> int:
    if cfg.outer.overlap != "streaming":
        return 1
    return len(split_fragments([p.numel() for p in outer.params], cfg.outer.fragments))


def _restore(
    cfg: Config,
    run_dir: Path,
    checkpoint: dict[str, Any],
    trainer: InnerTrainer,
    outer: OuterOptimizer,
    tokens: TokenLedger,
) -> dict[str, int]:
    """Restores the trainer, θ_global and the ledger; returns the checkpoint's round counters."""
    saved_model = checkpoint.get("model", checkpoint.get("preset"))  # "model": a preset or an hf config
    if checkpoint.get("run_id") != cfg.run.id or saved_model != model_name(cfg.model):
        raise ValueError(
            f"checkpoint in {run_dir} belongs to run '{checkpoint.get('run_id')}' "
            f"({saved_model}), not '{cfg.run.id}' ({model_name(cfg.model)}); use another --run-dir"
        )
    saved = checkpoint["outer"]
    outer.load_state(int(saved["step"]), [*saved["params"], *saved["momentum"], *saved.get("second", [])])
    trainer.load_state_dict(checkpoint["trainer"])
    saved_counters = checkpoint.get("counters", {})
    counters = {name: int(saved_counters.get(name, 0)) for name in COUNTERS}
    saved_tokens = checkpoint.get("tokens")
    if isinstance(saved_tokens, dict):
        tokens.load_state_dict(saved_tokens)
    log.info("resumed from checkpoint at outer step %d, inner step %d", outer.step, trainer.step)
    return counters


def _make_feedback(
    cfg: Config, outer: OuterOptimizer, checkpoint: dict[str, Any] | None
) -> ErrorFeedback | None:
    """Error feedback for the coarse codecs; the residual resumes from the checkpoint when it fits."""
    feedback = cfg.averaging.error_feedback([p.shape for p in outer.params])
    if feedback is None:
        return None
    saved = (checkpoint or {}).get("error_feedback")
    if saved is not None:
        try:
            feedback.load_state_dict(saved)
        except ValueError as e:  # harmless: the residual only delays what the codec dropped
            log.warning("checkpoint's error-feedback residual not resumed (%s); starting from zero", e)
        if not math.isfinite(feedback.norm()):
            feedback.reset()
    return feedback


def checkpoint_payload(cfg: Config, resumed: Resumed, rounds: RoundProgress) -> dict[str, Any]:
    """Runs in the trainer thread. The trainer's state (working copy, inner optimizer moments) is copied:
    inner steps go on while the file is written. θ_global, the outer momentum and the error-feedback
    residual are not (a second copy of 8-12 bytes per parameter): the writer's `guard` holds back every
    trainer-thread job that could change them until the file is written."""
    outer = resumed.outer
    return {
        "run_id": cfg.run.id,
        "preset": cfg.model.preset,
        "model": model_name(cfg.model),  # the preset, or "hf <model_type> <config sha256[:12]>"
        "outer": {
            "step": outer.step,
            "params": list(outer.params),
            "momentum": list(outer.momentum),
            "second": list(outer.second),  # FedAdam/FedYogi's second moments (none with sgd)
            "sha256": outer.sha256,
        },
        "trainer": resumed.trainer.state_dict(),
        "error_feedback": None if resumed.feedback is None else {"residual": list(resumed.feedback.residual)},
        "tokens": resumed.tokens.state_dict(),
        "chunks": resumed.cursor.state_dict(),
        "counters": {name: getattr(rounds, name) for name in COUNTERS},
    }
