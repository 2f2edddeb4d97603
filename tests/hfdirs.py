"""Tiny transformers configs written to directories, as `model.hf_config` names them (no network)."""

from __future__ import annotations

from pathlib import Path


def gpt2_dir(where: Path, vocab: int = 320, **extra: object) -> Path:
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=vocab, n_positions=128, **extra).save_pretrained(
        where
    )
    return where


def qwen2_dir(where: Path, vocab: int = 320, **extra: object) -> Path:
    from transformers import Qwen2Config

    config = Qwen2Config(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=vocab, max_position_embeddings=256, tie_word_embeddings=True, **extra,
    )  # fmt: skip
    config.save_pretrained(where)
    return where


def llama_dir(where: Path, vocab: int = 256, **extra: object) -> Path:
    """A Llama of the tiny preset's shape (what dilocod's own tiny model is)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        num_hidden_layers=4, hidden_size=128, num_attention_heads=4, intermediate_size=384, vocab_size=vocab,
        max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, **extra,
    )  # fmt: skip
    config.save_pretrained(where)
    return where
