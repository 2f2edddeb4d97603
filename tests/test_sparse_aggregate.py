"""The robust rule for sparse contributions (dilocod/aggregation/sparse.py), as tables: who is clipped and to
what, the mean over every member's weight, copied supports, malformed rows, and the same bits every time."""

from __future__ import annotations

import pytest
import torch

from dilocod.aggregation.sparse import (
    SparseRow,
    aggregate,
    check_row,
    clip_coefficients,
    clip_factors,
    copied_pairs,
    overlap,
)
from dilocod.codecs import TopKCodec
from peers.partrelay import combine


def row(positions: list[int], values: list[float]) -> SparseRow:
    return SparseRow(torch.tensor(positions, dtype=torch.int64), torch.tensor(values, dtype=torch.float32))


def topk_row(x: torch.Tensor) -> SparseRow:
    """The 64 largest |x| of each 4,096 values, as a member sending the default top-k payload holds them."""
    local, _ = TopKCodec(4096, 64, 2).select(x)
    positions = torch.arange(x.numel() // 4096).repeat_interleave(64) * 4096 + local
    return SparseRow(positions, x[positions])


@pytest.mark.parametrize(
    ("norms", "weights", "factors"),
    [
        ([1.0, 1.0, 1.0], [1, 1, 1], [1.0, 1.0, 1.0]),  # equals: nobody clipped
        ([1.0, 2.0, 100.0], [1, 1, 1], [1.0, 1.0, 0.02]),  # odd: everyone to at most the median
        ([1.0, 100.0], [1, 1], [1.0, 0.01]),  # a pair: the liar to the lower norm, never the mean
        ([1.0, 1.5], [1, 2], [1.0, 1.25 / 1.5]),  # an honest pair of unequal work: the heavier to M
        ([0.0, 1.0], [1, 1], [1.0, 0.0]),  # a pair with a free-rider: its partner gets nothing from it
        (
            [1.0, 1.0, 50.0, 60.0],
            [1, 1, 1, 1],
            [1.0, 1.0, 1 / 50, 1 / 60],
        ),  # even: M_lo with the weight factor
        ([1.0, 9.0, 2.0], [1, 0, 1], [1.0, 0.0, 0.5]),  # weight 0: out of the bound (a pair left), factor 0
    ],
)
def test_clip_factors(norms: list[float], weights: list[float], factors: list[float]) -> None:
    got = clip_factors(torch.tensor(norms, dtype=torch.float64), torch.tensor(weights, dtype=torch.float64))
    torch.testing.assert_close(got, torch.tensor(factors, dtype=torch.float64))


def test_the_mean_divides_by_every_members_weight() -> None:
    rows = [row([0, 2], [1.0, 1.0]), row([1, 3], [1.0, 1.0]), row([4, 5], [1.0, 1.0])]
    out = aggregate(rows, torch.tensor([1.0, 1.0, 2.0]), 6)
    torch.testing.assert_close(out.dense, torch.tensor([0.25, 0.25, 0.25, 0.25, 0.5, 0.5]))
    assert out.copies == []


def test_a_concentrating_attacker_moves_a_coordinate_by_at_most_its_clipped_share() -> None:
    """`concentrate`: all of a peer's k values on a few coordinates, large. Clipped to the median norm and
    divided by the group's weight, it moves any coordinate by at most M / n."""
    gen = torch.Generator().manual_seed(0)
    numel = 4096 * 4
    honest = [topk_row(torch.randn(numel, generator=gen) * 0.01) for _ in range(4)]
    attacker = row([5, 6, 7], [1e4, -1e4, 1e4])
    rows = [*honest, attacker]
    out = aggregate(rows, torch.ones(5), numel)
    norms = sorted(float(r.values.norm()) for r in rows)
    assert float(out.dense[5:8].abs().max()) <= norms[2] / 5 * (1 + 1e-6) + 0.01  # + an honest value there
    assert float(out.clipped[4]) == pytest.approx(norms[2] / float(attacker.values.norm()), rel=1e-6)


def test_copied_supports_are_flagged_and_independent_ones_are_not() -> None:
    gen = torch.Generator().manual_seed(1)
    supports = [topk_row(torch.randn(4096 * 8, generator=gen)).positions for _ in range(6)]
    rows = [SparseRow(s, torch.ones(s.numel())) for s in supports]
    assert copied_pairs(rows) == []  # chance overlap is about the density, 1.56 %
    copy = SparseRow(supports[2].clone(), torch.full((supports[2].numel(),), 2.0))
    assert copied_pairs([*rows, copy]) == [(2, 6)]
    assert overlap(supports[2], supports[2][::2]) == 1.0 and overlap(supports[0], supports[0][:0]) == 0.0


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (row([3, 1], [1.0, 1.0]), "strictly increase"),
        (row([0, 0], [1.0, 1.0]), "strictly increase"),
        (row([2, 10], [1.0, 1.0]), "outside"),
        (row([-1, 2], [1.0, 1.0]), "outside"),
        (row([1, 2], [1.0, float("nan")]), "not finite"),
        (SparseRow(torch.tensor([1, 2], dtype=torch.int32), torch.ones(2)), "int64"),
        (SparseRow(torch.tensor([1, 2]), torch.ones(3)), "one length"),
    ],
)
def test_malformed_rows_are_named(bad: SparseRow, message: str) -> None:
    assert message in (check_row(bad, 10) or "")
    with pytest.raises(ValueError, match="member 1's row"):
        aggregate([row([0], [1.0]), bad], torch.ones(2), 10)


