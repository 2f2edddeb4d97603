"""Unit tests of the trainer's device options (no process is started here): `trainer.devices` and its
resolution (CUDA paths with a faked torch.cuda), activation checkpointing, torch.compile, per-rank
data streams, MFU, and the `--devices` flag. The local group itself: tests/test_local_group.py."""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from dilocod.cli import _parser
from dilocod.commands.join import join_overrides
from dilocod.config import ConfigError, load_config
from dilocod.observability.metrics import Metrics
from dilocod.observability.peerstate import PeerState
from dilocod.trainer import settings
from dilocod.trainer.batches import Corpus, DataConfig, ShardSampler
from dilocod.trainer.inner import InnerTrainer
from dilocod.trainer.model import ModelConfig
from dilocod.trainer.settings import TrainerConfig, checkpointing_enabled, resolve_devices

TEXT = b"the quick brown fox jumps over the lazy dog. " * 400
# AdamW: the equality tolerances here follow its update's arithmetic (see test_compile_trains_like_eager)
CFG = TrainerConfig(batch_size=2, seq_len=32, warmup_steps=2, device="cpu", threads=1, optimizer="adamw")


def corpus() -> Corpus:
    tokens = torch.frombuffer(bytearray(TEXT), dtype=torch.uint8)
    return Corpus(train=tokens, eval=tokens[:2000].clone(), name="fox")


def make_trainer(cfg: TrainerConfig = CFG, rank: int = 0) -> InnerTrainer:
    return InnerTrainer(
        ModelConfig("tiny"), DataConfig(), cfg, seed=0, peer_key="k", corpus=corpus(), rank=rank
    )


@pytest.fixture(autouse=True)
def _keep_threads() -> Any:
    threads = torch.get_num_threads()  # trainers set the process-wide thread count
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"devices": 0}, "devices"),
        ({"devices": -2}, "devices"),
        ({"devices": "two"}, "devices"),
        ({"devices": "2"}, "devices"),
        ({"devices": True}, "devices"),
        ({"activation_checkpointing": "yes"}, "activation_checkpointing"),
        ({"peak_flops": 0.0}, "peak_flops"),
        ({"peak_flops": math.inf}, "peak_flops"),
        ({"peak_flops": math.nan}, "peak_flops"),
    ],
)
def test_validate_names_the_key(change: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=rf"^trainer\.{key} must be"):
        replace(TrainerConfig(), **change).validate()


def test_defaults() -> None:
    cfg = TrainerConfig()
    assert (cfg.devices, cfg.compile, cfg.activation_checkpointing, cfg.peak_flops) == (
        1,
        False,
        "auto",
        None,
    )


def test_devices_from_toml_and_set(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        "[trainer]\ndevices = 2\nactivation_checkpointing = false\npeak_flops = 1e12\ncompile = true\n"
    )
    cfg = load_config(path).trainer
    assert (cfg.devices, cfg.activation_checkpointing, cfg.peak_flops, cfg.compile) == (2, False, 1e12, True)
    path.write_text('[trainer]\ndevices = "auto"\nactivation_checkpointing = "auto"\n')
    assert load_config(path).trainer.devices == "auto"
    assert load_config(None, ["trainer.devices=2"]).trainer.devices == 2
    assert load_config(None, ["trainer.devices=auto"]).trainer.devices == "auto"
    assert (
        load_config(None, ["trainer.activation_checkpointing=true"]).trainer.activation_checkpointing is True
    )


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (["trainer.devices=0"], "trainer.devices must be an integer >= 1 or 'auto', got 0"),
        (["trainer.devices=1.5"], "trainer.devices must be an integer >= 1 or 'auto', got '1.5'"),
        (["trainer.compile=maybe"], "config key 'trainer.compile' must be true or false, got 'maybe'"),
        (["trainer.activation_checkpointing=on"], "trainer.activation_checkpointing must be true, false"),
    ],
)
def test_bad_values_are_one_line(items: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, items)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_devices_of_the_wrong_type_in_a_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[trainer]\ndevices = [1]\n")
    with pytest.raises(
        ConfigError, match=r"^config key 'trainer.devices' must be an integer or a string, got \[1\]$"
    ):
        load_config(path)


