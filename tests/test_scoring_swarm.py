"""Who really trained, through the CLI: 3 honest peers and 1 free-rider, scoring on. Within K = 8
outer steps every honest peer rates the adversary below the gate (its tickets list it, so it weighs 0 in
every round after) or has banned it; no honest peer is ever gated by any honest peer; the honest peers hold
one θ_global."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import FAST, Swarm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(480)]

K = 8  # outer steps within which the adversary is gated
CHUNK_TOKENS = 8192


@pytest.mark.parametrize("mode", ["freeride"])
def test_an_adversary_that_did_no_work_is_gated_and_honest_peers_are_not(tmp_path: Path, mode: str) -> None:
    s = Swarm(tmp_path, overrides=(*FAST, "scoring.enabled=true", f"data.chunk_tokens={CHUNK_TOKENS}"))
    try:
        s.start_bootstrap("dilocod")
        honest = [s.add_peer() for _ in range(3)]
        adversary = s.add_peer(f"adversary.mode={mode}")
        try:
            s.wait_all_at(1, timeout=120)
            start = min(p.status()["outer_step"] for p in honest)
            bad = adversary.status()["peer_id"]
            names = {p.status()["peer_id"] for p in honest}

            def caught() -> bool:
                statuses = [p.status() for p in honest]
                return all(bad in st["scoring"]["gated"] or bad in st.get("banned", []) for st in statuses)

            for _ in range(K):
                s.wait_all_at(start + 1, timeout=90, peers=honest)
                start += 1
                if caught():
                    break
            statuses = [p.status() for p in honest]
            assert caught(), [st["scoring"] for st in statuses]
            for st in statuses:
                assert not names & set(st["scoring"]["gated"]), st["scoring"]
                assert st["scoring"]["rating"] is None or st["scoring"]["rating"] >= 0.3, st["scoring"]
            s.wait_all_at(start + 1, timeout=90, peers=honest)
            hashes = {(st["outer_step"], st["global_sha256"]) for st in (p.status() for p in honest)}
            steps = {h[0] for h in hashes}
            assert len(hashes) == len(steps), hashes  # one θ_global per step among the honest
        except AssertionError as e:
            raise AssertionError(f"{e}\n{s.log_tails()}") from None
    finally:
        s.close()
