"""The ``[trainer]`` section and what it resolves to on this machine.

The config (`TrainerConfig`, checked by its ``validate``), the devices of the peer's local ranks, their
CPU threads, whether blocks recompute their activations, and the inner learning-rate schedule
(`lr_at`). Used by `inner.InnerTrainer`; depends on torch and the standard library only.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import torch

from .optim import OPTIMIZERS

_DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")
# Presets whose activations dominate GPU memory: `activation_checkpointing = "auto"` turns it on for them.
_CHECKPOINTED_PRESETS = frozenset({"124m", "1b", "llama-150m", "llama-1b"})


@dataclass(frozen=True)
class TrainerConfig:
    """`[trainer]`: the inner loop (AdamW or Muon steps on this peer's shard) and what it computes on."""

    inner_steps: int = 20  # H: inner steps a round of a peer of average speed (with round.tokens = 0)
    batch_size: int = 16  # sequences per inner step and local device
    seq_len: int = 128  # tokens per sequence
    # Sequences per forward/backward pass, gradients accumulated over batch_size / micro_batch_size of
    # them before the one optimizer step: this machine's memory, not the run's tokens per step. 0: all.
    micro_batch_size: int = 0
    lr: float = 1e-3  # the inner optimizer's peak learning rate
    weight_decay: float = 0.1  # the inner optimizer's decoupled weight decay
    warmup_steps: int = 50  # linear warmup to lr, in inner steps
    total_steps: int = 20000  # horizon of the cosine decay, in inner steps
    min_lr_ratio: float = 0.1  # the cosine decay ends at lr × this
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    eval_every: int = 1  # outer rounds between evaluations
    eval_batches: int = 4  # held-out batches of the dataset's eval split an evaluation of θ_global takes
    # Outer rounds between greedy completions of sample_prompt from θ_global (shown on the dashboard);
    # 0: none. One costs sample_tokens forward passes of a short context: a few inner steps' worth at most
    sample_every: int = 5
    sample_prompt: str = "The"  # the text every peer completes (the same for the whole run: comparable)
    sample_tokens: int = 48  # new tokens a completion has at most (its text is cut to 200 characters)
    device: str = "auto"  # "auto" (CUDA with bf16 autocast when present) | "cpu" | "cuda" | "cuda:N"
    # CPU threads for torch; 0: this peer's share of the machine's cores, the cores divided among the CPU
    # trainers running on it, followed as they come and go (split between local workers)
    threads: int = 0
    devices: int | str = 1  # local devices (data-parallel workers) of this peer: N >= 1 or "auto"
    compile: bool = False  # torch.compile the training forward/backward
    activation_checkpointing: bool | str = "auto"  # "auto": on for the 124m and 1b presets on CUDA
    peak_flops: float | None = None  # one device's peak FLOP/s, for MFU; unset: from the GPU's name
    # "muon" (Muon for the blocks' matrices, AdamW for the rest) | "adamw"; muon: lower loss at equal tokens in
    # every seed pair of the convergence study (docs/benchmarks.md), for 1.0-1.2 × the step time on any CPU
    # (tiny; its orthogonalisation runs in bf16 only where the CPU multiplies bf16 natively)
    optimizer: str = "muon"
    muon_lr_ratio: float = 1.0  # Muon's lr = this × the schedule's lr (Muon's updates match AdamW's RMS)

    def validate(self) -> None:
        checks: list[tuple[str, bool, str]] = [
            ("inner_steps", self.inner_steps >= 1, ">= 1"),
            ("batch_size", self.batch_size >= 1, ">= 1"),
            ("seq_len", self.seq_len >= 2, ">= 2"),
            (
                "micro_batch_size",
                self.micro_batch_size == 0
                or (self.micro_batch_size >= 1 and self.batch_size % self.micro_batch_size == 0),
                f"0 (the whole batch at once) or a divisor of trainer.batch_size ({self.batch_size})",
            ),
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
            ("sample_every", self.sample_every >= 0, ">= 0 (0 = no samples)"),
            ("sample_prompt", len(self.sample_prompt) <= 200, "at most 200 characters"),
            ("sample_tokens", 1 <= self.sample_tokens <= 256, "in 1..256"),
            (
                "device",
                _DEVICE_PATTERN.fullmatch(self.device) is not None,
                "'auto', 'cpu', 'cuda' or 'cuda:N'",
            ),
            ("threads", self.threads >= 0, ">= 0 (0 = torch default)"),
            (
                "devices",
                self.devices == "auto" or (type(self.devices) is int and self.devices >= 1),
                "an integer >= 1 or 'auto'",
            ),
            (
                "activation_checkpointing",
                isinstance(self.activation_checkpointing, bool) or self.activation_checkpointing == "auto",
                "true, false or 'auto'",
            ),
            (
                "peak_flops",
                self.peak_flops is None or (math.isfinite(self.peak_flops) and self.peak_flops > 0),
                "a number of FLOP/s > 0",
            ),
            ("optimizer", self.optimizer in OPTIMIZERS, "one of " + ", ".join(OPTIMIZERS)),
            (
                "muon_lr_ratio",
                math.isfinite(self.muon_lr_ratio) and self.muon_lr_ratio > 0,
                "a finite number > 0",
            ),
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


def resolve_devices(cfg: TrainerConfig) -> list[torch.device]:
    """The devices of this peer's local workers, in rank order (see `local.py`).

    On CPU every rank is "cpu" (N processes share the cores) and "auto" means one. On CUDA, rank r
    uses the r-th GPU from `trainer.device` on, and "auto" means every GPU from there.
    """
    first = resolve_device(cfg.device)
    if first.type == "cpu":
        count, cores = (1 if cfg.devices == "auto" else int(cfg.devices)), len(os.sched_getaffinity(0))
        if count > cores:  # more CPU ranks than cores only adds contention
            raise ValueError(f"trainer.devices is {count} on CPU but this machine has {cores} core(s)")
        return [first] * count
    base = first.index if first.index is not None else 0
    available = torch.cuda.device_count() - base
    count = available if cfg.devices == "auto" else int(cfg.devices)
    if count > available:
        raise ValueError(f"trainer.devices is {count} but only {available} GPU(s) from cuda:{base} on exist")
    return [torch.device("cuda", base + rank) for rank in range(count)]


def checkpointing_enabled(cfg: TrainerConfig, preset: str, device: torch.device) -> bool:
    """Whether to recompute each block's activations in backward (memory for compute)."""
    if isinstance(cfg.activation_checkpointing, bool):
        return cfg.activation_checkpointing
    return device.type == "cuda" and preset in _CHECKPOINTED_PRESETS


def cpu_threads(cfg: TrainerConfig, device: torch.device, local_ranks: int) -> int:
    """Threads for this rank; 0 leaves torch's default. N CPU ranks split the cores rather than
    each taking all of them, which would oversubscribe the machine N times."""
    if cfg.threads > 0:
        return cfg.threads
    if device.type == "cpu" and local_ranks > 1:
        return max(1, len(os.sched_getaffinity(0)) // local_ranks)
    return 0


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