def _join_args(*argv: str) -> argparse.Namespace:
    return _parser().parse_args(["join", *argv])


def test_devices_flag_becomes_the_config_key() -> None:
    assert "trainer.devices=2" in join_overrides(_join_args("--devices", "2"))
    assert load_config(None, join_overrides(_join_args("--devices", "auto"))).trainer.devices == "auto"
    assert not any(o.startswith("trainer.devices") for o in join_overrides(_join_args()))
    # the flag wins over --set, as --host and --port do
    args = _join_args("--set", "trainer.devices=3", "--devices", "2")
    assert load_config(None, join_overrides(args)).trainer.devices == 2


# ---------------------------------------------------------------- which devices


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_cpu_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settings.os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    cpu = torch.device("cpu")
    assert resolve_devices(replace(CFG, devices=1)) == [cpu]
    assert resolve_devices(replace(CFG, devices="auto")) == [cpu]  # auto on CPU: one
    assert resolve_devices(replace(CFG, devices=4)) == [cpu] * 4
    with pytest.raises(ValueError, match="trainer.devices is 5 on CPU but this machine has 4 core"):
        resolve_devices(replace(CFG, devices=5))


def test_cuda_devices_are_picked_by_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cuda(monkeypatch, 4)
    gpus = [torch.device("cuda", i) for i in range(4)]
    assert resolve_devices(TrainerConfig(device="cuda", devices="auto")) == gpus
    assert resolve_devices(TrainerConfig(device="auto", devices="auto")) == gpus
    assert resolve_devices(TrainerConfig(device="auto", devices=2)) == gpus[:2]
    assert resolve_devices(TrainerConfig(device="cuda:1", devices=2)) == gpus[1:3]
    assert resolve_devices(TrainerConfig(device="cuda:2", devices="auto")) == gpus[2:]
    with pytest.raises(ValueError, match="trainer.devices is 4 but only 3 GPU"):
        resolve_devices(TrainerConfig(device="cuda:1", devices=4))


def test_cuda_requested_without_cuda_is_an_error() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; CI (no GPU) always runs this test")
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_devices(TrainerConfig(device="cuda", devices=2))


def test_activation_checkpointing_auto_follows_preset_and_device() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    auto = TrainerConfig()
    assert checkpointing_enabled(auto, "1b", cuda) and checkpointing_enabled(auto, "124m", cuda)
    assert not checkpointing_enabled(auto, "small", cuda) and not checkpointing_enabled(auto, "tiny", cuda)
    assert not checkpointing_enabled(auto, "1b", cpu)
    assert checkpointing_enabled(replace(auto, activation_checkpointing=True), "tiny", cpu)
    assert not checkpointing_enabled(replace(auto, activation_checkpointing=False), "1b", cuda)


def test_cpu_ranks_split_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settings.os, "sched_getaffinity", lambda _pid: set(range(8)))
    cpu = torch.device("cpu")
    assert settings.cpu_threads(TrainerConfig(threads=0), cpu, 2) == 4
    assert settings.cpu_threads(TrainerConfig(threads=0), cpu, 1) == 0  # torch's default
    assert settings.cpu_threads(TrainerConfig(threads=3), cpu, 2) == 3  # an explicit value wins
    assert settings.cpu_threads(TrainerConfig(threads=0), torch.device("cuda", 0), 2) == 0


# ---------------------------------------------------------------- training paths on CPU


def test_activation_checkpointing_gives_the_same_losses_and_parameters() -> None:
    plain = make_trainer(replace(CFG, activation_checkpointing=False))
    checkpointed = make_trainer(replace(CFG, activation_checkpointing=True))
    assert checkpointed.model.activation_checkpointing and not plain.model.activation_checkpointing
    for _ in range(3):
        a, b = plain.train_steps(1), checkpointed.train_steps(1)
        assert a.mean_loss == pytest.approx(b.mean_loss, rel=1e-6)
    for p, q in zip(plain.params(), checkpointed.params(), strict=True):
        torch.testing.assert_close(p, q)


