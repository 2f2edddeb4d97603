"""Compressed all-reduce with real DHTs, p2pd daemons and averager processes (in-process API).

Each class starts its own trio and stops it when its tests are done, so one trio runs at a time.
Expected results are computed here from the same pure functions, bit for bit: every contribution is
decode(encode(part)), the reducer reduces those values part by part (hivemind's 131072-element parts)
and every member applies decode(encode(result)).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import pytest
import torch

from dilocod.aggregation import ReducerSettings, ScreeningSettings
from dilocod.aggregation.partrules import make_part_check, make_part_reduce, make_part_weigh
from dilocod.codecs import Codec, ErrorFeedback, TopKCodec, make_codec, roundtrip
from dilocod.trust.adversary import Adversary, AdversaryConfig
from peers.group import AveragingSettings, GroupAverager, RoundOutcome
from peers.node import Node
from peers.partrelay import combine
from peers.wirecodec import PartCodec
from tests.averagers import started_averagers
from tests.fakes import round_ticket

pytestmark = pytest.mark.integration

SHAPES = [(300_000,), (17, 3)]  # tensor 0 is three parts: [0, 131072), [131072, 262144), [262144, 300000)
PART = 131072  # hivemind's 512 KiB parts, in fp32 elements: the split does not depend on the codec
NUM = sum(torch.Size(s).numel() for s in SHAPES)
SHA = "a" * 64
MAGIC = 12345.0  # a part starting with this value leaves the saboteur malformed


def ticket(step: int) -> bytes:
    return round_ticket(step, NUM, SHA)


class Saboteur:
    """int8 on the wire, except that a part whose first value is MAGIC goes out with a NaN scale."""

    name = wire_name = "int8"  # meets honest int8 members

    def __init__(self) -> None:
        self.inner = make_codec("int8")

    @property
    def alignment(self) -> int:
        return self.inner.alignment

    def encoded_size(self, numel: int) -> int:
        return self.inner.encoded_size(numel)

    def encode(self, x: torch.Tensor) -> bytes:
        data = self.inner.encode(x)
        return b"\xff\xff" + data[2:] if x.numel() and float(x[0]) == MAGIC else data

    def decode(self, data: bytes | bytearray | memoryview, numel: int) -> torch.Tensor:
        return self.inner.decode(data, numel)


def run_round(groups: list[GroupAverager], step: int, inputs: list[list[torch.Tensor]]) -> list[RoundOutcome]:
    async def together() -> list[RoundOutcome]:
        return list(await asyncio.gather(*(g.average(step, ticket(step), x) for g, x in zip(groups, inputs))))

    return asyncio.run(together())


def random_inputs(seed: int, scale: float = 1.0) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) * scale for s in SHAPES] for _ in range(3)]


def assert_identical(outcomes: list[RoundOutcome]) -> list[torch.Tensor]:
    assert all(o.found_group and o.complete and o.in_majority for o in outcomes), [
        (o.found_group, o.complete, o.in_majority, o.rejected_reducers, o.faulty) for o in outcomes
    ]
    results = [o.averaged for o in outcomes]
    first = results[0]
    assert first is not None
    for other in results[1:]:
        assert other is not None
        assert all(torch.equal(a, b) for a, b in zip(first, other, strict=True)), [
            [(lo, float((a.reshape(-1)[lo : lo + PART] - b.reshape(-1)[lo : lo + PART]).abs().max()))
             for lo in range(0, a.numel(), PART)]
            for a, b in zip(first, other, strict=True)
        ] + [o.members for o in outcomes]  # fmt: skip
    return first


def part_bytes(codec: Codec) -> int:
    """Σ over the wire's parts of the codec's payload size for that part."""
    return sum(
        codec.encoded_size(min(PART, n - start))
        for n in (torch.Size(s).numel() for s in SHAPES)
        for start in range(0, n, PART)
    )


def reduce_by_parts(
    contributions: list[list[torch.Tensor]],
    codec: Codec,
    reduce: object,
    order: list[int],
    reencode: bool = True,
) -> list[torch.Tensor]:
    """What the group must apply: each part of the decoded contributions reduced (senders in group order),
    then encoded and decoded once (unless `reencode` is false: relayed parts)."""
    out = []
    for i, shape in enumerate(SHAPES):
        flat = [roundtrip(codec, [c[i]])[0].reshape(-1) for c in contributions]
        parts = []
        for start in range(0, flat[0].numel(), PART):
            stacked = torch.stack([flat[s][start : start + PART] for s in order])
            reduced, _ = reduce(stacked, torch.ones(len(order)))  # type: ignore[operator]
            parts.append(roundtrip(codec, [reduced])[0] if reencode else reduced)
        out.append(torch.cat(parts).reshape(shape))
    return out


def group_order(outcome: RoundOutcome, nodes: list[Node]) -> list[int]:
    """The trio's indices in the group's sender order (the reducers sum rows in that order)."""
    index = {node.peer_id: i for i, node in enumerate(nodes)}
    return [index[peer] for peer in outcome.members]


ROBUST = make_part_reduce(ReducerSettings("centered_clip"), ScreeningSettings())


def trio(key: str, options: list[AveragingSettings]) -> Iterator[tuple[list[Node], list[GroupAverager]]]:
    """Three averagers with these settings (one each), their nodes and groups, stopped when done."""
    with started_averagers(key, [torch.zeros(s) for s in SHAPES], options) as groups:
        yield [g.node for g in groups], groups


def checked(**settings: object) -> AveragingSettings:
    """A member as the daemon runs one: screened, checking what comes back."""
    return AveragingSettings(
        target_group_size=3, min_matchmaking_time=2.0, matchmaking_timeout=15.0,
        check_part=make_part_check(ScreeningSettings()), **settings,  # type: ignore[arg-type]
    )  # fmt: skip


# Class-scoped: each trio stops after the last test of the class that uses it.
@pytest.fixture(scope="class")
def int8_trio() -> Iterator[tuple[list[Node], list[GroupAverager]]]:
    codecs: list[PartCodec] = [make_codec("int8"), Saboteur(), make_codec("int8")]
    options = [
        AveragingSettings(target_group_size=3, min_matchmaking_time=2.0, matchmaking_timeout=15.0, codec=c)
        for c in codecs
    ]
    yield from trio("avgtest-int8", options)


@pytest.fixture(scope="class")
def int2_trio() -> Iterator[tuple[list[Node], list[GroupAverager]]]:
    yield from trio("avgtest-int2", [checked(reduce_part=ROBUST, codec=make_codec("int2"))] * 3)


class TestInt8:
    """int8, the mean reducer, no receiver check; one member's codec can be made to send malformed bytes."""

    def test_identical_bits_error_bound_and_exact_bytes(
        self, int8_trio: tuple[list[Node], list[GroupAverager]]
    ) -> None:
        nodes, groups = int8_trio
        codec = make_codec("int8")
        inputs = random_inputs(0)
        outcomes = run_round(groups, 0, inputs)
        result = assert_identical(outcomes)

        # Bit for bit what the codec and the mean give, part by part.
        order = group_order(outcomes[0], nodes)
        mean = make_part_reduce(ReducerSettings("mean"), ScreeningSettings())
        expected = reduce_by_parts(inputs, codec, mean, order)
        assert all(torch.equal(a, b) for a, b in zip(result, expected, strict=True))

        # Within the codec's error bound of the exact mean: each contribution and the result itself are
        # off by at most absmax/254 (× the bf16 scale's rounding up).
        for got, xs in zip(result, zip(*inputs, strict=True), strict=True):
            exact = torch.stack([x.double() for x in xs]).mean(dim=0)
            top = max(float(x.abs().max()) for x in xs)
            bound = 2.02 * top / 254 * (1 + 2**-7)
            assert float((got.double() - exact).abs().max()) <= bound

        # Bytes: every part crosses the wire n − 1 times as a contribution and n − 1 times as a result,
        # at the codec's payload size (int8: 1 byte per value + 2 per 256-value block).
        wire = 2 * 2 * part_bytes(codec)
        assert sum(o.bytes_sent for o in outcomes) == sum(o.bytes_received for o in outcomes) == wire
        assert all(o.bytes_sent == o.bytes_received for o in outcomes)
        assert wire < 8 * NUM * 2 / 3.9  # about a quarter of fp32

    def test_malformed_and_non_finite_payloads_are_screened(
        self, int8_trio: tuple[list[Node], list[GroupAverager]]
    ) -> None:
        nodes, groups = int8_trio
        codec = make_codec("int8")
        inputs = random_inputs(1)
        inputs[1][0][0] = MAGIC  # member 1's first part goes out with a NaN scale
        inputs[2][0][PART + 5] = float("nan")  # member 2's second part cannot be encoded: empty payload
        outcomes = run_round(groups, 1, inputs)
        result = assert_identical(outcomes)  # nobody crashed, everyone applies the same bytes

        faulty = set().union(*(o.faulty for o in outcomes))
        assert faulty == {nodes[1].peer_id, nodes[2].peer_id}
        assert not any(o.rejected_reducers for o in outcomes)

        order = group_order(outcomes[0], nodes)
        # Parts that nobody spoiled: the mean of all three (only those parts of `full` are compared; the
        # NaN is zeroed so that member 2's whole tensor can be encoded here).
        encodable = [[x.clone() for x in member] for member in inputs]
        encodable[2][0][PART + 5] = 0.0
        full = reduce_by_parts(
            encodable, codec, make_part_reduce(ReducerSettings("mean"), ScreeningSettings()), order
        )

        def mean_of(members: list[int], lo: int, hi: int) -> torch.Tensor:
            rows = [roundtrip(codec, [inputs[m][0][lo:hi].contiguous()])[0] for m in members]
            total = torch.zeros(hi - lo, dtype=torch.float64)
            for row in rows:
                total += row.double()
            return roundtrip(codec, [(total / len(rows)).float()])[0]

        assert torch.equal(result[0][:PART], mean_of([0, 2], 0, PART))
        assert torch.equal(result[0][PART : 2 * PART], mean_of([0, 1], PART, 2 * PART))
        assert torch.equal(result[0][2 * PART :], full[0][2 * PART :])
        assert torch.equal(result[1], full[1])


