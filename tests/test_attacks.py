"""Lying peers cannot poison the run: 4 real peers, one of them attacking through the protocol.

Each attacked run (3 honest peers + 1 attacker, from the start) is compared with a clean run of the
same length without the attacker (the same 3 honest peers' worth of data): the honest peers' eval loss
of θ_global, averaged over the same five outer steps (one step's small eval set is noisy). With
`centered_clip` it stays within 5 %; with the undefended `mean` a sign-flipper wrecks the run, so the
defense is shown to matter. A late joiner refuses a bad donor's poisoned state.

On 2 cores each run costs about a minute, so CI runs the attacks that exercise distinct defenses:
`sign_flip` (norm screening + robust reduction), `alie` (a stealthy attack that passes screening), and
`bad_reducer` (receiver-side checking and bans). Every mode, against every reducer, is in
`bench/attacks.py`.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hivemind.p2p import P2P

from tests.harness import FAST, Proc, Swarm, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROUNDS = 10
WINDOW = 5  # outer steps averaged: one step's small eval set is noisy
ATTACK = (
    *FAST,
    "averaging.group_size=4",
    "averaging.min_matchmaking_time=3",
    "averaging.matchmaking_timeout=10",
    "trainer.eval_batches=8",
)


IDENTITIES = Path(tempfile.mkdtemp(prefix="dilocod-attack-ids-"))


def start_honest(s: Swarm, index: int) -> Proc:
    """Honest peer `index`, with the same identity (so the same data shard and order) in every run:
    the clean and attacked runs then differ by the attacker, not by which data each peer drew."""
    key = IDENTITIES / f"honest-{index}.key"
    if not key.exists():
        P2P.generate_identity(str(key))
    peer = s.add_peer(start=False)
    assert peer.run_dir is not None
    peer.run_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(key, peer.run_dir / "identity.key")
    peer.start()
    return peer


def run_swarm(
    root: Path, attacker: str | None, *extra: str, rounds: int = ROUNDS
) -> tuple[Swarm, list[dict[str, Any]]]:
    """3 honest peers (+ 1 attacker) trained to outer step `rounds`."""
    s = Swarm(root, overrides=(*ATTACK, *extra))
    try:
        s.start_bootstrap()
        # The attacker (peer-0) starts first, so that it is in the run from the first round on.
        if attacker is not None:
            s.add_peer(f"adversary.mode={attacker}")
        honest = [start_honest(s, i) for i in range(3)]
        statuses = s.wait_all_at(rounds, timeout=400, peers=honest)
    except BaseException:
        s.close()  # the caller never sees a half-started swarm: reap it here
        raise
    return s, statuses


def mean_eval(statuses: list[dict[str, Any]], last: int) -> float:
    """Eval loss averaged over the WINDOW outer steps ending at `last`."""
    return sum(eval_at(statuses, step) for step in range(last - WINDOW + 1, last + 1)) / WINDOW


def eval_at(statuses: list[dict[str, Any]], step: int) -> float:
    """The honest peers' eval loss of θ_global after outer step `step` (the first who recorded it)."""
    for status in statuses:
        for entry in status["rounds"]:
            if entry["outer_step"] == step and entry["result"] in ("ok", "alone"):
                value = entry["eval_loss"]
                return math.inf if value is None else float(value)
    raise AssertionError(f"no honest peer evaluated outer step {step}")


def evaluated(statuses: list[dict[str, Any]]) -> set[int]:
    return {e["outer_step"] for s in statuses for e in s["rounds"] if e["result"] in ("ok", "alone")}


def common_step(attacked: list[dict[str, Any]], clean: list[dict[str, Any]]) -> int:
    """The latest step ≥ ROUNDS − 2 evaluated by both runs, with the WINDOW − 1 steps before it."""
    both = evaluated(attacked) & evaluated(clean)
    steps = [s for s in both if s >= ROUNDS - 2 and set(range(s - WINDOW + 1, s)) <= both]
    assert steps, f"no common evaluated step: {sorted(evaluated(attacked))} vs {sorted(evaluated(clean))}"
    return max(steps)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    s, _ = run_swarm(tmp_path_factory.mktemp("clean"), None)
    try:
        # a few rounds more than the attacked runs need: they are compared at the step they reached
        return s.wait_all_at(ROUNDS + 4, timeout=300)
    finally:
        s.close()  # its statuses hold the history; the swarm itself must not keep using the CPU


@pytest.mark.parametrize("mode", ["sign_flip", "alie", "bad_reducer"])
def test_centered_clip_keeps_honest_loss_within_5_percent(
    mode: str, clean: list[dict[str, Any]], tmp_path: Path
) -> None:
    s, statuses = run_swarm(tmp_path, mode)
    try:
        step = common_step(statuses, clean)
        loss, reference = mean_eval(statuses, step), mean_eval(clean, step)
        assert loss <= 1.05 * reference, f"{mode} at step {step}: honest {loss:.4f} vs clean {reference:.4f}"
        if mode != "alie":  # loud attacks are caught: refused and banned by an honest peer
            attacker = s.peers[0].status()["peer_id"]
            honest = [p.status() for p in s.peers[1:]]
            assert any(attacker in h["banned"] for h in honest), [h["banned"] for h in honest]
            assert sum(h["rejected_contributions"] for h in honest) >= 1
    finally:
        s.close()


def test_mean_is_wrecked_by_sign_flip(clean: list[dict[str, Any]], tmp_path: Path) -> None:
    # A wrecked run soon has NaN everywhere and its peers stop meeting: compare early.
    s, statuses = run_swarm(tmp_path, "sign_flip", "averaging.reducer=mean", rounds=3)
    try:
        step = max(evaluated(statuses) & evaluated(clean))
        loss, reference = eval_at(statuses, step), eval_at(clean, step)
        assert loss > 1.5 * reference, f"mean + sign_flip at step {step}: {loss:.4f} vs clean {reference:.4f}"
    finally:
        s.close()


def test_bad_donor_state_is_refused(tmp_path: Path) -> None:
    s = Swarm(tmp_path, overrides=ATTACK)
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
