"""Tests for dilocod.diloco.outer: the outer Nesterov step against hand arithmetic, hashing, state."""

from __future__ import annotations

import hashlib
import math
import struct

import pytest
import torch

from dilocod.diloco import outer as outer_module
from dilocod.diloco.outer import (
    REBASE_MAX_GAP,
    OuterConfig,
    OuterOptimizer,
    global_sha256,
    keeps_progress,
    rebase,
)

THETA0 = [1.0, -2.0, 0.5]
DELTAS = [
    [0.1, 0.2, -0.3],
    [0.05, -0.1, 0.2],
    [-0.2, 0.0, 0.1],
]


def vec(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def assert_fp32_close(actual: torch.Tensor, expected: list[float]) -> None:
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, vec(expected), rtol=1.3e-6, atol=1e-6)


def le_fp32_sha(*groups: list[float]) -> str:
    """sha256 of the values packed as little-endian IEEE-754 single precision, in order."""
    data = b"".join(struct.pack(f"<{len(g)}f", *g) for g in groups)
    return hashlib.sha256(data).hexdigest()


def random_tensors(seed: int, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in shapes]


SHAPES = [(4, 3), (5,), (2, 2, 2)]


# ---------------------------------------------------------------- the outer step, by hand


def test_nesterov_three_steps_match_hand_arithmetic() -> None:
    # lr = 0.7, μ = 0.9; m ← μ·m + Δ; θ ← θ − lr·(Δ + μ·m)
    # step 1: m1 = Δ1                     = [0.1, 0.2, -0.3]
    #         d1 = Δ1 + 0.9·m1 = 1.9·Δ1   = [0.19, 0.38, -0.57]
    #         θ1 = θ0 − 0.7·d1            = [1 − 0.133, −2 − 0.266, 0.5 + 0.399] = [0.867, −2.266, 0.899]
    # step 2: m2 = 0.9·m1 + Δ2            = [0.09 + 0.05, 0.18 − 0.1, −0.27 + 0.2] = [0.14, 0.08, −0.07]
    #         d2 = Δ2 + 0.9·m2            = [0.05 + 0.126, −0.1 + 0.072, 0.2 − 0.063] = [0.176, −0.028, 0.137]
    #         θ2 = θ1 − 0.7·d2            = [0.867 − 0.1232, −2.266 + 0.0196, 0.899 − 0.0959]
    #                                     = [0.7438, −2.2464, 0.8031]
    # step 3: m3 = 0.9·m2 + Δ3            = [0.126 − 0.2, 0.072 + 0, −0.063 + 0.1] = [−0.074, 0.072, 0.037]
    #         d3 = Δ3 + 0.9·m3            = [−0.2 − 0.0666, 0 + 0.0648, 0.1 + 0.0333] = [−0.2666, 0.0648, 0.1333]
    #         θ3 = θ2 − 0.7·d3            = [0.7438 + 0.18662, −2.2464 − 0.04536, 0.8031 − 0.09331]
    #                                     = [0.93042, −2.29176, 0.70979]
    expected = [
        ([0.867, -2.266, 0.899], [0.1, 0.2, -0.3]),
        ([0.7438, -2.2464, 0.8031], [0.14, 0.08, -0.07]),
        ([0.93042, -2.29176, 0.70979], [-0.074, 0.072, 0.037]),
    ]
    opt = OuterOptimizer([vec(THETA0)], OuterConfig(lr=0.7, momentum=0.9, nesterov=True))
    for step, (delta, (theta, momentum)) in enumerate(zip(DELTAS, expected, strict=True), start=1):
        opt.apply([vec(delta)])
        assert opt.step == step
        assert_fp32_close(opt.params[0], theta)
        assert_fp32_close(opt.momentum[0], momentum)
        assert opt.sha256 == global_sha256(opt.params)


