"""Several devices in one peer: a local data-parallel group of N ranks behind one DHT identity.

Rank 0 is the daemon's own `InnerTrainer` (in its trainer thread): the only rank that talks to the
swarm, holds θ_global and takes the outer step. Ranks 1..N-1 are worker processes
(`python -m dilocod.trainer.worker`) that build the same trainer from the same config and follow rank 0:

- before anything the ranks do together, rank 0 broadcasts a small command (`STEP step position`,
  `LOAD`, `SYNC`, `DIGEST`, `STOP`) over a gloo *control* group, on which a worker may wait as long as
  an outer round takes;
- each inner step, rank 0 draws the whole node's batch (from the node's chunk leases, or each rank's
  own random stream without one) and scatters each rank its windows over the control group; every
  rank runs forward and backward on its own and DDP averages the gradients (NCCL on CUDA, gloo on CPU)
  during backward, so every rank applies the same update and the parameters stay bit-identical;
- after an outer round rank 0's new parameters are broadcast (`LOAD`); at start and after a restore,
  its whole state, optimizer moments included (`SYNC`).

Workers die with the node: they stay in its process group (a group kill reaches them), ignore SIGINT
and SIGTERM (the node stops them with `STOP` at the end of its graceful shutdown, so a group-wide
Ctrl-C cannot kill a worker mid-step) and exit within a fraction of a second once their parent process
is gone, however it died.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .batches import DataConfig, load_corpus
from .inner import InnerTrainer, TrainerConfig
from .model import ModelConfig

OP_STEP, OP_LOAD, OP_SYNC, OP_DIGEST, OP_STOP = 1, 2, 3, 4, 5
WORKER_MODULE = "dilocod.trainer.worker"
START_TIMEOUT = 300.0  # a worker imports torch, loads the corpus and builds the model
STOP_TIMEOUT = 10.0
# Ranks enter every collective of the main group together, right after a command: only a dead or stuck
# rank makes another wait this long.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)
# A worker waits for the next command through a whole outer round, evaluation and checkpoint included.
CONTROL_TIMEOUT = timedelta(days=7)
PARENT_POLL_SECONDS = 0.2
EXIT_ORPHANED = 3


class LocalGroupError(RuntimeError):
    """A local worker could not start or exited."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build the same trainer as rank 0; JSON on its command line."""

    model: dict[str, Any]
    data: dict[str, Any]
    trainer: dict[str, Any]
    seed: int
    peer_key: str
    rank: int
    world_size: int
    store_port: int
    parent_pid: int

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        return cls(**json.loads(text))


