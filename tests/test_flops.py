"""Tests for dilocod.trainer.flops: FLOPs per token, the table of device peaks and MFU."""

from __future__ import annotations

import pytest

from dilocod.trainer.flops import PEAK_FLOPS, flops_per_token, known_peak_flops, mfu
from dilocod.trainer.model import PRESETS, ModelConfig, build_model, count_params, shape_of


def test_flops_per_token_by_hand_for_tiny() -> None:
    spec = PRESETS["tiny"]
    params = count_params(build_model(ModelConfig("tiny"), seed=0))
    assert params == 918_656
    # 6 × (all parameters but the 256×128 input embedding) + 12 × layers × d_model × seq_len
    expected = 6 * (918_656 - 256 * 128) + 12 * 4 * 128 * 128
    assert flops_per_token(shape_of(spec), 128, params) == expected == 6_101_760


def test_a_tied_embedding_counts_as_the_head_matmul() -> None:
    spec = PRESETS["llama-20m"]
    params = count_params(build_model(ModelConfig("llama-20m"), seed=0))
    assert flops_per_token(shape_of(spec), 1024, params) == 6 * params + 12 * 6 * 384 * 1024


def test_attention_term_grows_with_sequence_length() -> None:
    spec = PRESETS["1b"]
    short, long = (
        flops_per_token(shape_of(spec), 1024, 1_028_737_024),
        flops_per_token(shape_of(spec), 2048, 1_028_737_024),
    )
    assert long - short == 12 * spec.n_layers * spec.d_model * 1024
    assert 6e9 < short < 7e9  # ≈ 6 × 1.03 B parameters


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA A10", 125e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA GeForce RTX 4090", 165e12),
        ("NVIDIA B200", 2.25e15),
    ],
)
def test_known_devices(name: str, peak: float) -> None:
    assert known_peak_flops(name) == peak


@pytest.mark.parametrize("name", ["Tesla K80", "NVIDIA A10G", "NVIDIA RTX A4000", "cpu", ""])
def test_unknown_devices_have_no_peak(name: str) -> None:
    # Whole words only: "A10" must not claim "A10G", "A40" not "RTX A4000".
    assert known_peak_flops(name) is None


def test_table_has_no_shadowed_entries() -> None:
    keys = [key for key, _ in PEAK_FLOPS]
    assert len(keys) == len(set(keys))
    for i, key in enumerate(keys):
        # a key listed after one that matches it as a whole word could never be reached
        assert known_peak_flops(key) == PEAK_FLOPS[i][1], key


def test_mfu() -> None:
    assert mfu(1000.0, 6e9, None) is None
    assert mfu(1000.0, 6e9, 0.0) is None
    assert mfu(50_000.0, 6e9, 989e12) == pytest.approx(50_000 * 6e9 / 989e12)