def test_plain_momentum_three_steps_match_hand_arithmetic() -> None:
    # lr = 0.7, μ = 0.9, no Nesterov: m ← μ·m + Δ; θ ← θ − lr·m
    # step 1: m1 = [0.1, 0.2, −0.3];    θ1 = θ0 − 0.7·m1 = [1 − 0.07, −2 − 0.14, 0.5 + 0.21] = [0.93, −2.14, 0.71]
    # step 2: m2 = [0.14, 0.08, −0.07]; θ2 = θ1 − 0.7·m2 = [0.93 − 0.098, −2.14 − 0.056, 0.71 + 0.049]
    #                                                    = [0.832, −2.196, 0.759]
    # step 3: m3 = [−0.074, 0.072, 0.037]; θ3 = θ2 − 0.7·m3 = [0.832 + 0.0518, −2.196 − 0.0504, 0.759 − 0.0259]
    #                                                       = [0.8838, −2.2464, 0.7331]
    expected = [
        ([0.93, -2.14, 0.71], [0.1, 0.2, -0.3]),
        ([0.832, -2.196, 0.759], [0.14, 0.08, -0.07]),
        ([0.8838, -2.2464, 0.7331], [-0.074, 0.072, 0.037]),
    ]
    opt = OuterOptimizer([vec(THETA0)], OuterConfig(lr=0.7, momentum=0.9, nesterov=False))
    for delta, (theta, momentum) in zip(DELTAS, expected, strict=True):
        opt.apply([vec(delta)])
        assert_fp32_close(opt.params[0], theta)
        assert_fp32_close(opt.momentum[0], momentum)


def test_zero_momentum_is_plain_sgd() -> None:
    opt = OuterOptimizer([vec(THETA0)], OuterConfig(lr=0.5, momentum=0.0))
    opt.apply([vec(DELTAS[0])])
    # θ1 = θ0 − 0.5·Δ1 = [1 − 0.05, −2 − 0.1, 0.5 + 0.15]
    assert_fp32_close(opt.params[0], [0.95, -2.1, 0.65])


def test_apply_updates_every_tensor() -> None:
    opt = OuterOptimizer([vec([1.0, 2.0]), vec([3.0])], OuterConfig(lr=1.0, momentum=0.5, nesterov=False))
    opt.apply([vec([0.5, 0.25]), vec([-1.0])])
    # m = Δ; θ = θ − 1·m
    assert_fp32_close(opt.params[0], [0.5, 1.75])
    assert_fp32_close(opt.params[1], [4.0])


def test_apply_accepts_other_float_dtypes() -> None:
    opt = OuterOptimizer([vec(THETA0)], OuterConfig())
    opt.apply([torch.tensor(DELTAS[0], dtype=torch.float64)])
    assert opt.params[0].dtype == torch.float32 and opt.momentum[0].dtype == torch.float32


def test_initial_params_are_fp32_copies() -> None:
    source = torch.tensor(THETA0, dtype=torch.float64)
    opt = OuterOptimizer([source], OuterConfig())
    assert opt.params[0].dtype == torch.float32
    assert opt.step == 0 and opt.num_elements == 3
    assert torch.equal(opt.momentum[0], torch.zeros(3))
    source.add_(1.0)
    assert_fp32_close(opt.params[0], THETA0)


# ---------------------------------------------------------------- pseudo-gradient


def test_pseudo_gradient_is_global_minus_local() -> None:
    opt = OuterOptimizer([vec(THETA0), vec([4.0])], OuterConfig())
    local = [vec([0.75, -1.5, 1.0]), torch.tensor([3.0], dtype=torch.float64)]
    delta = opt.pseudo_gradient(local)
    # Δ = θ_global − θ_local = [1 − 0.75, −2 + 1.5, 0.5 − 1], [4 − 3]
    assert_fp32_close(delta[0], [0.25, -0.5, -0.5])
    assert_fp32_close(delta[1], [1.0])


def test_pseudo_gradient_does_not_change_the_optimizer() -> None:
    opt = OuterOptimizer([vec(THETA0)], OuterConfig())
    before = opt.sha256
    opt.pseudo_gradient([vec([0.0, 0.0, 0.0])])
    assert opt.sha256 == before == global_sha256([vec(THETA0)])
    assert_fp32_close(opt.params[0], THETA0)


