"""Many real all-reduce rounds in a row (4 members, real p2pd on loopback, jitter injected): none may be cut.

Issue 15: a round sometimes failed for one member with "peer … sent 3 parts, but we expected 4": the
reducer had sent every average and closed its end of the stream, and the last one was lost between the two
p2pd daemons (see `ExactAllReduceRunner._exchange_with_reducer`). Here senders pause at random before each
part and reducers stall at random before each average, with 512 KiB parts (4 per reducer): a reply bigger
than a socket's buffer is what was cut.

Measured with the fix disabled (the stock close order), on a loaded 2-core machine: 8 cut rounds in 350
(3/100, 2/100, 3/150), each "sent 3 parts, but we expected 4"; so this test's 100 rounds miss the bug about
one time in ten. With the fix: 0 in the runs written down in docs/benchmarks.md (issue 15). A longer run:
`STRESS_ROUNDS=250 CI=true python -m pytest -q -s tests/test_allreduce_stress.py`.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import torch

from peers import allreduce, group
from peers.group import AveragingSettings, GroupAverager, RoundOutcome
from tests.averagers import started_averagers
from tests.fakes import round_ticket

pytestmark = pytest.mark.integration

MEMBERS = 4
PART_BYTES = 512 * 1024  # hivemind's default part size
PARTS_PER_REDUCER = 4
NUM = MEMBERS * PARTS_PER_REDUCER * PART_BYTES // 4  # fp32 values: every reducer gets 4 whole parts
MAX_SENDER_PAUSE = 0.02  # seconds, before each part a member sends
MAX_REDUCER_STALL = 0.02  # seconds, before each average a reducer sends back
ROUNDS = int(os.environ.get("STRESS_ROUNDS", "100"))  # about 80 s in all on 2 cores


def ticket(step: int) -> bytes:
    return round_ticket(step, NUM, "c" * 64)


class SmallPartAverager(group.RunAverager):
    """The run's averager with parts of PART_BYTES."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, part_size_bytes=PART_BYTES, **kwargs)


class JitteryRunner(allreduce.ExactAllReduceRunner):
    """Senders pause between parts and reducers stall before replies, at random (in the averager process)."""

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[Any]:
        async for message in super()._generate_input_for_peer(peer_index):
            await asyncio.sleep(random.uniform(0, MAX_SENDER_PAUSE))
            yield message

    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[Any], sender_index: int
    ) -> AsyncIterator[Any]:
        async for message in super()._accumulate_parts_streaming(stream, sender_index):
            await asyncio.sleep(random.uniform(0, MAX_REDUCER_STALL))
            yield message


@pytest.fixture(scope="module")
def quartet() -> Iterator[list[GroupAverager]]:
    patch = pytest.MonkeyPatch()
    # Set before the averager processes fork: they inherit both classes.
    patch.setattr(group, "RunAverager", SmallPartAverager)
    patch.setattr("peers.averager.ExactAllReduceRunner", JitteryRunner)
    options = AveragingSettings(target_group_size=MEMBERS, min_matchmaking_time=2.0, matchmaking_timeout=15.0)
    try:
        with started_averagers("stresstest", [torch.zeros(NUM)], [options] * MEMBERS) as groups:
            yield groups
    finally:
        patch.undo()


def cut_rounds(groups: list[GroupAverager], count: int) -> list[str]:
    """Run `count` rounds one after another; one line per round that was not complete for every member."""
    cut: list[str] = []
    inputs = [[torch.full((NUM,), float(k))] for k in range(MEMBERS)]

    async def rounds() -> None:
        for step in range(count):
            outcomes: list[RoundOutcome] = await asyncio.gather(
                *(g.average(step, ticket(step), x, group_target=MEMBERS) for g, x in zip(groups, inputs))
            )
            bad = [o for o in outcomes if o.reducer_errors or not o.complete or o.group_size != MEMBERS]
            if bad:
                cut.append(f"round {step}: {[(o.group_size, o.reducer_errors, o.error) for o in bad]}")
                print(cut[-1], flush=True)

    asyncio.run(rounds())
    return cut


def test_no_round_is_cut(quartet: list[GroupAverager]) -> None:
    started = time.monotonic()
    cut = cut_rounds(quartet, ROUNDS)
    print(f"{ROUNDS} rounds, {len(cut)} incomplete, {time.monotonic() - started:.0f} s")
    assert not cut, cut
