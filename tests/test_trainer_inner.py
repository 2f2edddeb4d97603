"""Tests for dilocod.trainer.inner: the schedule, the inner loop and checkpoint round-trips."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch

from dilocod.trainer.batches import Corpus, DataConfig
from dilocod.trainer.inner import InnerTrainer
from dilocod.trainer.model import ModelConfig
from dilocod.trainer.optim import MuonWithAdamW
from dilocod.trainer.settings import TrainerConfig, lr_at, resolve_device

TEXT = b"the quick brown fox jumps over the lazy dog. " * 400
# AdamW unless a test says Muon (MUON below): the tolerances and states here are AdamW's
CFG = TrainerConfig(
    batch_size=4, seq_len=64, lr=3e-3, warmup_steps=5, total_steps=1000, device="cpu", optimizer="adamw"
)


def repetitive_corpus() -> Corpus:
    tokens = torch.frombuffer(bytearray(TEXT), dtype=torch.uint8)
    return Corpus(train=tokens, eval=tokens[:2000].clone(), name="fox")


def make_trainer(cfg: TrainerConfig = CFG, peer_key: str = "peer-a") -> InnerTrainer:
    return InnerTrainer(
        ModelConfig("tiny"), DataConfig(), cfg, seed=0, peer_key=peer_key, corpus=repetitive_corpus()
    )


# ---------------------------------------------------------------- config


def test_defaults_validate() -> None:
    TrainerConfig().validate()


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"inner_steps": 0}, "inner_steps"),
        ({"batch_size": 0}, "batch_size"),
        ({"seq_len": 1}, "seq_len"),
        ({"lr": 0.0}, "lr"),
        ({"lr": math.nan}, "lr"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"total_steps": 0}, "total_steps"),
        ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
        ({"grad_clip": -0.1}, "grad_clip"),
        ({"eval_every": 0}, "eval_every"),
        ({"eval_batches": 0}, "eval_batches"),
        ({"device": "tpu"}, "device"),
        ({"device": "cuda:x"}, "device"),
        ({"threads": -2}, "threads"),
        ({"optimizer": "sgd"}, "optimizer"),
        ({"optimizer": "Muon"}, "optimizer"),
        ({"muon_lr_ratio": 0.0}, "muon_lr_ratio"),
        ({"muon_lr_ratio": math.inf}, "muon_lr_ratio"),
    ],
)
def test_validate_names_the_key(change: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=rf"^trainer\.{key} must be"):
        replace(TrainerConfig(), **change).validate()


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda:0")


def test_seq_len_beyond_model_rejected() -> None:
    with pytest.raises(ValueError, match="trainer.seq_len must be <= 256"):
        make_trainer(replace(CFG, seq_len=512))


# ---------------------------------------------------------------- schedule


def test_lr_schedule() -> None:
    cfg = TrainerConfig(lr=1e-3, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(4, cfg) == pytest.approx(5e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)  # warmup reaches the peak on its last step
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx(1e-4 + 0.5 * 9e-4)  # halfway through the cosine
    assert lr_at(110, cfg) == pytest.approx(1e-4)
    assert lr_at(10_000, cfg) == pytest.approx(1e-4)
    lrs = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_lr_without_warmup() -> None:
    cfg = TrainerConfig(lr=2e-3, warmup_steps=0, total_steps=100, min_lr_ratio=0.0)
    assert lr_at(0, cfg) == pytest.approx(2e-3)
    assert lr_at(100, cfg) == pytest.approx(0.0)


# ---------------------------------------------------------------- training


def test_loss_falls() -> None:
    trainer = make_trainer()
    before = trainer.evaluate()
    seen: list[tuple[int, float]] = []
    stats = trainer.train_steps(30, on_step=lambda step, loss: seen.append((step, loss)))
    after = trainer.evaluate()
    assert stats.steps == 30 and trainer.step == 30 and trainer.data_position == 30
    assert stats.tokens == 30 * 4 * 64 == 30 * trainer.tokens_per_step
    assert [s for s, _ in seen] == list(range(1, 31))
    assert stats.mean_loss == pytest.approx(sum(loss for _, loss in seen) / 30, rel=1e-5)
    assert sum(loss for _, loss in seen[-5:]) / 5 < seen[0][1] - 1.0
    assert after < before - 1.0
    assert trainer.model.training


def test_should_stop_stops_early() -> None:
    trainer = make_trainer()
    calls = 0

    def stop_after_two() -> bool:
        nonlocal calls
        calls += 1
        return calls > 2

    stats = trainer.train_steps(10, should_stop=stop_after_two)
    assert stats.steps == 2 and trainer.step == 2
    empty = trainer.train_steps(5, should_stop=lambda: True)
    assert empty.steps == 0 and math.isnan(empty.mean_loss) and empty.tokens == 0
    assert trainer.step == 2


def test_params_order_and_exchange() -> None:
    trainer = make_trainer()
    names = list(trainer.model.state_dict())
    named = dict(trainer.model.named_parameters())
    assert [id(p) for p in trainer.params()] == [id(named[n]) for n in names]
    snapshot = trainer.working_params_fp32()
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in snapshot)
    trainer.train_steps(2)
    assert not torch.equal(snapshot[0], trainer.params()[0].detach())  # a copy, not a view
    trainer.load_params(snapshot)
    for p, t in zip(trainer.params(), snapshot, strict=True):
        assert torch.equal(p.detach(), t)
    with pytest.raises(ValueError, match="shape"):
        trainer.load_params([torch.zeros(3)] + snapshot[1:])
    with pytest.raises(ValueError, match="expected"):
        trainer.load_params(snapshot[:-1])


def test_same_seed_peers_start_identical_but_see_different_data() -> None:
    a, b = make_trainer(peer_key="a"), make_trainer(peer_key="b")
    for pa, pb in zip(a.params(), b.params(), strict=True):
        assert torch.equal(pa, pb)
    assert not torch.equal(a.sampler.batch(0)[0], b.sampler.batch(0)[0])


def test_state_dict_round_trip_is_bit_identical() -> None:
    original = make_trainer()
    original.train_steps(3)
    saved = original.state_dict()
    original.train_steps(2)

    resumed = make_trainer()
    resumed.load_state_dict(saved)
    assert resumed.step == 3 and resumed.data_position == 3
    resumed.train_steps(2)
    for p_orig, p_res in zip(original.params(), resumed.params(), strict=True):
        assert torch.equal(p_orig, p_res)
    # The saved state is a snapshot: training after saving or loading did not alter it.
    again = make_trainer()
    again.load_state_dict(saved)
    assert again.step == 3
    assert torch.equal(again.params()[0], saved["model"][next(iter(saved["model"]))])


def test_load_state_dict_rejects_mismatch() -> None:
    trainer = make_trainer()
    state = trainer.state_dict()
    with pytest.raises(ValueError, match="missing data_position"):
        trainer.load_state_dict({k: v for k, v in state.items() if k != "data_position"})
    wrong_shape = dict(state, model=dict(state["model"], **{"embed.weight": torch.zeros(256, 64)}))
    with pytest.raises(ValueError, match=r"embed\.weight has shape"):
        trainer.load_state_dict(wrong_shape)
    extra = dict(state, model=dict(state["model"], extra=torch.zeros(1)))
    with pytest.raises(ValueError, match="different model"):
        trainer.load_state_dict(extra)
    with pytest.raises(ValueError, match="version"):
        trainer.load_state_dict(dict(state, version=99))


# ---------------------------------------------------------------- Muon (trainer.optimizer = "muon")

MUON = replace(CFG, optimizer="muon", muon_lr_ratio=0.5)


def test_muon_takes_the_blocks_matrices_and_adamw_the_rest() -> None:
    trainer = make_trainer(MUON)
    assert isinstance(trainer.optimizer, MuonWithAdamW)
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    muon, adamw = trainer.optimizer.parts["muon"], trainer.optimizer.parts["adamw"]
    on_muon = {names[id(p)] for g in muon.param_groups for p in g["params"]}
    on_adamw = {names[id(p)] for g in adamw.param_groups for p in g["params"]}
    assert on_muon.isdisjoint(on_adamw) and on_muon | on_adamw == set(names.values())
    assert len(on_muon) == 4 * 5  # tiny: 4 blocks × (qkv, out, gate, up, down)
    assert all(n.startswith("blocks.") and n.endswith(".weight") and "norm" not in n for n in on_muon)
    assert {"embed.weight", "head.weight", "norm.weight"} <= on_adamw
    # One schedule for both; Muon's lr is scaled by muon_lr_ratio.
    trainer.train_steps(1)
    expected = lr_at(0, MUON)
    assert [g["lr"] for g in muon.param_groups] == [pytest.approx(0.5 * expected)]
    assert all(g["lr"] == pytest.approx(expected) for g in adamw.param_groups)


def test_muon_loss_falls() -> None:
    trainer = make_trainer(MUON)
    before = trainer.evaluate()
    seen: list[float] = []
    trainer.train_steps(30, on_step=lambda step, loss: seen.append(loss))
    assert sum(seen[-5:]) / 5 < seen[0] - 1.0
    assert trainer.evaluate() < before - 1.0


def test_muon_state_round_trip_resumes_identically() -> None:
    original = make_trainer(MUON)
    original.train_steps(3)
    saved = original.state_dict()
    assert saved["optimizer_kind"] == "muon" and set(saved["optimizer"]) == {"muon", "adamw"}
    assert saved["optimizer"]["muon"]["state"]  # Muon's momentum buffers are saved
    original.train_steps(2)

    resumed = make_trainer(MUON)
    resumed.load_state_dict(saved)
    resumed.train_steps(2)
    for p_orig, p_res in zip(original.params(), resumed.params(), strict=True):
        assert torch.equal(p_orig, p_res)


def test_muon_state_is_validated() -> None:
    source = make_trainer(MUON)
    source.train_steps(1)
    state = source.state_dict()
    trainer = make_trainer(MUON)
    fresh = [p.detach().clone() for p in trainer.params()]
    adamw_state = make_trainer().state_dict()
    with pytest.raises(ValueError, match="'adamw' optimizer moments, but trainer.optimizer is 'muon'"):
        trainer.load_state_dict(adamw_state)
    with pytest.raises(ValueError, match="'muon' optimizer moments, but trainer.optimizer is 'adamw'"):
        make_trainer().load_state_dict(state)
    for bad in (
        {"muon": state["optimizer"]["muon"]},  # a part missing
        {**state["optimizer"], "muon": {"state": {}}},  # a part without its groups
        {**state["optimizer"], "adamw": state["optimizer"]["muon"]},  # another optimizer's groups
    ):
        with pytest.raises(ValueError, match="optimizer"):
            trainer.load_state_dict(dict(state, optimizer=bad))
    # Nothing was half-loaded: the parameters are checked together with the optimizer, then loaded.
    assert trainer.step == 0
    assert all(torch.equal(p, f) for p, f in zip(trainer.params(), fresh, strict=True))