def test_applying_the_own_pseudo_gradient_with_lr_1_and_no_momentum_lands_on_local() -> None:
    opt = OuterOptimizer([vec(THETA0)], OuterConfig(lr=1.0, momentum=0.0))
    local = vec([0.5, 0.5, 0.5])
    opt.apply(opt.pseudo_gradient([local]))
    assert torch.equal(opt.params[0], local)


def test_pseudo_gradient_count_mismatch_raises() -> None:
    opt = OuterOptimizer([vec(THETA0)], OuterConfig())
    with pytest.raises(ValueError, match="expected 1 tensors, got 2"):
        opt.pseudo_gradient([vec(THETA0), vec(THETA0)])


def test_pseudo_gradient_shape_mismatch_raises() -> None:
    opt = OuterOptimizer([vec(THETA0)], OuterConfig())
    with pytest.raises(ValueError):
        opt.pseudo_gradient([vec([1.0])])


# ---------------------------------------------------------------- global_sha256


def test_sha256_is_of_little_endian_fp32_bytes_in_order() -> None:
    a, b = [1.0, -2.0, 0.5], [3.25, 1e-3]
    assert global_sha256([vec(a), vec(b)]) == le_fp32_sha(a, b)


def test_sha256_flattens_row_major_and_casts_to_fp32() -> None:
    matrix = [[1.0, 2.0], [3.0, 4.0]]
    expected = le_fp32_sha([1.0, 2.0, 3.0, 4.0])
    assert global_sha256([torch.tensor(matrix)]) == expected
    assert global_sha256([torch.tensor(matrix, dtype=torch.float64)]) == expected
    assert global_sha256([torch.tensor(matrix).t().contiguous().t()]) == expected  # non-contiguous view


def test_sha256_of_nothing_is_sha256_of_empty_bytes() -> None:
    assert global_sha256([]) == hashlib.sha256(b"").hexdigest()


def test_sha256_changes_with_one_ulp() -> None:
    tensors = [vec(THETA0), vec([3.0])]
    bumped = [tensors[0].clone(), tensors[1].clone()]
    bumped[0][1] = torch.nextafter(bumped[0][1], torch.tensor(math.inf))
    assert bumped[0][1].item() != tensors[0][1].item()
    assert global_sha256(bumped) != global_sha256(tensors)


def test_sha256_depends_on_order() -> None:
    a, b = vec([1.0, 2.0]), vec([3.0, 4.0])
    assert global_sha256([a, b]) != global_sha256([b, a])
    assert global_sha256([vec([1.0, 2.0])]) != global_sha256([vec([2.0, 1.0])])


def test_sha256_distinguishes_negative_zero() -> None:
    assert global_sha256([vec([0.0])]) != global_sha256([vec([-0.0])])


# ---------------------------------------------------------------- determinism and state


def test_two_optimizers_with_identical_inputs_end_bit_identical() -> None:
    initial = random_tensors(0, SHAPES)
    a = OuterOptimizer(initial, OuterConfig())
    b = OuterOptimizer([t.clone() for t in initial], OuterConfig())
    for round_seed in range(1, 6):
        delta = [t * 0.01 for t in random_tensors(round_seed, SHAPES)]
        a.apply(delta)
        b.apply([t.clone() for t in delta])
    for x, y in zip([*a.params, *a.momentum], [*b.params, *b.momentum], strict=True):
        assert torch.equal(x, y)
    assert a.sha256 == b.sha256 == global_sha256(b.params)
    assert a.step == b.step == 5


def test_state_tensors_are_params_then_momentum() -> None:
    opt = OuterOptimizer(random_tensors(0, SHAPES), OuterConfig())
    opt.apply(random_tensors(1, SHAPES))
    state = opt.state_tensors()
    assert len(state) == 2 * len(SHAPES)
    for got, want in zip(state, [*opt.params, *opt.momentum], strict=True):
        assert torch.equal(got, want)


