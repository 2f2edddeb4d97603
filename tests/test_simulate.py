"""The in-process simulator (bench/simulate.py): its own behaviour, and its agreement with real peers."""

from __future__ import annotations

import json
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import pytest
import torch

from bench.sim.allreduce import group_average
from bench.sim.diloco import DilocoRun, RunResult
from bench.sim.dp import JointSampler, replica_samplers, run_dp
from bench.sim.replica import Replica, identity_keys, synthetic_keys
from bench.sim.schedule import RoundPlan, plan_rounds, relative_speeds
from bench.sim.settings import SimOptions
from bench.sim.variants import Runner, Variant
from bench.simulate import main
from dilocod.aggregation import ReducerSettings, ScreeningSettings
from dilocod.aggregation.partrules import make_part_reduce
from dilocod.config import load_config
from dilocod.trainer import InnerTrainer, load_corpus
from tests.harness import FAST, REPO, Swarm, round_results

TINY = REPO / "configs" / "tiny.toml"
# Small steps (4 × 32 tokens) on one thread: a unit test's whole run takes a second or two.
SMALL = (
    "trainer.batch_size=4",
    "trainer.seq_len=32",
    "trainer.threads=1",
    "trainer.warmup_steps=2",
    "trainer.eval_batches=2",
    "averaging.compression=none",  # exact fp32 parts: the arithmetic below is checked to the rounding
    "trainer.optimizer=adamw",  # its update moves a last-bit difference by ~lr·1e-2; Muon's orthogonalisation more
)
STEP_TOKENS = 4 * 32


def runner(steps_per_replica: int, replicas: int, speeds: tuple[float, ...] | None = None) -> Runner:
    return Runner(SimOptions(TINY, SMALL, tokens=steps_per_replica * replicas * STEP_TOKENS, speeds=speeds))


def hashes(result: RunResult) -> list[str]:
    return [r.global_sha256 for r in result.rounds]


# ---- the schedule ------------------------------------------------------------------------------------------
def test_rounds_follow_the_runs_clock() -> None:
    equal = relative_speeds(None, 2)
    # H = 4 and a budget of 10 steps: two whole rounds and one cut short.
    assert [p.steps for p in plan_rounds(10, 4, equal)] == [(4, 4), (4, 4), (2, 2)]
    # Streaming with 2 fragments: rounds of H / 2 = 2.5 steps, whole steps as the run's time passes them.
    assert [p.steps[0] for p in plan_rounds(10, 5, equal, fragments=2)] == [2, 3, 2, 3]
    # Speeds 1 and 1/2: the faster replica trains twice the tokens, an average one H steps per round.
    unequal = plan_rounds(30, 3, relative_speeds([1.0, 0.5], 2))
    assert all(p.steps == (4, 2) for p in unequal)
    assert all(p.seconds == Fraction(3) for p in unequal)


# ---- one run -----------------------------------------------------------------------------------------------
def test_a_seed_fixes_the_run() -> None:
    variant = Variant(False, 2, inner_steps=2, compression="int4", overlap="delayed")
    sim = runner(4, 2)
    first, again = sim.run(variant, 0), sim.run(variant, 0)
    assert hashes(first) == hashes(again) and first.eval_loss == again.eval_loss
    assert len(first.rounds) == 2
    other = sim.run(variant, 1)
    assert hashes(other)[0] != hashes(first)[0]


def test_one_replica_with_a_plain_outer_step_is_plain_training() -> None:
    # M = 1, outer lr 1, momentum 0: θ_global ← θ_global − (θ_global − θ_local), i.e. the local weights
    # (up to one rounding per round), so three rounds of 3 steps are 9 steps of the trainer alone.
    sim = runner(9, 1)
    variant = Variant(False, 1, inner_steps=3, outer_lr=1.0, momentum=0.0)
    cfg = sim.config(variant, 0)
    corpus = sim.corpus(cfg.data)
    key = synthetic_keys(1)[0]
    run = DilocoRun(cfg, [key], corpus)
    result = run.run(plan_rounds(9, 3, relative_speeds(None, 1)))
    alone = InnerTrainer(cfg.model, cfg.data, cfg.trainer, seed=0, peer_key=key, corpus=corpus)
    alone.train_steps(9)
    for ours, theirs in zip(run.replicas[0].outer.params, alone.params(), strict=True):
        torch.testing.assert_close(ours, theirs.detach(), rtol=0, atol=1e-5)
    assert result.eval_loss == pytest.approx(alone.evaluate(), rel=1e-5)
    assert len(result.rounds) == 3


def test_speeds_weight_contributions_by_their_tokens_capped_like_the_daemon() -> None:
    variant = Variant(False, 2, inner_steps=3)
    half = runner(6, 2, speeds=(1.0, 0.5)).run(variant, 0)
    for r in half.rounds:  # speed 1 trains 4 steps a round, speed 1/2 two: weights are the tokens
        assert r.tokens == (4 * STEP_TOKENS, 2 * STEP_TOKENS)
        assert r.weights == (4.0 * STEP_TOKENS, 2.0 * STEP_TOKENS)
    # Speed 1/4: the fast replica's 8 steps count for at most twice the other's tokens (peers/membership.py).
    quarter = runner(10, 2, speeds=(1.0, 0.25)).run(Variant(False, 2, inner_steps=5), 0)
    for r in quarter.rounds:
        assert r.tokens == (8 * STEP_TOKENS, 2 * STEP_TOKENS)
        assert r.weights == (4.0 * STEP_TOKENS, 2.0 * STEP_TOKENS)


