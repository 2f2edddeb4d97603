"""`dilocod export`: a run's θ_global as a Hugging Face model directory (docs/model.md): a Llama for
dilocod's own model, the pinned architecture for a `model.hf_config` run.

The directory is written beside `out` under a temporary name and renamed into place when whole, so an
interrupted export leaves no half model where tools would load it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from dilocod import __version__
from dilocod.data.tokenizer import eos_id
from dilocod.export.errors import ExportError
from dilocod.export.hf import WEIGHTS_FILE, to_llama
from dilocod.export.hfexport import write_hf_model
from dilocod.export.hftokenizer import write_tokenizer
from dilocod.export.run import RunModel, read_run, run_tokenizer
from dilocod.files import fsync_dir
from dilocod.trainer.lm import hf_config_sha256
from dilocod.trainer.model import ModelSpec

log = logging.getLogger("dilocod.export")

PROVENANCE_FILE = "dilocod.json"
PROVENANCE_FORMAT = "dilocod-export"
PROVENANCE_VERSION = 1


def check_out(out: Path) -> None:
    """`out` must not exist yet, or be an empty directory: an export never overwrites anything."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ExportError(f"{out}: exists and is not a directory")
    if any(out.iterdir()):
        raise ExportError(f"{out}: exists and is not empty; export into a new directory")


@contextlib.contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A fresh directory beside `out` that becomes `out` when the block ends without an error."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.export-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists():
            out.rmdir()  # empty (check_out), and rename onto a directory is not portable
        os.replace(tmp, out)
        fsync_dir(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_run_model(out: Path, run: RunModel, *, eos: int) -> None:
    """The model files of `run`'s θ_global: a Llama for dilocod's own model, `save_pretrained`'s layout of
    the pinned architecture for a `model.hf_config` run."""
    if run.model.hf_config_json:
        write_hf_model(out, run.params, run.model.hf_config_json, eos=eos)
    else:
        write_model(out, run.params, run.spec, eos=eos)


def write_model(out: Path, params: Sequence[torch.Tensor], spec: ModelSpec, *, eos: int) -> None:
    """config.json, generation_config.json and model.safetensors of `params` as a Llama."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    # No BOS of its own: documents were separated by EOS in training, so EOS starts one.
    config, tensors = to_llama(params, spec, bos_id=eos, eos_id=eos)
    config.save_pretrained(str(out))
    generation = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    generation.save_pretrained(str(out))
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})


def provenance(run: RunModel, tok: Tokenizer, tokenizer_raw: bytes) -> dict[str, Any]:
    """What dilocod.json says: which run, state and data the weights are."""
    return {
        "format": PROVENANCE_FORMAT,
        "version": PROVENANCE_VERSION,
        "dilocod_version": __version__,
        "run_id": run.run_id,
        "preset": run.preset,
        "manifest_hash": run.manifest_hash,
        "outer_step": run.outer_step,
        "tokens_trained": run.tokens_trained,
        "global_sha256": run.global_sha256,
        "checkpoint": run.checkpoint.name if run.checkpoint is not None else None,
        "swarm": run.swarm,
        "dataset": run.dataset,
        "tokenizer_sha256": hashlib.sha256(tokenizer_raw).hexdigest(),
        "tokenizer_vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "vocab_size": run.shape.vocab_size,
        # a model.hf_config run: the transformers family and the sha256 of the pinned config's canonical JSON
        "hf_config_sha256": hf_config_sha256(run.model.hf_config_json) if run.model.hf_config_json else None,
        "model_type": run.shape.family,
        "eos_token_id": eos_id(tok),
    }


def export_run(run_dir: Path, out: Path, *, data_path: Path | None = None) -> Path:
    """Export the θ_global of `run_dir`'s newest whole checkpoint into the new directory `out`."""
    run_dir, out = Path(run_dir), Path(out)
    check_out(out)
    run = read_run(run_dir)
    for note in run.notes:
        log.warning("%s; exporting %s instead", note, getattr(run.checkpoint, "name", "?"))
    tok, raw = run_tokenizer(run_dir, run.vocab_size, run.dataset, data_path)
    return write_export(out, run, tok, raw)


def write_export(out: Path, run: RunModel, tok: Tokenizer, tokenizer_raw: bytes) -> Path:
    """The model directory of `run`'s θ_global with `tok`, its tokenizer, written whole into `out`."""
    with staged(out) as tmp:
        write_run_model(tmp, run, eos=eos_id(tok))
        write_tokenizer(tok, tmp, max_len=run.shape.max_seq_len)
        text = json.dumps(provenance(run, tok, tokenizer_raw), indent=2, sort_keys=True) + "\n"
        (tmp / PROVENANCE_FILE).write_text(text, encoding="utf-8")
    return out
