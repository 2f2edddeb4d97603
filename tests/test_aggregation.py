"""dilocod.aggregation: robust reducers, screening and receiver-side verification (pure tensor code)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dilocod.aggregation import (
    REDUCER_NAMES,
    Reducer,
    ReducerConfig,
    ScreeningConfig,
    auto_tau,
    average_bound,
    centered_clip,
    faulty,
    make_reducer,
    mean,
    median,
    plausible_average,
    screen,
    trim_count,
    trimmed_mean,
)

NAN, INF = float("nan"), float("inf")
REDUCERS: dict[str, Reducer] = {name: make_reducer(ReducerConfig(name=name)) for name in REDUCER_NAMES}
EXACT_ORDER_FREE = ("median", "trimmed_mean")  # sort-based: permutation invariant bit for bit
PROPS = settings(max_examples=100, deadline=None)


def t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def ones(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.float32)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


# ---------------------------------------------------------------- hand-computed values


def test_mean_by_hand() -> None:
    x = t([[1, 2], [3, -4], [2, 5], [6, 1], [NAN, INF]])
    w = t([[1, 1, 1, 1, 0]])[0]
    # (1+3+2+6)/4 = 12/4 = 3, (2−4+5+1)/4 = 4/4 = 1; the NaN row has weight 0
    assert torch.equal(mean(x, w), t([[3, 1]])[0])


def test_median_by_hand() -> None:
    # columns sorted: [1, 3, 100] → 3 and [−4, 0, 2] → 0
    assert torch.equal(median(t([[1, 2], [3, -4], [100, 0]]), ones(3)), t([[3, 0]])[0])
    # even count: sorted [1, 2, 4, 10] → (2 + 4)/2 = 3
    assert torch.equal(median(t([[1], [4], [2], [10]]), ones(4)), t([[3]])[0])


def test_trim_count_rule() -> None:
    # ⌊f·k⌋, at least 1 for f > 0 and k ≥ 3, at most ⌊(k−1)/2⌋
    cases = {(4, 0.2): 1, (5, 0.2): 1, (10, 0.2): 2, (3, 0.2): 1, (2, 0.2): 0, (10, 0.0): 0}
    cases |= {(5, 0.45): 2, (10, 0.3): 3, (7, 0.49): 3, (1, 0.4): 0}
    for (k, f), want in cases.items():
        assert trim_count(k, f) == want, (k, f)


def test_trimmed_mean_by_hand() -> None:
    x = t([[3, 1], [100, -50], [0, 2], [1, 3], [2, 4]])
    # k = 5, f = 0.2 → t = 1: [0, 1, 2, 3, 100] → (1+2+3)/3 = 2; [−50, 1, 2, 3, 4] → (1+2+3)/3 = 2
    assert torch.equal(trimmed_mean(x, ones(5), trim_fraction=0.2), t([[2, 2]])[0])
    # f = 0 trims nothing: the mean, (3+100+0+1+2)/5 = 21.2
    assert torch.allclose(trimmed_mean(x, ones(5), trim_fraction=0.0)[0], torch.tensor(21.2))
    # k = 4 (one weight-0 row): t = max(⌊0.8⌋, 1) = 1: [1, 2, 3, 100] → (2+3)/2 = 2.5
    assert trimmed_mean(x, t([[1, 1, 0, 1, 1]])[0])[0].item() == 2.5


def test_centered_clip_by_hand() -> None:
    x = t([[0], [0], [1], [10]])
    # v₀ = median (0+1)/2 = 0.5; diffs [−.5, −.5, .5, 9.5] clipped at τ = 1 → [−.5, −.5, .5, 1];
    # step 0.5/4 = 0.125 → v = 0.625
    assert centered_clip(x, ones(4), tau=1.0, iters=1).item() == 0.625
    # diffs [−.625, −.625, .375, 9.375] → [−.625, −.625, .375, 1]; step 0.125/4 = 0.03125 → v = 0.65625
    assert centered_clip(x, ones(4), tau=1.0, iters=2).item() == 0.65625
    # the fixed point: −v − v + (1 − v) + 1 = 0 → v = 2/3 (the mean would be 2.75)
    assert centered_clip(x, ones(4), tau=1.0, iters=100, tol=0.0).item() == pytest.approx(2 / 3, abs=1e-6)
    # clipping is by the row's L2 norm: diff [3, 4] has norm 5 → scaled by 1/5 → [0.6, 0.8]; /3
    got = centered_clip(t([[0, 0], [0, 0], [3, 4]]), ones(3), tau=1.0, iters=1)
    assert torch.allclose(got, torch.tensor([0.2, 0.8 / 3]))


def test_centered_clip_early_stop() -> None:
    x = t([[0], [0], [1], [10]])
    # tol 0.1 (steps from test_centered_clip_by_hand): step 1 is 0.125 > 0.1·0.625; step 2 is
    # 0.03125 ≤ 0.1·0.65625 → stop at 0.65625 although iters = 20 would go on towards 2/3
    assert centered_clip(x, ones(4), tau=1.0, iters=20, tol=0.1).item() == 0.65625
    # nothing clipped (τ = 10 ≥ every distance): one step lands on the mean (0+1+5)/3 = 2, the next is 0
    assert centered_clip(t([[0], [1], [5]]), ones(3), tau=10.0).item() == 2.0


def test_centered_clip_auto_tau() -> None:
    x = t([[0], [1], [2], [10]])
    # median (1+2)/2 = 1.5; distances [1.5, .5, .5, 8.5] → median (0.5+1.5)/2 = 1 = τ
    assert auto_tau(torch.tensor([1.5, 0.5, 0.5, 8.5])) == 1.0
    # clipped diffs [−1, −.5, .5, 1] sum to 0: the median is already the fixed point (the mean is 3.25)
    assert centered_clip(x, ones(4)).item() == 1.5


@pytest.mark.parametrize("name", REDUCER_NAMES)
def test_trivial_counts(name: str) -> None:
    reduce = REDUCERS[name]
    x = t([[NAN, 1, 2], [4, -5, 6], [INF, 0, 0]])
    assert bits_equal(reduce(x, t([[0, 0, 0]])[0]), torch.zeros(3))
    assert bits_equal(reduce(x, t([[0, 1, 0]])[0]), x[1])
    assert bits_equal(reduce(x[:0], torch.zeros(0)), torch.zeros(3))


@pytest.mark.parametrize("name", REDUCER_NAMES)
def test_rejects_bad_shapes(name: str) -> None:
    with pytest.raises(ValueError, match="weights"):
        REDUCERS[name](torch.zeros(3, 2), ones(2))
    with pytest.raises(ValueError, match="float32"):
        REDUCERS[name](torch.zeros(3, 2, dtype=torch.float64), ones(3))


# ---------------------------------------------------------------- hypothesis properties

unit = st.floats(-1, 1, width=32)
huge = st.one_of(st.sampled_from([1e6, -1e6]), st.floats(-1e6, 1e6, width=32))
garbage = st.sampled_from([NAN, INF, -INF, 1e30, -3e38])


@st.composite
def matrix(draw: st.DrawFn, rows: st.SearchStrategy[int], d: int | None = None) -> torch.Tensor:
    n = draw(rows)
    d = draw(st.integers(1, 6)) if d is None else d
    values = draw(st.lists(unit, min_size=n * d, max_size=n * d))
    return torch.tensor(values, dtype=torch.float32).reshape(n, d)


@st.composite
def weighted(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    x = draw(matrix(st.integers(1, 9)))
    w = torch.tensor(draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=len(x), max_size=len(x))))
    return x, w


def with_garbage(data: st.DataObject, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x``/``w`` with weight-0 rows of NaN/Inf/huge values inserted at drawn positions."""
    rows, weights = list(x), list(w)
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(rows)))
        row = data.draw(st.lists(garbage, min_size=x.shape[1], max_size=x.shape[1]))
        rows.insert(at, torch.tensor(row, dtype=torch.float32))
        weights.insert(at, torch.tensor(0.0))
    return torch.stack(rows), torch.stack(weights)


