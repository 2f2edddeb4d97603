"""What a peer's run directory holds that an export needs: θ_global, the manifest, the tokenizer.

Read only: unlike a starting peer (`open_checkpoint`, `load_stored`), an export never moves a damaged file
aside, since it may run beside the peer that owns the directory. Reading while that peer writes is safe:
a checkpoint write replaces the file by a rename, so an open file stays whole.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from dilocod.data.shards import INDEX_FILE, TOKENIZER_FILE, load_index
from dilocod.data.tokenizer import BYTE, load_tokenizer, tokenizer_json
from dilocod.diloco.outer import global_sha256
from dilocod.export.errors import ExportError
from dilocod.export.hf import named_params
from dilocod.export.hfexport import check_hf_params
from dilocod.statesync.checkpoint import (
    FILENAME,
    PREVIOUS,
    CheckpointError,
    UnreadableCheckpoint,
    read_checkpoint,
)
from dilocod.trainer.lm import lm_skeleton
from dilocod.trainer.model import ModelConfig, ModelSpec
from dilocod.trainer.shape import LMShape

MANIFEST_FILE = "manifest.bin"  # dilocod.manifest.obtain.MANIFEST_FILE (that module pulls in the p2p stack)
DATA_DIR = "data"  # a run's dataset copy when its config sets no data.path
BYTE_VOCAB = 256  # the byte tokenizer's; a BPE has at least 257 tokens (256 bytes + <|endoftext|>)


@dataclass(frozen=True)
class RunModel:
    """θ_global of a run, with what identifies it."""

    run_id: str
    preset: str
    model: ModelConfig  # the run's model: its preset and vocabulary, or its pinned transformers config
    params: list[torch.Tensor]  # θ_global, fp32, in the model's parameter order
    outer_step: int
    global_sha256: str
    tokens_trained: int | None
    checkpoint: Path | None  # None: taken from the swarm (`dilocod export --from`)
    manifest_hash: str
    dataset: str | None  # the dataset's index hash (data.dataset), None for a run that set none
    notes: list[str] = field(default_factory=list)  # one line each, e.g. a damaged newest checkpoint
    swarm: dict[str, Any] | None = None  # taken from the swarm: from where, which donor, how many agreed

    @property
    def spec(self) -> ModelSpec:
        """dilocod's own model's shapes (not for a `model.hf_config` run)."""
        return self.model.spec()

    @property
    def shape(self) -> LMShape:
        return lm_skeleton(self.model).shape

    @property
    def vocab_size(self) -> int:
        """The vocabulary the run's tokenizer may fill: the model's, or for a transformers model (whose
        config may hold more rows) the run's model.vocab_size (its tokenizer's, rounded up to 64)."""
        if self.model.hf_config_json and self.model.vocab_size:
            return self.model.vocab_size
        return self.shape.vocab_size


def run_model_config(manifest: Any, preset: str) -> ModelConfig:
    """The model a run's manifest names (a preset with its vocabulary, or a pinned transformers config)."""
    return ModelConfig(
        preset, int(manifest.value("model.vocab_size") or 0),
        hf_config_json=str(manifest.value("model.hf_config_json") or ""),
    )  # fmt: skip


def check_params(params: list[torch.Tensor], model: ModelConfig) -> None:
    """`params` must be θ_global of `model` (ExportError or ValueError naming the first mismatch)."""
    if model.hf_config_json:
        check_hf_params(params, model.hf_config_json)
    else:
        named_params(params, model.spec())


def newest_checkpoint(run_dir: Path) -> tuple[Path, dict[str, Any], list[str]]:
    """The newest whole checkpoint file, its state, and a note per damaged newer one."""
    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    damaged: list[UnreadableCheckpoint] = []
    for path in (run_dir / FILENAME, run_dir / PREVIOUS):
        if not path.exists():
            continue
        try:
            return path, read_checkpoint(path), [str(e) for e in damaged]
        except UnreadableCheckpoint as e:
            damaged.append(e)
    if damaged:
        raise damaged[0]
    raise ExportError(f"{run_dir}: no {FILENAME} (a peer writes one as it trains)")


