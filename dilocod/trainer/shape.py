"""What the trainer, the sampler and the FLOPs estimate need to know of a model, whatever builds it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LMShape:
    """A causal language model's outline: dilocod's own `Transformer` and a `transformers` model alike."""

    family: str  # "dilocod" for dilocod's own model, else the transformers config's model_type ("qwen2", …)
    vocab_size: int  # rows of the input embedding (ids at or past the tokenizer's are padding)
    max_seq_len: int  # the longest sequence the model takes (its position table or its preset's limit)
    n_layers: int
    d_model: int
    lookup_params: int  # parameters only looked up, never multiplied (an untied input embedding, positions)
