"""The local data-parallel group (dilocod.trainer.localgroup) on CPU: rank 0 in this process, rank 1 a real
worker process, gloo between them. Starts processes, so it is marked `integration`."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dilocod.data.cursor import ChunkCursor
from dilocod.data.localcopy import open_corpus, open_dataset
from dilocod.data.schedule import Grant
from dilocod.node.shardfetch import LazyShards
from dilocod.observability.peerstate import ShardProgress
from dilocod.trainer import DataConfig, InnerTrainer, LocalGroup, LocalGroupError, ModelConfig, TrainerConfig
from dilocod.trainer.batches import PresentSampler, ShardSampler
from dilocod.trainer.localgroup import params_sha256

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parent.parent
TEXT = b"the quick brown fox jumps over the lazy dog. " * 400
# AdamW: a local group's parameters are checked against one process's to AdamW's rounding (Muon's
# orthogonalisation spreads a last-bit gradient difference further)
CFG = TrainerConfig(batch_size=4, seq_len=32, warmup_steps=2, device="cpu", devices=2, optimizer="adamw")


@pytest.fixture
def data(tmp_path: Path) -> DataConfig:
    path = tmp_path / "corpus.txt"  # a file, not an in-memory corpus: the worker loads it too
    path.write_bytes(TEXT)
    return DataConfig(source=str(path))


def make_trainer(data: DataConfig, cfg: TrainerConfig = CFG) -> InnerTrainer:
    return InnerTrainer(ModelConfig("tiny"), data, cfg, seed=0, peer_key="node")


@pytest.fixture
def start_group() -> Iterator[Callable[[InnerTrainer], LocalGroup]]:
    threads = torch.get_num_threads()
    made: list[LocalGroup] = []

    def start(trainer: InnerTrainer) -> LocalGroup:
        group = LocalGroup(trainer)
        made.append(group)
        group.start(timeout=120)
        return group

    yield start
    for group in made:
        group.stop()
    torch.set_num_threads(threads)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited


class BothStreams:
    """Rank 0's and rank 1's batches as one batch of twice the size: what the group trains on per step."""

    def __init__(self, first: ShardSampler, second: ShardSampler) -> None:
        self.first, self.second = first, second

    def batch(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        (x0, y0), (x1, y1) = self.first.batch(position), self.second.batch(position)
        return torch.cat([x0, x1]), torch.cat([y0, y1])


def both_ranks_in_one(data: DataConfig) -> InnerTrainer:
    """The reference: one process, one batch holding both ranks' windows (equal halves, so its mean loss
    and gradient are the mean of the two ranks')."""
    ref = make_trainer(data, replace(CFG, devices=1))
    s = ref.sampler
    other = ShardSampler(
        ref.corpus.train, seed=0, peer_key="node", num_shards=s.num_shards, batch_size=s.batch_size,
        seq_len=s.seq_len, stream=1,
    )  # fmt: skip
    ref.sampler = BothStreams(ref.sampler, other)  # type: ignore[assignment]
    return ref