def _outer(path: Path, state: dict[str, Any]) -> tuple[list[torch.Tensor], int, str]:
    """θ_global, its outer step and sha256, checked against each other."""
    try:
        outer = state["outer"]
        params, step, sha = list(outer["params"]), int(outer["step"]), str(outer["sha256"])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"checkpoint {path} holds no θ_global (outer.params, step, sha256)") from None
    if not all(isinstance(p, torch.Tensor) for p in params):
        raise CheckpointError(f"checkpoint {path}: outer.params are not all tensors")
    params = [p.float() for p in params]
    if global_sha256(params) != sha:
        raise CheckpointError(f"checkpoint {path}: θ_global does not match its sha256 {sha[:16]}…")
    return params, step, sha


def read_manifest(run_dir: Path) -> Any:
    """The run's signed manifest (`dilocod.manifest.record.Manifest`), its signature checked."""
    from dilocod.manifest.record import ManifestError, decode  # the p2p stack: only when a run is read

    path = run_dir / MANIFEST_FILE
    try:
        return decode(path.read_bytes())
    except FileNotFoundError:
        raise ExportError(f"{path}: no such file (not a peer's run directory?)") from None
    except OSError as e:
        raise ExportError(f"{path}: cannot read ({e.strerror or e})") from None
    except ManifestError as e:
        raise ExportError(f"{path}: {e}") from None


def read_run(run_dir: Path) -> RunModel:
    """θ_global of the newest whole checkpoint in `run_dir`, shaped by the run's manifest."""
    path, state, notes = newest_checkpoint(run_dir)
    params, step, sha = _outer(path, state)
    manifest = read_manifest(run_dir)
    preset = str(state.get("preset"))
    if manifest.run_id != state.get("run_id") or manifest.value("model.preset") != preset:
        raise ExportError(
            f"{path} belongs to run {state.get('run_id')!r} ({preset}), "
            f"but {run_dir / MANIFEST_FILE} is run {manifest.run_id!r} ({manifest.value('model.preset')})"
        )
    try:
        model = run_model_config(manifest, preset)
        check_params(params, model)  # the shapes, before anything is written
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path} does not fit its run's model: {e}") from None
    tokens = state.get("tokens")
    trained = tokens.get("trained") if isinstance(tokens, dict) else None
    return RunModel(
        run_id=manifest.run_id, preset=preset, model=model, params=params, outer_step=step,
        global_sha256=sha, tokens_trained=None if trained is None else int(trained), checkpoint=path,
        manifest_hash=manifest.hash, dataset=manifest.value("data.dataset") or None, notes=notes,
    )  # fmt: skip


def run_tokenizer(
    run_dir: Path, vocab_size: int, dataset: str | None, data_path: Path | None = None
) -> tuple[Tokenizer, bytes]:
    """The run's tokenizer and its exact JSON bytes: the dataset copy's (`data_path`, default
    <run dir>/data), checked against the run's dataset hash; the byte tokenizer for a 256-token run
    whose dataset copy is not here."""
    data = data_path if data_path is not None else run_dir / DATA_DIR
    file = data / TOKENIZER_FILE
    if not file.is_file():
        if data_path is None and vocab_size == BYTE_VOCAB:
            return load_tokenizer(BYTE), tokenizer_json(BYTE)
        hint = "" if data_path is not None else "; pass --data-path with the run's dataset directory"
        raise ExportError(f"{file}: no such tokenizer file{hint}")
    raw = tokenizer_json(file)
    if (data / INDEX_FILE).is_file():
        index = load_index(data)
        if dataset and index.hash != dataset:
            raise ExportError(f"{data}: dataset {index.hash[:16]}… is not the run's {dataset[:16]}…")
        if hashlib.sha256(raw).hexdigest() != index.tokenizer_sha256:
            raise ExportError(f"{file}: not the tokenizer its {INDEX_FILE} names")
    tok = load_tokenizer(file)
    if tok.get_vocab_size(with_added_tokens=True) > vocab_size:
        raise ExportError(
            f"{file}: {tok.get_vocab_size(with_added_tokens=True)} tokens do not fit the model's "
            f"vocabulary of {vocab_size}"
        )
    return tok, raw
