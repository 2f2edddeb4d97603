"""Token weights: what a group counts for each contribution (peers/membership.py), and the ledger of a
peer's own tokens (dilocod/rounds/tokens.py)."""

from __future__ import annotations

from hivemind.averaging.allreduce import AveragingMode

from dilocod.rounds.tokens import TokenLedger
from peers.membership import Claim, agree, capped_tokens, normalized

NODE = AveragingMode.NODE


def claim(tokens: int, tps: float = 100.0, seconds: float | None = None) -> Claim:
    return Claim(tokens, tps, tokens / tps if seconds is None else seconds)


def test_honest_claims_count_as_they_are() -> None:
    # 4 peers at speeds 1, 1, 1/1.5, 1/3 over the same 10 s.
    claims = [claim(1000), claim(1000), claim(667, 66.7), claim(333, 33.3)]
    assert capped_tokens(claims) == [1000.0, 1000.0, 667.0, 333.0]


def test_a_claim_above_twice_the_others_median_is_clamped() -> None:
    liar = Claim(10_000, 1000.0, 10.0)  # claims 10× (and a throughput to match)
    assert capped_tokens([claim(1000), claim(1000), claim(1000), liar]) == [1000.0, 1000.0, 1000.0, 2000.0]
    # In a pair the other's claim is the median: a liar gains at most 2× there too.
    assert capped_tokens([claim(1000), liar]) == [1000.0, 2000.0]


def test_a_claim_above_what_its_throughput_could_produce_is_clamped() -> None:
    # 3000 tokens at 100 tokens/s in 10 s: 1.5 × 100 × 10 = 1500 at most.
    assert capped_tokens([claim(1000), claim(1000), Claim(3000, 100.0, 10.0)])[2] == 1500.0
    # Claiming more seconds than twice the group's median does not buy more.
    assert capped_tokens([claim(1000), claim(1000), Claim(2000, 100.0, 1000.0)])[2] == 2000.0
    assert capped_tokens([claim(1000), claim(1000), Claim(3000, 100.0, 1000.0)])[2] == 2000.0


def test_a_straggler_carrying_a_missed_round_still_counts_it() -> None:
    # Two rounds of tokens behind its pseudo-gradient: twice the median, within both caps.
    assert capped_tokens([claim(1000), claim(1000), claim(2000)]) == [1000.0, 1000.0, 2000.0]


def test_members_without_tokens_or_outside_the_majority_weigh_nothing() -> None:
    assert capped_tokens([None, claim(1000), claim(0, 100.0, 0.0)]) == [0.0, 1000.0, 0.0]
    assert capped_tokens([claim(0, 0.0, 0.0), claim(1000)]) == [0.0, 1000.0]  # a zero claim bounds nobody
    assert capped_tokens([]) == []


def test_normalized_weights_make_equal_weights_exactly_one() -> None:
    assert normalized([20480.0, 20480.0, 20480.0]) == [1.0, 1.0, 1.0]
    assert normalized([1000.0, 500.0, 0.0]) == [1.0, 0.5, 0.0]
    assert normalized([0.0, 0.0]) == [0.0, 0.0]


def ticket(step: int, sha: str, tokens: int, bans: list[str] | None = None) -> dict[str, object]:
    return {
        "outer_step": step, "global_sha256": sha, "num_params": 10, "role": "peer", "bans": bans or [],
        "tokens": tokens, "tokens_per_second": 100.0, "train_seconds": tokens / 100.0,
        "manifest_hash": "ab" * 32,
    }  # fmt: skip


def test_every_member_agrees_on_majority_bans_and_weights() -> None:
    a, b = "a" * 64, "b" * 64
    tickets = [ticket(1, a, 1000, ["p3"]), ticket(1, a, 500, ["p3"]), ticket(1, b, 1000), ticket(1, a, 800)]
    peers = ["p0", "p1", "p2", "p3"]
    agreement = agree(tickets, [NODE] * 4, peers)  # type: ignore[arg-type]
    assert agreement.in_majority == [True, True, False, True]
    # p3 holds the majority's θ, but 2 of the 3 majority members ban it: more than half.
    assert agreement.banned == [False, False, False, True]
    assert agreement.weights == [1000.0, 500.0, 0.0, 0.0]
    # One member's ban alone excludes nobody.
    tickets[1]["bans"] = []
    assert agree(tickets, [NODE] * 4, peers).banned == [False] * 4  # type: ignore[arg-type]