class LocalGroup:
    """Rank 0's side: starts the workers, drives them through the trainer's hooks, stops them.

    Every method runs collectives, so call them from the thread that trains (the daemon's trainer thread).
    """

    def __init__(self, trainer: InnerTrainer) -> None:
        self.trainer = trainer
        self.world_size = len(trainer.devices)
        self.procs: list[subprocess.Popen[bytes]] = []
        self._store: Any = None
        self._control: Any = None
        self._running = False

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self.procs]

    def start(self, timeout: float = START_TIMEOUT) -> None:
        """Spawn ranks 1..N-1, form the group, and give every rank rank 0's state."""
        if self.world_size < 2:
            raise ValueError("a local group needs at least 2 devices")
        # Port 0: the store picks a free port itself, so two nodes on one host never race for one.
        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            self.world_size,
            is_master=True,
            wait_for_workers=False,
            timeout=COLLECTIVE_TIMEOUT,
        )
        try:
            self.procs = [self._spawn(rank) for rank in range(1, self.world_size)]
            self._wait_ready(timeout)
            self._control = _init_ranks(self._store, 0, self.world_size, self.trainer.device)
            self.trainer.join_local_group(self.world_size, self)
            _share_state(self.trainer, self._control)
        except BaseException:
            self.stop()
            raise
        self._running = True

    def _spawn(self, rank: int) -> subprocess.Popen[bytes]:
        t = self.trainer
        spec = WorkerSpec(
            model=dataclasses.asdict(t.model_cfg),
            data=dataclasses.asdict(t.data_cfg),
            trainer=dataclasses.asdict(dataclasses.replace(t.cfg, devices=self.world_size)),
            seed=t.seed,
            peer_key=t.peer_key,
            rank=rank,
            world_size=self.world_size,
            store_port=self._store.port,
            parent_pid=os.getpid(),
        )
        # No new session: the workers stay in the node's process group, so killing the group kills them.
        return subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE, spec.to_json()], stdin=subprocess.DEVNULL
        )

    def _wait_ready(self, timeout: float) -> None:
        keys = [f"ready/{rank}" for rank in range(1, self.world_size)]
        deadline = time.monotonic() + timeout
        while not self._store.check(keys):
            self._check_workers()
            if time.monotonic() > deadline:
                raise LocalGroupError(f"local workers did not start within {timeout:.0f}s")
            time.sleep(0.05)

    def _check_workers(self) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                raise LocalGroupError(f"local worker {rank} (pid {proc.pid}) exited with code {code}")

    def _command(self, op: int, a: int = 0, b: int = 0) -> None:
        if not self._running:
            raise LocalGroupError("the local group is not running")
        self._check_workers()  # a dead worker would otherwise show up as a hung or failed collective
        dist.broadcast(torch.tensor([op, a, b], dtype=torch.int64), src=0, group=self._control)

    # ---- the trainer's hooks (inner.Followers) --------------------------------------------------
    def before_step(self, step: int, data_position: int, windows: Sequence[torch.Tensor]) -> None:
        self._command(OP_STEP, step, data_position)
        # Scatter wants a slot for rank 0 as well; rank 0's own windows stay where they are.
        mine = torch.empty_like(windows[0])
        dist.scatter(mine, [mine, *windows], src=0, group=self._control)

    def after_load(self) -> None:
        self._command(OP_LOAD)
        _broadcast_params(self.trainer)

    def after_restore(self) -> None:
        self._command(OP_SYNC)
        _share_state(self.trainer, self._control)

    # ---- checks and shutdown ----------------------------------------------------------------------
    def digests(self) -> list[str]:
        """sha256 of every rank's parameters, rank order (all equal while the group is healthy)."""
        self._command(OP_DIGEST)
        return _gather_digests(self.trainer, self._control)

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Tell the workers to exit, reap them (killing any that do not go), and leave the group."""
        if self._running:
            self._running = False
            with contextlib.suppress(Exception):  # a worker that is already gone cannot be told
                self._check_workers()
                dist.broadcast(torch.tensor([OP_STOP, 0, 0], dtype=torch.int64), src=0, group=self._control)
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.trainer.leave_local_group()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        self._control = None
        self._store = None


# ---- both sides -----------------------------------------------------------------------------------
def _init_ranks(store: Any, rank: int, world_size: int, device: torch.device) -> Any:
    """Join the main group (NCCL on CUDA, gloo on CPU) and the gloo control group; returns the latter."""
    # The ranks only ever talk over loopback; gloo otherwise picks the interface the hostname resolves to.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    cuda = device.type == "cuda"
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
        device_id=device if cuda else None,
    )
    return dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)


@torch.no_grad()
def _broadcast_params(trainer: InnerTrainer) -> None:
    for param in trainer.params():
        dist.broadcast(param.data, src=0)


def _share_state(trainer: InnerTrainer, control: Any) -> None:
    """Rank 0's parameters and optimizer moments to every rank (step and data position come per step)."""
    _broadcast_params(trainer)
    rank0 = dist.get_rank() == 0
    state = _broadcast_tree(trainer.optimizer.state_dict() if rank0 else None, trainer.device, control)
    if not rank0:
        trainer.optimizer.load_state_dict(state)


