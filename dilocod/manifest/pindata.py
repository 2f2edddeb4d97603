"""The run's data in its manifest: the dataset's index hash and the vocabulary it gives the model.

The node that starts a run prepares or opens the dataset its `data.source` names (`dilocod/data/localcopy.py`)
and writes what identifies it into the run-wide settings it signs: `data.dataset` (the index hash, which
also pins the tokenizer: the index holds its sha256) and `model.vocab_size` (the tokenizer's vocabulary,
rounded up to a multiple of 64). A path would mean nothing on another machine; a hash means the same bytes
everywhere.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from dilocod.config import Config, ConfigError
from dilocod.data.localcopy import open_dataset, source_dataset
from dilocod.data.tokenizer import padded_vocab


def pin_dataset(config: Config) -> tuple[Config, Path]:
    """`config` with the dataset of its `data.source` pinned (and its local path set), and that path."""
    directory = source_dataset(config.data)
    index = open_dataset(directory)
    if config.data.dataset and config.data.dataset != index.hash:
        raise ConfigError(
            f"data.dataset is {config.data.dataset[:16]}…, but data.source {config.data.source!r} holds "
            f"dataset {index.hash[:16]}…"
        )
    vocab = padded_vocab(index.vocab_size)
    if config.model.vocab_size and config.model.vocab_size < index.vocab_size:
        raise ConfigError(
            f"model.vocab_size {config.model.vocab_size} is smaller than the dataset's tokenizer's "
            f"{index.vocab_size} tokens"
        )
    data = replace(config.data, dataset=index.hash, path=str(directory))
    model = replace(config.model, vocab_size=config.model.vocab_size or vocab)
    return replace(config, data=data, model=model), directory