def test_the_same_rows_give_the_same_bits_whatever_the_threads() -> None:
    gen = torch.Generator().manual_seed(2)
    numel = 4096 * 64
    rows = [topk_row(torch.randn(numel, generator=gen)) for _ in range(8)]
    weights = torch.tensor([1.0, 2.0, 1.5, 1.0, 1.0, 0.5, 2.0, 1.0])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = aggregate(rows, weights, numel).dense
        torch.set_num_threads(max(2, threads))
        many = aggregate(rows, weights, numel).dense
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many) and int(one.count_nonzero()) > 0


def test_nobody_with_weight_gives_zeros() -> None:
    out = aggregate([row([1], [5.0])], torch.zeros(1), 3)
    assert torch.equal(out.dense, torch.zeros(3)) and float(out.clipped[0]) == 0.0
    assert torch.equal(aggregate([], torch.zeros(0), 4).dense, torch.zeros(4))


def test_clip_coefficients_on_dense_rows_give_the_sparse_aggregate() -> None:
    """What a reducer weighs a part of decoded payloads with (zeros off each support) is the rule on its rows."""
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(3 * 4096, generator=gen) * s for s in (1.0, 1.2, 40.0)]
    rows = [topk_row(x) for x in xs]
    dense = torch.zeros(3, 3 * 4096)
    for i, r in enumerate(rows):
        dense[i, r.positions] = r.values
    weights = torch.tensor([1.0, 0.5, 1.0])
    coefficients = clip_coefficients(dense, weights)
    got = combine(dense, coefficients.tolist())
    expected = aggregate(rows, weights, 3 * 4096).dense
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)  # float64 sums in two orders
    assert float(got.norm()) < 2 * float(dense[:2].norm(dim=1).max())  # the ×40 row clipped to the median
    assert coefficients[2] < weights[2] / weights.sum() / 10  # ... by its coefficient


def test_clip_coefficients_never_take_a_screened_rows_norm() -> None:
    rows = torch.tensor([[1.0, 0.0, 2.0], [float("nan"), 1.0, 0.0], [0.0, 3.0, 1.0]])
    coefficients = clip_coefficients(rows, torch.tensor([1.0, 0.0, 1.0]))
    # a pair: the larger row (norm √10) clipped to the lower one (√5)
    assert coefficients.tolist() == pytest.approx([0.5, 0.0, 0.5 * (5 / 10) ** 0.5], rel=1e-12)
    assert clip_coefficients(rows, torch.zeros(3)).tolist() == [0.0, 0.0, 0.0]
