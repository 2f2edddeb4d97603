"""The inner optimisation loop of DiLoCo: H local AdamW steps on this peer's data shard.

The outer loop (elsewhere) reads the parameters with ``working_params_fp32``, averages
pseudo-gradients with other peers, and writes the new global parameters back with
``load_params``. This module knows nothing about networking.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dilocod.data.corpus import TokenSource, as_source
from dilocod.data.cursor import ChunkCursor

from . import flops
from .batches import (
    Corpus,
    DataConfig,
    Sampler,
    ShardSampler,
    batch_at,
    eval_batches,
    inputs_and_targets,
    load_corpus,
    windows_at,
    windows_of,
)
from .lm import LanguageModel, build_lm, model_name
from .model import ModelConfig, count_params
from .optim import InnerOptimizer, make_inner_optimizer, with_saved_moments
from .precision import low_precision_dtype
from .settings import TrainerConfig, checkpointing_enabled, cpu_threads, lr_at, resolve_devices

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

_STATE_VERSION = 1


class Followers(Protocol):
    """The other ranks of this peer's local group (`local.LocalGroup`), driven by rank 0's trainer.

    Each call is a collective: every rank takes part, so rank 0 calls them only from its trainer thread.
    """

    def before_step(self, step: int, data_position: int, windows: Sequence[torch.Tensor]) -> None:
        """Tell the other ranks to take the same inner step (same lr), rank r on `windows[r - 1]`."""

    def after_load(self) -> None:
        """Rank 0's parameters were overwritten: copy them to every rank."""

    def after_restore(self) -> None:
        """Rank 0's whole state (parameters and optimizer moments) was replaced: copy it to every rank."""


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
        rank: int = 0,
    ) -> None:
        cfg.validate()
        self.cfg = cfg
        self.model_cfg, self.data_cfg, self.seed, self.peer_key = model_cfg, data_cfg, seed, peer_key
        self.rank = rank
        self.devices = resolve_devices(cfg)
        if not 0 <= rank < len(self.devices):
            raise ValueError(f"rank {rank} is outside the {len(self.devices)} local device(s)")
        self.device = self.devices[rank]
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL and stray allocations go to this rank's GPU
        threads = cpu_threads(cfg, self.device, len(self.devices))
        if threads > 0:
            torch.set_num_threads(threads)
        # Same seed on every peer -> same starting parameters, with no transfer needed.
        self.model: LanguageModel = build_lm(model_cfg, seed).to(self.device)
        self.model.train()
        self.model.activation_checkpointing = checkpointing_enabled(cfg, model_cfg.preset, self.device)
        self.world_size = 1  # ranks training together; more once a local group joins (`local.py`)
        self._followers: Followers | None = None
        self._ddp: DistributedDataParallel | None = None  # set while in a local group
        # What runs the training forward/backward: the model, maybe compiled, maybe data-parallel.
        self._train_model: nn.Module = self._compiled(self.model)
        if cfg.seq_len > self.model.shape.max_seq_len:
            raise ValueError(
                f"trainer.seq_len must be <= {self.model.shape.max_seq_len} "
                f"(max_seq_len of the model, {model_name(model_cfg)}), got {cfg.seq_len}"
            )
        self.corpus = corpus if corpus is not None else load_corpus(data_cfg)
        self.sampler: Sampler = ShardSampler(
            self.corpus.train,
            seed=seed,
            peer_key=peer_key,
            num_shards=data_cfg.num_shards,
            batch_size=cfg.batch_size,
            seq_len=cfg.seq_len,
            stream=rank,  # each local rank draws its own windows from the peer's shard
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
        # The run's chunk schedule (set by the daemon): batches come from the chunks leased to this peer;
        # without one, or when its leases run dry, from the sampler's random windows (`unscheduled`).
        self.cursor: ChunkCursor | None = None
        self.unscheduled_batches = 0
        # Where the windows of a scheduled batch really come from: themselves, except for the `wrong_data`
        # adversary, which trains one fixed stretch over and over while its cursor claims its leases.
        self.window_map: Callable[[list[int]], list[int]] = lambda starts: starts
        self._train_source = as_source(self.corpus.train)

    # ------------------------------------------------------------ setup

    def _params_in_state_dict_order(self) -> list[torch.nn.Parameter]:
        named = dict(self.model.named_parameters())
        return [named[name] for name in self.model.state_dict() if name in named]

    def _make_optimizer(self) -> InnerOptimizer:
        """AdamW, or Muon for the blocks' matrices with AdamW for the rest (see `optim.py`)."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        return make_inner_optimizer(
            [(names[id(p)], p) for p in self._params],
            kind=self.cfg.optimizer,
            lr=lr_at(0, self.cfg),
            weight_decay=self.cfg.weight_decay,
            muon_lr_ratio=self.cfg.muon_lr_ratio,
            # One kernel per tensor group, no temporaries per step: on CPU a step takes 0.55-0.64 of the
            # default (foreach) one where the optimizer dominates (small preset, batch 1 x 64), 0.93-1.00 at
            # tiny's 16 x 128 (bench/adamw_fused.py).
            fused=self.device.type in ("cpu", "cuda"),
            muon_matrix=self.model.muon_matrix,
            ns_dtype=low_precision_dtype(self.device),
        )

    def _compiled(self, module: nn.Module) -> nn.Module:
        return torch.compile(module) if self.cfg.compile else module  # type: ignore[return-value]

    def join_local_group(self, world_size: int, followers: Followers | None) -> None:
        """Train as one rank of `world_size` (torch.distributed is initialised by `local.py`).

        Gradients are averaged across ranks inside backward (DDP's bucketed all-reduce overlaps it with
        the rest of backward), so every rank applies the same update to the same parameters. Rank 0
        passes its `followers`, which it drives at each step; the other ranks pass None.
        """
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(
            self.model,
            device_ids=[self.device] if self.device.type == "cuda" else None,
            forward_sync_buffers=False,  # the model has no buffers: no collective per forward
        )
        self._ddp = ddp
        self._train_model = self._compiled(ddp)
        self.world_size = world_size
        self._followers = followers

    def leave_local_group(self) -> None:
        """Train alone again (after `local.LocalGroup.stop`)."""
        self._train_model = self._compiled(self.model)
        self._ddp = None
        self.world_size = 1
        self._followers = None

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        # bf16 on GPUs (tensor cores, no loss scaling needed); CPU bf16 is slow on most hosts.
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ------------------------------------------------------------ training

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one inner step on all local ranks together."""
        return self.cfg.batch_size * self.cfg.seq_len * self.world_size

    @property
    def flops_per_token(self) -> float:
        return flops.flops_per_token(self.model.shape, self.cfg.seq_len, count_params(self.model))

    @property
    def peak_flops(self) -> float | None:
        """Peak FLOP/s of all the ranks together; None when unknown (a CPU, or a GPU not in the table)."""
        one = self.cfg.peak_flops
        if one is None and self.device.type == "cuda":
            one = flops.known_peak_flops(torch.cuda.get_device_name(self.device))
        return None if one is None else one * self.world_size

    def mfu(self, tokens_per_second: float) -> float | None:
        """Model FLOPs utilization of this peer at `tokens_per_second` (None when the peak is unknown)."""
        return flops.mfu(tokens_per_second, self.flops_per_token, self.peak_flops)

    def params(self) -> list[torch.nn.Parameter]:
        """The model's parameters in ``model.state_dict()`` order (no buffers)."""
        return list(self._params)

    def _loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        with self._autocast():
            logits = model(x)
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    def _one_step(self, windows: torch.Tensor | None = None) -> torch.Tensor:
        if self._followers is not None:
            own, *others = self._node_windows()
            self._followers.before_step(self.step, self.data_position, others)
            x, y = inputs_and_targets(own)
        elif windows is not None:  # a rank > 0 of a local group: the windows rank 0 drew for it
            x, y = inputs_and_targets(windows)
        else:
            x, y = self._next_batch()
        lr = lr_at(self.step, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's group may scale the schedule
        micro = self.cfg.micro_batch_size
        if 0 < micro < x.shape[0]:
            loss = self._accumulate(x, y, micro)
        else:
            loss = self._loss(self._train_model, x, y)
            loss.backward()  # with a local group, this also averages the gradients across ranks
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self._params, self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.data_position += 1
        loss = loss.detach()
        if self.world_size > 1:  # report the loss of the node's whole batch, not rank 0's share
            dist.all_reduce(loss)
            loss = loss / self.world_size
        return loss

    @property
    def train_source(self) -> TokenSource:
        return self._train_source

    @property
    def train_tokens(self) -> int:
        """Tokens in the training split (what the run's chunk schedule cuts into chunks)."""
        return len(self._train_source)

    def _scheduled_starts(self, n: int) -> list[int] | None:
        """Where the next `n` windows of our chunk leases start; None when there is no schedule or the
        leases held do not have `n` windows left (the step is then `unscheduled`)."""
        if self.cursor is None:
            return None
        starts = self.cursor.windows(n)
        if starts is None:
            self.unscheduled_batches += 1
            return None
        return self.window_map(starts)

    def _next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = self._scheduled_starts(self.cfg.batch_size)
        if starts is not None:
            return batch_at(self._train_source, starts, self.cfg.seq_len)
        return self.sampler.batch(self.data_position)

    def _node_windows(self) -> list[torch.Tensor]:
        """Every local rank's windows for this step (int64 [batch_size, seq_len + 1] each, rank order).

        Rank 0 draws them all: the schedule leases chunks to the node, so the node's whole batch comes from
        its leases and its round tickets name every token its ranks trained; and the workers need no
        training shard of their own (a joiner's partial copy grows under rank 0's feet). Without a
        scheduled batch, rank r gets the windows of its own random stream, as it would draw them itself.
        """
        size, ranks = self.cfg.batch_size, self.world_size
        starts = self._scheduled_starts(size * ranks)
        if starts is not None:
            return list(windows_at(self._train_source, starts, self.cfg.seq_len).split(size))
        return [windows_of(*self.sampler.batch(self.data_position, stream=r)) for r in range(ranks)]

    def _accumulate(self, x: torch.Tensor, y: torch.Tensor, micro: int) -> torch.Tensor:
        """Forward and backward over the batch in pieces of ``micro`` sequences (`trainer.micro_batch_size`).

        Each piece's mean loss is divided by the number of pieces (all the same size), so the gradients
        they add up to are the whole batch's mean gradient (up to summation order) and the returned
        (detached) loss is the batch's mean loss. In a local group only the last backward all-reduces.
        """
        pieces = list(zip(x.split(micro), y.split(micro), strict=True))
        total = torch.zeros((), device=self.device)
        for i, (x_piece, y_piece) in enumerate(pieces):
            last = i == len(pieces) - 1
            with contextlib.nullcontext() if self._ddp is None or last else self._ddp.no_sync():
                loss = self._loss(self._train_model, x_piece, y_piece) / len(pieces)
                loss.backward()
            total += loss.detach()
        return total

    def follow_step(self, step: int, data_position: int, windows: torch.Tensor) -> None:
        """A rank > 0 of a local group takes the step rank 0 announced (same lr) on the windows it sent."""
        self.step, self.data_position = step, data_position
        self._one_step(windows)

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
            losses = [self._loss(self.model, x, y) for x, y in self.eval_set]
            return torch.stack(losses).mean().item()
        finally:
            self.model.train()

    # ------------------------------------------------------------ parameter exchange

    def working_params_fp32(self) -> list[torch.Tensor]:
        """CPU fp32 copies of ``params()``, safe to keep while training continues."""
        if self.device.type != "cuda":
            return [p.detach().to("cpu", torch.float32, copy=True) for p in self._params]
        # Into pinned host memory (torch caches those blocks after the first round), as DMA copies
        # queued back to back, with one wait at the end rather than one stall per tensor.
        copies = [torch.empty(p.shape, dtype=torch.float32, pin_memory=True) for p in self._params]
        for copy, param in zip(copies, self._params, strict=True):
            copy.copy_(param.detach(), non_blocking=True)
        torch.cuda.current_stream(self.device).synchronize()
        return copies

    def load_params(self, tensors: Sequence[torch.Tensor]) -> None:
        """Overwrite the parameters in place (optimizer state is kept, as DiLoCo prescribes)."""
        if len(tensors) != len(self._params):
            raise ValueError(f"expected {len(self._params)} tensors, got {len(tensors)}")
        for i, (param, tensor) in enumerate(zip(self._params, tensors, strict=True)):
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"tensor {i} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        with torch.no_grad():
            for param, tensor in zip(self._params, tensors, strict=True):
                # Asynchronous from pinned memory (θ_global is pinned on CUDA, see OuterOptimizer.pin_memory)
                param.copy_(tensor, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the caller may change `tensors` next
        if self._followers is not None:
            self._followers.after_load()

    # ------------------------------------------------------------ checkpointing

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume with the same next batch, lr and optimizer moments.

        All tensors are fresh CPU copies: the result can be saved while training continues.
        """
        return {
            "version": _STATE_VERSION,
            # parameters only: a transformers model's state_dict also names a tied head and buffers
            "model": _to_cpu_copy(dict(self.model.named_parameters())),
            "optimizer": _to_cpu_copy(self.optimizer.state_dict()),
            "optimizer_kind": self.cfg.optimizer,
            "step": self.step,
            "data_position": self.data_position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()``; raises ValueError if it does not fit this trainer."""
        self._check_state(state)
        # Keep this trainer's hyper-parameters (current config, fused flag for this device) and take
        # only the per-parameter moments; checked before anything is loaded, so a bad state changes nothing.
        optimizer_state = with_saved_moments(self.optimizer, state["optimizer"])
        model_state = state["model"]
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                param.copy_(model_state[name])
        # Cloned, so that training afterwards never mutates the caller's dict (load aliases tensors).
        self.optimizer.load_state_dict(_to_cpu_copy(optimizer_state))
        self.step = int(state["step"])
        self.data_position = int(state["data_position"])
        if self._followers is not None:
            self._followers.after_restore()

    def _check_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict):
            raise ValueError(f"trainer state must be a dict, got {type(state).__name__}")
        missing = [k for k in ("model", "optimizer", "step", "data_position") if k not in state]
        if missing:
            raise ValueError(f"trainer state is missing {', '.join(missing)}")
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"trainer state has version {state.get('version')!r}, expected {_STATE_VERSION}")
        kind = state.get("optimizer_kind", "adamw")  # states written before `trainer.optimizer` hold AdamW
        if kind != self.cfg.optimizer:
            raise ValueError(
                f"trainer state holds {kind!r} optimizer moments, but trainer.optimizer is {self.cfg.optimizer!r}"
            )
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