def test_the_group_average_is_the_token_weighted_mean() -> None:
    reduce_part = make_part_reduce(ReducerSettings("mean"), ScreeningSettings())
    a, b = torch.full((3, 2), 1.0), torch.full((3, 2), 5.0)
    (averaged,) = group_average([[a], [b]], [3000.0, 1000.0], reduce_part, None)
    torch.testing.assert_close(averaged, torch.full((3, 2), 2.0))


def test_dp_trains_on_the_replicas_batches_and_evaluates_on_their_eval_set() -> None:
    cfg = load_config(TINY, SMALL)
    corpus = load_corpus(cfg.data)
    keys = synthetic_keys(3)
    replicas = [Replica(cfg, key, corpus) for key in keys]
    joint = JointSampler(replica_samplers(cfg, keys, corpus))
    for position in (0, 7):
        x, y = joint.batch(position)
        batches = [r.trainer.sampler.batch(position) for r in replicas]
        assert torch.equal(x, torch.cat([b[0] for b in batches]))
        assert torch.equal(y, torch.cat([b[1] for b in batches]))
    # Before any step dp and a replica hold the same model, so the same eval set gives the same loss.
    dp = run_dp(cfg, keys, 0, corpus)
    assert dp.eval_loss == pytest.approx(replicas[0].trainer.evaluate(), rel=1e-6)


def test_json_has_one_object_per_variant(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--replicas", "2", "--inner-steps", "2", "--tokens", str(4 * 2 * STEP_TOKENS), "--json"]
    assert main([*argv, *(f"--set={s}" for s in SMALL)]) == 0
    dp, diloco = json.loads(capsys.readouterr().out)
    keys = {"variant", "replicas", "inner_steps", "seeds", "tokens", "eval_loss_mean", "eval_loss_sd"}
    keys |= {"ratio_to_dp", "bytes_per_token_ratio"}
    assert keys <= dp.keys() and keys <= diloco.keys()
    assert dp["variant"].startswith("dp") and dp["ratio_to_dp"] == 1.0 and dp["bytes_per_token_ratio"] == 1.0
    assert (diloco["replicas"], diloco["inner_steps"], diloco["seeds"]) == (2, 2, 1)
    assert dp["tokens"] == diloco["tokens"] == 4 * 2 * STEP_TOKENS
    # One fp32 pseudo-gradient every H = 2 steps instead of one gradient every step.
    assert diloco["bytes_per_token_ratio"] == pytest.approx(0.5)
    assert diloco["ratio_to_dp"] == pytest.approx(diloco["eval_loss_mean"] / dp["eval_loss_mean"])


# ---- agreement with real peers -----------------------------------------------------------------------------
PEER_STEP_TOKENS = 8 * 64  # tests.harness.FAST: batch 8 × seq_len 64
ROUNDS = 3


def _ok_rounds(status: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {e["outer_step"]: e for e in status["rounds"] if e["result"] == "ok"}


def _weight_known(weight: float, own: int, other: int) -> bool:
    """Whether a group weight (rounded to 0.1 in the round record) is known exactly: the tokens behind the
    contribution, or the cap of twice the other member's tokens (not the throughput cap)."""
    return weight in (float(own), 2.0 * other)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_two_real_peers_and_the_simulator_agree(swarm: Callable[..., Swarm]) -> None:
    """Two real peers on loopback and the simulator with their seed, identities and steps per round end
    every one of the first 3 rounds with the same θ_global bits.

    A real peer trains until the run's clock closes the round, so its steps per round depend on timing;
    each round record says how many tokens stood behind its contribution (steps × 512) and what weight
    the group counted for it, and the simulator is given exactly those. The one thing a record does not
    give exactly is a weight cut by the throughput cap (a peer that slowed down at the end of a round:
    `peers/membership.py`): it is rounded to 0.1 token, so the averages differ in the last bits. For such
    a run the test compares θ_global's eval loss instead (within 1 %).
    """
    # The simulator draws each peer's random windows of its part of the split: the run keeps no chunk
    # schedule here (which chunks a peer is leased depends on the order its requests arrive in).
    s = swarm(2, "data.chunk_tokens=0")
    statuses = s.wait_all_at(ROUNDS, timeout=180, evaluated=True)
    records = [_ok_rounds(st) for st in statuses]
    steps = range(1, ROUNDS + 1)
    usable = all(k in r and r[k]["group_size"] == 2 for r in records for k in steps)
    assert usable, (
        f"the first {ROUNDS} rounds were not all averaged by both peers:\n{round_results(statuses)}"
    )

    plans, exact = [], True
    for k in steps:
        tokens = [r[k]["tokens"] for r in records]
        weights = [float(r[k]["tokens_counted"]) for r in records]
        assert all(t % PEER_STEP_TOKENS == 0 for t in tokens), tokens
        exact &= all(_weight_known(w, t, o) for w, t, o in zip(weights, tokens, tokens[::-1], strict=True))
        plans.append(RoundPlan(tuple(t // PEER_STEP_TOKENS for t in tokens), Fraction(1), tuple(weights)))

    cfg = load_config(TINY, FAST)
    keys = identity_keys([p.run_dir for p in s.peers if p.run_dir is not None])
    result = DilocoRun(cfg, keys, load_corpus(cfg.data)).run(plans)

    if exact:
        assert hashes(result) == [records[0][k]["global_sha256"] for k in steps], round_results(statuses)
        assert result.eval_loss == records[0][ROUNDS]["eval_loss"]
    else:
        assert result.eval_loss == pytest.approx(records[0][ROUNDS]["eval_loss"], rel=0.01)
