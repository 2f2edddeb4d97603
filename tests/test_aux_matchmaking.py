"""An auxiliary reducer (the bootstrap) never makes a group with a single trainer.

Real DHTs, p2pd daemons and averager processes (in-process API). Two trainers reach matchmaking a few
seconds apart, longer than the matchmaking window, while an auxiliary reducer keeps looking for a group
as the bootstrap does. The first trainer must wait for the second, whichever of them leads, instead of
averaging with the reducer alone (which averages nothing and splits the run's trainers into pairs).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import torch

from peers.group import AveragingSettings, GroupAverager, RoundOutcome
from peers.node import Node, NodeSettings
from proto import encode_ticket

pytestmark = pytest.mark.integration

SHAPES = [(50_000,), (7, 3)]
NUM = sum(torch.Size(s).numel() for s in SHAPES)
STEP = 5
LATE = 3.5  # the second trainer arrives this long after the first: over twice the matchmaking window
OPTIONS = dict(target_group_size=3, min_group_size=2, min_matchmaking_time=1.5, matchmaking_timeout=12.0)


def tokens(role: str) -> dict[str, object]:
    """A trainer claims a round's tokens; a helper none."""
    trainer = role == "peer"
    return {
        "tokens": 1000 if trainer else 0,
        "tokens_per_second": 100.0 if trainer else 0.0,
        "train_seconds": 10.0 if trainer else 0.0,
        "manifest_hash": "ab" * 32,
    }


def ticket(role: str) -> bytes:
    return encode_ticket(
        {"outer_step": STEP, "global_sha256": "a" * 64, "num_params": NUM, "role": role, **tokens(role)}
    )


@pytest.fixture(scope="module")
def members() -> Iterator[tuple[GroupAverager, GroupAverager, GroupAverager]]:
    nodes: list[Node] = []
    groups: list[GroupAverager] = []
    try:
        for mode in ("aux", "node", "node"):
            initial = tuple(nodes[0].visible_maddrs()[:1]) if nodes else ()
            node = Node(NodeSettings(run_id="auxtest", initial_peers=initial, host="127.0.0.1"))
            node.start()
            nodes.append(node)
            opts = AveragingSettings(**OPTIONS, mode=mode)  # type: ignore[arg-type]
            group = GroupAverager(node, [torch.zeros(s) for s in SHAPES], opts, state_provider=None)
            group.start()
            groups.append(group)
        yield groups[0], groups[1], groups[2]
    finally:
        for group in groups:
            group.stop()
        for node in nodes:
            node.stop()


async def reduce_until(aux: GroupAverager, done: asyncio.Event) -> list[RoundOutcome]:
    """What the bootstrap does: look for a group at the run's step, again and again."""
    outcomes = []
    while not done.is_set():
        outcomes.append(await aux.average(STEP, ticket("helper"), [torch.zeros(s) for s in SHAPES]))
    return outcomes


def test_a_trainer_waits_for_the_other_rather_than_averaging_with_the_reducer_alone(
    members: tuple[GroupAverager, GroupAverager, GroupAverager],
) -> None:
    aux, first, second = members
    gen = torch.Generator().manual_seed(7)
    inputs = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(2)]

    async def scenario() -> tuple[RoundOutcome, RoundOutcome, list[RoundOutcome]]:
        done = asyncio.Event()
        reducing = asyncio.create_task(reduce_until(aux, done))
        await asyncio.sleep(2.0)  # the reducer is already looking when the trainers come
        early = asyncio.create_task(first.average(STEP, ticket("peer"), inputs[0]))
        await asyncio.sleep(LATE)
        late = await second.average(STEP, ticket("peer"), inputs[1])
        outcome = await early
        done.set()
        return outcome, late, await reducing

    early, late, reduced = asyncio.run(scenario())
    for outcome in (early, late):
        assert outcome.found_group and outcome.complete, outcome
        assert outcome.contributors == 2, outcome  # both trainers, not one trainer and the reducer
        assert outcome.averaged is not None
    assert early.averaged is not None and late.averaged is not None
    for got, other, a, b in zip(early.averaged, late.averaged, *inputs, strict=True):
        assert torch.equal(got, other)
        torch.testing.assert_close(got, (a + b) / 2)
    # The reducer took part in the trainers' group and in no group of one trainer.
    met = [o for o in reduced if o.found_group]
    assert met and all(o.contributors == 2 for o in met), reduced