def test_load_state_round_trip() -> None:
    source = OuterOptimizer(random_tensors(0, SHAPES), OuterConfig())
    for seed in (1, 2):
        source.apply(random_tensors(seed, SHAPES))
    target = OuterOptimizer(random_tensors(9, SHAPES), OuterConfig())
    target.load_state(source.step, [t.clone() for t in source.state_tensors()])
    assert target.step == 2
    assert target.sha256 == source.sha256
    for got, want in zip(target.state_tensors(), source.state_tensors(), strict=True):
        assert torch.equal(got, want)
    # the momentum came along too: the next step agrees bit for bit
    delta = random_tensors(3, SHAPES)
    source.apply(delta)
    target.apply(delta)
    assert target.sha256 == source.sha256


def test_an_outer_step_replaces_the_state_and_never_writes_the_tensors_held_before() -> None:
    # The state served to re-syncing peers and a checkpoint being written hold θ_global and the momentum
    # without a copy of their own: an outer step must leave what they hold as it was.
    opt = OuterOptimizer(random_tensors(0, SHAPES), OuterConfig())
    opt.apply(random_tensors(2, SHAPES))
    held = opt.state_tensors()
    copies = [t.clone() for t in held]
    sha = opt.sha256
    opt.apply(random_tensors(3, SHAPES))
    assert all(torch.equal(h, c) for h, c in zip(held, copies))
    assert global_sha256(held[: len(SHAPES)]) == sha != opt.sha256
    assert all(not torch.equal(h, p) for h, p in zip(held, opt.state_tensors()))


def test_load_state_takes_the_tensors_given_and_an_outer_step_leaves_them_unchanged() -> None:
    state = [t.clone() for t in OuterOptimizer(random_tensors(0, SHAPES), OuterConfig()).state_tensors()]
    copies = [t.clone() for t in state]
    opt = OuterOptimizer(random_tensors(1, SHAPES), OuterConfig())
    opt.load_state(4, state)
    assert opt.sha256 == global_sha256(copies[: len(SHAPES)])
    opt.apply(random_tensors(2, SHAPES))
    assert all(torch.equal(t, c) for t, c in zip(state, copies))


def test_load_state_wrong_count_raises() -> None:
    opt = OuterOptimizer(random_tensors(0, SHAPES), OuterConfig())
    with pytest.raises(ValueError, match="expected 6 state tensors, got 3"):
        opt.load_state(1, opt.params)


def test_load_state_shape_mismatch_raises_and_changes_nothing() -> None:
    opt = OuterOptimizer(random_tensors(0, SHAPES), OuterConfig())
    before = [t.clone() for t in opt.state_tensors()]
    bad = [t.clone() + 1 for t in opt.state_tensors()]
    bad[-1] = torch.zeros(3)
    with pytest.raises(ValueError, match="shape mismatch"):
        opt.load_state(7, bad)
    assert opt.step == 0
    for got, want in zip(opt.state_tensors(), before, strict=True):
        assert torch.equal(got, want)


def test_apply_wrong_count_raises() -> None:
    opt = OuterOptimizer(random_tensors(0, SHAPES), OuterConfig())
    with pytest.raises(ValueError, match="expected 3 tensors, got 1"):
        opt.apply([torch.zeros(4, 3)])


def test_apply_shape_mismatch_raises() -> None:
    opt = OuterOptimizer([vec(THETA0)], OuterConfig())
    with pytest.raises(ValueError, match="shape mismatch"):
        opt.apply([vec([1.0, 2.0])])
    assert opt.step == 0


def test_apply_shape_mismatch_leaves_state_untouched() -> None:
    opt = OuterOptimizer([vec(THETA0), vec([1.0, 2.0])], OuterConfig())
    with pytest.raises(ValueError, match="shape mismatch"):
        opt.apply([vec(DELTAS[0]), vec([1.0])])
    assert_fp32_close(opt.params[0], THETA0)
    assert torch.equal(opt.momentum[0], torch.zeros(3))
    assert opt.sha256 == global_sha256(opt.params)