def test_the_ledger_follows_a_contribution_through_its_round() -> None:
    ledger = TokenLedger()
    ledger.stepped(512, 0.1)
    ledger.stepped(512, 0.1)
    assert (ledger.trained, ledger.round, ledger.send()) == (1024, 1024, (1024, 0.2))
    ledger.stepped(512, 0.1)  # overlap: the next round trains while this one averages
    assert ledger.applied(counted=800.0) == 800.0  # the group counted 800 of our 1024
    assert ledger.contributed == 800.0 and ledger.pending == [512]
    ledger.send()
    ledger.kept()  # not applied: the tokens go out again with the next contribution
    ledger.stepped(512, 0.1)
    assert ledger.send() == (1024, 0.2)
    assert ledger.applied() == 1024.0  # alone: all of it
    assert ledger.share == (800 + 1024) / 2048


def test_a_re_sync_keeps_or_drops_the_tokens_with_the_progress() -> None:
    ledger = TokenLedger()
    ledger.stepped(1000, 1.0)
    ledger.send()
    assert ledger.resynced(kept_progress=True) == 0 and ledger.pending == [1000]
    assert ledger.resynced(kept_progress=False) == 1000 and ledger.pending == [0]
    assert ledger.contributed == 0.0 and ledger.share == 0.0


def test_streaming_fragments_each_carry_every_token_once() -> None:
    ledger = TokenLedger(fragments=2)
    ledger.stepped(100, 1.0)
    assert ledger.send(0) == (100, 1.0)
    ledger.applied()
    ledger.stepped(100, 1.0)
    assert ledger.send(1) == (200, 2.0)  # fragment 1 carries both steps' progress
    ledger.applied()
    assert ledger.contributed == (100 + 200) / 2 and ledger.pending == [100, 0]


def test_the_ledger_survives_a_checkpoint_with_a_round_in_flight() -> None:
    ledger = TokenLedger()
    ledger.stepped(1000, 1.0)
    ledger.send()
    ledger.stepped(500, 0.5)
    resumed = TokenLedger()
    resumed.load_state_dict(ledger.state_dict())
    # The round in flight is lost with the process; its progress is in the checkpoint's working copy.
    assert (resumed.trained, resumed.pending) == (1500, [1500])
    other = TokenLedger(fragments=4)
    other.load_state_dict(ledger.state_dict())  # another fragment count: pending restarts at zero
    assert other.pending == [0, 0, 0, 0] and other.trained == 1500


def test_the_chunk_parts_behind_a_contribution_travel_with_its_tokens() -> None:
    ledger = TokenLedger()
    ledger.stepped(512, 1.0, [(0, 7, 0, 256), (0, 7, 256, 512)])
    ledger.stepped(512, 1.0, [(0, 7, 512, 600), (0, 9, 0, 424)])
    ledger.send()
    assert ledger.parts_sent == [(0, 7, 0, 600), (0, 9, 0, 424)]  # contiguous parts of a chunk merged
    ledger.stepped(256, 0.5, [(0, 9, 424, 680)])
    ledger.kept()  # not applied: the parts go out with the next contribution, in order
    assert ledger.pending_parts == [[(0, 7, 0, 600), (0, 9, 0, 680)]]
    again = TokenLedger()
    again.load_state_dict(ledger.state_dict())  # a restart keeps them too
    assert again.pending_parts == ledger.pending_parts
    ledger.send()
    ledger.applied()
    assert ledger.parts_sent == [] and ledger.pending_parts == [[]]
    ledger.stepped(64, 0.1, [(1, 2, 0, 64)])
    ledger.resynced(kept_progress=False)  # progress dropped: so is the claim on its data
    assert ledger.pending_parts == [[]]
