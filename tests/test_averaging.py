"""The networking layer's averaging, with real DHTs, p2pd daemons and averager processes (in-process API)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch
from hivemind.averaging.allreduce import AveragingMode

from peers.group import AveragingSettings, GroupAverager, RoundOutcome
from peers.membership import agree_weights
from peers.shmem import whole_pages
from proto import encode_ticket
from tests.averagers import started_averagers

pytestmark = pytest.mark.integration  # real processes, servers or namespaces: not in `make test-fast`

SHAPES = [(300_000,), (17, 3)]  # > one 512 KiB part, so several reducers share the work
SHA_A, SHA_B = "a" * 64, "b" * 64
NUM = sum(torch.Size(s).numel() for s in SHAPES)


def ticket(
    step: int, sha: str, role: str = "peer", num: int = NUM, tokens: int = 1000, tps: float = 100.0
) -> dict[str, object]:
    return {
        "outer_step": step, "global_sha256": sha, "num_params": num, "role": role,
        "tokens": tokens, "tokens_per_second": tps, "train_seconds": 10.0, "manifest_hash": "ab" * 32,
    }  # fmt: skip


def test_agree_weights_majority_ties_and_invalid() -> None:
    node = AveragingMode.NODE
    assert agree_weights([ticket(1, SHA_A), ticket(1, SHA_A), ticket(1, SHA_B)], [node] * 3) == [
        1000.0,
        1000.0,
        0.0,
    ]
    # a tie goes to the smallest (step, hash), whoever computes it
    assert agree_weights([ticket(1, SHA_B), ticket(1, SHA_A)], [node] * 2) == [0.0, 1000.0]
    # invalid tickets, helpers and auxiliary reducers never count
    weights = agree_weights(
        [None, ticket(1, SHA_A, role="helper"), ticket(1, SHA_A), ticket(1, SHA_A)],
        [node, node, node, AveragingMode.AUX],
    )
    assert weights == [0.0, 0.0, 1000.0, 0.0]
    assert agree_weights([None, None], [node, node]) == [0.0, 0.0]


@pytest.fixture(scope="module")
def trio() -> Iterator[list[GroupAverager]]:
    options = AveragingSettings(target_group_size=3, min_matchmaking_time=2.0, matchmaking_timeout=15.0)
    with started_averagers("avgtest", [torch.zeros(s) for s in SHAPES], [options] * 3) as groups:
        yield groups


def run_round(groups: list[GroupAverager], step: int, tickets: list[bytes], inputs: list[list[torch.Tensor]]):
    async def together() -> list[RoundOutcome]:
        return list(
            await asyncio.gather(
                *(g.average(step, t, x) for g, t, x in zip(groups, tickets, inputs, strict=True))
            )
        )

    return asyncio.run(together())


def random_inputs(seed: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(3)]


def assert_same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def assert_buffers_released(groups: list[GroupAverager]) -> None:
    """Between rounds the averager's shared buffers hold no pages (peers/shmem.py): they read zeros."""
    for group in groups:
        with group.averager.get_tensors() as shared:
            big = shared[0]  # the partial pages at its ends may keep bytes
            start, length = whole_pages(big.untyped_storage().data_ptr(), big.untyped_storage().nbytes())
            offset = (start - big.data_ptr()) // 4
            assert length > 0 and not bool(big[offset : offset + length // 4].any())


def test_members_get_identical_bytes_and_minority_is_told(trio: list[GroupAverager]) -> None:
    groups = trio
    inputs = random_inputs(0)
    outcomes = run_round(groups, 0, [encode_ticket(ticket(0, SHA_A))] * 3, inputs)
    assert all(o.found_group and o.complete and o.in_majority for o in outcomes), outcomes
    assert all(o.group_size == 3 and o.contributors == 3 for o in outcomes)
    # Byte accounting matches the butterfly exactly: member i sends its other parts (N − s_i elements) and
    # returns its s_i averaged elements to the 2 others, fp32 each way — 8·N·(n − 1) bytes in all.
    assert sum(o.bytes_sent for o in outcomes) == sum(o.bytes_received for o in outcomes) == 8 * NUM * 2
    assert all(o.bytes_sent == o.bytes_received for o in outcomes)
    results = [o.averaged for o in outcomes]
    assert all(r is not None for r in results)
    assert_same_bits(results[0], results[1])  # type: ignore[arg-type]
    assert_same_bits(results[0], results[2])  # type: ignore[arg-type]
    expected = [(a + b + c) / 3 for a, b, c in zip(*inputs, strict=True)]
    for got, want in zip(results[0], expected, strict=True):  # type: ignore[arg-type]
        torch.testing.assert_close(got, want)
    assert_buffers_released(groups)  # the averages were cloned out, then the pages went back

    # Round 1: peer 2 holds another θ_global. It takes part but does not count, and is told so.
    inputs = random_inputs(1)
    tickets = [encode_ticket(ticket(1, SHA_A))] * 2 + [encode_ticket(ticket(1, SHA_B))]
    outcomes = run_round(groups, 1, tickets, inputs)
    assert [o.in_majority for o in outcomes] == [True, True, False]
    assert outcomes[2].averaged is None
    # Every member names the same majority, without the one out of step (scoring assigns only within it).
    ids = [g.averager.peer_id.to_base58() for g in groups]
    assert all(sorted(o.members) == sorted(ids) for o in outcomes), [o.members for o in outcomes]
    assert all(sorted(o.majority) == sorted(ids[:2]) for o in outcomes), [o.majority for o in outcomes]
    assert outcomes[0].contributors == 2
    assert outcomes[0].averaged is not None and outcomes[1].averaged is not None
    assert_same_bits(outcomes[0].averaged, outcomes[1].averaged)
    for got, a, b in zip(outcomes[0].averaged, inputs[0], inputs[1], strict=True):
        torch.testing.assert_close(got, (a + b) / 2)


def test_contributions_are_weighted_by_their_tokens_identically_on_every_member(
    trio: list[GroupAverager],
) -> None:
    inputs = random_inputs(4)
    claims = [ticket(3, SHA_A, tokens=1000), ticket(3, SHA_A, tokens=500), ticket(3, SHA_A, tokens=1500)]
    outcomes = run_round(trio, 3, [encode_ticket(c) for c in claims], inputs)
    assert all(o.averaged is not None and o.contributors == 3 for o in outcomes), outcomes
    assert [o.my_weight for o in outcomes] == [1000.0, 500.0, 1500.0]
    assert all(o.total_weight == 3000.0 for o in outcomes)
    assert_same_bits(outcomes[0].averaged, outcomes[1].averaged)  # type: ignore[arg-type]
    assert_same_bits(outcomes[0].averaged, outcomes[2].averaged)  # type: ignore[arg-type]
    for got, a, b, c in zip(outcomes[0].averaged, *inputs, strict=True):  # type: ignore[arg-type]
        torch.testing.assert_close(got, (1000 * a + 500 * b + 1500 * c) / 3000)
    # A member with no tokens yet (it joined as the round closed) takes part and applies, weightless.
    claims = [ticket(4, SHA_A, tokens=1000), ticket(4, SHA_A, tokens=0), ticket(4, SHA_A, tokens=1000)]
    outcomes = run_round(trio, 4, [encode_ticket(c) for c in claims], random_inputs(5))
    assert [o.contributors for o in outcomes] == [2, 2, 2]
    assert all(o.in_majority and o.majority_size == 3 and o.averaged is not None for o in outcomes)
    assert_same_bits(outcomes[0].averaged, outcomes[1].averaged)  # type: ignore[arg-type]


def test_non_finite_contribution_is_screened_out(trio: list[GroupAverager]) -> None:
    inputs = random_inputs(2)
    inputs[1][0][5] = float("nan")  # peer 1 poisons one element of its first tensor
    inputs[1][1][0, 0] = float("inf")
    outcomes = run_round(trio, 2, [encode_ticket(ticket(2, SHA_A))] * 3, inputs)
    assert all(o.averaged is not None for o in outcomes), outcomes
    results = [o.averaged for o in outcomes]
    for result in results:
        assert all(bool(torch.isfinite(t).all()) for t in result)  # type: ignore[union-attr]
    assert_same_bits(results[0], results[1])  # type: ignore[arg-type]
    assert_same_bits(results[0], results[2])  # type: ignore[arg-type]
    # element 5 lies in a part where peer 1 was dropped: the mean of the two others
    torch.testing.assert_close(results[0][0][5], (inputs[0][0][5] + inputs[2][0][5]) / 2)  # type: ignore[index]


def test_no_group_returns_quickly_when_alone(trio: list[GroupAverager]) -> None:
    outcome = run_round(trio[:1], 99, [encode_ticket(ticket(99, SHA_A))], [random_inputs(3)[0]])[0]
    assert not outcome.found_group and outcome.averaged is None
    assert outcome.seconds < 15.0 + 10.0
    assert_buffers_released(trio[:1])  # a failed round gives them back too


def test_reducers_share_the_parts_in_proportion_to_their_bandwidth() -> None:
    from peers.grouping import share_by_bandwidth

    assert share_by_bandwidth(4000, [100.0, 300.0, 0.0, 0.0]) == (1000, 3000, 0, 0)
    assert share_by_bandwidth(900, [None, None, None]) == (300, 300, 300)  # nobody says: equal
    shares = share_by_bandwidth(1000, [None, 100.0, 300.0, 0.0])  # None = the mean of the stated ones
    assert shares[2] == 500 and shares[3] == 0 and abs(shares[0] - 2 * shares[1]) <= 2
    assert sum(share_by_bandwidth(12_345, [1.0, 2.0, 3.0])) == 12_345


def test_at_most_group_size_trusted_trainers_reduce() -> None:
    from peers.grouping import reducer_bandwidths

    node, client, aux = AveragingMode.NODE, AveragingMode.CLIENT, AveragingMode.AUX
    modes = [node, node, client, node, aux, node]
    trusted = [True, False, True, True, True, True]
    # The untrusted member, the client and every trainer past the cap reduce nothing; helpers always do.
    assert reducer_bandwidths([10.0, 20.0, 30.0, None, 50.0, 60.0], modes, trusted, 2) == [
        10.0, 0.0, 0.0, None, 50.0, 0.0,
    ]  # fmt: skip
    assert reducer_bandwidths([1.0] * 6, modes, trusted, None) == [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