@dataclass(frozen=True)
class _Slot:
    """Where a tensor sat in a broadcast structure (the tensors themselves travel separately)."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _strip(value: Any, leaves: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return _Slot(len(leaves) - 1, tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {k: _strip(v, leaves) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_strip(v, leaves) for v in value)
    return value


def _fill(value: Any, tensors: Sequence[torch.Tensor]) -> Any:
    if isinstance(value, _Slot):
        return tensors[value.index]
    if isinstance(value, dict):
        return {k: _fill(v, tensors) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_fill(v, tensors) for v in value)
    return value


def _slots(value: Any) -> list[_Slot]:
    if isinstance(value, _Slot):
        return [value]
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else ()
    return [slot for item in items for slot in _slots(item)]


def _broadcast_tree(tree: Any, device: torch.device, control: Any) -> Any:
    """Rank 0's nested dicts/lists of tensors on every rank: the structure is pickled over the control
    group, the tensors go one by one over the main group (device to device on NCCL)."""
    leaves: list[torch.Tensor] = []
    box = [_strip(tree, leaves) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=control)
    skeleton = box[0]
    received: list[torch.Tensor] = []
    for slot in sorted(_slots(skeleton), key=lambda s: s.index):
        if leaves:
            buffer = leaves[slot.index].to(device).contiguous()
        else:
            buffer = torch.empty(slot.shape, dtype=slot.dtype, device=device)
        dist.broadcast(buffer, src=0)
        received.append(buffer)
    return _fill(skeleton, received)


def params_sha256(trainer: InnerTrainer) -> str:
    digest = hashlib.sha256()
    for param in trainer.params():
        digest.update(param.detach().to("cpu", torch.float32).contiguous().view(-1).numpy().tobytes())
    return digest.hexdigest()


def _gather_digests(trainer: InnerTrainer, control: Any) -> list[str]:
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, params_sha256(trainer), group=control)
    return [str(d) for d in found]


# ---- the worker side ------------------------------------------------------------------------------
def _exit_with_parent(parent_pid: int) -> None:
    """Exit as soon as the node is gone (even SIGKILLed): our parent changes when it dies."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_SECONDS)
        os._exit(EXIT_ORPHANED)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def worker_main(argv: Sequence[str]) -> int:
    """Rank > 0: build the trainer, join the group, then follow rank 0's commands until STOP."""
    spec = WorkerSpec.from_json(argv[0])
    _exit_with_parent(spec.parent_pid)
    # The node decides when we stop (STOP, after its own graceful shutdown); a signal sent to the whole
    # process group (a terminal's Ctrl-C, a service manager's SIGTERM) must not kill us mid-step first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    data = DataConfig(**spec.data)
    trainer = InnerTrainer(
        ModelConfig(**spec.model),
        data,
        TrainerConfig(**spec.trainer),
        seed=spec.seed,
        peer_key=spec.peer_key,
        rank=spec.rank,
        # Rank 0 sends every training window: a joiner's copy may still lack most training shards.
        corpus=load_corpus(data, partial=True),
    )
    store = dist.TCPStore(
        "127.0.0.1", spec.store_port, spec.world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT
    )
    store.set(f"ready/{spec.rank}", "1")
    control = _init_ranks(store, spec.rank, spec.world_size, trainer.device)
    trainer.join_local_group(spec.world_size, None)
    try:
        _share_state(trainer, control)
        _follow(trainer, control)
    except Exception:
        if _orphaned(spec.parent_pid):  # the node died: its sockets closing is the news, not our error
            os._exit(EXIT_ORPHANED)
        raise
    dist.destroy_process_group()
    return 0


def _orphaned(parent_pid: int, wait: float = 1.0) -> bool:
    """Whether the node is gone; a dying process closes its sockets a moment before we are re-parented."""
    deadline = time.monotonic() + wait
    while os.getppid() == parent_pid:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _follow(trainer: InnerTrainer, control: Any) -> None:
    command = torch.zeros(3, dtype=torch.int64)
    while True:
        dist.broadcast(command, src=0, group=control)
        op, a, b = (int(v) for v in command.tolist())
        if op == OP_STEP:
            windows = torch.empty(trainer.cfg.batch_size, trainer.cfg.seq_len + 1, dtype=torch.int64)
            dist.scatter(windows, None, src=0, group=control)
            trainer.follow_step(a, b, windows)
        elif op == OP_LOAD:
            _broadcast_params(trainer)
        elif op == OP_SYNC:
            _share_state(trainer, control)
        elif op == OP_DIGEST:
            _gather_digests(trainer, control)
        elif op == OP_STOP:
            return
        else:
            raise LocalGroupError(f"unknown command {op} from rank 0")