def assert_ranks_follow_one_process(
    trainer: InnerTrainer, group: LocalGroup, ref: InnerTrainer, steps: int
) -> None:
    """`steps` inner steps of the 2-rank node: the ranks stay identical, and the node's tokens, loss and
    parameters are those of one process training on both ranks' data (`ref`)."""
    for _ in range(steps):
        stats = trainer.train_steps(1)
        assert stats.tokens == 2 * CFG.batch_size * CFG.seq_len
        digests = group.digests()
        assert digests[0] == digests[1] == params_sha256(trainer), "ranks diverged after an inner step"
        assert stats.mean_loss == pytest.approx(ref.train_steps(1).mean_loss, rel=1e-5)
    for mine, theirs in zip(trainer.params(), ref.params(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-3, atol=1e-4)


def test_two_ranks_stay_identical_and_train_on_both_batches(
    data: DataConfig, start_group: Callable[[InnerTrainer], LocalGroup]
) -> None:
    trainer = make_trainer(data)
    group = start_group(trainer)
    assert trainer.world_size == 2 and len(group.pids) == 1
    assert trainer.tokens_per_step == 2 * CFG.batch_size * CFG.seq_len

    assert_ranks_follow_one_process(trainer, group, both_ranks_in_one(data), steps=4)


def test_micro_batches_in_a_local_group(
    data: DataConfig, start_group: Callable[[InnerTrainer], LocalGroup]
) -> None:
    """trainer.micro_batch_size with 2 ranks: each rank accumulates its batch in pieces, the gradients are
    averaged once (the last piece's backward) and the step is the whole node batch's step."""
    trainer = make_trainer(data, replace(CFG, micro_batch_size=CFG.batch_size // 2))  # the worker's too
    group = start_group(trainer)
    assert_ranks_follow_one_process(trainer, group, both_ranks_in_one(data), steps=3)


def leased(trainer: InnerTrainer, *grants: Grant) -> ChunkCursor:
    cursor = ChunkCursor(CFG.seq_len, seed="ds")
    cursor.adopt(list(grants))
    trainer.cursor = cursor
    return cursor


def test_a_scheduled_node_trains_its_leases_on_every_rank(
    data: DataConfig, start_group: Callable[[InnerTrainer], LocalGroup]
) -> None:
    """With the run's chunk schedule, the node's whole batch comes from its leases: rank 0 takes twice a
    rank's windows and sends rank 1 its half, so the node trains what one process would on the same
    leases with a batch of twice the size, and the parts its tickets name cover every token both ranks
    trained."""
    chunks = (Grant(0, 0, 0, 4096, 0), Grant(0, 1, 4096, 4096, 0))
    trainer = make_trainer(data)
    group = start_group(trainer)
    cursor = leased(trainer, *chunks)
    ref = make_trainer(data, replace(CFG, devices=1, batch_size=2 * CFG.batch_size))
    ref_cursor = leased(ref, *chunks)
    steps = 5
    assert_ranks_follow_one_process(trainer, group, ref, steps=steps)
    assert trainer.unscheduled_batches == ref.unscheduled_batches == 0
    assert cursor.windows_taken == ref_cursor.windows_taken == steps * 2 * CFG.batch_size
    parts = cursor.drain()
    assert parts == ref_cursor.drain()
    assert sum(p.hi - p.lo for p in parts) == steps * trainer.tokens_per_step


def test_a_worker_of_a_joiner_with_a_partial_copy_trains_on_what_rank_0_sends(
    partial_dataset: Path, start_group: Callable[[InnerTrainer], LocalGroup]
) -> None:
    """A joiner's copy lacks training shards it has not needed yet: the worker still starts (it reads no
    training shard), trains the scheduled windows rank 0 sends, and, once the leases run dry, the
    random windows rank 0 draws for it from the shards this machine holds."""
    out = partial_dataset
    data = DataConfig(path=str(out))
    lazy = LazyShards(out, open_dataset(out, partial=True), ShardProgress())
    trainer = InnerTrainer(
        ModelConfig("tiny"), data, CFG, seed=0, peer_key="node", corpus=open_corpus(data, partial=True)
    )
    trainer.sampler = PresentSampler(
        trainer.train_source, lazy.present_ranges, seed=0, peer_key="node",
        batch_size=CFG.batch_size, seq_len=CFG.seq_len,
    )  # fmt: skip
    group = start_group(trainer)
    leased(trainer, Grant(0, 0, 0, 512, 0))  # 15 windows: one node step, then none
    for _ in range(3):
        assert math.isfinite(trainer.train_steps(1).mean_loss)
        assert len(set(group.digests())) == 1, "ranks diverged after an inner step"
    assert trainer.unscheduled_batches == 2
    assert group.pids and all(alive(pid) for pid in group.pids)


def test_loaded_and_restored_state_reaches_every_rank(
    data: DataConfig, start_group: Callable[[InnerTrainer], LocalGroup]
) -> None:
    trainer = make_trainer(data)
    group = start_group(trainer)
    trainer.train_steps(2)
    early = trainer.state_dict()
    trainer.train_steps(2)

    # After an outer round: θ_global replaces the working copy on every rank.
    theta = [p + 0.01 for p in trainer.working_params_fp32()]
    trainer.load_params(theta)
    assert set(group.digests()) == {params_sha256(trainer)}

    # A restore rolls the optimizer moments back too: the worker must get them, or the next update differs.
    trainer.load_state_dict(early)
    assert trainer.step == 2
    for _ in range(2):
        trainer.train_steps(1)
        assert len(set(group.digests())) == 1, "ranks diverged after a restore"


def test_group_started_after_a_resume_hands_over_the_optimizer_state(
    data: DataConfig, start_group: Callable[[InnerTrainer], LocalGroup]
) -> None:
    solo = make_trainer(data)
    solo.train_steps(3)  # moments and step count the worker cannot know
    resumed = make_trainer(data)
    resumed.load_state_dict(solo.state_dict())
    group = start_group(resumed)
    for _ in range(2):
        resumed.train_steps(1)
        assert len(set(group.digests())) == 1


def test_a_dead_worker_is_reported_and_stop_still_cleans_up(
    data: DataConfig, start_group: Callable[[InnerTrainer], LocalGroup]
) -> None:
    trainer = make_trainer(data)
    group = start_group(trainer)
    trainer.train_steps(1)
    worker = group.procs[0]
    worker.kill()
    worker.wait(timeout=10)
    with pytest.raises(LocalGroupError, match="local worker 1 .* exited"):
        trainer.train_steps(1)
    group.stop()
    assert trainer.world_size == 1  # back to training alone


def test_stop_ends_the_workers(data: DataConfig, start_group: Callable[[InnerTrainer], LocalGroup]) -> None:
    trainer = make_trainer(data)
    group = start_group(trainer)
    trainer.train_steps(1)
    pid = group.pids[0]
    group.stop()
    assert group.procs[0].returncode == 0
    assert not alive(pid)


PARENT = textwrap.dedent(
    """
    import sys, time
    from dilocod.trainer import DataConfig, InnerTrainer, LocalGroup, ModelConfig, TrainerConfig
    cfg = TrainerConfig(batch_size=2, seq_len=32, device="cpu", devices=2)
    trainer = InnerTrainer(ModelConfig("tiny"), DataConfig(source=sys.argv[1]), cfg, seed=0, peer_key="x")
    group = LocalGroup(trainer)
    group.start(timeout=120)
    trainer.train_steps(1)
    print(group.pids[0], flush=True)
    time.sleep(120)
    """
)


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_workers_exit_when_the_node_dies(data: DataConfig, signum: int) -> None:
    """However rank 0's process dies (here without any cleanup of its own), its worker follows it."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, data.source], cwd=REPO, stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        assert line.strip().isdigit(), f"parent printed {line!r}"
        worker = int(line)
        assert alive(worker)
        parent.send_signal(signum)  # the worker itself ignores SIGTERM; only its parent's death ends it
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(worker), "the worker outlived its node"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
