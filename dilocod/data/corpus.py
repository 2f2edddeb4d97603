"""The trainer's view of a dataset: token streams it reads windows from, and what eval needs to report bits
per byte. A prepared dataset's splits are `dilocod.data.shards.TokenStream`s (memory-mapped); tests and
benchmarks pass token tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


class TokenSource(Protocol):
    """A split's token stream: its length and any range of it as int64."""

    def __len__(self) -> int: ...

    def read(self, start: int, stop: int) -> np.ndarray: ...


class TensorTokens:
    """A token tensor as a stream (tests, benchmarks, an in-memory corpus)."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens.reshape(-1)

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def read(self, start: int, stop: int) -> np.ndarray:
        if not 0 <= start <= stop <= len(self):
            raise IndexError(f"tokens [{start}, {stop}) outside the stream of {len(self)}")
        return self.tokens[start:stop].to(torch.int64).numpy()


def as_source(tokens: TokenSource | torch.Tensor) -> TokenSource:
    return TensorTokens(tokens) if isinstance(tokens, torch.Tensor) else tokens


@dataclass(frozen=True)
class Corpus:
    """The training and the held-out evaluation stream of a run's dataset."""

    train: TokenSource | torch.Tensor
    eval: TokenSource | torch.Tensor
    name: str
    # Tokens per byte of UTF-8 text in the eval split: bits per byte = loss / ln 2 × this (comparable
    # between tokenizers). 1.0 for a byte corpus without document separators.
    eval_tokens_per_byte: float = 1.0

    def bits_per_byte(self, loss: float) -> float:
        """An eval loss (nats per token) as bits per byte of text."""
        return loss / math.log(2) * self.eval_tokens_per_byte
