"""Who really trained, through the CLI: 4 honest peers and 1 adversary that does no work on the data it
claims (a free-rider, a copier of the run's last update, a peer that trains other data), scoring on, H = 20
(at H = 5 an honest Δ's margin over the scorer's reference came as low as +0.0008 once: H = 20 leaves
honest peers a margin of +0.03 and more, docs/trust.md). Within K = 8 outer
steps every honest peer rates the adversary below the gate (its tickets list it, so it weighs 0 in every
round after) or has banned it; the adversary's share of its tokens that count falls below every honest
peer's; no honest peer is ever gated by any honest peer; the honest peers hold one θ_global and their eval
loss stays within the noise of a clean run's (4 honest peers, no adversary, scoring on). The run's
view shows it: `/api/run` `scoring` on the bootstrap and on a peer, and the dashboard's rating column in a
real browser (once, for the free-rider)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.attackrun import common_step, mean_eval, start_run
from tests.harness import Proc, Swarm, get_json, wait_for
from tests.tools import CHROMIUM_ARGS, artifact, need_program, playwright

pytestmark = [pytest.mark.integration, pytest.mark.timeout(480)]

K = 8  # outer steps within which the adversary is gated
ROUNDS = 8  # the eval comparison averages 5 outer steps up to about here (attackrun.common_step)
# Clean runs of the same settings differ by up to ~11 % on the run's clock (tests/test_attacks.py); these
# adversaries measured 0.99–1.03 of clean (bench/scoring.py, docs/benchmarks.md).
NOISE = 1.25
HONEST = 4
SCORED = ("trainer.inner_steps=20", "scoring.enabled=true", "data.chunk_tokens=8192")


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The honest peers alone, scoring on: their statuses at outer step ROUNDS + 1; nobody is gated."""
    s = start_run(tmp_path_factory.mktemp("clean"), HONEST, 0, None, *SCORED)
    try:
        statuses = s.wait_all_at(ROUNDS + 1, timeout=300, evaluated=True)
        for st in statuses:
            assert st["scoring"]["gated"] == [], (st["scoring"], s.log_tails())
        return statuses
    finally:
        s.close()


def _caught(honest: list[Proc], bad: str) -> bool:
    statuses = [p.status() for p in honest]
    return all(bad in st["scoring"]["gated"] or bad in st.get("banned", []) for st in statuses)


def _one_theta(peers: list[Any]) -> bool:
    """Whether `peers` report one outer step and one θ_global at it (read within a moment)."""
    return len({(st["outer_step"], st["global_sha256"]) for st in (p.status() for p in peers)}) == 1


def _assert_honest_never_gated(statuses: list[dict[str, Any]]) -> None:
    names = {st["peer_id"] for st in statuses}
    for st in statuses:
        assert not names & set(st["scoring"]["gated"]), st["scoring"]
        assert st["scoring"]["rating"] is None or st["scoring"]["rating"] >= 0.3, st["scoring"]


@pytest.mark.parametrize("mode", ["freeride", "copy_update", "wrong_data"])
def test_an_adversary_that_did_no_work_is_gated_and_honest_peers_are_not(
    tmp_path: Path, mode: str, clean: list[dict[str, Any]]
) -> None:
    s = start_run(tmp_path, HONEST, 1, mode, *SCORED)  # the adversary is peer-0, the honest ones the rest
    try:
        honest, adversary = s.peers[-HONEST:], s.peers[0]
        try:
            s.wait_all_at(1, timeout=120)
            start = min(p.status()["outer_step"] for p in honest)
            bad = adversary.status()["peer_id"]
            for _ in range(K):
                s.wait_all_at(start + 1, timeout=90, peers=honest)
                start += 1
                _assert_honest_never_gated([p.status() for p in honest])
                if _caught(honest, bad):
                    break
            assert _caught(honest, bad), [p.status()["scoring"] for p in honest]
            # two rounds with the adversary at weight 0, and the steps the eval comparison needs
            statuses = s.wait_all_at(max(start + 2, ROUNDS), timeout=120, peers=honest, evaluated=True)
            _assert_honest_never_gated(statuses)
            shares = [st["contribution_share"] for st in statuses]
            assert adversary.status()["contribution_share"] < min(shares), (adversary.status(), shares)
            # Honest peers that banned the adversary at different moments can average apart for a round
            # (docs/trust.md): the minority re-syncs to the majority's θ. They must end on one θ_global.
            wait_for("the honest peers on one θ_global", lambda: _one_theta(honest), 60)
            step = common_step(statuses, clean, ROUNDS)
            loss, reference = mean_eval(statuses, step), mean_eval(clean, step)
            assert loss <= NOISE * reference, (
                f"{mode} at step {step}: honest {loss:.4f} vs clean {reference:.4f}"
            )
            # wrong_data passes a score now and then (docs/trust.md) and climbs back for a round: only its
            # failed verdicts are sure to be in the view at any given moment.
            _assert_the_run_view_shows_it(
                s, honest[0], bad, {st["peer_id"] for st in statuses}, mode != "wrong_data"
            )
            if mode == "freeride":
                _assert_the_dashboard_shows_it(s, bad)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{s.log_tails()}") from None
    finally:
        s.close()


def _assert_the_run_view_shows_it(s: Swarm, peer: Proc, bad: str, names: set[str], gated: bool) -> None:
    """`/api/run` `scoring`: the bootstrap folds the verdicts as published, a peer the ones it checked; both
    show the adversary's failed verdicts (and it gated, when it fails every score), no honest peer gated."""
    assert s.bootstrap is not None
    for node, verified in ((s.bootstrap, False), (peer, True)):
        view = get_json(f"http://127.0.0.1:{node.http_port}/api/run")["scoring"]
        assert view["verified"] is verified and view["gate"] == 0.3, view
        entry = view["peers"][bad]
        assert any(not v["passed"] for v in entry["last_scores"]), entry
        assert not gated or (entry["gated"] and entry["rating"] < 0.3), entry
        assert not [p for p in names if view["peers"].get(p, {}).get("gated")], view


def _assert_the_dashboard_shows_it(s: Swarm, bad: str) -> None:
    """The bootstrap's dashboard, in chromium: the adversary's row says gated, with its verdicts."""
    chromium = need_program("chromium")
    assert s.bootstrap is not None
    with playwright()() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, timeout=60_000)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"http://127.0.0.1:{s.bootstrap.http_port}/", timeout=30_000)
            cell = f'#peers tr[data-peer="{bad}"] td.rating'
            page.wait_for_function(
                "(sel) => (document.querySelector(sel) || {}).textContent?.includes('gated')",
                arg=cell, timeout=60_000, polling=500,
            )  # fmt: skip
            page.screenshot(path=str(artifact("dashboard-scoring.png")), full_page=True)
            title = page.eval_on_selector(cell, "(td) => td.title")
            assert "FAIL by" in title and "below 0.3" in title, title
            assert errors == [], errors
        finally:
            browser.close()