class TestInt2ErrorFeedback:
    """int2 with error feedback, screened CenteredClip and the receiver check, as the daemon runs them."""

    REDUCE = staticmethod(ROBUST)

    def test_rounds_with_error_feedback_and_an_attacker(
        self, int2_trio: tuple[list[Node], list[GroupAverager]]
    ) -> None:
        nodes, groups = int2_trio
        codec = make_codec("int2")
        feedback = [ErrorFeedback(SHAPES) for _ in range(3)]
        sup = 0.0
        for step in range(3):
            deltas = random_inputs(10 + step, scale=10.0 ** (step - 1))
            sup = max(sup, max(float(d.abs().max()) for member in deltas for d in member))
            sent = [ef.compensate(d) for ef, d in zip(feedback, deltas)]
            if step == 2:
                sent[2] = [s * -1000.0 for s in sent[2]]  # a sign-flipping member: screened on decoded values
            outcomes = run_round(groups, 100 + step, sent)
            result = assert_identical(outcomes)
            expected = reduce_by_parts(sent, codec, self.REDUCE, group_order(outcomes[0], nodes))
            assert all(torch.equal(a, b) for a, b in zip(result, expected, strict=True)), f"round {step}"
            assert not any(o.rejected_reducers for o in outcomes)
            faulty = set().union(*(o.faulty for o in outcomes))
            assert faulty == ({nodes[2].peer_id} if step == 2 else set())
            if step == 2:  # the honest pair decides: the result is near their values, not the flipped ones
                honest = (sent[0][0] + sent[1][0]) / 2
                assert float((result[0] - honest).norm()) < float(honest.norm())  # the mean: ~333× off
            bytes_expected = 2 * 2 * part_bytes(codec)
            assert sum(o.bytes_sent for o in outcomes) == bytes_expected  # ~1/14 of fp32
            for ef, s in zip(feedback, sent):
                ef.update(s, roundtrip(codec, s))
            # The residual stays bounded: ≤ ρ/(1 − ρ)·sup|Δ| with ρ ≈ 1/3 for int2 (see codecs.feedback).
            worst = max(float(e.abs().max()) for ef in feedback[:2] for e in ef.residual)
            assert worst <= 0.51 * sup, (worst, sup)
        assert math.isfinite(sup)


