"""The losses a scorer measures: a Δ that moves the model toward the claimed data lowers its loss there
more than on other data; a zero Δ changes nothing; the claimed windows are the ones the ticket's part
names."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dilocod.data.cursor import ChunkCursor, part_windows
from dilocod.data.schedule import Grant
from dilocod.trust.measure import measure, pick, random_starts, reference_step
from dilocod.trust.scoring import score


class Bigram(nn.Module):
    def __init__(self, vocab: int = 8) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(vocab, vocab))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table[x]


def batches() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    claimed_x = torch.tensor([[0, 1, 0, 1]])  # 0 → 1, 1 → 0
    random_x = torch.tensor([[2, 3, 4, 5]])
    return (claimed_x, (claimed_x + 1) % 2), (random_x, random_x + 1)


def test_a_delta_toward_the_claimed_data_passes_and_a_zero_delta_does_not() -> None:
    model = Bigram()
    start = [torch.zeros(8, 8)]
    claimed, rand = batches()
    toward = torch.zeros(8, 8)
    toward[0, 1] = toward[1, 0] = -1.0  # θ − Δ raises the logits of the claimed transitions
    assert score(measure(model, start, [toward], None, claimed, rand)).passed
    assert not score(measure(model, start, [torch.zeros(8, 8)], None, claimed, rand)).passed
    general = torch.zeros(8, 8)
    for a in range(7):
        general[a, a + 1] = -1.0  # helps the random text as much: not the claimed data's work
    general[0, 1] = general[1, 0] = -1.0
    verdict = score(measure(model, start, [general], None, rand, rand))
    assert not verdict.passed  # claimed = random: no gain beyond random


def test_against_a_reference_only_work_on_the_claimed_data_passes() -> None:
    model = Bigram()
    start = [torch.zeros(8, 8)]
    claimed, rand = batches()
    toward = torch.zeros(8, 8)
    toward[0, 1] = toward[1, 0] = -1.0  # the claimed transitions
    elsewhere = torch.zeros(8, 8)
    for a in range(2, 7):
        elsewhere[a, a + 1] = -1.0  # work on other data: the random text's transitions
    elsewhere[0, 0] = elsewhere[1, 1] = 1.0  # which also moves the claimed rows a little
    honest = score(measure(model, start, [toward], None, claimed, rand, reference=[elsewhere]))
    assert honest.passed and honest.reference_margin is not None and honest.reference_margin > 0
    other = elsewhere.clone()
    wrong = score(measure(model, start, [other], None, claimed, rand, reference=[elsewhere]))
    assert not wrong.passed and wrong.reference_margin == 0.0  # no more than work on other data
    assert not score(measure(model, start, [toward * 0], None, claimed, rand, reference=[elsewhere])).passed
    alone = measure(model, start, [toward], None, claimed, None, reference=[elsewhere])  # no random text
    assert alone.random_before is None and alone.random_after is None
    assert score(alone).passed and score(alone).reference_margin == honest.reference_margin


def test_the_reference_is_measured_as_far_as_the_delta_reaches_never_further() -> None:
    d, ref = [torch.full((4,), 1.0)], [torch.full((4,), 4.0)]
    assert reference_step(d, ref, 1.0) == pytest.approx(0.25)  # a contributor with fewer steps
    assert reference_step([torch.full((4,), 40.0)], ref, 1.0) == 1.0  # a Δ made large: the reference ends
    assert reference_step(d, [torch.zeros(4)], 0.5) == 0.5
    model = Bigram()
    with pytest.raises(ValueError, match="shapes"):
        measure(model, [torch.zeros(8, 8)], [torch.zeros(8, 8)], None, *batches(), reference=[torch.zeros(3)])


def test_part_windows_are_the_cursor_s_windows() -> None:
    cursor = ChunkCursor(16, seed="ds")
    cursor.adopt([Grant(0, 2, 2 * 256, 256, 0)])
    taken = cursor.windows(5)
    assert taken is not None
    assert part_windows("ds", (0, 2, 0, 5 * 16), 256, 10_000, 16) == taken


def test_picks_are_seeded() -> None:
    values = list(range(100))
    assert pick(values, 5, "a") == pick(values, 5, "a") != pick(values, 5, "b")
    assert pick([1, 2], 5, "a") == [1, 2]
    assert random_starts(1000, 16, 4, "x") == random_starts(1000, 16, 4, "x")
    assert random_starts(10, 16, 4, "x") == []
