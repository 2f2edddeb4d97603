"""Lying peers cannot poison the run: real peers, one of them attacking through the protocol.

Two swarms run side by side: a clean one (4 honest peers) and an attacked one (3 honest peers, plus
one attacker at a time). The attacked swarm lives through every attack mode in turn, a few rounds
each, with a fresh attacker (a new identity) per mode. After each episode the honest peers' eval loss
of θ_global is compared with the clean swarm's at the same outer step: with `centered_clip` it must
stay within 5 %. A third swarm uses the undefended `mean` against a sign-flipper and must be wrecked,
so the defense is shown to matter. Finally a late joiner must refuse a bad donor's poisoned state.
"""

from __future__ import annotations

import math
import signal
from pathlib import Path

import pytest

from tests.harness import FAST, Proc, Swarm, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

EPISODE = 4  # outer rounds per attack mode
ATTACK = (
    *FAST,
    "averaging.group_size=4",
    "averaging.min_matchmaking_time=3",
    "averaging.matchmaking_timeout=10",
)
MODES = ["sign_flip", "random_direction", "scale", "nan", "stale", "alie", "bad_reducer"]
LOUD = {"sign_flip", "random_direction", "scale", "nan", "bad_reducer"}  # must be caught and banned


def start(root: Path, honest: int, *extra: str) -> Swarm:
    s = Swarm(root, overrides=(*ATTACK, *extra))
    try:
        s.start_bootstrap()
        for _ in range(honest):
            s.add_peer()
    except BaseException:
        s.close()
        raise
    return s


def evals(peers: list[Proc]) -> dict[int, float]:
    """outer step → eval loss of θ_global, from the peers' own round histories."""
    found: dict[int, float] = {}
    for peer in peers:
        for entry in peer.status()["rounds"]:
            if entry["result"] in ("ok", "alone"):
                value = entry["eval_loss"]
                found[entry["outer_step"]] = math.inf if value is None else float(value)
    return found


def min_step(peers: list[Proc]) -> int:
    return min(p.status()["outer_step"] for p in peers)


def compare_at(attacked: dict[int, float], clean: dict[int, float], step: int) -> tuple[int, float, float]:
    """The first outer step ≥ `step` that both swarms evaluated, and both losses there."""
    common = sorted(s for s in attacked if s >= step and s in clean)
    assert common, f"no common evaluated step ≥ {step}: {sorted(attacked)} vs {sorted(clean)}"
    return common[0], attacked[common[0]], clean[common[0]]


def joined_a_group(peer: Proc) -> bool:
    return any(e["result"] == "ok" and e["group_size"] >= 2 for e in peer.status()["rounds"])


def stop(peer: Proc) -> None:
    peer.signal(signal.SIGKILL)
    peer.reap()


def test_centered_clip_holds_against_every_attack_and_mean_does_not(tmp_path: Path) -> None:
    clean = start(tmp_path / "clean", 4)
    attacked = start(tmp_path / "attacked", 3)
    wrecked = start(tmp_path / "mean", 3, "averaging.reducer=mean")
    try:
        flipper = wrecked.add_peer("adversary.mode=sign_flip")
        honest = list(attacked.peers)
        attacked.wait_all_at(1, timeout=240, peers=honest)
        episodes: list[tuple[str, int, str]] = []
        for mode in MODES:
            attacker = attacked.add_peer(f"adversary.mode={mode}")
            attacked.wait_serving(attacker)
            # The episode starts once the attacker has been in a group (it first has to catch up).
            wait_for(f"the {mode} attacker to join a group", lambda a=attacker: joined_a_group(a), 240)
            begin = min_step(honest)
            attacked.wait_all_at(begin + EPISODE, timeout=240, peers=honest)
            attacker_id = attacker.status()["peer_id"]
            episodes.append((mode, min_step(honest), attacker_id))
            if mode in LOUD:
                banned = [p.status()["banned"] for p in honest]
                assert any(attacker_id in b for b in banned), (
                    f"{mode}: attacker not banned by anyone: {banned}"
                )
            stop(attacker)

        # The undefended mean, meanwhile, was wrecked by one sign-flipper.
        wrecked_honest = wrecked.peers[:3]
        wrecked.wait_all_at(3, timeout=120, peers=wrecked_honest)
        wrecked_evals = evals(wrecked_honest)
        clean.wait_all_at(episodes[-1][1] + 1, timeout=300)
        clean_evals = evals(clean.peers)
        step, loss, reference = compare_at(wrecked_evals, clean_evals, 3)
        assert loss > 1.5 * reference, f"mean + sign_flip at step {step}: {loss:.4f} vs clean {reference:.4f}"
        stop(flipper)

        attacked_evals = evals(honest)
        for mode, at, _ in episodes:
            step, loss, reference = compare_at(attacked_evals, clean_evals, at)
            assert loss <= 1.05 * reference, (
                f"{mode} at step {step}: honest {loss:.4f} vs clean {reference:.4f}"
            )
        assert sum(p.status()["rejected_contributions"] for p in honest) >= len(LOUD)
    finally:
        for s in (clean, attacked, wrecked):
            s.close()


def test_bad_donor_state_is_refused(tmp_path: Path) -> None:
    s = start(tmp_path, 3)
    try:
        donor = s.add_peer("adversary.mode=bad_donor")
        s.wait_all_at(2, timeout=240)
        donor_id = donor.status()["peer_id"]
        late = s.add_peer()  # must re-sync; the liar claims to be far ahead, so it is asked first
        log = late.run_dir / "dilocod.log"  # type: ignore[operator]
        wait_for(
            "the late peer to refuse the bad donor",
            lambda: f"refused state from {donor_id}" in log.read_text(),
            120,
        )
        honest = s.peers[:3]
        wait_for(
            "the late peer to hold the honest θ_global",
            lambda: (
                late.status()["global_sha256"] in {p.status()["global_sha256"] for p in honest}
                and late.status()["outer_step"] > 0
            ),
            120,
        )
        assert donor_id in late.status()["banned"]
    finally:
        s.close()