def test_compile_trains_like_eager() -> None:
    """torch.compile (inductor) on the tiny model, CPU: ~10-45 s, mostly the first compilation."""
    eager = make_trainer()
    compiled = make_trainer(replace(CFG, compile=True))
    assert compiled._train_model is not compiled.model  # the compiled wrapper runs the steps
    a, b = eager.train_steps(3), compiled.train_steps(3)
    assert b.steps == 3 and math.isfinite(b.mean_loss)
    assert a.mean_loss == pytest.approx(b.mean_loss, rel=1e-4)
    for p, q in zip(eager.params(), compiled.params(), strict=True):
        # AdamW divides by √v: a last-bit difference in a near-zero gradient moves a weight by ~lr·1e-2
        torch.testing.assert_close(p, q, rtol=1e-3, atol=1e-4)
    # evaluation and checkpoints use the plain module: same names, no `_orig_mod.` prefix
    assert set(compiled.state_dict()["model"]) == set(eager.state_dict()["model"])
    assert math.isfinite(compiled.evaluate())


def test_rank_streams_share_the_shard_and_differ_in_windows() -> None:
    tokens = torch.arange(100_000, dtype=torch.int64).remainder(251).to(torch.uint8)
    kwargs: dict[str, Any] = {"seed": 1, "peer_key": "p", "num_shards": 4, "batch_size": 3, "seq_len": 16}
    legacy, zero, one = (
        ShardSampler(tokens, **kwargs),
        ShardSampler(tokens, **kwargs, stream=0),
        ShardSampler(tokens, **kwargs, stream=1),
    )
    assert zero.shard_index == one.shard_index == legacy.shard_index
    assert torch.equal(zero.batch(7)[0], legacy.batch(7)[0])  # rank 0 reads what a one-device peer reads
    assert not torch.equal(one.batch(7)[0], zero.batch(7)[0])


def test_rank_one_trainer_reads_stream_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settings.os, "sched_getaffinity", lambda _pid: {0, 1})
    rank1 = make_trainer(replace(CFG, devices=2), rank=1)
    assert rank1.sampler.stream == 1 and rank1.world_size == 1  # no group joined: trains alone
    assert rank1.tokens_per_step == CFG.batch_size * CFG.seq_len
    with pytest.raises(ValueError, match="rank 2 is outside"):
        make_trainer(replace(CFG, devices=2), rank=2)


def test_working_copies_on_cpu_are_plain_and_independent() -> None:
    trainer = make_trainer()
    copies = trainer.working_params_fp32()
    assert not any(c.is_pinned() for c in copies)
    before = copies[0].clone()
    trainer.train_steps(1)
    assert torch.equal(copies[0], before)


# ---------------------------------------------------------------- MFU


def test_mfu_is_unknown_on_cpu_unless_overridden() -> None:
    trainer = make_trainer()
    assert trainer.peak_flops is None and trainer.mfu(10_000.0) is None
    overridden = make_trainer(replace(CFG, peak_flops=1e12))
    assert overridden.flops_per_token == 6 * (918_656 - 256 * 128) + 12 * 4 * 128 * 32
    assert overridden.mfu(10_000.0) == pytest.approx(10_000.0 * overridden.flops_per_token / 1e12)
    overridden.world_size = 2  # a node of two devices has twice the peak (set by join_local_group)
    assert overridden.peak_flops == 2e12


def test_mfu_in_status_and_metrics() -> None:
    state = PeerState()
    assert state.status()["mfu"] is None and state.status()["devices"] == 1
    metrics = Metrics()
    assert "dilocod_mfu NaN" in metrics.render().decode()
    metrics.mfu.set(0.41)
    assert "dilocod_mfu 0.41" in metrics.render().decode()
