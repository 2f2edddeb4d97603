"""A Hugging Face Llama checkpoint as a run's starting weights (`dilocod bootstrap --init-from DIR`).

The node that starts the run checks the directory against the run's model before it signs anything: a Llama
causal LM our model computes exactly (`hf.spec_of_config`), of the run's preset's shape (`model.preset`:
the checkpoint does not choose the shape, the run's config does, so every peer builds the same model from
the manifest alone), with the run's vocabulary (`model.vocab_size`, the tokenizer's padded size; when the
directory has a tokenizer.json, it must hold the same tokens as the run's). `max_position_embeddings` may
differ: rotary positions have no weights, and the run's `max_seq_len` applies. The manifest then pins the
sha256 of model.safetensors, so every peer starts from the same bytes, whoever served them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from dilocod.export.errors import ExportError
from dilocod.export.hf import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX,
    from_llama,
    llama_config_dict,
    load_safetensors,
    matching_preset,
    read_config,
    spec_of_config,
)
from dilocod.files import file_sha256
from dilocod.trainer.model import ModelSpec

TOKENIZER_FILE = "tokenizer.json"


def check_init_dir(directory: Path, spec: ModelSpec, run_tokenizer: Path | None = None) -> str:
    """The sha256 of `directory`'s model.safetensors once it is a checkpoint the run's model can start
    from; ExportError (one line) otherwise."""
    if not directory.is_dir():
        raise ExportError(f"{directory}: no such directory")
    if not (directory / WEIGHTS_FILE).is_file():
        sharded = (directory / WEIGHTS_INDEX).is_file()
        why = "sharded checkpoints are not read: save it as one file" if sharded else "no such file"
        raise ExportError(f"{directory / WEIGHTS_FILE}: {why}")
    cfg = read_config(directory)
    where = str(directory / CONFIG_FILE)
    theirs = spec_of_config(cfg, where)
    if theirs.vocab_size != spec.vocab_size:
        raise ExportError(
            f"{where}: a vocabulary of {theirs.vocab_size} tokens; the run's tokenizer gives the model "
            f"{spec.vocab_size} (model.vocab_size)"
        )
    if dataclasses.replace(theirs, max_seq_len=spec.max_seq_len) != spec:
        raise ExportError(f"{where}: {_shape_mismatch(theirs, spec)}")
    if run_tokenizer is not None and (directory / TOKENIZER_FILE).is_file():
        _check_tokenizer(directory / TOKENIZER_FILE, run_tokenizer)
    from_llama(directory)  # every tensor there, of its shape: a damaged or partial file fails here
    return file_sha256(directory / WEIGHTS_FILE)


def _shape_mismatch(theirs: ModelSpec, ours: ModelSpec) -> str:
    fields = [f.name for f in dataclasses.fields(ModelSpec) if f.name not in ("vocab_size", "max_seq_len")]
    odd = [f"{name} {getattr(theirs, name)} (the run's {getattr(ours, name)})" for name in fields
           if getattr(theirs, name) != getattr(ours, name)]  # fmt: skip
    preset = matching_preset(dataclasses.replace(theirs, max_seq_len=ours.max_seq_len))
    hint = f"; it is preset {preset!r}'s shape: set model.preset" if preset else ""
    return "not the run's model.preset: " + ", ".join(odd[:3]) + hint


def _check_tokenizer(theirs: Path, ours: Path) -> None:
    from tokenizers import Tokenizer

    try:
        a, b = Tokenizer.from_file(str(theirs)), Tokenizer.from_file(str(ours))
    except Exception as e:  # the library raises a bare Exception for a malformed file
        raise ExportError(
            f"{theirs}: unreadable ({str(e).splitlines()[0][:120] if str(e) else e!r})"
        ) from None
    if a.get_vocab(with_added_tokens=True) != b.get_vocab(with_added_tokens=True):
        raise ExportError(f"{theirs}: another vocabulary than the run's tokenizer ({ours})")


def load_init(weights: Path, spec: ModelSpec) -> list[torch.Tensor]:
    """The starting weights in `weights` (a model.safetensors the manifest pinned), as our fp32 parameters
    in state_dict order: θ_global at outer step 0. The shapes are checked against the run's `spec`."""
    tensors = load_safetensors(weights)
    _, params = from_llama((llama_config_dict(spec), tensors))
    return [p.to(torch.float32) for p in params]
