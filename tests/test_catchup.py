"""The pure parts of re-syncing: which θ hash a donor's state must have, and where in its round the run is."""

from __future__ import annotations

from typing import Any

from dilocod.catchup import expected_hash, remember_hashes, run_phase

A, B, C = "a" * 64, "b" * 64, "c" * 64


def record(peer: str, step: int, sha: str = A, **extra: Any) -> dict[str, Any]:
    return {"peer_id": peer, "outer_step": step, "global_sha256": sha, **extra}


def test_the_ledger_remembers_steps_the_run_has_left() -> None:
    seen: dict[int, dict[str, str]] = {}
    remember_hashes(seen, [record("p1", 9), record("p2", 9), record("liar", 9, B)])
    remember_hashes(seen, [record("p1", 10, C), record("p2", 10, C), record("liar", 10, C)])
    # A donor that sends step 9's state after everyone moved on is still checked against step 9.
    assert expected_hash(seen, 9, "liar") == A
    assert expected_hash(seen, 10, "p1") == C


def test_the_donor_alone_only_counts_when_nobody_else_reported_the_step() -> None:
    seen: dict[int, dict[str, str]] = {}
    remember_hashes(seen, [record("donor", 4, B), record("p1", 3)])
    assert expected_hash(seen, 4, "donor") == B
    assert expected_hash(seen, 5, "donor") is None
    remember_hashes(seen, [record("p1", 4, A), record("p2", 4, A)])
    assert expected_hash(seen, 4, "donor") == A


def test_a_peer_that_re_synced_at_a_step_counts_once_with_its_latest_hash() -> None:
    seen: dict[int, dict[str, str]] = {}
    remember_hashes(seen, [record("p1", 4, B), record("p2", 4, A), record("p3", 4, A)])
    remember_hashes(seen, [record("p1", 4, A)])
    assert seen[4] == {"p1": A, "p2": A, "p3": A}


def test_the_ledger_is_bounded() -> None:
    seen: dict[int, dict[str, str]] = {}
    for step in range(100):
        remember_hashes(seen, [record("p1", step)], keep=8)
    assert sorted(seen) == list(range(92, 100))


def status(peer: str, step: int, round_steps: int | None, age: float, tps: float = 100.0) -> dict[str, Any]:
    return record(peer, step, round_steps=round_steps, time=1000.0 - age, tokens_per_second=tps)


def phase(records: list[dict[str, Any]], step: int = 5, **kw: Any) -> int:
    args: dict[str, Any] = {"now": 1000.0, "tokens_per_step": 10, "sync_every": 20, "max_age": 2.0}
    return run_phase(records, step, **(args | kw))


def test_phase_is_the_median_place_moved_on_by_each_records_age() -> None:
    # 3 + 1 s × 100 tokens/s ÷ 10 tokens per step = 13; 5 + 0 = 5; 8 + 0.5 × 10 = 13 → median 13
    records = [status("p1", 5, 3, age=1.0), status("p2", 5, 5, age=0.0), status("p3", 5, 8, age=0.5)]
    assert phase(records) == 13


def test_phase_ignores_other_steps_and_old_senders_and_caps_the_age() -> None:
    records = [status("p1", 4, 19, 0.0), status("old", 5, None, 0.0), status("p2", 5, 2, age=60.0)]
    assert phase(records, sync_every=40) == 2 + 20  # the age is capped at max_age = 2 s
    assert phase(records) == 19  # and the place at the round's last step
    assert phase([status("p1", 4, 7, 0.0)]) == 0  # nobody at our step: train the whole round


def test_phase_leaves_at_least_one_step_and_is_never_negative() -> None:
    assert phase([status("p1", 5, 20, 0.0)]) == 19
    assert phase([status("p1", 5, 0, age=-30.0)]) == 0  # a clock ahead of ours


def adopter(rebase_on_resync: bool) -> Any:
    """A `CatchUp` with a real tiny trainer and outer optimizer, a few inner steps past θ_global."""
    from dilocod.catchup import CatchUp
    from dilocod.config import load_config
    from dilocod.diloco import OuterOptimizer
    from dilocod.trainer import InnerTrainer

    cfg = load_config(
        None,
        [
            "trainer.batch_size=2",
            "trainer.seq_len=16",
            "trainer.threads=1",
            f"outer.rebase_on_resync={str(rebase_on_resync).lower()}",
        ],
    )
    keeper: Any = object.__new__(CatchUp)
    keeper.cfg, keeper.feedback = cfg, None
    keeper.trainer = InnerTrainer(cfg.model, cfg.data, cfg.trainer, seed=0, peer_key="catchup")
    keeper.outer = OuterOptimizer(keeper.trainer.working_params_fp32(), cfg.outer)
    keeper.trainer.train_steps(2)
    return keeper


def donor_state(keeper: Any) -> list[Any]:
    return [p + 0.01 for p in keeper.outer.params] + [m.clone() for m in keeper.outer.momentum]


def test_adopting_with_rebase_keeps_the_progress_not_yet_averaged() -> None:
    import torch

    keeper = adopter(rebase_on_resync=True)
    old_global = [p.clone() for p in keeper.outer.params]
    local = keeper.trainer.working_params_fp32()
    kept = keeper._adopt_in_trainer(2, donor_state(keeper))
    progress = [g - t for g, t in zip(old_global, local)]
    assert kept is not None and abs(kept - float(torch.sqrt(sum(d.square().sum() for d in progress)))) < 1e-4
    for now, new, d in zip(keeper.trainer.working_params_fp32(), keeper.outer.params, progress):
        assert torch.allclose(now, new - d, atol=1e-6)
    assert keeper.outer.step == 2


def test_adopting_without_rebase_restarts_from_the_new_global() -> None:
    import torch

    keeper = adopter(rebase_on_resync=False)
    assert keeper._adopt_in_trainer(1, donor_state(keeper)) is None
    for now, new in zip(keeper.trainer.working_params_fp32(), keeper.outer.params):
        assert torch.equal(now, new)
