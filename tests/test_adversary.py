"""Each adversary mode sends what docs/trust.md says it sends (the attacks the defenses are tested on)."""

from __future__ import annotations

import math

import pytest
import torch

from dilocod.trust.adversary import ALIE_WINDOW, Adversary, AdversaryConfig


def honest_delta(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4, 3, generator=g), torch.randn(5, generator=g)]


def norm(tensors: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in tensors))


def adversary(mode: str, **kwargs: float | int) -> Adversary:
    return Adversary(AdversaryConfig(mode=mode, **kwargs), seed=1)  # type: ignore[arg-type]


def test_honest_mode_sends_its_delta_unchanged() -> None:
    delta = honest_delta(0)
    sent = adversary("none").corrupt_delta(delta)
    assert all(torch.equal(a, b) for a, b in zip(sent, delta))
    assert not adversary("none").active


@pytest.mark.parametrize(("mode", "factor"), [("sign_flip", -1000.0), ("scale", 100.0)])
def test_scaling_modes_multiply_the_honest_delta(mode: str, factor: float) -> None:
    delta = honest_delta(1)
    sent = adversary(mode).corrupt_delta(delta)
    assert all(torch.equal(s, d * factor) for s, d in zip(sent, delta))


def test_nan_mode_sends_only_nan() -> None:
    sent = adversary("nan").corrupt_delta(honest_delta(2))
    assert all(bool(t.isnan().all()) for t in sent)


def test_random_direction_is_fixed_and_1000_times_the_honest_norm() -> None:
    a = adversary("random_direction")
    first = a.corrupt_delta(honest_delta(3))
    second = a.corrupt_delta(honest_delta(4))
    assert norm(first) == pytest.approx(1000 * norm(honest_delta(3)), rel=1e-5)
    assert norm(second) == pytest.approx(1000 * norm(honest_delta(4)), rel=1e-5)
    cosine = sum(float((x * y).sum()) for x, y in zip(first, second)) / (norm(first) * norm(second))
    assert cosine == pytest.approx(1.0, abs=1e-6)  # the same direction every round


def test_stale_sends_zeros_then_the_delta_from_k_rounds_ago() -> None:
    a = adversary("stale", stale_rounds=3)
    rounds = [honest_delta(10 + i) for i in range(6)]
    sent = [a.corrupt_delta(d) for d in rounds]
    for i in range(3):
        assert all(not bool(t.any()) for t in sent[i])
    for i in range(3, 6):
        assert all(torch.equal(s, d) for s, d in zip(sent[i], rounds[i - 3]))


def test_alie_sends_mean_minus_z_std_of_what_it_has_seen() -> None:
    a = adversary("alie", alie_z=1.5)
    rounds = [honest_delta(20 + i) for i in range(ALIE_WINDOW + 2)]
    for d in rounds:
        sent = a.corrupt_delta(d)
    window = rounds[-ALIE_WINDOW:]
    for i, tensor in enumerate(sent):
        samples = torch.stack([w[i] for w in window])
        expected = samples.mean(0) - 1.5 * samples.std(0, unbiased=False)
        assert torch.allclose(tensor, expected, atol=1e-6)


def test_bad_donor_claims_to_be_ahead_and_poisons_state() -> None:
    donor, honest = adversary("bad_donor"), adversary("none")
    assert donor.declared_state_step(7) > 1000 and honest.declared_state_step(7) == 7
    state = honest_delta(30)
    assert not torch.equal(donor.poison_state(state)[0], state[0])
    assert honest.poison_state(state) is state


def test_only_bad_reducer_corrupts_reductions() -> None:
    assert adversary("bad_reducer").corrupt_reductions
    assert not adversary("sign_flip").corrupt_reductions


def test_stale_rounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stale_rounds"):
        AdversaryConfig(mode="stale", stale_rounds=0).validate()


def test_inflate_tokens_claims_ten_times_its_tokens_and_a_throughput_to_match() -> None:
    assert adversary("inflate_tokens").claim(1000, 50.0) == (10_000, 500.0)
    assert adversary("none").claim(1000, 50.0) == (1000, 50.0)
    delta = [torch.ones(3)]
    assert torch.equal(adversary("inflate_tokens").corrupt_delta(delta)[0], delta[0])  # its Δ is honest


def test_freeride_sends_tiny_noise_whatever_it_trained() -> None:
    delta = honest_delta(20)
    sent = adversary("freeride").corrupt_delta(delta)
    assert norm(sent) == pytest.approx(1e-3 * norm(delta), rel=1e-5)
    assert adversary("freeride").claim(1000, 50.0) == (1000, 50.0)  # its claims look honest


def test_copy_update_sends_the_runs_last_outer_update_at_its_own_norm() -> None:
    a = adversary("copy_update")
    before = honest_delta(21)
    a.observe_global(before)
    assert all(bool((t == 0).all()) for t in a.corrupt_delta(honest_delta(22)))  # nothing to copy yet
    update = honest_delta(23)
    a.observe_global([b - u for b, u in zip(before, update)])  # the run applied an outer step
    delta = honest_delta(24)
    sent = a.corrupt_delta(delta)
    scale = norm(delta) / norm(update)
    assert all(torch.allclose(s, u * scale, atol=1e-6) for s, u in zip(sent, update))


def test_wrong_data_trains_the_same_windows_whatever_its_leases_say() -> None:
    assert adversary("none").windows(8) is None
    fixed = adversary("wrong_data").windows(8)
    assert fixed is not None
    first = fixed([1000, 2000, 3000])
    assert first == [0, 8, 16]
    seen = set(first)
    for _ in range(40):
        seen.update(fixed([10**6 + i for i in range(3)]))
    assert seen == {8 * i for i in range(64)}  # 64 windows at the stream's start, round and round