TOPK = TopKCodec(4096, 64, 2)
SPARSE = make_part_weigh(ScreeningSettings())


@pytest.fixture(scope="class")
def topk_trio() -> Iterator[tuple[list[Node], list[GroupAverager]]]:
    yield from trio("avgtest-topk", [checked(weigh_part=SPARSE, codec=TOPK)] * 3)


def reduce_sparse_by_parts(contributions: list[list[torch.Tensor]], order: list[int]) -> list[torch.Tensor]:
    """What a topk group must apply: each part's decoded top-k rows combined by the sparse rule (every member
    reduces the relayed payloads itself: nothing re-encoded)."""

    def sparse(stacked: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        coefficients, faulty = SPARSE(stacked, weights)
        return combine(stacked, coefficients.tolist()), faulty

    return reduce_by_parts(contributions, TOPK, sparse, order, reencode=False)


class TestTopK:
    """topk: sparse parts out, the union of the supports back, the sparse rule at every reducer."""

    def test_identical_bits_union_of_supports_and_exact_bytes(
        self, topk_trio: tuple[list[Node], list[GroupAverager]]
    ) -> None:
        nodes, groups = topk_trio
        inputs = random_inputs(20)
        outcomes = run_round(groups, 200, inputs)
        result = assert_identical(outcomes)
        order = group_order(outcomes[0], nodes)
        expected = reduce_sparse_by_parts(inputs, order)
        assert all(torch.equal(a, b) for a, b in zip(result, expected, strict=True))
        # The result holds the union of the members' supports (but where two members' values cancel exactly).
        for got, xs in zip(result, zip(*inputs, strict=True), strict=True):
            support = torch.zeros(got.numel(), dtype=torch.bool)
            for x in xs:
                support |= roundtrip(TOPK, [x])[0].reshape(-1) != 0
            kept = got.reshape(-1) != 0
            assert not bool((kept & ~support).any())
            assert int((support & ~kept).sum()) <= 0.001 * int(support.sum())  # members' values that cancel
        # Bytes: each part goes to its reducer n − 1 times, and each reducer relays the n − 1 payloads a sender
        # lacks to each of its n − 1 senders, after n status bytes and n coefficients: (n − 1) payloads a
        # member, an all-gather's.
        parts = sum(-(-torch.Size(s).numel() // PART) for s in SHAPES)
        wire = 2 * part_bytes(TOPK) + 2 * (2 * part_bytes(TOPK) + 3 * 9 * parts)
        assert sum(o.bytes_sent for o in outcomes) == sum(o.bytes_received for o in outcomes) == wire
        assert wire < 8 * NUM * 2 / 25  # int8 sends ~a quarter of fp32's bytes; topk a hundredth of it

    @pytest.mark.parametrize("mode", ["concentrate", "copy_support"])
    def test_a_sparse_attacker_is_clipped_to_the_groups_norm(
        self, mode: str, topk_trio: tuple[list[Node], list[GroupAverager]]
    ) -> None:
        nodes, groups = topk_trio
        inputs = random_inputs(21)
        attacker = Adversary(AdversaryConfig(mode=mode), seed=3)
        theta = [torch.zeros(s) for s in SHAPES]
        attacker.observe_global(theta)
        attacker.observe_global(
            [t - u for t, u in zip(theta, random_inputs(22)[0], strict=True)]
        )  # an update
        inputs[1] = attacker.corrupt_delta(inputs[1])
        outcomes = run_round(groups, 201 if mode == "concentrate" else 202, inputs)
        result = assert_identical(outcomes)
        assert not set().union(*(o.faulty for o in outcomes))  # under the screen: clipped, not dropped
        expected = reduce_sparse_by_parts(inputs, group_order(outcomes[0], nodes))
        assert all(torch.equal(a, b) for a, b in zip(result, expected, strict=True))
        # Clipped to at most the group's median norm of the part, the attacker moves the mean by at most that
        # / 3, whatever it concentrates or copies (concentrate, unclipped: ~5× the honest norm, / 3).
        for lo in range(0, SHAPES[0][0], PART):
            hi = min(lo + PART, SHAPES[0][0])
            norms = [float(roundtrip(TOPK, [x[0][lo:hi].contiguous()])[0].norm()) for x in inputs]
            bound = (norms[0] + norms[2] + sorted(norms)[1]) / 3
            assert float(result[0][lo:hi].norm()) <= bound * (1 + 1e-5), (lo, norms)
