"""The inner optimisation loop of DiLoCo: H local AdamW steps on this peer's data shard.

The outer loop (elsewhere) reads the parameters with ``working_params_fp32``, averages
pseudo-gradients with other peers, and writes the new global parameters back with
``load_params``. This module knows nothing about networking.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .data import Corpus, DataConfig, ShardSampler, eval_batches, load_corpus
from .model import ModelConfig, Transformer, build_model

_DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")
_STATE_VERSION = 1


@dataclass(frozen=True)
class TrainerConfig:
    """The ``[trainer]`` section of the config file."""

    inner_steps: int = 20  # H: local steps per outer round
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.1
    warmup_steps: int = 50
    total_steps: int = 20000  # horizon of the cosine decay, in inner steps
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    eval_every: int = 1  # outer rounds between evaluations
    eval_batches: int = 4
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    threads: int = 0  # CPU threads for torch; 0 keeps torch's default

    def validate(self) -> None:
        checks: list[tuple[str, bool, str]] = [
            ("inner_steps", self.inner_steps >= 1, ">= 1"),
            ("batch_size", self.batch_size >= 1, ">= 1"),
            ("seq_len", self.seq_len >= 2, ">= 2"),
            ("lr", math.isfinite(self.lr) and self.lr > 0, "a finite number > 0"),
            ("weight_decay", math.isfinite(self.weight_decay) and self.weight_decay >= 0, ">= 0"),
            ("warmup_steps", self.warmup_steps >= 0, ">= 0"),
            ("total_steps", self.total_steps >= 1, ">= 1"),
            ("min_lr_ratio", 0.0 <= self.min_lr_ratio <= 1.0, "in [0, 1]"),
            (
                "grad_clip",
                math.isfinite(self.grad_clip) and self.grad_clip >= 0,
                ">= 0 (0 disables clipping)",
            ),
            ("eval_every", self.eval_every >= 1, ">= 1"),
            ("eval_batches", self.eval_batches >= 1, ">= 1"),
            (
                "device",
                _DEVICE_PATTERN.fullmatch(self.device) is not None,
                "'auto', 'cpu', 'cuda' or 'cuda:N'",
            ),
            ("threads", self.threads >= 0, ">= 0 (0 = torch default)"),
        ]
        for key, ok, requirement in checks:
            if not ok:
                raise ValueError(f"trainer.{key} must be {requirement}, got {getattr(self, key)!r}")


def resolve_device(name: str) -> torch.device:
    """Map a ``trainer.device`` value to a torch device; "auto" prefers CUDA when present."""
    if _DEVICE_PATTERN.fullmatch(name) is None:
        raise ValueError(f"trainer.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"trainer.device is {name!r} but CUDA is not available on this machine")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"trainer.device is {name!r} but only {torch.cuda.device_count()} GPU(s) exist")
    return device


def lr_at(step: int, cfg: TrainerConfig) -> float:
    """Learning rate for the inner step numbered ``step`` (0-based count of steps already taken).

    Linear warmup reaching ``lr`` on the last warmup step, then cosine decay to
    ``lr * min_lr_ratio`` at ``total_steps``, flat afterwards.
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    min_lr = cfg.lr * cfg.min_lr_ratio
    span = max(1, cfg.total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return min_lr + (cfg.lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class StepStats:
    steps: int
    mean_loss: float  # nan when no step was taken
    tokens: int
    seconds: float


def _to_cpu_copy(value: Any) -> Any:
    """Deep copy with every tensor cloned to CPU, so a saved state never aliases live buffers."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_cpu_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu_copy(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_cpu_copy(v) for v in value)
    return value


class InnerTrainer:
    def __init__(
        self,
        model_cfg: ModelConfig,
        data_cfg: DataConfig,
        cfg: TrainerConfig,
        *,
        seed: int,
        peer_key: str,
        corpus: Corpus | None = None,
    ) -> None:
        cfg.validate()
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        # Same seed on every peer -> same starting parameters, with no transfer needed.
        self.model: Transformer = build_model(model_cfg, seed).to(self.device)
        self.model.train()
        if cfg.seq_len > self.model.spec.max_seq_len:
            raise ValueError(
                f"trainer.seq_len must be <= {self.model.spec.max_seq_len} "
                f"(max_seq_len of model.preset {model_cfg.preset!r}), got {cfg.seq_len}"
            )
        self.corpus = corpus if corpus is not None else load_corpus(data_cfg)
        self.sampler = ShardSampler(
            self.corpus.train,
            seed=seed,
            peer_key=peer_key,
            num_shards=data_cfg.num_shards,
            batch_size=cfg.batch_size,
            seq_len=cfg.seq_len,
        )
        self.eval_set = eval_batches(
            self.corpus.eval,
            seed=seed,
            n_batches=cfg.eval_batches,
            batch_size=cfg.batch_size,
            seq_len=cfg.seq_len,
        )
        self._params = self._params_in_state_dict_order()
        self.optimizer = self._make_optimizer()
        self.step = 0  # inner steps taken in total; drives the lr schedule
        self.data_position = 0  # index of the next batch in this peer's data stream

    # ------------------------------------------------------------ setup

    def _params_in_state_dict_order(self) -> list[torch.nn.Parameter]:
        named = dict(self.model.named_parameters())
        return [named[name] for name in self.model.state_dict() if name in named]

    def _make_optimizer(self) -> torch.optim.AdamW:
        # Weight decay on matrices only: decaying RMSNorm gains just fights the normalisation.
        decay = [p for p in self._params if p.ndim >= 2]
        no_decay = [p for p in self._params if p.ndim < 2]
        groups = [
            {"params": decay, "weight_decay": self.cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        fused = self.device.type == "cuda"
        return torch.optim.AdamW(groups, lr=lr_at(0, self.cfg), betas=(0.9, 0.95), eps=1e-8, fused=fused)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        # bf16 on GPUs (tensor cores, no loss scaling needed); CPU bf16 is slow on most hosts.
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ------------------------------------------------------------ training

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.batch_size * self.cfg.seq_len

    def params(self) -> list[torch.nn.Parameter]:
        """The model's parameters in ``model.state_dict()`` order (no buffers)."""
        return list(self._params)

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        with self._autocast():
            logits = self.model(x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def _one_step(self) -> torch.Tensor:
        lr = lr_at(self.step, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss = self._loss(*self.sampler.batch(self.data_position))
        loss.backward()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self._params, self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.data_position += 1
        return loss.detach()

    def train_steps(
        self,
        n: int,
        should_stop: Callable[[], bool] = lambda: False,
        on_step: Callable[[int, float], None] | None = None,
    ) -> StepStats:
        """Take up to ``n`` optimizer steps, stopping early as soon as ``should_stop()`` is true."""
        started = time.perf_counter()
        loss_sum = torch.zeros((), device=self.device)
        steps = 0
        for _ in range(n):
            if should_stop():
                break
            loss = self._one_step()
            loss_sum += loss
            steps += 1
            if on_step is not None:
                on_step(self.step, loss.item())
        # Reading the sum once (not per step) avoids a GPU sync per step when nobody listens.
        mean_loss = loss_sum.item() / steps if steps else math.nan
        return StepStats(
            steps=steps,
            mean_loss=mean_loss,
            tokens=steps * self.tokens_per_step,
            seconds=time.perf_counter() - started,
        )

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the run's fixed eval batches (identical on every peer)."""
        self.model.eval()
        try:
            losses = [self._loss(x, y) for x, y in self.eval_set]
            return torch.stack(losses).mean().item()
        finally:
            self.model.train()

    # ------------------------------------------------------------ parameter exchange

    def working_params_fp32(self) -> list[torch.Tensor]:
        """CPU fp32 copies of ``params()``, safe to keep while training continues."""
        return [p.detach().to("cpu", torch.float32, copy=True) for p in self._params]

    def load_params(self, tensors: Sequence[torch.Tensor]) -> None:
        """Overwrite the parameters in place (optimizer state is kept, as DiLoCo prescribes)."""
        if len(tensors) != len(self._params):
            raise ValueError(f"expected {len(self._params)} tensors, got {len(tensors)}")
        for i, (param, tensor) in enumerate(zip(self._params, tensors, strict=True)):
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"tensor {i} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        with torch.no_grad():
            for param, tensor in zip(self._params, tensors, strict=True):
                param.copy_(tensor)

    # ------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume with the same next batch, lr and optimizer moments.

        All tensors are fresh CPU copies: the result can be saved while training continues.
        """
        return {
            "version": _STATE_VERSION,
            "model": _to_cpu_copy(dict(self.model.state_dict())),
            "optimizer": _to_cpu_copy(self.optimizer.state_dict()),
            "step": self.step,
            "data_position": self.data_position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()``; raises ValueError if it does not fit this trainer."""
        self._check_state(state)
        model_state = state["model"]
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                param.copy_(model_state[name])
        self._load_optimizer_state(state["optimizer"])
        self.step = int(state["step"])
        self.data_position = int(state["data_position"])

    def _check_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise ValueError(f"trainer state must be a dict, got {type(state).__name__}")
        missing = [k for k in ("model", "optimizer", "step", "data_position") if k not in state]
        if missing:
            raise ValueError(f"trainer state is missing {', '.join(missing)}")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"trainer state has version {state.get('version')!r}, expected {_STATE_VERSION}")
        ours = {name: tuple(p.shape) for name, p in self.model.named_parameters()}
        theirs = {name: tuple(t.shape) for name, t in state["model"].items()}
        if ours.keys() != theirs.keys():
            unexpected = sorted(theirs.keys() - ours.keys())[:3]
            absent = sorted(ours.keys() - theirs.keys())[:3]
            raise ValueError(
                f"trainer state is for a different model (missing {absent}, unexpected {unexpected})"
            )
        for name, shape in ours.items():
            if theirs[name] != shape:
                raise ValueError(
                    f"trainer state is for a different model: {name} has shape {theirs[name]}, expected {shape}"
                )

    def _load_optimizer_state(self, saved: dict[str, Any]) -> None:
        # Keep this trainer's hyper-parameters (current config, fused flag for this device) and
        # take only the per-parameter moments from the saved state.
        try:
            saved_sizes = [len(g["params"]) for g in saved["param_groups"]]
            moments = saved["state"]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"trainer state has a malformed optimizer state ({exc!r})") from None
        current = self.optimizer.state_dict()
        if saved_sizes != [len(g["params"]) for g in current["param_groups"]]:
            raise ValueError("trainer state's optimizer does not match this model's parameter groups")
        # Clone so that training afterwards never mutates the caller's dict (load aliases tensors).
        current["state"] = _to_cpu_copy(moments)
        self.optimizer.load_state_dict(current)