@pytest.mark.parametrize("name", REDUCER_NAMES)
@PROPS
@given(case=weighted(), data=st.data())
def test_permutation_invariance(
    name: str, case: tuple[torch.Tensor, torch.Tensor], data: st.DataObject
) -> None:
    x, w = case
    perm = torch.tensor(data.draw(st.permutations(range(len(x)))))
    a, b = REDUCERS[name](x, w), REDUCERS[name](x[perm], w[perm])
    if name in EXACT_ORDER_FREE:
        assert torch.equal(a, b)
    else:  # row order changes the float64 rounding of the sums, not the math
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", REDUCER_NAMES)
@PROPS
@given(case=weighted(), data=st.data())
def test_weight_zero_rows_never_matter(
    name: str, case: tuple[torch.Tensor, torch.Tensor], data: st.DataObject
) -> None:
    x, w = case
    noisy_x, noisy_w = with_garbage(data, x, w)
    assert bits_equal(REDUCERS[name](noisy_x, noisy_w), REDUCERS[name](x, w))


@pytest.mark.parametrize("name", REDUCER_NAMES)
@PROPS
@given(row=matrix(st.just(1)), k=st.integers(1, 9), data=st.data())
def test_all_agree_gives_the_common_value(name: str, row: torch.Tensor, k: int, data: st.DataObject) -> None:
    x, w = with_garbage(data, row.expand(k, -1).clone(), ones(k))
    assert torch.equal(REDUCERS[name](x, w), row[0])


