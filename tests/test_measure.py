"""The losses a scorer measures: a Δ that moves the model toward the claimed data lowers its loss there
more than on other data; a zero Δ changes nothing; the claimed windows are the ones the ticket's part
names."""

from __future__ import annotations

import torch
from torch import nn

from dilocod.data.cursor import ChunkCursor, part_windows
from dilocod.data.schedule import Grant
from dilocod.trust.measure import measure, pick, random_starts
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
