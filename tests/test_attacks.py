"""Lying peers cannot poison the run: 4 real peers, one of them attacking through the protocol.

Each attacked run (3 honest peers + 1 attacker, from the start) is compared with clean runs of the
same length without the attacker (the same 3 honest peers' worth of data): the honest peers' eval loss
of θ_global, averaged over the same five outer steps (one step's small eval set is noisy). With
`centered_clip` it stays within 20 % of the worse of two clean runs: on the run's clock clean runs of
the same settings differ by up to about 10 % (the `cleans` fixture; before the clock, when a run was
nearly deterministic, the bound was 5 %), and an attacked run also carries what its first rounds let
through before the attacker was banned. Undefended, the loud attacks cost 12× (`scale`) to ∞
(docs/benchmarks.md), and the undefended `mean` with a sign-flipper is checked here to be wrecked, so
the bound still tells a defended run from a broken one. A late joiner refuses a bad donor's poisoned state.

Each way an attack is caught runs here against the default reducer; each run costs about a minute on 2
cores. The loud attacks (`sign_flip` for an oversized Δ, `nan`, `bad_reducer`) must also be caught:
refused by an honest peer and banned; `sign_flip` and `nan` attack one run together (2 attackers of 5:
each is refused by its own screen before any reduction, so neither shields the other). `random_direction` and `scale` are oversized like `sign_flip` and
meet the same norm screen; `scale` is also the attacker of the pair test below. `alie` and `stale` send
plausible values that no screen can tell from honest noise; robust reduction alone has to bound them (both
attack one run together, 2 attackers of 5).
Every mode against every reducer, and with 8 peers / 2 attackers, is in `bench/attacks.py`.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests.attackrun import ATTACK, common_step, eval_at, evaluated, mean_eval, start_run
from tests.harness import Swarm, round_results, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

# Two clean runs of the same settings measured 3.23 and 2.90 at step 8 (11 %); four more, in a row on
# 2 cores, 2.91, 2.96, 3.03 and 3.07 (and at equal tokens the spread was the same, so it is not the
# clock's tokens per round). Attacked runs: bad_reducer 3.10 against two clean at 2.90 (7 %),
# random_direction 3.13 against 2.90 (8 %), scale 3.34 against 2.94 (14 %, in CI).
NOISE = 1.20
ROUNDS = 8  # the comparison averages outer steps ≥ ROUNDS − 2 back over 5 steps (attackrun.common_step)


def run_swarm(
    root: Path, attacker: str | tuple[str, ...] | None, *extra: str, rounds: int = ROUNDS
) -> tuple[Swarm, list[dict[str, Any]]]:
    """3 honest peers (+ 1 attacker, peer-0, or one per mode of a tuple) trained to outer step `rounds`."""
    attackers = len(attacker) if isinstance(attacker, tuple) else 1
    s = start_run(root, 3, attackers, attacker, *extra)
    try:
        statuses = s.wait_all_at(rounds, timeout=400, peers=s.peers[-3:], evaluated=True)
    except BaseException:
        s.close()
        raise
    return s, statuses


def clean_run(root: Path) -> list[dict[str, Any]]:
    s, _ = run_swarm(root, None)
    try:
        # a round more than the attacked runs wait for: they are compared at a step both reached
        return s.wait_all_at(ROUNDS + 1, timeout=300, evaluated=True)
    finally:
        s.close()  # its statuses hold the history; the swarm itself must not keep using the CPU


@pytest.fixture(scope="module")
def cleans(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    """Two clean runs. On the run's clock a peer's inner steps per round depend on timing (a peer that
    started first carries its early rounds into a big first contribution), so two clean runs of the same
    settings differ: measured 3.23 and 2.90 at outer step 8 on this machine. An attacked run is held to
    `NOISE` × the worse of two, not to one draw of that spread."""
    return [clean_run(tmp_path_factory.mktemp(f"clean{i}")) for i in range(2)]


@pytest.fixture(scope="module")
def clean(cleans: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return cleans[0]


# One per screen: norm and non-finite (one run, an attacker each), reduction check.
LOUD: list[str | tuple[str, ...]] = [("sign_flip", "nan"), "bad_reducer"]
# Both plausible-value attackers in one run (2 of 5 peers): a stronger test than one each, and one swarm less.
STEALTHY = [("stale", "alie")]


def banned_by(s: Swarm, attacker: str) -> list[dict[str, Any]] | None:
    """The honest peers' statuses once one of them bans `attacker`; None before."""
    honest = [p.status() for p in s.peers[-3:]]
    return honest if any(attacker in h["banned"] for h in honest) else None


