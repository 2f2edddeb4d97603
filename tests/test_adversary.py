"""Each adversary mode sends what docs/trust.md says it sends (the attacks the defenses are tested on)."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

from dilocod.trust.adversary import ALIE_WINDOW, Adversary, AdversaryConfig, tampering_for
from dilocod.trust.hooks import HONEST


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


def test_concentrate_pushes_each_tensors_largest_coordinates_against_their_sign() -> None:
    delta = [torch.randn(64, 8, generator=torch.Generator().manual_seed(5)), torch.tensor([1.0, -2.0])]
    sent = adversary("concentrate").corrupt_delta(delta)
    for s, d in zip(sent, delta):
        flat, honest = s.reshape(-1), d.reshape(-1)
        top = torch.topk(honest.abs(), min(4, honest.numel())).indices
        assert torch.equal(torch.nonzero(flat).reshape(-1).sort().values, top.sort().values)
        assert bool((torch.sign(flat[top]) == -torch.sign(honest[top])).all())
        assert norm([s]) == pytest.approx(5 * norm([d]), rel=1e-5)  # under the 10x screen


def test_copy_support_puts_honest_sized_noise_on_the_last_updates_coordinates() -> None:
    a = adversary("copy_support")
    theta = [torch.zeros(6), torch.zeros(3)]
    a.sent([torch.randn(6), torch.randn(3)], None, theta)  # the θ_global it starts from
    update = [torch.tensor([0.0, 1.0, 0.0, 0.0, 2.0, 0.0]), torch.tensor([0.0, 0.0, 3.0])]
    delta = [torch.randn(6), torch.randn(3)]
    sent = a.sent(delta, None, [t - u for t, u in zip(theta, update)])  # θ_global moved by the update
    assert all(torch.equal(s != 0, u != 0) for s, u in zip(sent, update))
    assert norm(sent) == pytest.approx(norm(delta), rel=1e-5)


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
    lie = adversary("bad_reducer").reply_part()
    assert lie is not None and adversary("sign_flip").reply_part() is None
    part = torch.ones(5)
    assert lie(part).shape == part.shape and not torch.equal(lie(part), part)


def test_an_honest_peers_hooks_hand_back_what_they_are_given() -> None:
    honest = tampering_for(AdversaryConfig(), seed=1)
    assert honest is HONEST and not honest.active and honest.checks_reducers
    delta, params = honest_delta(1), honest_delta(2)
    assert honest.sent(delta, None, params) is delta and honest.sent(delta, [0], params) is delta
    assert honest.claimed(100, 5.0) == (100, 5.0)
    assert honest.served_state(7, params) == (7, params)
    assert honest.reply_part() is None and honest.training_windows(64) is None


def test_a_fragments_lie_is_cut_from_a_lie_about_the_whole_model() -> None:
    """Streaming overlap sends one fragment's parameters: the mode sees the whole model, zero-padded."""
    params = honest_delta(3)
    delta = honest_delta(4)
    fragment = [delta[1]]
    sent = adversary("scale").sent(fragment, [1], params)
    assert [s.shape for s in sent] == [f.shape for f in fragment]
    assert all(torch.allclose(s, f * 100.0) for s, f in zip(sent, fragment))
    step, served = adversary("bad_donor").served_state(5, params)
    assert step > 5 and not torch.equal(served[0], params[0])


def test_adversary_modes_reach_the_daemon_through_the_hooks_only() -> None:
    """Outside trust/, only the daemon that builds the hooks and the config that holds the mode import the
    adversary; the networking layer names neither it nor its modes."""
    root = Path(__file__).resolve().parents[1]
    importers = set()
    for path in (root / "dilocod").rglob("*.py"):
        module = path.relative_to(root / "dilocod").as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "dilocod.trust.adversary":
                importers.add(module)
    assert importers - {"trust/adversary.py"} == {"node/peer.py", "config.py"}
    for path in (root / "peers").rglob("*.py"):
        text = path.read_text().lower()
        assert "adversary" not in text and "corrupt" not in text, path


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