@pytest.mark.parametrize("name", REDUCER_NAMES)
@PROPS
@given(case=weighted(), data=st.data())
def test_deterministic(name: str, case: tuple[torch.Tensor, torch.Tensor], data: st.DataObject) -> None:
    x, w = with_garbage(data, *case)
    assert bits_equal(REDUCERS[name](x, w), REDUCERS[name](x.clone(), w.clone()))


@st.composite
def attacked(draw: st.DrawFn, max_liars: Callable[[int], int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(honest rows ∈ [−1, 1], all rows with liars of up to ±1e6 mixed in, the number of liars)."""
    k = draw(st.integers(2, 9))
    b = draw(st.integers(0, max_liars(k)))
    honest = draw(matrix(st.just(k - b)))
    liars = torch.tensor(draw(st.lists(huge, min_size=b * honest.shape[1], max_size=b * honest.shape[1])))
    everyone = torch.cat([honest, liars.reshape(b, honest.shape[1]).float()])
    perm = torch.tensor(draw(st.permutations(range(k))))
    return honest, everyone[perm], b


def fewer_than_half(k: int) -> int:
    return (k - 1) // 2


def within_trim(k: int) -> int:
    return trim_count(k, 0.2)


@PROPS
@given(case=attacked(fewer_than_half))
def test_median_bounded_by_honest_range(case: tuple[torch.Tensor, torch.Tensor, int]) -> None:
    honest, x, _ = case
    out = median(x, ones(len(x)))
    assert bool(((honest.min(0).values <= out) & (out <= honest.max(0).values)).all())


@PROPS
@given(case=attacked(within_trim))
def test_trimmed_mean_bounded_by_honest_range(case: tuple[torch.Tensor, torch.Tensor, int]) -> None:
    honest, x, _ = case
    out = trimmed_mean(x, ones(len(x)), trim_fraction=0.2)
    assert bool(((honest.min(0).values <= out) & (out <= honest.max(0).values)).all())


@PROPS
@given(case=attacked(fewer_than_half))
def test_centered_clip_bounded_near_honest_mean(case: tuple[torch.Tensor, torch.Tensor, int]) -> None:
    # Stated bound: ‖out − honest mean‖ ≤ 2·D, D = the diagonal of the honest rows' bounding box. Each liar
    # pulls by at most τ/k per step and auto-τ ≤ the largest honest distance from the median ≤ D, while
    # the h > b honest rows pull back; a random search found ≤ 1·D, the liars sit up to 1e6 away.
    honest, x, _ = case
    out = centered_clip(x, ones(len(x)))
    box = float((honest.max(0).values - honest.min(0).values).norm())
    assert float((out.double() - honest.double().mean(0)).norm()) <= 2 * box + 1e-6


def test_deterministic_across_thread_counts() -> None:
    # long rows, so ATen's parallel paths (≥ 32768 elements) are really taken
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 3 * 2**15 + 7, generator=g) * torch.logspace(-3, 3, 7).unsqueeze(1).float()
    w = t([[1, 1, 0, 1, 1, 1, 1]])[0]
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 4):
            torch.set_num_threads(threads)
            outs = [REDUCERS[name](x, w) for name in REDUCER_NAMES]
            results.append([*outs, screen(x, w, ScreeningConfig(norm_ratio=50.0))])
    finally:
        torch.set_num_threads(before)
    assert all(bits_equal(a, b) for a, b in zip(*results))


# ---------------------------------------------------------------- screening


def test_screen_drops_nan_inf_and_blown_up_rows() -> None:
    g = torch.Generator().manual_seed(0)
    honest = torch.randn(5, 64, generator=g)
    x = torch.cat([honest, honest[:1] * 1000, torch.full((1, 64), NAN), torch.full((1, 64), INF)])
    x[1, 7] = NAN  # one bad coordinate is enough
    w = ones(8)
    after = screen(x, w, ScreeningConfig())
    assert after.tolist() == [1, 0, 1, 1, 1, 0, 0, 0]
    assert faulty(w, after) == [1, 5, 6, 7]
    assert w.tolist() == [1] * 8  # a new tensor: the input is untouched
    # already-excluded rows stay excluded and are not reported again
    again = screen(x, after, ScreeningConfig())
    assert torch.equal(again, after) and faulty(after, again) == []


def test_screen_ratio_and_edges() -> None:
    x = t([[1, 0], [0, 2], [3, 0], [0, 31]])
    # norms [1, 2, 3, 31], median (2+3)/2 = 2.5 → limit 25 with ratio 10: only 31 goes
    assert screen(x, ones(4), ScreeningConfig()).tolist() == [1, 1, 1, 0]
    assert screen(x, ones(4), ScreeningConfig(norm_ratio=20.0)).tolist() == [1, 1, 1, 1]
    assert screen(x, torch.zeros(4), ScreeningConfig()).tolist() == [0, 0, 0, 0]
    assert screen(x[:1], ones(1), ScreeningConfig()).tolist() == [1]


@PROPS
@given(case=weighted(), data=st.data())
def test_screen_never_adds_and_always_drops_garbage(
    case: tuple[torch.Tensor, torch.Tensor], data: st.DataObject
) -> None:
    x, w = case
    bad_at = data.draw(st.integers(0, len(x)))
    bad = torch.full((1, x.shape[1]), data.draw(st.sampled_from([NAN, INF, -INF])))
    x, w = torch.cat([x[:bad_at], bad, x[bad_at:]]), torch.cat([w[:bad_at], ones(1), w[bad_at:]])
    after = screen(x, w, ScreeningConfig())
    assert after[bad_at] == 0 and bool((after <= w).all())
    assert bad_at in faulty(w, after)


# ---------------------------------------------------------------- verification


def test_plausible_average_accepts_robust_and_rejects_garbage() -> None:
    g = torch.Generator().manual_seed(1)
    honest = torch.randn(3, 256, generator=g)
    x = torch.cat([honest, -1000 * honest[:1]])  # one sign-flipping liar
    w = screen(x, ones(4), ScreeningConfig())
    assert w.tolist() == [1, 1, 1, 0]
    avg = centered_clip(x, w)
    own = honest[0]
    ref = float(honest.norm(dim=1).median())  # the caller's estimate of the group's median part norm
    bound = average_bound(float(own.norm()), ref, norm_ratio=10.0)
    assert plausible_average(avg, own, bound=bound)
    assert not plausible_average(-1000 * own, own, bound=bound)  # a reducer that returns garbage
    assert not plausible_average(torch.full_like(avg, 1e4), own, bound=bound)
    nan_avg = avg.clone()
    nan_avg[3] = NAN
    assert not plausible_average(nan_avg, own, bound=bound)
    assert not plausible_average(avg[:-1], own, bound=bound)  # wrong shape
    assert plausible_average(avg, own, bound=INF)
    with pytest.raises(ValueError, match="bound"):
        plausible_average(avg, own, bound=-1.0)


@pytest.mark.parametrize("name", REDUCER_NAMES)
@PROPS
@given(case=attacked(lambda k: k), own_at=st.integers(0, 8))
def test_plausible_average_has_no_false_positives(
    name: str, case: tuple[torch.Tensor, torch.Tensor, int], own_at: int
) -> None:
    # The bound ‖own‖ + √3·ratio·M holds for ANY finite inputs once screened, liars or not, with M the
    # median norm screening used; so an honest reducer is never rejected when the caller knows M.
    _, x, _ = case
    w = screen(x, ones(len(x)), ScreeningConfig())
    s = x.double().norm(dim=1).sort().values  # the median as screening computes it
    m = float(s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2
    own = x[own_at % len(x)]
    bound = average_bound(float(own.double().norm()), m, norm_ratio=10.0) * (1 + 1e-6)
    assert plausible_average(REDUCERS[name](x, w), own, bound=bound)


# ---------------------------------------------------------------- configuration


def bad_configs() -> Iterator[tuple[object, str]]:
    choices = "averaging.reducer must be one of mean, trimmed_mean, median, centered_clip"
    yield ReducerConfig(name="krum"), choices
    for frac in (-0.1, 0.5, NAN, "0.2"):
        yield ReducerConfig(trim_fraction=frac), "averaging.trim_fraction"  # type: ignore[arg-type]
    for tau in (0.0, -1.0, INF, NAN):
        yield ReducerConfig(clip_tau=tau), "averaging.clip_tau"
    for iters in (0, -3, 2.5, True):
        yield ReducerConfig(clip_iters=iters), "averaging.clip_iters"  # type: ignore[arg-type]
    for tol in (-1e-6, NAN, INF):
        yield ReducerConfig(clip_tol=tol), "averaging.clip_tol"
    for ratio in (0.5, INF, NAN, -1.0):
        yield ScreeningConfig(norm_ratio=ratio), "averaging.screen_norm_ratio"


@pytest.mark.parametrize(("cfg", "key"), list(bad_configs()))
def test_config_errors_name_the_key(cfg: ReducerConfig | ScreeningConfig, key: str) -> None:
    with pytest.raises(ValueError, match=key):
        cfg.validate()


def test_make_reducer_validates_and_binds() -> None:
    with pytest.raises(ValueError, match="averaging.reducer"):
        make_reducer(ReducerConfig(name="krum"))
    ReducerConfig().validate()
    ScreeningConfig().validate()
    ReducerConfig(clip_tau=2.0, clip_tol=0.0, trim_fraction=0.0).validate()
    x = t([[0], [0], [1], [10]])
    # the settings really reach the reducer (values from test_centered_clip_by_hand)
    assert make_reducer(ReducerConfig(clip_tau=1.0, clip_iters=2))(x, ones(4)).item() == 0.65625
    # trim_fraction 0 → no trimming → the mean 11/4
    assert make_reducer(ReducerConfig(name="trimmed_mean", trim_fraction=0.0))(x, ones(4)).item() == 2.75
    assert math.isfinite(make_reducer(ReducerConfig())(x, ones(4)).item())