@pytest.mark.parametrize("mode", LOUD + STEALTHY, ids=lambda m: m if isinstance(m, str) else "+".join(m))
def test_centered_clip_keeps_honest_loss_within_clean_noise(
    mode: str | tuple[str, ...], cleans: list[list[dict[str, Any]]], tmp_path: Path
) -> None:
    s, statuses = run_swarm(tmp_path, mode)
    try:
        step = common_step(statuses, cleans[0], ROUNDS, *cleans[1:])
        loss, reference = mean_eval(statuses, step), max(mean_eval(clean, step) for clean in cleans)
        assert loss <= NOISE * reference, f"{mode} at step {step}: honest {loss:.4f} vs clean {reference:.4f}"
        if mode in LOUD:  # loud attacks are caught: refused and banned by an honest peer
            attackers = s.peers[: len(mode) if isinstance(mode, tuple) else 1]
            # An attacker is caught in the first round it completes with honest peers. That may be after
            # the steps compared above: on 2 cores its one round with them can fail in transport (a slow
            # sender, seen in a full suite) and leave it re-syncing for a few rounds. The run goes on.
            for attacker in (p.status()["peer_id"] for p in attackers):
                try:
                    honest = wait_for(
                        f"an honest peer to ban {attacker}", partial(banned_by, s, attacker), 120
                    )
                except AssertionError as e:
                    raise AssertionError(f"{e}\n{round_results([p.status() for p in s.peers])}") from None
            # every attacker refused at least once
            assert sum(h["rejected_contributions"] for h in honest) >= len(attackers), honest
    finally:
        s.close()


def test_mean_is_wrecked_by_sign_flip(clean: list[dict[str, Any]], tmp_path: Path) -> None:
    # A wrecked run soon has NaN everywhere and its peers stop meeting: compare at the first step the
    # attacker's update went into (on 2 cores the run may close its first rounds without it; seen in a
    # full suite: it re-synced twice and θ_global at step 3 had none of its work).
    s, _ = run_swarm(tmp_path, "sign_flip", "averaging.reducer=mean", rounds=1)
    try:
        attacker = s.peers[0]

        def attacked_steps() -> list[int]:
            rounds = attacker.status()["rounds"]
            return sorted(e["outer_step"] for e in rounds if e["result"] == "ok" and e["group_size"] >= 2)

        try:
            first = wait_for("the attacker in a round with honest peers", attacked_steps, 180)[0]
            statuses = s.wait_all_at(first, timeout=120, peers=s.peers[-3:], evaluated=True)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{s.log_tails()}") from None
        step = min(step for step in evaluated(statuses) & evaluated(clean) if step >= first)
        loss, reference = eval_at(statuses, step), eval_at(clean, step)
        # Wrecked: 1.5× the clean run's loss, or worse than the untrained byte model (ln 256) where the
        # attacker's first round is the run's first, whose clean loss is still near it (seen: 6.20 vs 4.51).
        assert math.isnan(loss) or loss > min(1.5 * reference, math.log(256)), (
            f"mean + sign_flip at step {step} (the attacker's first round: {first}): {loss:.4f} vs clean {reference:.4f}"
        )
    finally:
        s.close()


def test_bad_donor_state_is_refused(tmp_path: Path) -> None:
    s = Swarm(tmp_path, overrides=(*ATTACK, "averaging.group_size=4"))
    try:
        s.start_bootstrap()
        honest = [s.add_peer() for _ in range(3)]
        donor = s.add_peer("adversary.mode=bad_donor")
        s.wait_all_at(2, timeout=300, peers=honest)
        donor_id = donor.status()["peer_id"]
        late = s.add_peer()  # must re-sync; the liar claims to be far ahead, so it is asked first
        log = late.run_dir / "dilocod.log"  # type: ignore[operator]
        wait_for(
            "the late peer to refuse the bad donor",
            lambda: log.exists() and f"refused state from {donor_id}" in log.read_text(),
            180,
        )
        wait_for(
            "the late peer to hold the honest θ_global",
            lambda: (
                late.status()["outer_step"] > 0
                and late.status()["global_sha256"] in {p.status()["global_sha256"] for p in honest}
            ),
            180,
        )
        assert donor_id in late.status()["banned"]
    finally:
        s.close()


def test_a_pair_with_a_scaling_attacker_keeps_an_honest_model(tmp_path: Path) -> None:
    # The attacker's first round can be with a single honest peer (it starts first; the others are not up
    # yet). Two copies cannot outvote each other, and the pair's average was ~50 × an honest step: every
    # honest peer that later downloaded that θ_global was wrecked (CI: eval 51 against 2.9 clean).
    s = start_run(tmp_path, 1, 1, "scale")
    try:
        honest = s.peers[-1]
        statuses = s.wait_all_at(3, timeout=300, peers=[honest], evaluated=True)
        losses = [e["eval_loss"] for e in statuses[0]["rounds"] if e["eval_loss"] is not None]
        # ln 256 is an untrained model's loss; the pair's average wrecked it to 56–181 in three rounds
        assert losses and max(losses) < math.log(256), f"{losses}\n{round_results(statuses)}"
        attacker = s.peers[0].status()["peer_id"]
        wait_for("the honest peer to ban the attacker", lambda: attacker in honest.status()["banned"], 120)
    finally:
        s.close()
