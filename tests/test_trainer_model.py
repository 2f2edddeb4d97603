"""Tests for dilocod.trainer.model: presets, shapes, causality and deterministic init."""

from __future__ import annotations

import hashlib

import pytest
import torch

from dilocod.trainer.model import PRESETS, ModelConfig, ModelSpec, Transformer, build_model, count_params

# (low, high) bounds on the total parameter count each preset promises.
PRESET_RANGES = {
    "tiny": (0.8e6, 1.2e6),
    "small": (18e6, 22e6),
    "124m": (124e6 * 0.95, 124e6 * 1.05),
    "1b": (1.0e9, 1.1e9),
}


def analytic_params(spec: ModelSpec) -> int:
    """Embedding + head, plus per block: qkv/out (4 d^2), SwiGLU (3 d f) and two norm gains."""
    d, f = spec.d_model, spec.ffn_hidden
    per_block = 4 * d * d + 3 * d * f + 2 * d
    return 2 * spec.vocab_size * d + spec.n_layers * per_block + d


@pytest.mark.parametrize("preset", sorted(PRESET_RANGES))
def test_preset_param_counts(preset: str) -> None:
    spec = PRESETS[preset]
    with torch.device("meta"):  # no memory: the 1b preset would otherwise need 4 GB
        model = Transformer(spec)
    n = count_params(model)
    assert n == analytic_params(spec)
    low, high = PRESET_RANGES[preset]
    assert low <= n <= high, f"{preset}: {n:,} params"
    assert spec.vocab_size == 256


def test_max_seq_lens() -> None:
    assert PRESETS["tiny"].max_seq_len == 256
    for name in ("small", "124m", "1b"):
        assert 1024 <= PRESETS[name].max_seq_len <= 2048


def test_unknown_preset() -> None:
    with pytest.raises(ValueError, match=r"unknown model.preset 'x' \(choose from tiny, small, 124m, 1b\)"):
        build_model(ModelConfig(preset="x"), seed=0)


def test_logits_shape_and_no_biases() -> None:
    model = build_model(ModelConfig(), seed=0)
    idx = torch.randint(0, 256, (2, 17))
    logits = model(idx)
    assert logits.shape == (2, 17, 256)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())


def test_initial_loss_is_near_uniform() -> None:
    # Small init should give roughly uniform predictions: loss close to ln(256) ~= 5.55.
    model = build_model(ModelConfig(), seed=0)
    idx = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    assert abs(loss.item() - 5.545) < 0.1


def test_causality() -> None:
    model = build_model(ModelConfig(), seed=1).eval()
    idx = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[0, 20] = (changed[0, 20] + 1) % 256
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_too_long_sequence_rejected() -> None:
    model = build_model(ModelConfig(), seed=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 257, dtype=torch.long))


def test_same_seed_same_params_and_global_rng_untouched() -> None:
    rng_before = torch.random.get_rng_state()
    a = build_model(ModelConfig(), seed=7)
    b = build_model(ModelConfig(), seed=7)
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    for (name_a, pa), (name_b, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert name_a == name_b
        assert torch.equal(pa, pb), name_a


def test_init_is_pinned() -> None:
    # Peers on different machines must agree on θ0 bit for bit. The init is built from integer
    # RNG output and IEEE arithmetic only, so this digest must not depend on the CPU; if it
    # changes, a code change altered the init (peers of mixed versions would then diverge).
    digest = hashlib.sha256()
    for tensor in build_model(ModelConfig(), seed=0).state_dict().values():
        digest.update(tensor.numpy().tobytes())
    assert digest.hexdigest()[:16] == "9c5cf435a03805c8"


def test_different_seed_different_params() -> None:
    a = build_model(ModelConfig(), seed=1)
    b = build_model(ModelConfig(), seed=2)
    assert not torch.equal(a.embed.weight, b.embed.weight)
    key = "blocks.0.attn.qkv.weight"
    assert not torch.equal(a.state_dict()[key], b.state_dict()[key])


def test_init_statistics() -> None:
    model = build_model(ModelConfig(), seed=0)
    params = model.state_dict()
    weight = params["blocks.0.mlp.gate.weight"]
    assert abs(weight.mean().item()) < 2e-3
    assert weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))
    # Residual output projections are scaled down with depth.
    assert params["blocks.0.attn.out.weight"].std().item() < 0.02 / 2


def test_activation_checkpointing_matches() -> None:
    model = build_model(ModelConfig(), seed=3)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    model(idx).square().mean().backward()
    plain = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    model.activation_checkpointing = True
    model(idx).square().mean().backward()
    checkpointed = [p.grad for p in model.parameters() if p.grad is not None]
    for g1, g2 in zip(plain, checkpointed, strict=True):
        torch.testing.assert_close(g1, g2)
