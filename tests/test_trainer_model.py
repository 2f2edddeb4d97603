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
    # BPE presets, at their default 32,000-token vocabulary (a run's is its tokenizer's)
    "llama-20m": (18e6, 23e6),
    "llama-150m": (120e6, 160e6),
    "llama-1b": (1.0e9, 1.15e9),
}
BYTE_PRESETS = ("tiny", "small", "124m", "1b")


def analytic_params(spec: ModelSpec) -> int:
    """Embedding (+ head when untied), plus per block: q/out (2 d^2), k/v (2 d kv), SwiGLU (3 d f) and two
    norm gains."""
    d, f, kv = spec.d_model, spec.ffn_hidden, spec.kv_dim
    per_block = 2 * d * d + 2 * d * kv + 3 * d * f + 2 * d
    embeddings = (1 if spec.tie_embeddings else 2) * spec.vocab_size * d
    return embeddings + spec.n_layers * per_block + d


@pytest.mark.parametrize("preset", sorted(PRESET_RANGES))
def test_preset_param_counts(preset: str) -> None:
    spec = PRESETS[preset]
    with torch.device("meta"):  # no memory: the 1b preset would otherwise need 4 GB
        model = Transformer(spec)
    n = count_params(model)
    assert n == analytic_params(spec)
    low, high = PRESET_RANGES[preset]
    assert low <= n <= high, f"{preset}: {n:,} params"
    assert spec.vocab_size == (256 if preset in BYTE_PRESETS else 32000)


def test_byte_presets_keep_their_shapes_and_bpe_presets_are_llama_shaped() -> None:
    for name in BYTE_PRESETS:  # unchanged: configs, tests and the demo rely on them
        spec = PRESETS[name]
        assert spec.n_kv_heads == spec.n_heads and not spec.tie_embeddings
        assert (spec.rope_theta, spec.norm_eps) == (10000.0, 1e-6)

    def shape(s: ModelSpec) -> tuple[int, ...]:
        return (s.d_model, s.n_layers, s.n_heads, s.n_kv_heads, s.ffn_hidden, s.max_seq_len)

    smol, tiny_llama = PRESETS["llama-150m"], PRESETS["llama-1b"]
    assert shape(smol) == (576, 30, 9, 3, 1536, 2048) and smol.tie_embeddings  # SmolLM-135M's
    assert shape(tiny_llama) == (2048, 22, 32, 4, 5632, 2048) and not tiny_llama.tie_embeddings  # TinyLlama's
    assert PRESETS["llama-20m"].tie_embeddings and PRESETS["llama-20m"].n_kv_heads == 2


def test_tied_model_has_no_head_tensor_and_grouped_attention_is_causal() -> None:
    spec = ModelSpec(vocab_size=320, d_model=64, n_layers=2, n_heads=4, ffn_hidden=96, max_seq_len=64,
                     n_kv_heads=2, tie_embeddings=True, rope_theta=500000.0, norm_eps=1e-5)  # fmt: skip
    model = Transformer(spec)
    assert "head.weight" not in model.state_dict() and model.head is None
    assert model.state_dict()["blocks.0.attn.qkv.weight"].shape == (64 + 2 * 32, 64)
    torch.nn.init.normal_(model.embed.weight, std=0.02)
    model.eval()
    idx = torch.randint(0, 320, (1, 32), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[0, 20] = (changed[0, 20] + 1) % 320
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :20], b[:, :20], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="groups of 3 key/value heads"):
        Transformer(ModelSpec(320, 64, 1, 4, 96, 64, n_kv_heads=3))


def test_max_seq_lens() -> None:
    assert PRESETS["tiny"].max_seq_len == 256
    for name in ("small", "124m", "1b"):
        assert 1024 <= PRESETS[name].max_seq_len <= 2048


def test_unknown_preset() -> None:
    with pytest.raises(
        ValueError, match=r"unknown model.preset 'x' \(choose from tiny, small, 124m, 1b, llama-20m"
    ):
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


def test_the_model_skeleton_is_cheap_to_build() -> None:
    """The skeleton (names and shapes on the meta device) runs no default init: on meta, nn.Embedding's
    `normal_` imported torch._dynamo, ~1 s of a bootstrap's start-up and of every process that sizes the
    model. Checked in a fresh interpreter, where nothing has imported it yet."""
    import subprocess
    import sys

    code = (
        "import sys; from dilocod.trainer.lm import lm_skeleton; from dilocod.trainer.model import ModelConfig;"
        "m = lm_skeleton(ModelConfig(preset='tiny'));"
        "assert m.embed.weight.is_meta; print('torch._dynamo' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"
