"""Integration: a run with `averaging.compression=topk` through the CLI (a bootstrap and 3 peers), against an
int4 run of the same settings in the same test: θ_global agrees, training goes on, each peer puts far fewer
bytes a token on the wire, and contribution scoring passes the honest peers (it judges each round's own Δ,
not the error feedback, which with topk holds many rounds of unsent work: judged with it, an honest peer
failed three rounds in a row from outer step 4 on)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from tests.harness import Swarm, round_hashes

pytestmark = pytest.mark.integration


def bytes_per_token(statuses: list[dict[str, Any]]) -> float:
    """Bytes each peer sent over the tokens behind its contributions, over the rounds all 3 averaged."""
    rounds = [e for st in statuses for e in st["rounds"] if e["result"] == "ok" and e["group_size"] == 3]
    tokens = sum(e["tokens"] for e in rounds)
    assert rounds and tokens > 0, [st["rounds"] for st in statuses]
    return sum(e["bytes_sent"] for e in rounds) / tokens


def run_to_step(swarm: Callable[..., Swarm], step: int, *extra: str) -> list[dict[str, Any]]:
    s = swarm(3, *extra)
    try:
        statuses = s.wait_all_at(step, timeout=240)
        for outer_step, found in round_hashes(statuses).items():
            assert len(found) == 1, f"peers disagree on θ_global after outer step {outer_step}: {found}"
        assert any(e["group_size"] == 3 for st in statuses for e in st["rounds"] if e["result"] == "ok")
        return statuses
    except AssertionError as e:
        raise AssertionError(f"{e}\n{s.log_tails()}") from None
    finally:
        s.close()


def assert_scored_and_never_gated(statuses: list[dict[str, Any]]) -> None:
    scores = [t for st in statuses for t in st["scoring"]["last_scores"]]
    assert len(scores) >= 6 and sum(t["passed"] for t in scores) * 10 >= 9 * len(scores), scores
    views = [st["scoring"] for st in statuses]
    assert all(v["gated"] == [] and min(v["ratings"].values(), default=1) >= 0.3 for v in views), views


@pytest.mark.timeout(600)
def test_topk_run_agrees_scores_and_sends_a_tenth_of_int4s_bytes(swarm: Callable[..., Swarm]) -> None:
    sparse = run_to_step(swarm, 10, "averaging.compression=topk", "scoring.enabled=true")
    assert_scored_and_never_gated(sparse)
    dense = run_to_step(swarm, 4, "averaging.compression=int4")
    ratio = bytes_per_token(dense) / bytes_per_token(sparse)
    # tiny: 0.0208 B a value against int4's 0.531, relayed (n − 1 payloads a member) against reduced (~2)
    print(
        f"bytes a token: topk {bytes_per_token(sparse):.1f}, int4 {bytes_per_token(dense):.1f}, ratio {ratio:.1f}"
    )
    assert ratio >= 10, ratio
    losses = [e["loss"] for st in sparse for e in st["rounds"] if e["loss"] is not None]
    assert losses and all(math.isfinite(x) for x in losses)
    assert min(st["loss"] for st in sparse) < math.log(256)  # trains: below an untrained model's loss