# ---------------------------------------------------------------- OuterConfig.validate


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (OuterConfig(lr=-0.1), "outer.lr"),
        (OuterConfig(lr=math.nan), "outer.lr"),
        (OuterConfig(momentum=1.0), "outer.momentum"),
        (OuterConfig(momentum=1.5), "outer.momentum"),
        (OuterConfig(momentum=-0.01), "outer.momentum"),
        (OuterConfig(momentum=math.nan), "outer.momentum"),
    ],
)
def test_outer_config_validate_rejects(cfg: OuterConfig, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cfg.validate()
    with pytest.raises(ValueError, match=match):
        OuterOptimizer([vec(THETA0)], cfg)


@pytest.mark.parametrize(
    "cfg", [OuterConfig(), OuterConfig(momentum=0.0), OuterConfig(lr=1e-6, momentum=0.999)]
)
def test_outer_config_validate_accepts(cfg: OuterConfig) -> None:
    cfg.validate()


def test_rebase_keeps_the_pseudo_gradient_measured_from_the_new_global() -> None:
    old_global, local = [vec(THETA0)], [vec([0.9, -1.8, 0.7])]
    new_global = [vec([1.5, -2.5, 0.0])]
    rebased = rebase(local, old_global, new_global)
    # the peer's unsent progress (old θ_global − local) is what it now holds against the new θ_global
    assert_fp32_close(new_global[0] - rebased[0], [0.1, -0.2, -0.2])
    assert_fp32_close(rebased[0], [1.4, -2.3, 0.2])
    # a peer with no progress (a fresh one) lands exactly on the new θ_global
    assert torch.equal(rebase(old_global, old_global, new_global)[0], new_global[0])
    with pytest.raises(ValueError, match="rebase"):
        rebase(local, old_global, [])


def test_progress_is_kept_only_for_a_near_re_sync_and_only_when_enabled() -> None:
    on, off = OuterConfig(), OuterConfig(rebase_on_resync=False)
    assert on.rebase_on_resync  # every peer's tokens count: on by default
    assert keeps_progress(on, 7, 7)  # the losing side of a split at our own step
    assert keeps_progress(on, 7, 8) and keeps_progress(on, 7, 7 + REBASE_MAX_GAP)
    assert not keeps_progress(on, 7, 8 + REBASE_MAX_GAP)  # e.g. restarted from an old checkpoint
    assert not keeps_progress(on, 7, 6)
    assert not keeps_progress(off, 7, 8)


@pytest.mark.parametrize("nesterov", [True, False])
def test_the_step_gives_the_bits_of_the_textbook_ops_in_their_order(nesterov: bool) -> None:
    """m' = μ·m + Δ, then θ' = θ − lr·(Δ + μ·m') (or θ − lr·m'), each op unfused: members on any machine,
    and members of another release computing it this way, hold the same bits."""
    cfg = OuterConfig(lr=0.7, momentum=0.9, nesterov=nesterov)
    theta = random_tensors(1, SHAPES)
    opt = OuterOptimizer(theta, cfg)
    params, momentum = [t.clone() for t in theta], [torch.zeros_like(t) for t in theta]
    for seed in (2, 3, 4):
        deltas = random_tensors(seed, SHAPES)
        opt.apply(deltas)
        for i, delta in enumerate(deltas):
            buf = torch.add(torch.mul(momentum[i], 0.9), delta)
            direction = torch.add(delta, torch.mul(buf, 0.9)) if nesterov else buf
            params[i] = torch.sub(params[i], torch.mul(direction, 0.7))
            momentum[i] = buf
    assert all(torch.equal(a, b) for a, b in zip(opt.params, params))
    assert all(torch.equal(a, b) for a, b in zip(opt.momentum, momentum))


def test_the_step_releases_freed_memory_as_it_goes(monkeypatch: pytest.MonkeyPatch) -> None:
    """`release` runs after every RELEASE_BYTES of replaced θ and momentum and once at the end, so the
    caller can give the old tensors' pages back before the new state has all been made beside them."""
    monkeypatch.setattr(outer_module, "RELEASE_BYTES", 8 * 20)  # θ and momentum of 20 elements
    shapes = [(10,)] * 7  # 80 bytes replaced a tensor: a release after every second one, and at the end
    opt = OuterOptimizer(random_tensors(1, shapes), OuterConfig(lr=0.7, momentum=0.9, nesterov=True))
    replaced: list[int] = []
    opt.apply(random_tensors(2, shapes), release=lambda: replaced.append(opt.step))
    assert replaced == [0, 0, 0, 0]  # after tensors 2, 4, 6 and the last one, all within the step
    plain = OuterOptimizer(random_tensors(1, shapes), OuterConfig(lr=0.7, momentum=0.9, nesterov=True))
    plain.apply(random_tensors(2, shapes))
    assert plain.sha256 == opt.sha256  # releasing changes nothing computed


# ---------------------------------------------------------------- FedAdam and FedYogi


@pytest.mark.parametrize("optimizer", ["fedadam", "fedyogi"])
def test_the_adaptive_steps_give_the_bits_of_the_textbook_ops_in_their_order(optimizer: str) -> None:
    """Reddi et al.'s server updates, each op unfused and in this order: m' = β1·m + (1 − β1)·Δ; v' = β2·v +
    (1 − β2)·Δ² (Adam) or v − (1 − β2)·Δ²·sign(v − Δ²) (Yogi); θ' = θ − lr·m'/(√v' + τ)."""
    cfg = OuterConfig(optimizer=optimizer, lr=0.05, momentum=0.9, beta2=0.99, tau=1e-3)
    theta = random_tensors(1, SHAPES)
    opt = OuterOptimizer(theta, cfg)
    params = [t.clone() for t in theta]
    m = [torch.zeros_like(t) for t in theta]
    v = [torch.zeros_like(t) for t in theta]
    for seed in (2, 3, 4):
        deltas = random_tensors(seed, SHAPES)
        opt.apply(deltas)
        for i, d in enumerate(deltas):
            m[i] = torch.add(torch.mul(m[i], 0.9), torch.mul(d, 1.0 - 0.9))
            sq = torch.mul(d, d)
            if optimizer == "fedyogi":
                v[i] = torch.sub(v[i], torch.mul(torch.mul(sq, 1.0 - 0.99), torch.sign(torch.sub(v[i], sq))))
            else:
                v[i] = torch.add(torch.mul(v[i], 0.99), torch.mul(sq, 1.0 - 0.99))
            step = torch.mul(torch.div(m[i], torch.add(torch.sqrt(v[i]), 1e-3)), 0.05)
            params[i] = torch.sub(params[i], step)
    assert all(torch.equal(a, b) for a, b in zip(opt.params, params))
    assert all(torch.equal(a, b) for a, b in zip(opt.momentum, m))
    assert all(torch.equal(a, b) for a, b in zip(opt.second, v))
    assert opt.sha256 == global_sha256(params)


def test_fedadam_by_hand_for_one_value() -> None:
    """One element, two steps, in float64 arithmetic (the fp32 result within a few ulps)."""
    opt = OuterOptimizer(
        [vec([1.0])], OuterConfig(optimizer="fedadam", lr=0.1, momentum=0.5, beta2=0.9, tau=0.01)
    )
    theta, m, v = 1.0, 0.0, 0.0
    for d in (0.2, -0.1):
        opt.apply([vec([d])])
        m = 0.5 * m + 0.5 * d
        v = 0.9 * v + 0.1 * d * d
        theta -= 0.1 * m / (math.sqrt(v) + 0.01)
        assert_fp32_close(opt.params[0], [theta])


def test_fedyogi_moves_v_toward_the_square_by_at_most_its_share() -> None:
    opt = OuterOptimizer([vec([0.0, 0.0])], OuterConfig(optimizer="fedyogi", beta2=0.9))
    opt.second[0] = vec([1.0, 0.0])  # one v above Δ², one below
    opt.apply([vec([0.5, 0.5])])  # Δ² = 0.25: v − 0.1·0.25·sign(v − Δ²)
    assert_fp32_close(opt.second[0], [1.0 - 0.025, 0.0 + 0.025])


def test_an_adaptive_state_is_params_momentum_and_second_moments() -> None:
    cfg = OuterConfig(optimizer="fedadam", momentum=0.9)
    opt = OuterOptimizer(random_tensors(0, SHAPES), cfg)
    opt.apply(random_tensors(1, SHAPES))
    assert opt.state_width == 3 and len(opt.state_tensors()) == 3 * len(SHAPES)
    other = OuterOptimizer(random_tensors(5, SHAPES), cfg)
    other.load_state(opt.step, [t.clone() for t in opt.state_tensors()])
    assert other.sha256 == opt.sha256 and all(torch.equal(a, b) for a, b in zip(other.second, opt.second))
    with pytest.raises(ValueError, match="expected 9 state tensors, got 6 .the run's outer step is fedadam"):
        other.load_state(1, [*opt.params, *opt.momentum])
    plain = OuterOptimizer(random_tensors(0, SHAPES), OuterConfig())
    assert plain.state_width == 2 and plain.second == [] and len(plain.state_tensors()) == 2 * len(SHAPES)


def test_fedadam_descends_a_noisy_quadratic() -> None:
    """Δ = the gradient of ½‖θ − target‖² plus noise, as replicas' pseudo-gradients would be: the adaptive
    steps bring θ near the target."""
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(200, generator=gen)
    for optimizer in ("fedadam", "fedyogi"):
        opt = OuterOptimizer([torch.zeros(200)], OuterConfig(optimizer=optimizer, lr=0.05, momentum=0.9))
        start = float((opt.params[0] - target).norm())
        for _ in range(300):
            opt.apply([opt.params[0] - target + 0.1 * torch.randn(200, generator=gen)])
        assert float((opt.params[0] - target).norm()) < 0.2 * start, optimizer


def test_lr_0_is_the_optimizers_own() -> None:
    assert OuterConfig().step_lr == 1.0 and OuterConfig(lr=0.7).step_lr == 0.7
    assert OuterConfig(optimizer="fedadam").step_lr == outer_module.ADAPTIVE_LR
    assert OuterConfig(optimizer="fedyogi", lr=0.01).step_lr == 0.01


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (OuterConfig(optimizer="adam"), "outer.optimizer"),
        (OuterConfig(optimizer="fedadam", beta2=1.0), "outer.beta2"),
        (OuterConfig(optimizer="fedyogi", beta2=0.0), "outer.beta2"),
        (OuterConfig(optimizer="fedadam", tau=0.0), "outer.tau"),
        (OuterConfig(optimizer="fedadam", tau=math.inf), "outer.tau"),
        (OuterConfig(optimizer="fedadam", lr=0.7), "outer.lr 0.7 is an sgd rate"),
    ],
)
def test_adaptive_settings_are_checked(cfg: OuterConfig, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OuterOptimizer([vec(THETA0)], cfg)


def test_sparse_pseudo_gradients_take_sgds_own_rate_of_three() -> None:
    """`outer.lr = 0` with topk: 3, the study's best plain step for sparse means; a set rate stays."""
    from dilocod.config import load_config

    assert load_config(None, ["averaging.compression=topk"]).outer_settings().step_lr == 3.0
    assert load_config(None, ["averaging.compression=topk", "outer.lr=1"]).outer_settings().step_lr == 1.0
    assert load_config(None, ["averaging.compression=int4"]).outer_settings().step_lr == 1.0
    adaptive = load_config(None, ["averaging.compression=topk", "outer.optimizer=fedadam"]).outer_settings()
    assert adaptive.step_lr == 3e-3
